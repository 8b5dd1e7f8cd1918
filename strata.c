/*
 * strata.c — the command line: generate, tokenize, perplexity, info, bench,
 * synth.
 *
 * Every command writes only its result to stdout; logs, progress, timings and
 * warnings go to stderr. Each error is one line on stderr and a non-zero exit.
 * This file parses options and drives the subsystems through strata.h; it
 * holds no model, tokenizer or sampling logic of its own. V is the vocabulary.
 */
#include "strata.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_CTX_CAP 4096  /* default context: the model's, at most this */
#define PPL_DEFAULT_CTX 512   /* perplexity's default window */
#define PPL_LOGIT_BYTES (256u << 20) /* logits buffer bound for perplexity */
#define BENCH_BW_BYTES (1ull << 30)  /* bandwidth buffer: far beyond the caches */

static const char usage[] =
    "usage: strata COMMAND [options]\n"
    "\n"
    "commands:\n"
    "  generate   -m MODEL (-p TEXT | -f FILE) [-n N] [--temp T] [--top-k K] [--top-p P]\n"
    "             [--min-p P] [--seed S] [--repeat-penalty R] [--repeat-last-n N]\n"
    "             [--presence-penalty P] [--frequency-penalty P] [--logprobs N]\n"
    "             [--no-special] [--json]\n"
    "  tokenize   -m MODEL (-p TEXT | -f FILE) [--no-bos] [--no-special] [--json]\n"
    "  perplexity -m MODEL -f FILE [-c N] [--json]\n"
    "  info       -m MODEL [-c N] [--kv F]\n"
    "  bench      -m MODEL [-p N] [-n N] [-r REPS] [-d DEPTH] [--prefix N] [--split S] [--batch B]\n"
    "  synth      --arch A | --shape S [--set K=V] [--type T|q4_k_m|q5_k_m] [--vocab F] -o F\n"
    "  serve      -m MODEL [--port P] [--host H] [--parallel N] ... (strata serve --help)\n"
    "  help       this text\n"
    "\n"
    "shared options:\n"
    "  -m MODEL         GGUF model file\n"
    "  -t THREADS       threads (default: the cores)\n"
    "  -c, --ctx N      context length (default: the model's, at most 4096;\n"
    "                   perplexity: the window, default 512)\n"
    "  --kv F           KV cache cells: f16 (default), f32, int8 (one scale per\n"
    "                   row), q4 (Q4_0 blocks of 32), k8v4 (int8 K, Q4_0 V)\n"
    "  --kv-mem MIB     size the KV pool in MiB instead of by -c\n"
    "  --prefill-chunk N  prompt tokens per forward chunk (default 512; 2048 on a GPU)\n"
    "  --device D       auto (default: the GPU when there is one), cpu, gpu (cuda, hip)\n"
    "  --float          generate/perplexity/bench: compute the float function (weights\n"
    "                   dequantised, activations F32; slower): with --kv f32 it is the\n"
    "                   float reference the parity tests hold Strata to\n"
    "\n"
    "generate defaults: -n 128 --temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05\n"
    "--repeat-penalty 1 --repeat-last-n 64 (-1: the context), a random seed\n"
    "(printed to stderr); --temp 0 is greedy.\n"
    "\n"
    "bench: -p N prompt tokens (512), then -n N decode steps (128), -r REPS (3);\n"
    "-d DEPTH cells before them (on the CPU random K/V rows, written straight into\n"
    "the pages); --prefix N times a prompt of N shared + -p new tokens evaluated\n"
    "twice (the second shares the cached pages); --split S decode attention\n"
    "partitions (0: automatic); --batch B also -n decode steps of B sequences\n"
    "together (each at DEPTH cells, sharing its pages), tokens/s of all B; the\n"
    "sample line times generate's sampling chain on the last logits (its options,\n"
    "generate's defaults).\n";

/* ==== errors and small helpers ==== */

__attribute__((format(printf, 1, 2)))
static int fail(const char *fmt, ...)
{
    va_list ap;
    fputs("strata: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static double mib(size_t bytes)
{
    return bytes / 1048576.0;
}

/* Whole file into a malloc'd buffer (NUL-terminated); NULL with errno set. */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap + 1);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *nb = realloc(buf, 2 * cap + 1);
            if (!nb) {
                free(buf);
                buf = NULL;
                errno = ENOMEM;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    int bad = buf && ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        errno = EIO;
        return NULL;
    }
    if (buf) {
        buf[n] = 0;
        *len = n;
    }
    return buf;
}

/* ==== options ==== */

enum { C_GEN = 1, C_TOK = 2, C_PPL = 4, C_INFO = 8, C_BENCH = 16, C_ALL = 31 };
enum { O_STR, O_INT, O_FLOAT, O_U64, O_FLAG, O_KV, O_DEV };

struct opts {
    const char *model, *prompt, *file;
    int threads, n_ctx, kv, kv_mem, chunk, device;
    int n_predict, n_prompt, reps, depth, prefix, split, batch;
    int logprobs, no_special, no_bos, json, have_seed, f32ref;
    struct sample_params sp;
};

struct flag {
    const char *name, *alias;
    int kind;
    size_t off;
    unsigned cmds;
    long min, max;        /* O_INT bounds */
};

