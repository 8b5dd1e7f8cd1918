/*
 * sched.c — generation slots and their scheduler: N model contexts, a queue
 * of jobs, and one thread that runs the slots' prompt and decode steps.
 *
 * A job is a prompt plus sampling settings; the scheduler samples its tokens,
 * appends their text, watches its stop strings and publishes the progress
 * under one lock, so the thread that owns the job (http.c's connection) can
 * stream it. No sockets, no JSON, no printing. Batching: model.c has no
 * multi-sequence evaluation yet, so each step runs the active slots one after
 * the other (one token each, round-robin), not as one batched forward pass.
 * V is the vocabulary, C the cells of one slot.
 */
#include "strata.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SCHED_PROMPT_CHUNK 512   /* prompt tokens a slot evaluates per step (model_eval's chunk) */
#define SCHED_RATE_WINDOW 16     /* jobs behind the tokens/s rates */

enum { J_NEW, J_QUEUED, J_ACTIVE, J_DONE };

struct sched_job_priv {
    struct sampler *smp;
    pthread_cond_t cv;           /* signalled on each token and at the end */
    struct sched_job *next;      /* (lock) the queue */
    int state, cancel;           /* (lock) */
};

struct slot {
    struct model_ctx *ctx;
    int32_t *cache;              /* (C) the ids whose KV the context holds */
    int n_cache;                 /* (lock) */
    float *logits;               /* (V) */
    struct sched_job *job;       /* NULL when free; only the scheduler thread changes it */
};

