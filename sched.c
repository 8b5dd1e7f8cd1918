/*
 * sched.c — generation slots and their scheduler: one model context whose KV
 * pool holds a sequence per slot, a queue of jobs, and one thread that runs
 * the steps.
 *
 * A job is a prompt plus sampling settings; the scheduler samples its tokens,
 * appends their text, watches its stop strings and publishes the progress
 * under one lock, so the thread that owns the job (http.c's connection) can
 * stream it. Each step samples every decoding slot, evaluates their tokens
 * in ONE batched forward pass (model_decode_batch), then spends a bounded
 * budget of prompt tokens on the slots still reading their prompts. A job
 * gets a fresh sequence when its prompt starts and frees it when it ends, so
 * its whole pages stay in the pool's prefix cache for the next prompt that
 * starts the same way. When the pool runs short, a prompt that does not fit
 * waits in its slot, and a job that needs a page takes the youngest job's,
 * which ends with an error naming the KV cache. No sockets, no JSON, no
 * printing; only the scheduler thread touches the model context and its
 * pool. V is the vocabulary.
 */
#include "strata.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Prompt tokens one step evaluates over all slots while other slots decode:
 * a long prompt then delays their next token by about the cost of this many
 * rows per step, not by its whole length. With no slot decoding a step takes
 * the model's whole chunk. */
#define SCHED_PROMPT_BUSY 128
#define SCHED_RATE_WINDOW 16     /* jobs behind the tokens/s rates */

enum { J_NEW, J_QUEUED, J_ACTIVE, J_DONE };

struct sched_job_priv {
    struct sampler *smp;
    pthread_cond_t cv;           /* signalled on each token and at the end */
    struct sched_job *next;      /* (lock) the queue */
    int state, cancel;           /* (lock) */
};

/* Everything but n_cells is the scheduler thread's alone. */
struct slot {
    struct sched_job *job;       /* NULL when free */
    int seq;                     /* its sequence in the pool; -1 until its prompt starts */
    const float *logits;         /* (V) for the next token: a row of plog or blog; NULL while
                                    the prompt is read */
    int n_cells;                 /* (lock) cells of the sequence, for the stats */
};