#define OFF(field) offsetof(struct opts, field)
static const struct flag flags[] = {
    { "-m", "--model", O_STR, OFF(model), C_ALL, 0, 0 },
    { "-t", "--threads", O_INT, OFF(threads), C_ALL, 1, 1024 },
    { "-c", "--ctx", O_INT, OFF(n_ctx), C_ALL, 1, 1 << 24 },
    { "--kv", NULL, O_KV, OFF(kv), C_ALL, 0, 0 },
    { "--kv-mem", NULL, O_INT, OFF(kv_mem), C_GEN | C_PPL | C_BENCH | C_INFO, 1, 1 << 24 },
    { "--prefill-chunk", NULL, O_INT, OFF(chunk), C_GEN | C_PPL | C_BENCH, 1, 1 << 16 },
    { "--device", NULL, O_DEV, OFF(device), C_GEN | C_PPL | C_BENCH, 0, 0 },
    { "-p", "--prompt", O_STR, OFF(prompt), C_GEN | C_TOK, 0, 0 },
    { "-f", "--file", O_STR, OFF(file), C_GEN | C_TOK | C_PPL, 0, 0 },
    { "-n", "--n-predict", O_INT, OFF(n_predict), C_GEN | C_BENCH, 0, 1 << 24 },
    { "-p", "--n-prompt", O_INT, OFF(n_prompt), C_BENCH, 0, 1 << 24 },
    { "-r", "--reps", O_INT, OFF(reps), C_BENCH, 1, 1000 },
    { "-d", "--depth", O_INT, OFF(depth), C_BENCH, 0, 1 << 24 },
    { "--prefix", NULL, O_INT, OFF(prefix), C_BENCH, 0, 1 << 24 },
    { "--split", NULL, O_INT, OFF(split), C_BENCH, 0, ATTN_MAX_SPLIT },
    { "--batch", NULL, O_INT, OFF(batch), C_BENCH, 1, 64 },
    { "--temp", NULL, O_FLOAT, OFF(sp.temp), C_GEN | C_BENCH, 0, 0 },
    { "--top-k", NULL, O_INT, OFF(sp.top_k), C_GEN | C_BENCH, -1, 1 << 24 },
    { "--top-p", NULL, O_FLOAT, OFF(sp.top_p), C_GEN | C_BENCH, 0, 0 },
    { "--min-p", NULL, O_FLOAT, OFF(sp.min_p), C_GEN | C_BENCH, 0, 0 },
    { "--repeat-penalty", NULL, O_FLOAT, OFF(sp.repeat_penalty), C_GEN | C_BENCH, 0, 0 },
    { "--presence-penalty", NULL, O_FLOAT, OFF(sp.presence_penalty), C_GEN | C_BENCH, 0, 0 },
    { "--frequency-penalty", NULL, O_FLOAT, OFF(sp.frequency_penalty), C_GEN | C_BENCH, 0, 0 },
    { "--repeat-last-n", NULL, O_INT, OFF(sp.repeat_last_n), C_GEN | C_BENCH, -1, 1 << 24 },
    { "--seed", NULL, O_U64, OFF(sp.seed), C_GEN | C_BENCH, 0, 0 },
    { "--logprobs", NULL, O_INT, OFF(logprobs), C_GEN, 0, 1 << 24 },
    { "--no-special", NULL, O_FLAG, OFF(no_special), C_GEN | C_TOK, 0, 0 },
    { "--no-bos", NULL, O_FLAG, OFF(no_bos), C_TOK, 0, 0 },
    { "--json", NULL, O_FLAG, OFF(json), C_GEN | C_TOK | C_PPL, 0, 0 },
    { "--float", NULL, O_FLAG, OFF(f32ref), C_GEN | C_PPL | C_BENCH, 0, 0 },
};
#undef OFF

static int parse_value(const struct flag *fl, const char *arg, const char *v, struct opts *o)
{
    char *end;
    void *dst = (char *)o + fl->off;
    errno = 0;
    switch (fl->kind) {
    case O_STR:
        *(const char **)dst = v;
        return 0;
    case O_INT: {
        long x = strtol(v, &end, 10);
        if (end == v || *end || errno || x < fl->min || x > fl->max)
            return fail("%s: '%s' is not an integer in [%ld, %ld]", arg, v, fl->min, fl->max);
        *(int *)dst = (int)x;
        return 0;
    }
    case O_FLOAT: {
        float x = strtof(v, &end);
        if (end == v || *end || errno || !isfinite(x))
            return fail("%s: '%s' is not a number", arg, v);
        *(float *)dst = x;
        return 0;
    }
    case O_U64: {
        unsigned long long x = strtoull(v, &end, 10);
        if (end == v || *end || errno || v[0] == '-')
            return fail("%s: '%s' is not an unsigned integer", arg, v);
        *(uint64_t *)dst = x;
        o->have_seed = 1;
        return 0;
    }
    case O_KV:
        if ((o->kv = kv_cell_parse(v)) < 0)
            return fail("%s: '%s' is not f16, f32, int8, q4 or k8v4", arg, v);
        return 0;
    case O_DEV:
        if ((o->device = model_device_parse(v)) < 0)
            return fail("%s: '%s' is not auto, cpu, gpu, cuda or hip", arg, v);
        return 0;
    }
    return fail("%s: unhandled option kind", arg);
}

static int parse_opts(int argc, char **argv, unsigned cmd, const char *cmd_name, struct opts *o)
{
    memset(o, 0, sizeof *o);
    o->kv = KV_CELL_F16;
    o->device = MODEL_DEV_AUTO;
    o->n_predict = 128;
    o->n_prompt = 512;
    o->reps = 3;
    o->batch = 1;
    o->sp = (struct sample_params){ .temp = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                                    .repeat_penalty = 1.0f, .repeat_last_n = 64 };
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const struct flag *fl = NULL;
        int elsewhere = 0;
        for (size_t k = 0; k < sizeof flags / sizeof *flags && !fl; k++) {
            if (strcmp(a, flags[k].name) != 0 && !(flags[k].alias && strcmp(a, flags[k].alias) == 0))
                continue;
            if (flags[k].cmds & cmd)
                fl = &flags[k];
            else
                elsewhere = 1;
        }
        if (!fl && elsewhere)
            return fail("option %s does not apply to '%s'", a, cmd_name);
        if (!fl)
            return fail("unknown option '%s' for '%s' (see strata --help)", a, cmd_name);
        if (fl->kind == O_FLAG) {
            *(int *)((char *)o + fl->off) = 1;
            continue;
        }
        if (i + 1 >= argc)
            return fail("option %s needs a value", a);
        if (parse_value(fl, a, argv[++i], o))
            return 1;
    }
    if (!o->model)
        return fail("%s: a model is required (-m MODEL)", cmd_name);
    if (o->threads == 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        o->threads = nc > 0 ? (int)nc : 1;
    }
    return 0;
}

/* The text of -p or -f (exactly one); malloc'd. */
static char *input_text(const struct opts *o, const char *cmd, size_t *len)
{
    if (!!o->prompt == !!o->file) {
        fail("%s: give exactly one of -p TEXT or -f FILE", cmd);
        return NULL;
    }
    if (o->prompt) {
        *len = strlen(o->prompt);
        return strdup(o->prompt);
    }
    char *t = read_file(o->file, len);
    if (!t)
        fail("cannot read %s: %s", o->file, strerror(errno));
    return t;
}

/* ==== models ==== */

static int load_model(const struct opts *o, struct model **m, int need_tok)
{
    char err[512];
    if (model_load(m, o->model, err, sizeof err) != 0)
        return fail("cannot load %s: %s", o->model, err);
    if (need_tok && !model_tok(*m)) {
        model_free(*m);
        *m = NULL;
        return fail("%s has no tokenizer", o->model);
    }
    return 0;
}

/* The KV pool of one sequence of n_ctx cells for m, as --kv/--kv-mem ask. */
static struct kv_config kv_shape(const struct opts *o, const struct model_hp *hp, int cell, int n_ctx)
{
    struct kv_config k = { hp->n_layer, hp->n_head_kv, hp->head_dim, cell, 0, 1, n_ctx, o->kv_mem, NULL };
    return k;
}