struct sched {
    const struct tok *tok;
    int V, n_ctx;
    size_t max_piece;            /* the longest text of one token */
    struct pool *pool;
    struct slot *slots;          /* (n_slots) */
    int n_slots;
    pthread_t thread;
    int started;
    pthread_mutex_t lock;
    pthread_cond_t cv;           /* the scheduler waits here for work */
    /* (lock) from here on */
    struct sched_job *q_head, *q_tail;
    int n_queued, n_active;
    int closed, cancel_running, quit;
    struct sched_stats st;
    double win_pn[SCHED_RATE_WINDOW], win_ps[SCHED_RATE_WINDOW]; /* recent prompts: tokens, seconds */
    double win_gn[SCHED_RATE_WINDOW], win_gs[SCHED_RATE_WINDOW]; /* recent generations */
    int win_at;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ==== jobs ==== */

struct sched_job *sched_job_new(struct sched *s, const struct sched_req *req)
{
    struct sched_job *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->priv = calloc(1, sizeof *j->priv);
    if (!j->priv) {
        free(j);
        return NULL;
    }
    pthread_cond_init(&j->priv->cv, NULL);
    j->req = *req;
    if (j->req.n_stop > SCHED_MAX_STOPS)
        j->req.n_stop = SCHED_MAX_STOPS;
    if (j->req.n_top > s->V)
        j->req.n_top = s->V;
    /* the last token needs no cell: a full context still yields one more */
    int room = s->n_ctx - req->n_prompt + 1;
    j->cap = req->n_predict >= 0 && req->n_predict < room ? req->n_predict : room;
    if (j->cap < 0)
        j->cap = 0;
    j->stop_word = -1;
    j->slot = -1;
    size_t cap = (size_t)(j->cap > 0 ? j->cap : 1);
    j->priv->smp = sample_new(&req->sp, s->V);
    j->ids = malloc(cap * sizeof *j->ids);
    j->lp = malloc(cap * sizeof *j->lp);
    j->top = malloc(cap * (size_t)(j->req.n_top > 0 ? j->req.n_top : 1) * sizeof *j->top);
    /* sized for the longest pieces, so the text never moves while it is read */
    j->text = malloc(cap * s->max_piece + 1);
    if (!j->priv->smp || !j->ids || !j->lp || !j->top || !j->text) {
        sched_job_free(j);
        return NULL;
    }
    j->text[0] = 0;
    for (int i = 0; i < req->n_prompt; i++)
        sample_accept(j->priv->smp, req->prompt[i]);
    return j;
}

void sched_job_free(struct sched_job *j)
{
    if (!j)
        return;
    pthread_cond_destroy(&j->priv->cv);
    sample_free(j->priv->smp);
    free(j->priv);
    free(j->ids);
    free(j->lp);
    free(j->top);
    free(j->text);
    free(j);
}

/* Ends a job (lock held): frees its slot, counts it, wakes its owner. */
static void job_finish(struct sched *s, struct slot *sl, struct sched_job *j, int end)
{
    j->ready = j->text_len;
    j->t_end = now_s();
    if (sl) {
        sl->job = NULL;
        s->n_active--;
        double ps = j->t_prompt > 0 ? j->t_prompt - j->t_start : 0;
        double gs = j->t_prompt > 0 ? j->t_end - j->t_prompt : 0;
        int n_prompt = j->req.n_prompt;
        int evaluated = (j->n_past < n_prompt ? j->n_past : n_prompt) - j->n_cached;
        if (evaluated < 0)
            evaluated = 0;
        s->st.prompt_tokens += (uint64_t)evaluated;
        s->st.gen_tokens += (uint64_t)j->n_ids;
        s->st.prompt_s += ps;
        s->st.decode_s += gs;
        if ((uint64_t)(n_prompt + j->n_ids) > s->st.n_tokens_max)
            s->st.n_tokens_max = (uint64_t)(n_prompt + j->n_ids);
        s->win_pn[s->win_at] = evaluated;
        s->win_ps[s->win_at] = ps;
        s->win_gn[s->win_at] = j->n_ids;
        s->win_gs[s->win_at] = gs;
        s->win_at = (s->win_at + 1) % SCHED_RATE_WINDOW;
    }
    j->priv->state = J_DONE;
    j->end = end;
    pthread_cond_broadcast(&j->priv->cv);
}

static int common_prefix(const int32_t *a, int na, const int32_t *b, int nb)
{
    int k = 0;
    while (k < na && k < nb && a[k] == b[k])
        k++;
    return k;
}

/* Gives queued jobs free slots (lock held): the slot whose cache shares the
 * longest prefix with the prompt, so cache_prompt reuses the most. */
static void assign(struct sched *s)
{
    while (s->q_head) {
        struct sched_job *j = s->q_head;
        int best = -1, best_k = -1;
        for (int i = 0; i < s->n_slots; i++) {
            struct slot *sl = &s->slots[i];
            if (sl->job)
                continue;
            int k = j->req.cache_prompt ? common_prefix(sl->cache, sl->n_cache, j->req.prompt, j->req.n_prompt) : 0;
            if (k > best_k)
                best = i, best_k = k;
        }
        if (best < 0)
            return;
        s->q_head = j->priv->next;
        if (!s->q_head)
            s->q_tail = NULL;
        s->n_queued--;
        s->n_active++;
        j->priv->state = J_ACTIVE;
        j->slot = best;
        s->slots[best].job = j;
    }
}

/* Appends the text of id and settles what can be sent (lock held); returns
 * 1 when a stop string ended the text. */
static int append(struct sched *s, struct sched_job *j, int32_t id)
{
    const struct sched_req *q = &j->req;
    size_t old = j->text_len;
    j->text_len += tok_piece(s->tok, id, j->text + old, s->max_piece, 0);
    j->text[j->text_len] = 0;
    /* a stop string can only end in the new bytes */
    size_t best = SIZE_MAX;
    for (int k = 0; k < q->n_stop; k++) {
        size_t sl = q->stop_len[k];
        for (size_t p = old + 1 > sl ? old + 1 - sl : 0; p + sl <= j->text_len; p++) {
            if (memcmp(j->text + p, q->stop[k], sl) == 0) {
                if (p < best) {
                    best = p;
                    j->stop_word = k;
                }
                break;
            }
        }
    }
    if (best != SIZE_MAX) {
        /* every byte from best on was held back (a partial match), so none was sent */
        j->text_len = best;
        j->text[best] = 0;
        return 1;
    }
    /* hold back a character split across tokens and a possible stop string start */
    size_t ready = tok_utf8_complete(j->text, j->text_len), hold = 0;
    for (int k = 0; k < q->n_stop; k++) {
        size_t sl = q->stop_len[k];
        for (size_t m = sl - 1 < j->text_len ? sl - 1 : j->text_len; m > hold; m--) {
            if (memcmp(j->text + j->text_len - m, q->stop[k], m) == 0) {
                hold = m;
                break;
            }
        }
    }
    if (j->text_len - hold < ready)
        ready = j->text_len - hold;
    if (ready > j->ready)
        j->ready = ready;
    return 0;
}

/* ==== the scheduler thread ==== */

/* One step of a slot: a chunk of its prompt, or sampling one token and
 * evaluating it. Runs without the lock, taking it to publish. */
static void slot_step(struct sched *s, struct slot *sl)
{
    struct sched_job *j = sl->job;
    const struct sched_req *q = &j->req;
    char err[256];
    if (j->t_prompt == 0) {
        if (j->t_start == 0) {
            j->t_start = now_s();
            int k = q->cache_prompt ? common_prefix(sl->cache, sl->n_cache, q->prompt, q->n_prompt) : 0;
            if (k == q->n_prompt)
                k--; /* the last prompt token is evaluated again for its logits */
            j->n_cached = k;
            j->n_past = k;
        }
        int n = q->n_prompt - j->n_past;
        if (n > SCHED_PROMPT_CHUNK)
            n = SCHED_PROMPT_CHUNK;
        int last = j->n_past + n == q->n_prompt;
        int rc = model_eval(sl->ctx, q->prompt + j->n_past, n, j->n_past, last ? sl->logits : NULL, 0, err,
                            sizeof err);
        pthread_mutex_lock(&s->lock);
        if (rc != 0) {
            sl->n_cache = 0;
            snprintf(j->err, sizeof j->err, "%s", err);
            job_finish(s, sl, j, SCHED_ERROR);
        } else {
            memcpy(sl->cache + j->n_past, q->prompt + j->n_past, (size_t)n * sizeof *sl->cache);
            j->n_past += n;
            sl->n_cache = j->n_past;
            if (last) {
                j->t_prompt = now_s();
                if (j->cap == 0)
                    job_finish(s, sl, j, SCHED_LIMIT);
            }
        }
        pthread_mutex_unlock(&s->lock);
        return;
    }
    int32_t id = sample_next(j->priv->smp, sl->logits);
    if (q->want_lp)
        j->lp[j->n_ids] = sample_logprob(sl->logits, s->V, id, j->top + (size_t)j->n_ids * (size_t)q->n_top, q->n_top);
    j->ids[j->n_ids] = id;
    sample_accept(j->priv->smp, id);
    pthread_mutex_lock(&s->lock);
    j->n_ids++;
    int done = 1;
    if (tok_is_eog(s->tok, id))
        job_finish(s, sl, j, SCHED_EOS);
    else if (append(s, j, id))
        job_finish(s, sl, j, SCHED_WORD);
    else if (j->n_ids >= j->cap)
        job_finish(s, sl, j, SCHED_LIMIT);
    else
        done = 0;
    if (!done)
        pthread_cond_broadcast(&j->priv->cv);
    pthread_mutex_unlock(&s->lock);
    if (done)
        return;
    int rc = model_eval(sl->ctx, &id, 1, j->n_past, sl->logits, 0, err, sizeof err);
    pthread_mutex_lock(&s->lock);
    if (rc != 0) {
        sl->n_cache = 0;
        snprintf(j->err, sizeof j->err, "%s", err);
        job_finish(s, sl, j, SCHED_ERROR);
    } else {
        sl->cache[j->n_past++] = id;
        sl->n_cache = j->n_past;
    }
    pthread_mutex_unlock(&s->lock);
}

/*
 * Each step gives every active slot one step, round-robin: a new job joins at
 * the next step, a finished one leaves at once. Slots share the thread pool
 * and run one after the other, so N active slots cost N single-token forward
 * passes per step (no batching across slots until model.c evaluates several
 * sequences at once).
 */
static void *sched_main(void *arg)
{
    struct sched *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        /* cancelled jobs leave first, so that their slots are refilled now:
         * with every slot free after assign(), the queue is empty */
        for (int i = 0; i < s->n_slots; i++) {
            struct slot *sl = &s->slots[i];
            if (sl->job && (sl->job->priv->cancel || s->cancel_running))
                job_finish(s, sl, sl->job, SCHED_CANCEL);
        }
        assign(s);
        if (s->quit)
            break;
        int busy = 0;
        for (int i = 0; i < s->n_slots; i++)
            busy += s->slots[i].job != NULL;
        if (busy == 0) {
            pthread_cond_wait(&s->cv, &s->lock);
            continue;
        }
        s->st.n_steps++;
        s->st.busy_slot_steps += (uint64_t)busy;
        pthread_mutex_unlock(&s->lock);
        for (int i = 0; i < s->n_slots; i++)
            if (s->slots[i].job)
                slot_step(s, &s->slots[i]);
        pthread_mutex_lock(&s->lock);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* ==== the interface ==== */

int sched_new(struct sched **out, struct model *m, int n_slots, int n_ctx, int kv_type, int n_threads,
              char *err, size_t errlen)
{
    *out = NULL;
    struct sched *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->tok = model_tok(m);
    s->V = model_hp(m)->n_vocab;
    s->n_ctx = n_ctx;
    s->max_piece = 1;
    char one[1];
    for (int32_t id = 0; id < tok_n_vocab(s->tok); id++) {
        size_t n = tok_piece(s->tok, id, one, 0, 0);
        if (n > s->max_piece)
            s->max_piece = n;
    }
    s->pool = pool_new(n_threads);
    s->slots = calloc((size_t)n_slots, sizeof *s->slots);
    if (!s->pool || !s->slots) {
        snprintf(err, errlen, "out of memory");
        sched_free(s);
        return -1;
    }
    for (int i = 0; i < n_slots; i++) {
        struct slot *sl = &s->slots[i];
        char e[256];
        if (model_ctx_new(&sl->ctx, m, n_ctx, kv_type, s->pool, e, sizeof e) != 0) {
            snprintf(err, errlen, "slot %d: %s", i, e);
            sched_free(s);
            return -1;
        }
        s->n_slots++;
        sl->cache = malloc((size_t)n_ctx * sizeof *sl->cache);
        sl->logits = malloc((size_t)s->V * sizeof *sl->logits);
        if (!sl->cache || !sl->logits) {
            snprintf(err, errlen, "out of memory");
            sched_free(s);
            return -1;
        }
    }
    if (pthread_create(&s->thread, NULL, sched_main, s) != 0) {
        snprintf(err, errlen, "cannot start the scheduler thread");
        sched_free(s);
        return -1;
    }
    s->started = 1;
    *out = s;
    return 0;
}

void sched_free(struct sched *s)
{
    if (!s)
        return;
    if (s->started) {
        pthread_mutex_lock(&s->lock);
        s->quit = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->lock);
        pthread_join(s->thread, NULL);
    }
    for (int i = 0; i < s->n_slots; i++) {
        model_ctx_free(s->slots[i].ctx);
        free(s->slots[i].cache);
        free(s->slots[i].logits);
    }
    free(s->slots);
    pool_free(s->pool);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

int sched_submit(struct sched *s, struct sched_job *j)
{
    pthread_mutex_lock(&s->lock);
    if (s->closed || j->priv->state != J_NEW) {
        pthread_mutex_unlock(&s->lock);
        return -1;
    }
    j->priv->state = J_QUEUED;
    if (s->q_tail)
        s->q_tail->priv->next = j;
    else
        s->q_head = j;
    s->q_tail = j;
    s->n_queued++;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

void sched_wait(struct sched *s, struct sched_job *j, struct sched_view *v, int timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L)
        ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&s->lock);
    while (j->priv->state != J_DONE && j->n_ids == v->n_ids && j->ready == v->ready &&
           pthread_cond_timedwait(&j->priv->cv, &s->lock, &ts) == 0)
        ;
    v->n_ids = j->n_ids;
    v->ready = j->ready;
    v->end = j->priv->state == J_DONE ? j->end : SCHED_RUNNING;
    v->slot = j->slot;
    pthread_mutex_unlock(&s->lock);
}

void sched_cancel(struct sched *s, struct sched_job *j)
{
    pthread_mutex_lock(&s->lock);
    if (j->priv->state == J_QUEUED) {
        struct sched_job **pp = &s->q_head, *prev = NULL;
        while (*pp && *pp != j)
            prev = *pp, pp = &(*pp)->priv->next;
        if (*pp) {
            *pp = j->priv->next;
            if (s->q_tail == j)
                s->q_tail = prev;
            s->n_queued--;
        }
        job_finish(s, NULL, j, SCHED_CANCEL);
    } else if (j->priv->state == J_ACTIVE) {
        j->priv->cancel = 1;
        pthread_cond_signal(&s->cv);
    }
    pthread_mutex_unlock(&s->lock);
}

void sched_close(struct sched *s, int cancel_running)
{
    pthread_mutex_lock(&s->lock);
    s->closed = 1;
    while (s->q_head) {
        struct sched_job *j = s->q_head;
        s->q_head = j->priv->next;
        s->n_queued--;
        snprintf(j->err, sizeof j->err, "the server is shutting down");
        job_finish(s, NULL, j, SCHED_REFUSED);
    }
    s->q_tail = NULL;
    if (cancel_running)
        s->cancel_running = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->lock);
}

static double window_rate(const double *n, const double *sec)
{
    double tn = 0, ts = 0;
    for (int i = 0; i < SCHED_RATE_WINDOW; i++)
        tn += n[i], ts += sec[i];
    return ts > 0 ? tn / ts : 0;
}

void sched_stats(struct sched *s, struct sched_stats *out)
{
    pthread_mutex_lock(&s->lock);
    *out = s->st;
    out->processing = s->n_active;
    out->queued = s->n_queued;
    out->kv_used = out->kv_cached = 0;
    for (int i = 0; i < s->n_slots; i++) {
        if (s->slots[i].job)
            out->kv_used += s->slots[i].n_cache;
        else
            out->kv_cached += s->slots[i].n_cache;
    }
    out->kv_total = (long)s->n_slots * s->n_ctx;
    out->prompt_rate = window_rate(s->win_pn, s->win_ps);
    out->gen_rate = window_rate(s->win_gn, s->win_gs);
    pthread_mutex_unlock(&s->lock);
}