struct sched {
    const struct tok *tok;
    int V, n_ctx, P;             /* n_ctx: cells one sequence holds; P: cells per page */
    int chunk;                   /* prompt tokens per step when no slot decodes */
    size_t max_piece;            /* the longest text of one token */
    struct pool *pool;
    struct model_ctx *ctx;       /* one context, a sequence per busy slot */
    struct kv *kv;               /* its pool */
    struct slot *slots;          /* (n_slots) */
    int n_slots;
    int *age;                    /* (n_slots) slot ids, the longest-held job first */
    float *plog;                 /* (n_slots, V) each slot's logits after its prompt */
    float *blog;                 /* (n_slots, V) the decode batch's logits, a row per entry:
                                    the context's rows where they hold n_slots
                                    (model_ctx_batch_logits), else blog_own */
    float *blog_own;
    int *bseq, *bslot;           /* (n_slots) the batch's sequences and their slots */
    int32_t *btok;               /* (n_slots) the batch's tokens */
    int *draw, n_draw;           /* (n_slots) the slots sample_all draws for (draw_run) */
    int32_t *drawn;              /* (n_slots) their tokens */
    pthread_t thread;
    int started;
    pthread_mutex_t lock;
    pthread_cond_t cv;           /* the scheduler waits here for work */
    /* (lock) from here on */
    struct sched_job *q_head, *q_tail;
    int n_queued, n_active;
    int closed, cancel_running, quit;
    struct sched_stats st;
    struct kv_stats kvs;         /* the pool after the last step */
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

/* Ends a job (lock held): frees its slot and sequence (on the scheduler
 * thread only), counts it, wakes its owner. */
static void job_finish(struct sched *s, struct slot *sl, struct sched_job *j, int end)
{
    j->ready = j->text_len;
    j->t_end = now_s();
    if (sl) {
        if (sl->seq >= 0)
            kv_seq_free(s->kv, sl->seq);
        sl->job = NULL;
        sl->seq = -1;
        sl->logits = NULL;
        sl->n_cells = 0;
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

static void job_fail(struct sched *s, struct slot *sl, int end, const char *msg)
{
    snprintf(sl->job->err, sizeof sl->job->err, "%s", msg);
    job_finish(s, sl, sl->job, end);
}

/* Gives queued jobs free slots in arrival order (lock held). Any free slot
 * serves: the prefix cache is the pool's, not a slot's. */
static void assign(struct sched *s)
{
    for (int a = 0; a < s->n_slots && s->q_head; a++) {
        int i = s->age[a];
        if (s->slots[i].job)
            continue;
        struct sched_job *j = s->q_head;
        s->q_head = j->priv->next;
        if (!s->q_head)
            s->q_tail = NULL;
        s->n_queued--;
        s->n_active++;
        j->priv->state = J_ACTIVE;
        j->slot = i;
        s->slots[i].job = j;
        /* the newest job goes last in age order */
        memmove(s->age + a, s->age + a + 1, (size_t)(s->n_slots - a - 1) * sizeof *s->age);
        s->age[s->n_slots - 1] = i;
        a--;
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

/* The draws of sample_all's slots (s->draw[0..n_draw)), each into
 * s->drawn[k], with its log-probability where asked: shared out among the
 * pool's threads (each slot's sampler is its own, and only this thread
 * moves a job's n_ids). */
static void draw_run(void *arg, int t, int n)
{
    struct sched *s = arg;
    for (int k = t; k < s->n_draw; k += n) {
        struct slot *sl = &s->slots[s->draw[k]];
        struct sched_job *j = sl->job;
        const struct sched_req *q = &j->req;
        int32_t id = sample_next(j->priv->smp, sl->logits);
        if (q->want_lp)
            j->lp[j->n_ids] = sample_logprob(sl->logits, s->V, id, j->top + (size_t)j->n_ids * (size_t)q->n_top,
                                             q->n_top);
        sample_accept(j->priv->smp, id);
        s->drawn[k] = id;
    }
}

/* Samples the next token of every decoding slot, oldest job first, and
 * publishes it; the jobs that go on form the batch (bseq, btok, bslot).
 * Returns the batch's size. */
static int sample_all(struct sched *s)
{
    s->n_draw = 0;
    for (int a = 0; a < s->n_slots; a++) {
        struct slot *sl = &s->slots[s->age[a]];
        if (sl->job && sl->logits)
            s->draw[s->n_draw++] = s->age[a];
    }
    if (s->n_draw > 1)
        pool_run(s->pool, draw_run, s);
    else
        draw_run(s, 0, 1);
    int nb = 0;
    for (int k = 0; k < s->n_draw; k++) {
        int i = s->draw[k];
        struct slot *sl = &s->slots[i];
        struct sched_job *j = sl->job;
        int32_t id = s->drawn[k];
        j->ids[j->n_ids] = id;
        pthread_mutex_lock(&s->lock);
        j->n_ids++;
        if (tok_is_eog(s->tok, id)) {
            job_finish(s, sl, j, SCHED_EOS);
        } else if (append(s, j, id)) {
            job_finish(s, sl, j, SCHED_WORD);
        } else if (j->n_ids >= j->cap) {
            job_finish(s, sl, j, SCHED_LIMIT);
        } else {
            pthread_cond_broadcast(&j->priv->cv);
            s->bseq[nb] = sl->seq;
            s->btok[nb] = id;
            s->bslot[nb++] = i;
        }
        pthread_mutex_unlock(&s->lock);
    }
    return nb;
}

/*
 * Makes sure need pages are free or evictable for slot i's job. When the
 * pool runs short, the youngest job holding a sequence ends (SCHED_REFUSED,
 * with a message naming the KV cache) and its pages return, until there
 * are enough or the youngest is i's own job, which then ends: an exhausted
 * pool fails the newest requests and the older ones go on. Returns 0 when
 * the pages are there.
 */
static int make_room(struct sched *s, int i, int need)
{
    for (;;) {
        struct kv_stats ks;
        kv_stats(s->kv, &ks);
        if (need <= ks.free + ks.idle)
            return 0;
        int victim = i;
        for (int a = s->n_slots - 1; a >= 0; a--) {
            struct slot *sl = &s->slots[s->age[a]];
            if (sl->job && sl->seq >= 0) {
                victim = s->age[a];
                break;
            }
        }
        char err[200];
        snprintf(err, sizeof err,
                 "KV cache exhausted: all %d pages of %d cells are held by older requests "
                 "(raise --kv-mem or -c)", ks.pages, s->P);
        pthread_mutex_lock(&s->lock);
        job_fail(s, &s->slots[victim], SCHED_REFUSED, err);
        pthread_mutex_unlock(&s->lock);
        if (victim == i)
            return -1;
    }
}

/*
 * Evaluates the batch's tokens in one forward pass. A token that starts a
 * new page needs one from the pool (no page of ours is shared part-filled:
 * the prefix cache shares whole pages only); the batch is in age order, so
 * make_room only ever ends jobs after the one it serves.
 */
static void decode(struct sched *s, int nb)
{
    char err[256];
    int kept = 0, taken = 0;
    for (int k = 0; k < nb; k++) {
        int i = s->bslot[k];
        struct slot *sl = &s->slots[i];
        if (!sl->job)
            continue; /* ended by make_room for an older job */
        if (kv_seq_len(s->kv, sl->seq) % s->P == 0) {
            if (make_room(s, i, taken + 1) != 0)
                continue;
            taken++;
        }
        s->bseq[kept] = s->bseq[k];
        s->btok[kept] = s->btok[k];
        s->bslot[kept++] = i;
    }
    if (kept == 0)
        return;
    int rc = model_decode_batch(s->ctx, s->bseq, s->btok, kept, s->blog, err, sizeof err);
    pthread_mutex_lock(&s->lock);
    s->st.decode_batches++;
    s->st.decode_rows += (uint64_t)kept;
    for (int k = 0; k < kept; k++) {
        struct slot *sl = &s->slots[s->bslot[k]];
        if (rc != 0) {
            job_fail(s, sl, SCHED_ERROR, err);
        } else {
            sl->logits = s->blog + (size_t)k * s->V;
            sl->job->n_past++;
        }
    }
    pthread_mutex_unlock(&s->lock);
}

/*
 * One chunk of a slot's prompt, at most budget tokens; returns the tokens
 * spent. The first chunk takes a fresh sequence and, with cache_prompt,
 * shares the cached pages holding the prompt's longest page-aligned prefix
 * (the last token is always evaluated, for its logits).
 */
static int prompt_chunk(struct sched *s, int i, int budget)
{
    struct slot *sl = &s->slots[i];
    struct sched_job *j = sl->job;
    const struct sched_req *q = &j->req;
    char err[256];
    if (sl->seq < 0) {
        j->t_start = now_s();
        if (q->n_prompt <= 0 || (sl->seq = kv_seq_new(s->kv, err, sizeof err)) < 0) {
            pthread_mutex_lock(&s->lock);
            job_fail(s, sl, SCHED_ERROR, q->n_prompt <= 0 ? "the prompt is empty" : err);
            pthread_mutex_unlock(&s->lock);
            return 0;
        }
        int k = q->cache_prompt ? kv_prefix(s->kv, sl->seq, q->prompt, q->n_prompt - 1) : 0;
        pthread_mutex_lock(&s->lock);
        j->n_cached = j->n_past = k;
        pthread_mutex_unlock(&s->lock);
    }
    int pos = j->n_past, n = q->n_prompt - pos < budget ? q->n_prompt - pos : budget;
    /* model_eval shares cached pages by itself when a sequence starts at 0;
     * a first chunk of one token has nothing to share, so without
     * cache_prompt the first token goes alone */
    if (pos == 0 && !q->cache_prompt)
        n = 1;
    int last = pos + n == q->n_prompt;
    if (make_room(s, i, (pos + n + s->P - 1) / s->P - (pos + s->P - 1) / s->P) != 0)
        return n;
    int rc = model_eval(s->ctx, sl->seq, q->prompt + pos, n, pos, last ? s->plog + (size_t)i * s->V : NULL, 0,
                        err, sizeof err);
    pthread_mutex_lock(&s->lock);
    if (rc != 0) {
        job_fail(s, sl, SCHED_ERROR, err);
    } else {
        j->n_cached += model_last_reused(s->ctx);
        j->n_past += n;
        if (last) {
            j->t_prompt = now_s();
            sl->logits = s->plog + (size_t)i * s->V;
            if (j->cap == 0)
                job_finish(s, sl, j, SCHED_LIMIT);
        }
    }
    pthread_mutex_unlock(&s->lock);
    return n;
}

/* Whether slot i's job may start its prompt: not while the pool cannot hold
 * the whole prompt (shared prefix pages counted too) and other jobs hold
 * pages that will come back; it then waits in its slot instead of failing. */
static int may_start(struct sched *s, int i)
{
    struct kv_stats ks;
    kv_stats(s->kv, &ks);
    if ((s->slots[i].job->req.n_prompt + s->P - 1) / s->P <= ks.free + ks.idle)
        return 1;
    for (int k = 0; k < s->n_slots; k++)
        if (k != i && s->slots[k].job && s->slots[k].seq >= 0)
            return 0;
    return 1;
}

/* The pool's state for sched_stats (lock held, on the scheduler thread). */
static void snapshot(struct sched *s)
{
    kv_stats(s->kv, &s->kvs);
    for (int i = 0; i < s->n_slots; i++) {
        struct slot *sl = &s->slots[i];
        sl->n_cells = sl->job && sl->seq >= 0 ? kv_seq_len(s->kv, sl->seq) : 0;
    }
}

/*
 * A step: cancelled jobs leave and queued ones take the free slots (a new
 * job joins at the next step); every decoding slot samples a token and all
 * of them are evaluated together (model_decode_batch: each weight matrix is
 * read once for the whole batch); then the slots reading prompts share a
 * budget of prompt tokens, oldest job first.
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
        snapshot(s);
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
        int nb = sample_all(s);
        if (nb > 0)
            decode(s, nb);
        int budget = nb > 0 ? SCHED_PROMPT_BUSY : s->chunk, waiting = 0;
        for (int a = 0; a < s->n_slots && budget > 0; a++) {
            int i = s->age[a];
            struct slot *sl = &s->slots[i];
            if (!sl->job || sl->logits)
                continue;
            /* once a job waits for pages, the younger ones do not start
             * either, so that short prompts never pass a long one for good */
            if (sl->seq < 0 && (waiting || !may_start(s, i))) {
                waiting = 1;
                continue;
            }
            budget -= prompt_chunk(s, i, budget);
        }
        pthread_mutex_lock(&s->lock);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* ==== the interface ==== */

int sched_new(struct sched **out, struct model *m, const struct sched_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (o->n_slots < 1)
        return strata_errf(err, errlen, "%d slots; need at least one", o->n_slots);
    struct sched *s = calloc(1, sizeof *s);
    if (!s)
        return strata_errf(err, errlen, "out of memory");
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->tok = model_tok(m);
    s->V = model_hp(m)->n_vocab;
    s->max_piece = 1;
    char one[1];
    for (int32_t id = 0; id < tok_n_vocab(s->tok); id++) {
        size_t n = tok_piece(s->tok, id, one, 0, 0);
        if (n > s->max_piece)
            s->max_piece = n;
    }
    size_t N = (size_t)o->n_slots, V = (size_t)s->V;
    s->pool = pool_new(o->n_threads);
    s->slots = calloc(N, sizeof *s->slots);
    s->age = malloc(N * sizeof *s->age);
    s->bseq = malloc(N * sizeof *s->bseq);
    s->bslot = malloc(N * sizeof *s->bslot);
    s->btok = malloc(N * sizeof *s->btok);
    s->draw = malloc(N * sizeof *s->draw);
    s->drawn = malloc(N * sizeof *s->drawn);
    s->plog = malloc(N * V * sizeof *s->plog);
    if (!s->pool || !s->slots || !s->age || !s->bseq || !s->bslot || !s->btok || !s->draw || !s->drawn || !s->plog) {
        strata_errf(err, errlen, "out of memory");
        goto fail;
    }
    s->n_slots = o->n_slots;
    for (int i = 0; i < s->n_slots; i++) {
        s->slots[i].seq = -1;
        s->age[i] = i;
    }
    struct model_opts mo = model_opts_default();
    mo.n_ctx = o->n_ctx;
    mo.kv_cell = o->kv_cell;
    mo.kv_mem_mib = o->kv_mem_mib;
    mo.n_seq = o->n_slots;
    mo.device = o->device;
    mo.prefill_chunk = o->prefill_chunk;
    if (model_ctx_new(&s->ctx, m, &mo, s->pool, err, errlen) != 0)
        goto fail;
    int rows = 0;
    s->blog = model_ctx_batch_logits(s->ctx, &rows);
    if ((size_t)rows < N && !(s->blog = s->blog_own = malloc(N * V * sizeof *s->blog))) {
        strata_errf(err, errlen, "out of memory");
        goto fail;
    }
    s->kv = model_kv(s->ctx);
    kv_seq_free(s->kv, 0); /* model_ctx_new's sequence: each job makes its own */
    s->n_ctx = kv_cfg(s->kv)->n_ctx;
    s->P = kv_cfg(s->kv)->page_cells;
    s->chunk = model_ctx_chunk(s->ctx);
    kv_stats(s->kv, &s->kvs);
    if (pthread_create(&s->thread, NULL, sched_main, s) != 0) {
        strata_errf(err, errlen, "cannot start the scheduler thread");
        goto fail;
    }
    s->started = 1;
    *out = s;
    return 0;
fail:
    sched_free(s);
    return -1;
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
    model_ctx_free(s->ctx);
    free(s->slots);
    free(s->age);
    free(s->bseq);
    free(s->bslot);
    free(s->draw);
    free(s->drawn);
    free(s->btok);
    free(s->plog);
    free(s->blog_own);
    pool_free(s->pool);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

int sched_n_ctx(const struct sched *s) { return s->n_ctx; }
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
    out->kv_used = 0;
    for (int i = 0; i < s->n_slots; i++)
        out->kv_used += s->slots[i].n_cells;
    out->kv_cached = (long)s->kvs.idle * s->P;
    out->kv_total = (long)s->kvs.pages * s->P;
    out->prompt_rate = window_rate(s->win_pn, s->win_ps);
    out->gen_rate = window_rate(s->win_gn, s->win_gs);
    pthread_mutex_unlock(&s->lock);
}