/* Bytes the pool takes: --kv-mem, or whole pages for n_ctx cells (0 when
 * the format cannot hold the head dim). */
static size_t kv_bytes(const struct opts *o, const struct model_hp *hp, int n_ctx)
{
    if (o->kv_mem > 0)
        return (size_t)o->kv_mem << 20;
    struct kv_config k = kv_shape(o, hp, o->kv, n_ctx);
    size_t cells = ((size_t)n_ctx + KV_PAGE_CELLS - 1) / KV_PAGE_CELLS * KV_PAGE_CELLS;
    return kv_cell_bytes(&k) * cells;
}

static int default_ctx(const struct model_hp *hp)
{
    return hp->n_ctx_train > 0 && hp->n_ctx_train < DEFAULT_CTX_CAP ? hp->n_ctx_train : DEFAULT_CTX_CAP;
}

/* Whether the context will run on the GPU (where the KV pages live in
 * device memory). */
static int on_gpu(const struct opts *o)
{
    return o->device == MODEL_DEV_GPU || (o->device == MODEL_DEV_AUTO && !o->f32ref && gpu_devices(NULL, 0) > 0);
}

/* Refuses a model and cache that do not fit in physical memory: the weights
 * are mapped, and paging them in and out each token would be unusable. */
static int check_memory(const struct opts *o, const struct model *m, int n_ctx)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0)
        return 0;
    size_t have = (size_t)pages * (size_t)page;
    size_t w = model_weight_bytes(m), kv = on_gpu(o) ? 0 : kv_bytes(o, model_hp(m), n_ctx);
    if (w + kv > have)
        return fail("%s needs %.0f MiB (weights %.0f MiB + KV cache %.0f MiB for %d cells) but this "
                    "machine has %.0f MiB", o->model, mib(w + kv), mib(w), mib(kv), n_ctx, mib(have));
    return 0;
}

/* A pool and a context of n_ctx cells (one sequence) for m; the KV pool it
 * took goes to stderr. */
static int open_ctx(const struct opts *o, struct model *m, int n_ctx, struct pool **pool,
                    struct model_ctx **c)
{
    char err[512];
    if (check_memory(o, m, n_ctx))
        return 1;
    *pool = pool_new(o->threads);
    if (!*pool)
        return fail("cannot start %d threads", o->threads);
    struct model_opts mo = model_opts_default();
    mo.n_ctx = n_ctx;
    mo.kv_cell = o->kv;
    mo.kv_mem_mib = o->kv_mem;
    mo.prefill_chunk = o->chunk;
    mo.device = o->device;
    mo.attn_split = o->split;
    mo.n_seq = o->batch > 1 ? o->batch : mo.n_seq;
    mo.f32ref = o->f32ref;
    if (model_ctx_new(c, m, &mo, *pool, err, sizeof err) != 0) {
        pool_free(*pool);
        *pool = NULL;
        return fail("%s", err);
    }
    struct kv_stats st;
    kv_stats(model_kv(*c), &st);
    fprintf(stderr, "kv cache: %s cells, %d per sequence, %.1f MiB in %s memory (%zu bytes per cell, %d pages)\n",
            kv_cell_name(o->kv), kv_cfg(model_kv(*c))->n_ctx, mib(st.total_bytes),
            model_ctx_device(*c) == MODEL_DEV_GPU ? "device" : "host", st.cell_bytes, st.pages);
    return 0;
}

/* ==== generate ==== */

struct gen_out {
    int32_t id;
    float logprob;
    struct sample_top *top;   /* (logprobs) */
};

static uint64_t random_seed(void)
{
    uint64_t s = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(&s, sizeof s, 1, f) != 1)
        s = (uint64_t)time(NULL) * 6364136223846793005ull ^ (uint64_t)getpid();
    if (f)
        fclose(f);
    return s;
}

/* tok_piece into a growing buffer; returns the length. */
static size_t piece(const struct tok *t, int32_t id, char **buf, size_t *cap, int special)
{
    size_t n = tok_piece(t, id, *buf, *cap, special);
    if (n > *cap) {
        char *nb = realloc(*buf, n);
        if (!nb)
            return 0;
        *buf = nb;
        *cap = n;
        n = tok_piece(t, id, *buf, *cap, special);
    }
    return n;
}

static void put_gen_json(FILE *f, const struct tok *t, const int32_t *prompt, int np,
                         const struct gen_out *out, int n_out, int n_top, double prompt_ms,
                         double decode_ms, int n_decoded)
{
    char *buf = malloc(64);
    size_t cap = buf ? 64 : 0;
    fputs("{\"prompt_tokens\":[", f);
    for (int i = 0; i < np; i++)
        fprintf(f, i ? ",%" PRId32 : "%" PRId32, prompt[i]);
    fputs("],\"tokens\":[", f);
    for (int i = 0; i < n_out; i++) {
        size_t n = buf ? piece(t, out[i].id, &buf, &cap, 1) : 0;
        fprintf(f, "%s{\"id\":%" PRId32 ",\"text\":", i ? "," : "", out[i].id);
        json_put_str(f, buf, n);
        fputs(",\"bytes\":[", f);
        for (size_t k = 0; k < n; k++)
            fprintf(f, k ? ",%u" : "%u", (unsigned char)buf[k]);
        fputs("],\"logprob\":", f);
        json_put_num(f, out[i].logprob, "%.9g");
        if (n_top > 0) {
            fputs(",\"top\":[", f);
            for (int k = 0; k < n_top; k++) {
                fprintf(f, "%s{\"id\":%" PRId32 ",\"logprob\":", k ? "," : "", out[i].top[k].id);
                json_put_num(f, out[i].top[k].logprob, "%.9g");
                fputc('}', f);
            }
            fputc(']', f);
        }
        fputc('}', f);
    }
    fputs("],\"timings\":{\"prompt_ms\":", f);
    json_put_num(f, prompt_ms, "%.3f");
    fputs(",\"prompt_tok_s\":", f);
    json_put_num(f, prompt_ms > 0 ? np / (prompt_ms / 1e3) : 0, "%.3f");
    fputs(",\"decode_ms\":", f);
    json_put_num(f, decode_ms, "%.3f");
    fputs(",\"decode_tok_s\":", f);
    json_put_num(f, decode_ms > 0 ? n_decoded / (decode_ms / 1e3) : 0, "%.3f");
    fputs("}}\n", f);
    free(buf);
}

