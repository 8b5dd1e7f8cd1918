/*
 * pool.c — the persistent pthread pool that every parallel loop runs on.
 *
 * pool_run(fn, arg) runs fn(arg, i, n) once for each index i of the n
 * threads and returns when all are done. The indices are handed out as the
 * threads arrive, the caller taking them too: when another program holds a
 * worker's core, the caller runs that worker's index itself instead of
 * waiting for it, and a worker that arrives late finds nothing left. Decode
 * calls it about ten times per layer, so a call must cost microseconds: idle
 * workers spin on a generation counter for a short while before they sleep
 * on a condition variable, and the caller spins until the indices taken by
 * workers are finished.
 * No work splitting happens here; the callers decide what index i does.
 */
#include "strata.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define pool_relax() _mm_pause()
#elif defined(__aarch64__)
#define pool_relax() __asm__ __volatile__("yield")
#else
#define pool_relax() ((void)0)
#endif

/* About half a millisecond of polling (a pause takes ~20 ns on Zen 5) before
 * an idle worker goes to sleep: long enough to cover the gaps between the
 * calls of one forward pass, short enough not to burn a core while the
 * program waits for input. */
#define POOL_SPIN 20000

/* Polls between two yields of the CPU while spinning: when the machine has
 * more runnable threads than cores, a spinner lets the thread it waits for
 * run (about 5 µs of polling per yield). */
#define POOL_YIELD_EVERY 256

struct pool {
    int n;                        /* threads, caller included */
    pthread_t *threads;           /* (n - 1) workers */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int sleepers;                 /* workers waiting on `wake` (under mu) */
    void (*fn)(void *arg, int i, int n);
    void *arg;
    atomic_uint gen;              /* bumped (under mu) once per pool_run */
    atomic_int next;              /* the next index of the current job to hand out */
    atomic_int finished;          /* indices of the current job finished */
    atomic_int quit;
};

/* Waits until the generation moves past `seen`; returns the new one. */
static unsigned pool_wait_gen(struct pool *p, unsigned seen)
{
    for (int k = 0; k < POOL_SPIN; k++) {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen)
            return g;
        if (k % POOL_YIELD_EVERY == POOL_YIELD_EVERY - 1)
            sched_yield();
        else
            pool_relax();
    }
    pthread_mutex_lock(&p->mu);
    unsigned g;
    while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen) {
        p->sleepers++;
        pthread_cond_wait(&p->wake, &p->mu);
        p->sleepers--;
    }
    pthread_mutex_unlock(&p->mu);
    return g;
}

/* Runs indices of the current job until none is left. An index taken
 * belongs to the job whose fn and arg are read after taking it: that job
 * cannot end (and the caller cannot publish the next) before the index is
 * finished, even when the taker saw an older generation. */
static void pool_work(struct pool *p)
{
    int i;
    while ((i = atomic_fetch_add_explicit(&p->next, 1, memory_order_acquire)) < p->n) {
        p->fn(p->arg, i, p->n);
        atomic_fetch_add_explicit(&p->finished, 1, memory_order_release);
    }
}

static void *pool_main(void *arg)
{
    struct pool *p = arg;
    unsigned seen = 0;
    for (;;) {
        seen = pool_wait_gen(p, seen);
        if (atomic_load_explicit(&p->quit, memory_order_acquire))
            return NULL;
        pool_work(p);
    }
}

/* Publishes a new generation; the mutex makes a worker that is about to
 * sleep either see the new value or be woken by the broadcast. */
static void pool_bump(struct pool *p)
{
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    if (p->sleepers)
        pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
}

struct pool *pool_new(int n_threads)
{
    struct pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->n = n_threads < 1 ? 1 : n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    atomic_init(&p->gen, 0);
    atomic_init(&p->next, 0);
    atomic_init(&p->finished, 0);
    atomic_init(&p->quit, 0);
    p->threads = calloc((size_t)p->n, sizeof *p->threads);
    if (!p->threads) {
        pool_free(p);
        return NULL;
    }
    for (int i = 1; i < p->n; i++) {
        if (pthread_create(&p->threads[i - 1], NULL, pool_main, p) != 0) {
            p->n = i;   /* pool_free joins the i - 1 workers that started */
            pool_free(p);
            return NULL;
        }
    }
    return p;
}

void pool_free(struct pool *p)
{
    if (!p)
        return;
    if (p->threads) {
        atomic_store_explicit(&p->quit, 1, memory_order_release);
        pool_bump(p);
        for (int i = 1; i < p->n; i++)
            pthread_join(p->threads[i - 1], NULL);
        free(p->threads);
    }
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int pool_size(const struct pool *p)
{
    return p ? p->n : 1;
}

void pool_run(struct pool *p, void (*fn)(void *arg, int i, int n), void *arg)
{
    if (!p || p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->finished, 0, memory_order_relaxed);
    /* from here on indices can be taken: fn, arg and finished are set */
    atomic_store_explicit(&p->next, 0, memory_order_release);
    pool_bump(p);
    pool_work(p);
    /* every index is taken: wait for those the workers are running */
    for (int k = 0; atomic_load_explicit(&p->finished, memory_order_acquire) != p->n; k++) {
        if (k < POOL_SPIN && k % POOL_YIELD_EVERY != POOL_YIELD_EVERY - 1)
            pool_relax();
        else
            sched_yield();
    }
}