static int cmd_generate(struct opts *o)
{
    char err[512];
    size_t len;
    int rc = 1;
    struct model *m = NULL;
    struct pool *pool = NULL;
    struct model_ctx *c = NULL;
    struct sampler *smp = NULL;
    int32_t *prompt = NULL;
    struct gen_out *out = NULL;
    struct sample_top *tops = NULL;
    char *pbuf = NULL, *pending = NULL;
    char *text = input_text(o, "generate", &len);
    if (!text)
        return 1;
    if (load_model(o, &m, 1))
        goto done;
    const struct tok *t = model_tok(m);
    const struct model_hp *hp = model_hp(m);
    int V = hp->n_vocab, np = 0;
    prompt = tok_encode(t, text, len, 1, !o->no_special, &np, err, sizeof err);
    if (!prompt) {
        fail("cannot tokenize the prompt: %s", err);
        goto done;
    }
    if (np == 0) {
        fail("the prompt is empty (no tokens)");
        goto done;
    }
    int n_ctx = o->n_ctx ? o->n_ctx : default_ctx(hp);
    if (np >= n_ctx) {
        fail("the prompt is %d tokens; the context holds %d (-c)", np, n_ctx);
        goto done;
    }
    /* only the cells this run can use */
    int cells = (long)np + o->n_predict < n_ctx ? np + o->n_predict : n_ctx;
    if (cells < np + 1)
        cells = np + 1;
    if (open_ctx(o, m, cells, &pool, &c))
        goto done;

    struct sample_params sp = o->sp;
    if (sp.repeat_last_n < 0)
        sp.repeat_last_n = n_ctx;
    if (!o->have_seed)
        sp.seed = random_seed();
    fprintf(stderr, "seed: %" PRIu64 "\n", sp.seed);
    int n_top = o->json ? (o->logprobs < V ? o->logprobs : V) : 0;
    /* the last token needs no cell: a full context still yields one more */
    int n_max = o->n_predict < cells - np + 1 ? o->n_predict : cells - np + 1;
    smp = sample_new(&sp, V);
    float *logits = model_ctx_logits(c);
    out = calloc((size_t)n_max + 1, sizeof *out);
    tops = calloc(((size_t)n_max + 1) * (size_t)(n_top ? n_top : 1), sizeof *tops);
    size_t pcap = 256, pend = 0, pend_cap = 256;
    pbuf = malloc(pcap);
    pending = malloc(pend_cap);
    if (!smp || !out || !tops || !pbuf || !pending) {
        fail("out of memory");
        goto done;
    }
    for (int i = 0; i < np; i++)
        sample_accept(smp, prompt[i]);

    double t0 = now_ms();
    if (model_eval(c, 0, prompt, np, 0, logits, 0, err, sizeof err) != 0) {
        fail("%s", err);
        goto done;
    }
    double prompt_ms = now_ms() - t0, decode_ms = 0;
    int reused = model_last_reused(c);
    int n_out = 0, n_decoded = 0, pos = np;
    double t_loop = now_ms();
    while (n_out < n_max) {
        struct gen_out *g = &out[n_out];
        g->top = tops + (size_t)n_out * (size_t)n_top;
        int32_t id = sample_next(smp, logits);
        if (o->json)
            g->logprob = sample_logprob(logits, V, id, g->top, n_top);
        g->id = id;
        n_out++;
        sample_accept(smp, id);
        if (tok_is_eog(t, id))
            break;
        if (!o->json) {
            /* stream the text, holding back a UTF-8 character split across tokens */
            size_t n = piece(t, id, &pbuf, &pcap, 0);
            if (pend + n > pend_cap) {
                char *nb = realloc(pending, pend + n);
                if (!nb) {
                    fail("out of memory");
                    goto done;
                }
                pending = nb;
                pend_cap = pend + n;
            }
            memcpy(pending + pend, pbuf, n);
            pend += n;
            size_t ready = tok_utf8_complete(pending, pend);
            fwrite(pending, 1, ready, stdout);
            fflush(stdout);
            memmove(pending, pending + ready, pend - ready);
            pend -= ready;
        }
        if (n_out == n_max)
            break;
        double t1 = now_ms();
        if (model_eval(c, 0, &id, 1, pos, logits, 0, err, sizeof err) != 0) {
            fail("%s", err);
            goto done;
        }
        decode_ms += now_ms() - t1;
        n_decoded++;
        pos++;
    }
    double loop_ms = now_ms() - t_loop;
    if (n_out == n_max && n_max < o->n_predict)
        fprintf(stderr, "\nstrata: the context of %d cells is full: generation stopped\n", cells);
    if (o->json) {
        put_gen_json(stdout, t, prompt, np, out, n_out, n_top, prompt_ms, decode_ms, n_decoded);
    } else {
        fwrite(pending, 1, pend, stdout);
        fflush(stdout);
        fputc('\n', stderr);
    }
    /* decode: the model's steps alone; generated: each token's whole loop
     * (sampling, output, the step) */
    fprintf(stderr, "prompt: %d tokens (%d from the prefix cache) in %.1f ms (%.1f tok/s); decode: %d tokens "
            "in %.1f ms (%.1f tok/s); generated: %d tokens in %.1f ms (%.1f tok/s)\n", np, reused, prompt_ms,
            prompt_ms > 0 ? np / (prompt_ms / 1e3) : 0, n_decoded, decode_ms,
            decode_ms > 0 ? n_decoded / (decode_ms / 1e3) : 0, n_out, loop_ms,
            loop_ms > 0 ? n_out / (loop_ms / 1e3) : 0);
    rc = ferror(stdout) ? fail("error writing the output") : 0;
done:
    free(text);
    free(prompt);
    free(out);
    free(tops);
    free(pbuf);
    free(pending);
    sample_free(smp);
    model_ctx_free(c);
    pool_free(pool);
    model_free(m);
    return rc;
}

/* ==== tokenize: gguf + tokenizer only, so vocabulary-only files work ==== */

static int cmd_tokenize(struct opts *o)
{
    char err[512];
    size_t len;
    struct gguf g;
    struct tok *t = NULL;
    int rc = 1, n = 0;
    int32_t *ids = NULL;
    memset(&g, 0, sizeof g);
    char *text = input_text(o, "tokenize", &len);
    if (!text)
        return 1;
    if (gguf_open(&g, o->model, err, sizeof err) != 0) {
        fail("cannot load %s: %s", o->model, err);
        goto done;
    }
    if (tok_load(&t, &g, err, sizeof err) != 0) {
        fail("cannot load the tokenizer of %s: %s", o->model, err);
        goto done;
    }
    ids = tok_encode(t, text, len, !o->no_bos, !o->no_special, &n, err, sizeof err);
    if (!ids) {
        fail("cannot tokenize: %s", err);
        goto done;
    }
    if (o->json)
        putchar('[');
    for (int i = 0; i < n; i++)
        printf(i ? (o->json ? ",%" PRId32 : " %" PRId32) : "%" PRId32, ids[i]);
    puts(o->json ? "]" : "");
    rc = ferror(stdout) ? fail("error writing the output") : 0;
done:
    free(text);
    free(ids);
    if (t)
        tok_free(t);
    gguf_close(&g);
    return rc;
}

/* ==== perplexity (ARCH.md §5b) ==== */

/* -log softmax(row r)[next[r]] for the rows of one evaluated slice, shared
 * out among the pool's threads (on the GPU these sums are the host's whole
 * share of a window) */
struct nll_rows {
    const float *logits;
    const int32_t *next;
    int rows, V;
    double *v;
};

static void nll_rows_run(void *arg, int i, int n)
{
    const struct nll_rows *j = arg;
    for (int r = i; r < j->rows; r += n)
        j->v[r] = sample_lse(j->logits + (size_t)r * j->V, j->V) - j->logits[(size_t)r * j->V + j->next[r]];
}

static int cmd_perplexity(struct opts *o)
{
    char err[512];
    size_t len;
    int rc = 1, n = 0;
    struct model *m = NULL;
    struct pool *pool = NULL;
    struct model_ctx *c = NULL;
    int32_t *ids = NULL, *chunk = NULL;
    float *logits = NULL;
    double *nlls = NULL;
    if (!o->file)
        return fail("perplexity: a text file is required (-f FILE)");
    char *text = input_text(o, "perplexity", &len);
    if (!text)
        return 1;
    if (load_model(o, &m, 1))
        goto done;
    const struct tok *t = model_tok(m);
    int V = model_hp(m)->n_vocab;
    int n_ctx = o->n_ctx ? o->n_ctx : PPL_DEFAULT_CTX;
    if (n_ctx < 4) {
        fail("perplexity: the window (-c) must be at least 4 tokens");
        goto done;
    }
    /* the reference tool tokenizes with add_special and without parse_special */
    ids = tok_encode(t, text, len, 1, 0, &n, err, sizeof err);
    if (!ids) {
        fail("cannot tokenize %s: %s", o->file, err);
        goto done;
    }
    if (n < 2 * n_ctx) {
        fail("perplexity: %s has %d tokens; a window of %d needs at least %d (2·n_ctx)", o->file, n,
             n_ctx, 2 * n_ctx);
        goto done;
    }
    if (open_ctx(o, m, n_ctx, &pool, &c))
        goto done;
    int first = n_ctx / 2, n_chunks = n / n_ctx;
    /* logits for the scored half, in slices that bound the buffer */
    int slice = (int)(PPL_LOGIT_BYTES / ((size_t)V * sizeof(float)));
    if (slice < 1)
        slice = 1;
    if (slice > n_ctx - first)
        slice = n_ctx - first;
    logits = malloc((size_t)slice * (size_t)V * sizeof *logits);
    chunk = malloc((size_t)n_ctx * sizeof *chunk);
    nlls = malloc((size_t)slice * sizeof *nlls);
    if (!logits || !chunk || !nlls) {
        fail("out of memory");
        goto done;
    }
    double nll = 0, nll2 = 0, t0 = now_ms();
    long count = 0;
    for (int ch = 0; ch < n_chunks; ch++) {
        memcpy(chunk, ids + (size_t)ch * n_ctx, (size_t)n_ctx * sizeof *chunk);
        if (tok_add_bos(t))
            chunk[0] = tok_bos(t); /* overwritten, not inserted */
        /* position 0 starts from an empty cache */
        if (model_eval(c, 0, chunk, first, 0, NULL, 0, err, sizeof err) != 0) {
            fail("%s", err);
            goto done;
        }
        for (int p0 = first; p0 < n_ctx - 1; p0 += slice) {
            int rows = n_ctx - p0 < slice ? n_ctx - p0 : slice;
            if (model_eval(c, 0, chunk + p0, rows, p0, logits, 1, err, sizeof err) != 0) {
                fail("%s", err);
                goto done;
            }
            /* the last position has no next token to score */
            struct nll_rows job = {logits, chunk + p0 + 1, p0 + rows < n_ctx ? rows : n_ctx - 1 - p0, V, nlls};
            pool_run(pool, nll_rows_run, &job);
            for (int r = 0; r < job.rows; r++) {
                nll += nlls[r];
                nll2 += nlls[r] * nlls[r];
                count++;
            }
        }
        fprintf(stderr, "[%d]%.4f,", ch + 1, exp(nll / count));
        if (ch == 0)
            fprintf(stderr, " (%.2f s per chunk) ", (now_ms() - t0) / 1e3);
        fflush(stderr);
    }
    fputc('\n', stderr);
    /* the reference tool's error estimate: the standard error of the mean
     * NLL, carried to the perplexity through d(exp x) = exp x dx */
    double mean = nll / count, var = nll2 / count - mean * mean, ppl = exp(mean);
    double err_ppl = var > 0 && count > 1 ? sqrt(var / (count - 1)) * ppl : 0;
    if (o->json) {
        fputs("{\"ppl\":", stdout);
        json_put_num(stdout, ppl, "%.17g");
        fputs(",\"ppl_err\":", stdout);
        json_put_num(stdout, err_ppl, "%.17g");
        printf(",\"tokens\":%ld,\"chunks\":%d}\n", count, n_chunks);
    } else {
        printf("Final estimate: PPL = %.4f +/- %.5f\n", ppl, err_ppl);
    }
    rc = ferror(stdout) ? fail("error writing the output") : 0;
done:
    free(text);
    free(ids);
    free(chunk);
    free(logits);
    free(nlls);
    model_ctx_free(c);
    pool_free(pool);
    model_free(m);
    return rc;
}

/* ==== info ==== */

static const char *arch_name(int arch)
{
    switch (arch) {
    case ARCH_LLAMA: return "llama";
    case ARCH_QWEN2: return "qwen2";
    case ARCH_QWEN3: return "qwen3";
    case ARCH_QWEN3MOE: return "qwen3moe";
    }
    return "?";
}

static void put_gguf_str(const struct gguf *g, const char *label, const char *key)
{
    struct gguf_str s;
    if (gguf_get_str(g, key, &s) == 0)
        printf("%-18s %.*s\n", label, (int)(s.len > 200 ? 200 : s.len), s.ptr);
}

static int cmd_info(struct opts *o)
{
    struct model *m = NULL;
    if (load_model(o, &m, 0))
        return 1;
    const struct model_hp *hp = model_hp(m);
    const struct gguf *g = model_gguf(m);
    const struct tok *t = model_tok(m);
    printf("%-18s %s\n", "file", o->model);
    printf("%-18s %.1f MiB, GGUF v%u, %" PRIu64 " metadata keys\n", "size", mib(g->size), g->version,
           g->n_kv);
    put_gguf_str(g, "name", "general.name");
    printf("%-18s %s\n", "architecture", arch_name(hp->arch));
    printf("%-18s %d\n", "n_vocab", hp->n_vocab);
    printf("%-18s %d\n", "n_ctx_train", hp->n_ctx_train);
    printf("%-18s %d\n", "n_embd", hp->n_embd);
    printf("%-18s %d\n", "n_layer", hp->n_layer);
    printf("%-18s %d / %d (head dim %d)\n", "n_head / kv", hp->n_head, hp->n_head_kv, hp->head_dim);
    printf("%-18s %d\n", "n_ff", hp->n_ff);
    if (hp->n_expert)
        printf("%-18s %d (%d used), expert n_ff %d\n", "experts", hp->n_expert, hp->n_expert_used,
               hp->n_ff_exp);
    printf("%-18s %s, base %g, %d dims\n", "rope", hp->rope_neox ? "neox" : "normal", hp->rope_base,
           hp->n_rot);
    printf("%-18s %g\n", "rms_eps", hp->rms_eps);
    put_gguf_str(g, "tokenizer", "tokenizer.ggml.model");
    put_gguf_str(g, "pre-tokenizer", "tokenizer.ggml.pre");
    if (t)
        printf("%-18s bos %" PRId32 "%s, eos %" PRId32 "\n", "special tokens", tok_bos(t),
               tok_add_bos(t) ? " (added)" : "", tok_eos(t));

    /* tensors per type */
    uint64_t count[QT_COUNT] = { 0 };
    size_t bytes[QT_COUNT] = { 0 };
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        int ty = g->tensors[i].type;
        if (ty >= 0 && ty < QT_COUNT) {
            count[ty]++;
            bytes[ty] += g->tensors[i].nbytes;
        }
    }
    printf("%-18s %" PRIu64 ":", "tensors", g->n_tensors);
    for (int ty = 0; ty < QT_COUNT; ty++)
        if (count[ty])
            printf(" %s %" PRIu64 " (%.1f MiB)", gguf_type_name(ty), count[ty], mib(bytes[ty]));
    putchar('\n');
    int n_ctx = o->n_ctx ? o->n_ctx : default_ctx(hp);
    size_t w = model_weight_bytes(m), kv = kv_bytes(o, hp, n_ctx);
    printf("%-18s %.1f MiB\n", "weights", mib(w));
    printf("%-18s %.1f MiB\n", "decode reads", mib(model_decode_bytes(m)));
    printf("%-18s", "KV bytes per cell");
    for (int cell = 0; cell < KV_CELL_COUNT; cell++) {
        struct kv_config k = kv_shape(o, hp, cell, n_ctx);
        size_t b = kv_cell_bytes(&k);
        printf(b ? " %s %zu" : " %s -", kv_cell_name(cell), b);
    }
    putchar('\n');
    if (o->kv_mem > 0)
        printf("%-18s %.1f MiB (%s, --kv-mem)\n", "KV cache", mib(kv), kv_cell_name(o->kv));
    else
        printf("%-18s %.1f MiB (%d cells, %s)\n", "KV cache", mib(kv), n_ctx, kv_cell_name(o->kv));
    printf("%-18s %.1f MiB (weights + KV cache)\n", "memory needed", mib(w + kv));
    model_free(m);
    return ferror(stdout) ? fail("error writing the output") : 0;
}

/* ==== bench ==== */

typedef uint64_t bw_vec __attribute__((vector_size(32)));

struct bw_job {
    const bw_vec *buf;   /* (n) */
    size_t n;
    uint64_t sink[64];   /* one slot per thread (up to 64), keeps the reads alive */
};

static void bw_read(void *arg, int i, int n)
{
    struct bw_job *j = arg;
    size_t lo = j->n * (size_t)i / (size_t)n, hi = j->n * (size_t)(i + 1) / (size_t)n;
    bw_vec a = { 0 }, b = { 0 }, c = { 0 }, d = { 0 };
    size_t k = lo;
    for (; k + 4 <= hi; k += 4) {
        a ^= j->buf[k];
        b ^= j->buf[k + 1];
        c ^= j->buf[k + 2];
        d ^= j->buf[k + 3];
    }
    for (; k < hi; k++)
        a ^= j->buf[k];
    a ^= b ^ c ^ d;
    j->sink[i & 63] = a[0] ^ a[1] ^ a[2] ^ a[3];
}

/* Read bandwidth in bytes/s: the best of 3 multi-threaded passes over a
 * buffer far larger than the caches; 0 if it cannot be allocated. */
static double read_bandwidth(struct pool *pool, size_t *used)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    size_t size = BENCH_BW_BYTES;
    if (pages > 0 && page > 0 && size > (size_t)pages * (size_t)page / 4)
        size = (size_t)pages * (size_t)page / 4;
    size &= ~(size_t)4095;
    void *buf = aligned_alloc(4096, size);
    *used = size;
    if (!buf)
        return 0;
    memset(buf, 1, size); /* touch every page before timing */
    struct bw_job j = { buf, size / sizeof(bw_vec), { 0 } };
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now_ms();
        pool_run(pool, bw_read, &j);
        double s = (now_ms() - t0) / 1e3;
        if (s > 0 && size / s > best)
            best = size / s;
    }
    free(buf);
    return best;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Fixed pseudo-random tokens: ids[0..n) from seed. */
static void bench_tokens(int32_t *ids, int n, int V, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)V);
    }
}

/* The sampling chain's µs a token on one row of logits (the host's share
 * of a generated token besides the model's step), over 200 draws, each
 * accepted into the penalties' window as generation does. */
static double bench_sample(const struct sample_params *sp, const float *logits, int V)
{
    struct sampler *s = sample_new(sp, V);
    if (!s)
        return -1;
    double t0 = now_ms();
    for (int i = 0; i < 200; i++)
        sample_accept(s, sample_next(s, logits));
    double us = (now_ms() - t0) * 1e3 / 200;
    sample_free(s);
    return us;
}

/* Evaluates ids[0..n) at pos and returns the milliseconds (< 0 on error). */
static double bench_eval(struct model_ctx *c, const int32_t *ids, int n, int pos, float *logits)
{
    char err[512];
    double t0 = now_ms();
    if (model_eval(c, 0, ids, n, pos, logits, 0, err, sizeof err) != 0) {
        fail("%s", err);
        return -1;
    }
    return now_ms() - t0;
}

/* The depth: d cells of sequence 0 filled with random K/V rows written
 * straight into the pages (attention costs the same whatever the values,
 * and evaluating a long context first would take minutes); on the GPU,
 * whose pages are device memory, d evaluated tokens. */
static int bench_fill(struct model_ctx *c, const struct model_hp *hp, const int32_t *ids, int d, float *logits)
{
    if (model_ctx_device(c) == MODEL_DEV_GPU)
        return bench_eval(c, ids, d, 0, logits) < 0 ? -1 : 0;
    enum { ROWS = 256 };
    char err[512];
    struct kv *kv = model_kv(c);
    size_t ke = (size_t)hp->n_head_kv * (size_t)hp->head_dim;
    float *rows = malloc(2 * ROWS * ke * sizeof *rows);   /* K then V: (ROWS, K*E) each */
    if (!rows)
        return fail("out of memory");
    uint64_t x = 0x243F6A8885A308D3ull;
    for (size_t i = 0; i < 2 * ROWS * ke; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        rows[i] = (float)((double)(x >> 11) / 4503599627370496.0 - 1.0);
    }
    int rc = 0;
    kv_truncate(kv, 0, kv_seq_len(kv, 0));
    if (kv_append(kv, 0, NULL, d, err, sizeof err) != 0)
        rc = fail("%s", err);
    for (int l = 0; rc == 0 && l < hp->n_layer; l++)
        for (int p = 0; rc == 0 && p < d; p += ROWS) {
            int n = d - p < ROWS ? d - p : ROWS;
            if (kv_store(kv, 0, l, p, n, rows, rows + ROWS * ke, err, sizeof err) != 0)
                rc = fail("%s", err);
        }
    free(rows);
    return rc;
}

/* Tests, each rep: a prompt of np tokens and ng decode steps after it,
 * both after `depth` cells filled once (bench_fill); with --prefix, a prompt of `prefix` shared and
 * np new tokens cold, then the same shared tokens with other new ones (the
 * second reuses the first's pages). Every rep's prompts start with a token
 * of their own, so that no rep shares the pages of another. */
static int cmd_bench(struct opts *o)
{
    int rc = 1;
    struct model *m = NULL;
    struct pool *pool = NULL;
    struct model_ctx *c = NULL;
    int32_t *fill = NULL, *toks = NULL, *pa = NULL, *pb = NULL, *bt = NULL;
    int *seqs = NULL;
    float *logits = NULL, *lb = NULL;
    double *pp = NULL, *tg = NULL, *cold = NULL, *warm = NULL, *tgb = NULL;
    if (load_model(o, &m, 0))
        return 1;
    const struct model_hp *hp = model_hp(m);
    int V = hp->n_vocab, np = o->n_prompt, ng = o->n_predict, reps = o->reps, d = o->depth, nx = o->prefix;
    int B = ng > 0 ? o->batch : 1;
    if (np + ng + nx < 1) {
        fail("bench: nothing to measure (-p 0 -n 0)");
        goto done;
    }
    int cells = d + np + ng;
    if (nx + np > cells)
        cells = nx + np;
    if (open_ctx(o, m, cells + 1, &pool, &c))
        goto done;
    fill = malloc(((size_t)d + 1) * sizeof *fill);
    toks = malloc(((size_t)np + (size_t)ng + 1) * sizeof *toks);
    pa = malloc(((size_t)nx + (size_t)np + 1) * sizeof *pa);
    pb = malloc(((size_t)nx + (size_t)np + 1) * sizeof *pb);
    logits = model_ctx_logits(c);
    pp = calloc((size_t)reps, sizeof *pp);
    tg = calloc((size_t)reps, sizeof *tg);
    cold = calloc((size_t)reps, sizeof *cold);
    warm = calloc((size_t)reps, sizeof *warm);
    if (!fill || !toks || !pa || !pb || !pp || !tg || !cold || !warm) {
        fail("out of memory");
        goto done;
    }
    bench_tokens(fill, d + 1, V, 0x2545F4914F6CDD1Dull);
    bench_tokens(toks, np + ng + 1, V, 0x9E3779B97F4A7C15ull);
    /* warm-up (pages the weights in), then the depth, once */
    if (bench_eval(c, fill, 1, 0, logits) < 0 || (d > 0 && bench_fill(c, hp, fill, d, logits) != 0))
        goto done;
    int reused = 0;
    for (int r = 0; r < reps; r++) {
        if (np > 0) {
            toks[0] = (int32_t)((uint32_t)(r + 1) * 2654435761u % (uint32_t)V);
            double ms = bench_eval(c, toks, np, d, logits);
            if (ms < 0)
                goto done;
            pp[r] = np / (ms / 1e3);
        }
        double ms = 0;
        for (int i = 0; i < ng; i++) {
            double t = bench_eval(c, toks + np + i, 1, d + np + i, logits);
            if (t < 0)
                goto done;
            ms += t;
        }
        tg[r] = ng > 0 ? ng / (ms / 1e3) : 0;
        fprintf(stderr, "rep %d: prompt %.1f tok/s, decode %.1f tok/s\n", r + 1, pp[r], tg[r]);
    }
    /* --batch: B sequences of the depth's cells (forks of sequence 0: its
     * pages shared), -n steps of all B together */
    if (B > 1) {
        char err[512];
        struct kv *kv = model_kv(c);
        seqs = malloc((size_t)B * sizeof *seqs);
        bt = malloc((size_t)B * sizeof *bt);
        /* the context's rows where they hold the batch (the server's choice too) */
        int rows = 0;
        float *bl = model_ctx_batch_logits(c, &rows);
        if (rows < B)
            bl = lb = malloc((size_t)B * V * sizeof *lb);
        tgb = calloc((size_t)reps, sizeof *tgb);
        if (!seqs || !bt || !bl || !tgb) {
            fail("out of memory");
            goto done;
        }
        kv_truncate(kv, 0, kv_seq_len(kv, 0) - d);
        seqs[0] = 0;
        for (int b = 1; b < B; b++)
            if ((seqs[b] = kv_seq_fork(kv, 0, err, sizeof err)) < 0) {
                fail("bench --batch: %s", err);
                goto done;
            }
        for (int r = 0; r < reps; r++) {
            double t0 = now_ms();
            for (int i = 0; i < ng; i++) {
                for (int b = 0; b < B; b++)
                    bt[b] = toks[(np + i + b) % (np + ng + 1)];
                if (model_decode_batch(c, seqs, bt, B, bl, err, sizeof err) != 0) {
                    fail("bench --batch: %s", err);
                    goto done;
                }
            }
            tgb[r] = (double)B * ng / ((now_ms() - t0) / 1e3);
            for (int b = 0; b < B; b++)
                kv_truncate(kv, seqs[b], ng);
            fprintf(stderr, "rep %d: decode of %d sequences %.1f tok/s\n", r + 1, B, tgb[r]);
        }
        for (int b = 1; b < B; b++)
            kv_seq_free(kv, seqs[b]);
    }
    /* after the others: these prompts start at position 0, dropping the depth */
    for (int r = 0; r < reps && nx > 0; r++) {
        bench_tokens(pa, nx + np, V, 0xD1B54A32D192ED03ull + (uint64_t)r);
        memcpy(pb, pa, (size_t)nx * sizeof *pb);
        bench_tokens(pb + nx, np, V, 0x8CB92BA72F3D8DD7ull + (uint64_t)r);
        if ((cold[r] = bench_eval(c, pa, nx + np, 0, logits)) < 0 ||
            (warm[r] = bench_eval(c, pb, nx + np, 0, logits)) < 0)
            goto done;
        reused = model_last_reused(c);
        fprintf(stderr, "rep %d: prefix cold %.1f ms, warm %.1f ms (%d reused)\n", r + 1, cold[r], warm[r], reused);
    }
    /* the bound: the device's bandwidth (a copy on the GPU, a read loop on
     * the CPU) over the bytes a decode step reads */
    int gpu = model_ctx_device(c) == MODEL_DEV_GPU;
    size_t bw_size = (size_t)1 << 30;
    double bw = gpu ? gpu_copy_bandwidth(bw_size) : read_bandwidth(pool, &bw_size);
    double dec = (double)model_decode_bytes(m);
    /* each decode step also reads every cell it attends to, K twice with
     * F16 cells on the CPU (attn.c's reference mode takes a second pass over K) */
    struct kv_stats st;
    kv_stats(model_kv(c), &st);
    double cell_reads = o->kv == KV_CELL_F16 && !gpu ? 1.5 * st.cell_bytes : (double)st.cell_bytes;
    double kv_dec = ng > 0 ? (d + np + (ng - 1) / 2.0 + 1) * cell_reads : 0;
    double bound = bw > 0 && dec > 0 ? bw / (dec + kv_dec) : 0, tg_med = median(tg, reps);
    printf("%-14s %s (%s, %.1f MiB; decode reads %.1f MiB/token)\n", "model", o->model,
           arch_name(hp->arch), mib(model_weight_bytes(m)), mib((size_t)dec));
    printf("%-14s %d\n", "threads", o->threads);
    printf("%-14s %s, %zu bytes per cell%s\n", "kv cache", kv_cell_name(o->kv), st.cell_bytes,
           gpu ? ", on the GPU" : "");
    if (gpu)
        printf("%-14s %s\n", "prompt gemm",
               gpu_gemm_blas() ? "cuBLAS, weights dequantised to f16 (64 tokens or more)" : "Strata's kernels");
    if (d > 0)
        printf("%-14s %d cells before each test (decode reads %.1f MiB/token of KV)\n", "depth", d,
               mib((size_t)kv_dec));
    printf("%-14s %-8s %12s\n", "test", "tokens", "tok/s");
    if (np > 0)
        printf("%-14s %-8d %12.2f\n", "prompt", np, median(pp, reps));
    if (ng > 0) {
        printf("%-14s %-8d %12.2f\n", "decode", ng, tg_med);
        printf("%-14s %-8s %12.1f us a token (the sampling chain on the host: --temp %g --top-k %d --top-p %g "
               "--min-p %g)\n", "sample", "", bench_sample(&o->sp, logits, V), o->sp.temp, o->sp.top_k,
               o->sp.top_p, o->sp.min_p);
    }
    if (B > 1) {
        /* a step of B reads the weights once and each sequence's own cells */
        double kv_b = (d + (ng - 1) / 2.0 + 1) * cell_reads, tgb_med = median(tgb, reps);
        double bound_b = bw > 0 && dec > 0 ? B * bw / (dec + B * kv_b) : 0;
        char bname[32];
        snprintf(bname, sizeof bname, "decode x%d", B);
        printf("%-14s %-8d %12.2f (%d sequences, all their tokens; bound %.2f, %.1f%%)\n", bname, ng, tgb_med, B,
               bound_b, bound_b > 0 ? 100 * tgb_med / bound_b : 0);
    }
    if (nx > 0) {
        printf("%-14s %-8d %12.2f ms (all evaluated)\n", "prefix cold", nx + np, median(cold, reps));
        printf("%-14s %-8d %12.2f ms (%d from the prefix cache)\n", "prefix warm", nx + np, median(warm, reps),
               reused);
    }
    if (gpu)
        printf("%-14s %.2f GB/s (device copy of %.0f MiB, read + write)\n", "bandwidth", bw / 1e9, mib(bw_size));
    else
        printf("%-14s %.2f GB/s (read, %d threads, %.0f MiB buffer)\n", "bandwidth", bw / 1e9, o->threads,
               mib(bw_size));
    if (bound > 0) {
        printf("%-14s %.2f tok/s (bandwidth / decode bytes)\n", "decode bound", bound);
        if (ng > 0)
            printf("%-14s %.1f%%\n", "decode/bound", 100 * tg_med / bound);
    }
    fprintf(stderr, "medians of %d reps\n", reps);
    rc = ferror(stdout) ? fail("error writing the output") : 0;
done:
    free(fill);
    free(toks);
    free(pa);
    free(pb);
    free(pp);
    free(tg);
    free(cold);
    free(warm);
    free(seqs);
    free(bt);
    free(lb);
    free(tgb);
    model_ctx_free(c);
    pool_free(pool);
    model_free(m);
    return rc;
}

/* ==== main ==== */

int main(int argc, char **argv)
{
    static const struct { const char *name; unsigned cmd; int (*run)(struct opts *); } cmds[] = {
        { "generate", C_GEN, cmd_generate },
        { "tokenize", C_TOK, cmd_tokenize },
        { "perplexity", C_PPL, cmd_perplexity },
        { "info", C_INFO, cmd_info },
        { "bench", C_BENCH, cmd_bench },
    };
    if (argc < 2) {
        fputs(usage, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        fputs(usage, stdout);
        return 0;
    }
    if (strcmp(cmd, "serve") == 0)
        return http_serve_main(argc - 1, argv + 1);
    if (strcmp(cmd, "synth") == 0) {
        char err[512];
        if (synth_main(argc - 1, argv + 1, err, sizeof err) != 0)
            return fail("%s", err);
        return 0;
    }
    for (size_t k = 0; k < sizeof cmds / sizeof *cmds; k++) {
        if (strcmp(cmd, cmds[k].name) != 0)
            continue;
        for (int i = 2; i < argc; i++) {
            if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
                fputs(usage, stdout);
                return 0;
            }
        }
        struct opts o;
        if (parse_opts(argc - 2, argv + 2, cmds[k].cmd, cmd, &o))
            return 1;
        return cmds[k].run(&o);
    }
    return fail("unknown command '%s' (see strata --help)", cmd);
}
