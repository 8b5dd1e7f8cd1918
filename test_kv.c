/*
 * test_kv.c — tests of kv.c: each cell format read back against its
 * definition (f16 round to nearest even, int8 absmax within half a step,
 * Q4_0 identical to quant.c's reference quantiser) and its byte count;
 * append/truncate/fork with reference counts and copy-on-write, checked cell
 * by cell with tagged values; an exhausted pool failing one request and
 * leaving the others intact; the prefix cache sharing, matching exactly and
 * evicting least recently used pages, deepest first.
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- tagged contents: every stored value says where it belongs ---- */

#define TL 2  /* layers */
#define TK 2  /* kv heads */
#define TE 32 /* head dim */

/* An exact f32 integer naming (tag, cell, layer, head, e, K or V). */
static float tag_val(int tag, int cell, int layer, int head, int e, int isv)
{
    return (float)((((((tag * 4096 + cell) * TL + layer) * TK + head) * TE + e) * 2) + isv);
}

static int store_tagged(struct kv *kv, int seq, int pos, int n, int tag)
{
    float *k = malloc((size_t)n * TK * TE * sizeof *k), *v = malloc((size_t)n * TK * TE * sizeof *v);
    char err[256];
    int rc = 0;
    for (int l = 0; l < TL && rc == 0; l++) {
        for (int i = 0; i < n; i++)
            for (int h = 0; h < TK; h++)
                for (int e = 0; e < TE; e++) {
                    k[((size_t)i * TK + h) * TE + e] = tag_val(tag, pos + i, l, h, e, 0);
                    v[((size_t)i * TK + h) * TE + e] = tag_val(tag, pos + i, l, h, e, 1);
                }
        rc = kv_store(kv, seq, l, pos, n, k, v, err, sizeof err);
        CHECK(rc == 0, "store: %s", err);
    }
    free(k);
    free(v);
    return rc;
}

/* Cells pos..pos+n-1 of seq hold tag's values (read by ranges and by list). */
static int check_tagged(const struct kv *kv, int seq, int pos, int n, int tag)
{
    float k[TE * 8], v[TE * 8];
    int bad = 0;
    for (int l = 0; l < TL; l++)
        for (int h = 0; h < TK; h++)
            for (int c = pos; c < pos + n; c += 8) {
                int m = pos + n - c < 8 ? pos + n - c : 8;
                kv_read(kv, seq, l, h, c, m, k, v);
                for (int i = 0; i < m; i++)
                    for (int e = 0; e < TE; e++)
                        bad += k[i * TE + e] != tag_val(tag, c + i, l, h, e, 0) ||
                               v[i * TE + e] != tag_val(tag, c + i, l, h, e, 1);
            }
    /* the gather path: every third cell, then runs of neighbours */
    int32_t cells[64];
    int m = 0;
    for (int c = pos; c < pos + n && m < 32; c += 3)
        cells[m++] = c;
    for (int c = pos; c < pos + n && m < 64; c++)
        cells[m++] = c;
    float *kg = malloc((size_t)m * TE * sizeof *kg), *vg = malloc((size_t)m * TE * sizeof *vg);
    kv_gather(kv, seq, 1, 1, cells, m, kg, vg);
    for (int i = 0; i < m; i++)
        for (int e = 0; e < TE; e++)
            bad += kg[i * TE + e] != tag_val(tag, cells[i], 1, 1, e, 0) ||
                   vg[i * TE + e] != tag_val(tag, cells[i], 1, 1, e, 1);
    free(kg);
    free(vg);
    return bad;
}

static struct kv *small_kv(int n_seq, int n_ctx, int mem_mib, char *err, size_t errlen)
{
    struct kv_config c = {TL, TK, TE, KV_CELL_F32, 16, n_seq, n_ctx, mem_mib, NULL};
    struct kv *kv = NULL;
    if (kv_new(&kv, &c, err, errlen) != 0)
        return NULL;
    return kv;
}

static int32_t *seq_tokens(int n, int salt)
{
    int32_t *t = malloc((size_t)n * sizeof *t);
    for (int i = 0; i < n; i++)
        t[i] = 1000 + i * 7 + salt;
    return t;
}

/* ---- cases ---- */

static void case_formats(void)
{
    if (!test_begin("kv/formats"))
        return;
    enum { E = 128, C = 40 };
    unsigned st = 17;
    static float x[C * E];
    for (int i = 0; i < C * E; i++)
        x[i] = test_randf(&st) * (1.0f + (float)(i / E % 7)) + (i % 97 == 0 ? 5.0f : 0.0f);
    const struct quant_type *q4 = quant_type(QT_Q4_0);
    for (int cell = 0; cell < KV_CELL_COUNT; cell++) {
        struct kv_config cfg = {1, 1, E, cell, 16, 1, C, 0, NULL};
        struct kv *kv;
        char err[256];
        if (!CHECK(kv_new(&kv, &cfg, err, sizeof err) == 0, "%s", err))
            continue;
        int s = kv_seq_new(kv, err, sizeof err);
        CHECK(kv_append(kv, s, NULL, C, err, sizeof err) == 0, "%s", err);
        CHECK(kv_store(kv, s, 0, 0, C, x, x, err, sizeof err) == 0, "%s", err);
        static float k[C * E], v[C * E], want[E];
        kv_read(kv, s, 0, 0, 0, C, k, v);
        int krow = cell == KV_CELL_F32 ? 0 : cell == KV_CELL_F16 ? 1 : cell == KV_CELL_Q4 ? 3 : 2;
        int vrow = cell == KV_CELL_K8V4 ? 3 : krow;
        double max_err[2] = {0, 0};
        int bad = 0;
        for (int r = 0; r < C; r++)
            for (int which = 0; which < 2; which++) {
                const float *xr = x + (size_t)r * E, *y = (which ? v : k) + (size_t)r * E;
                int row = which ? vrow : krow;
                if (row == 0)
                    bad += memcmp(xr, y, E * 4) != 0;
                if (row == 1)
                    for (int e = 0; e < E; e++)
                        bad += y[e] != quant_f16_to_f32(quant_f32_to_f16(xr[e]));
                if (row == 2) {
                    /* symmetric absmax: step d = amax/127, error <= d/2 */
                    float amax = 0;
                    for (int e = 0; e < E; e++)
                        amax = fmaxf(amax, fabsf(xr[e]));
                    double d = amax / 127.0;
                    for (int e = 0; e < E; e++)
                        bad += fabs((double)y[e] - xr[e]) > d * 0.5 * (1 + 1e-5) + 1e-7;
                }
                if (row == 3) {
                    uint8_t blk[E / 32 * 18];
                    q4->from_f32(xr, blk, E);
                    q4->to_f32(blk, want, E);
                    bad += memcmp(want, y, E * 4) != 0;
                }
                for (int e = 0; e < E; e++)
                    max_err[which] = fmax(max_err[which], fabs((double)y[e] - xr[e]));
            }
        size_t want_bytes[KV_CELL_COUNT] = {2 * E * 4, 2 * E * 2, 2 * (E + 4), 2 * (E / 32 * 18),
                                           (E + 4) + E / 32 * 18};
        CHECK(kv_cell_bytes(&cfg) == want_bytes[cell], "%s: %zu bytes per cell, want %zu",
              kv_cell_name(cell), kv_cell_bytes(&cfg), want_bytes[cell]);
        CHECK(bad == 0, "%s: %d rows differ from the format's definition", kv_cell_name(cell), bad);
        printf("     %-5s %3zu bytes/cell/head (E=%d)  max |err| K %.2e V %.2e\n", kv_cell_name(cell),
               kv_cell_bytes(&cfg), E, max_err[0], max_err[1]);
        kv_free(kv);
    }
    /* q4 and k8v4 need whole Q4_0 blocks along E; int8 does not */
    struct kv_config odd = {1, 1, 80, KV_CELL_Q4, 0, 1, 64, 0, NULL};
    struct kv *kv = NULL;
    char err[256] = "";
    CHECK(kv_new(&kv, &odd, err, sizeof err) != 0 && strstr(err, "multiple of 32"),
          "q4 with E=80: '%s'", err);
    odd.cell = KV_CELL_K8V4;
    CHECK(kv_new(&kv, &odd, err, sizeof err) != 0 && strstr(err, "multiple of 32"),
          "k8v4 with E=80: '%s'", err);
    odd.cell = KV_CELL_INT8;
    CHECK(kv_new(&kv, &odd, err, sizeof err) == 0, "int8 with E=80: %s", err);
    kv_free(kv);
    CHECK(kv_cell_parse("k8v4") == KV_CELL_K8V4 && kv_cell_parse("q4") == KV_CELL_Q4 &&
              kv_cell_parse("int8") == KV_CELL_INT8 && kv_cell_parse("q8") == -1,
          "format names");
}

static void case_append_truncate(void)
{
    if (!test_begin("kv/append-truncate"))
        return;
    char err[256];
    struct kv *kv = small_kv(2, 100, 0, err, sizeof err);
    if (!CHECK(kv, "%s", err))
        return;
    struct kv_stats st;
    kv_stats(kv, &st);
    CHECK(st.pages == 2 * 7 && st.free == 14, "pool of %d pages (%d free), want 14", st.pages, st.free);
    int s = kv_seq_new(kv, err, sizeof err);
    /* appends of odd sizes across page boundaries */
    int sizes[] = {5, 11, 1, 30, 9}, pos = 0;
    for (int i = 0; i < 5; i++) {
        CHECK(kv_append(kv, s, NULL, sizes[i], err, sizeof err) == 0, "%s", err);
        store_tagged(kv, s, pos, sizes[i], 1);
        pos += sizes[i];
    }
    CHECK(kv_seq_len(kv, s) == 56, "len %d", kv_seq_len(kv, s));
    CHECK(check_tagged(kv, s, 0, 56, 1) == 0, "contents after appends");
    kv_stats(kv, &st);
    CHECK(st.free == 14 - 4, "%d pages free after 56 cells, want 10", st.free);
    /* speculative rollback: drop 20, re-append 7 with other values */
    kv_truncate(kv, s, 20);
    CHECK(kv_seq_len(kv, s) == 36, "len %d after truncate", kv_seq_len(kv, s));
    kv_stats(kv, &st);
    CHECK(st.free == 14 - 3, "%d pages free after truncating to 36, want 11", st.free);
    CHECK(kv_append(kv, s, NULL, 7, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, s, 36, 7, 2);
    CHECK(check_tagged(kv, s, 0, 36, 1) == 0 && check_tagged(kv, s, 36, 7, 2) == 0,
          "contents after rollback and re-append");
    /* the per-sequence limit (-c) */
    err[0] = 0;
    CHECK(kv_append(kv, s, NULL, 58, err, sizeof err) != 0 && strstr(err, "more than"),
          "passing n_ctx: '%s'", err);
    CHECK(kv_seq_len(kv, s) == 43, "a failed append changed the length to %d", kv_seq_len(kv, s));
    kv_truncate(kv, s, 1000);
    kv_stats(kv, &st);
    CHECK(kv_seq_len(kv, s) == 0 && st.free == 14, "truncating all: len %d, %d free", kv_seq_len(kv, s),
          st.free);
    kv_seq_free(kv, s);
    kv_free(kv);
}

static void case_fork_cow(void)
{
    if (!test_begin("kv/fork-cow"))
        return;
    char err[256];
    struct kv *kv = small_kv(4, 128, 0, err, sizeof err);
    if (!CHECK(kv, "%s", err))
        return;
    int a = kv_seq_new(kv, err, sizeof err);
    CHECK(kv_append(kv, a, NULL, 40, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, a, 0, 40, 1);
    int b = kv_seq_fork(kv, a, err, sizeof err);
    CHECK(b >= 0 && kv_seq_len(kv, b) == 40, "fork: %s", err);
    int pa[3], pb[3];
    for (int i = 0; i < 3; i++) {
        pa[i] = kv_page_of(kv, a, i * 16);
        pb[i] = kv_page_of(kv, b, i * 16);
        CHECK(pa[i] == pb[i] && kv_page_refs(kv, pa[i]) == 2, "page %d: %d vs %d, refs %d", i, pa[i], pb[i],
              kv_page_refs(kv, pa[i]));
    }
    /* writing into the shared partial page without appending is refused */
    float row[TK * TE] = {0};
    err[0] = 0;
    CHECK(kv_store(kv, b, 0, 39, 1, row, row, err, sizeof err) != 0 && strstr(err, "shared"),
          "store into a shared page: '%s'", err);
    /* b's first append copies the shared last page, and only that one */
    struct kv_stats st0, st1;
    kv_stats(kv, &st0);
    CHECK(kv_append(kv, b, NULL, 4, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, b, 40, 4, 2);
    kv_stats(kv, &st1);
    int nb2 = kv_page_of(kv, b, 32);
    CHECK(nb2 != pa[2] && kv_page_of(kv, b, 0) == pa[0] && kv_page_of(kv, b, 16) == pa[1],
          "copy-on-write replaced the wrong pages");
    CHECK(st0.free - st1.free == 1, "COW took %d pages", st0.free - st1.free);
    CHECK(kv_page_refs(kv, pa[2]) == 1 && kv_page_refs(kv, nb2) == 1 && kv_page_refs(kv, pa[0]) == 2,
          "refs after COW: %d %d %d", kv_page_refs(kv, pa[2]), kv_page_refs(kv, nb2), kv_page_refs(kv, pa[0]));
    CHECK(check_tagged(kv, b, 0, 40, 1) == 0 && check_tagged(kv, b, 40, 4, 2) == 0, "b's cells");
    CHECK(check_tagged(kv, a, 0, 40, 1) == 0, "a's cells changed by b's write");
    /* a now owns its last page alone: its append writes in place */
    CHECK(kv_append(kv, a, NULL, 3, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, a, 40, 3, 3);
    CHECK(kv_page_of(kv, a, 40) == pa[2], "a's unshared page was copied");
    CHECK(check_tagged(kv, a, 40, 3, 3) == 0 && check_tagged(kv, b, 40, 4, 2) == 0, "cells 40.. of a and b");
    /* fork of a fork, then rollback into a shared full page: copied again */
    int c = kv_seq_fork(kv, b, err, sizeof err);
    CHECK(kv_page_refs(kv, pa[0]) == 3, "three holders of page 0: refs %d", kv_page_refs(kv, pa[0]));
    kv_truncate(kv, c, 44 - 20);
    CHECK(kv_seq_len(kv, c) == 20 && kv_page_refs(kv, nb2) == 1, "truncate of c: len %d, refs %d",
          kv_seq_len(kv, c), kv_page_refs(kv, nb2));
    CHECK(kv_append(kv, c, NULL, 5, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, c, 20, 5, 4);
    CHECK(kv_page_of(kv, c, 16) != pa[1] && kv_page_refs(kv, pa[1]) == 2, "rollback COW of page 1");
    CHECK(check_tagged(kv, c, 0, 16, 1) == 0 && check_tagged(kv, c, 16, 4, 1) == 0 &&
              check_tagged(kv, c, 20, 5, 4) == 0, "c's cells");
    CHECK(check_tagged(kv, b, 0, 40, 1) == 0 && check_tagged(kv, a, 0, 40, 1) == 0, "a and b after c's write");
    /* freeing returns every page once */
    kv_seq_free(kv, a);
    kv_seq_free(kv, b);
    CHECK(check_tagged(kv, c, 0, 16, 1) == 0, "c after freeing a and b");
    kv_seq_free(kv, c);
    kv_stats(kv, &st1);
    CHECK(st1.free == st1.pages, "%d of %d pages free after freeing all", st1.free, st1.pages);
    kv_free(kv);
}

static void case_exhaustion(void)
{
    if (!test_begin("kv/exhaustion"))
        return;
    char err[256];
    /* a 1 MiB budget: pages of 16 cells x 1 KiB, 64 of them */
    struct kv_config cfg = {TL, TK, TE, KV_CELL_F32, 16, 3, 0, 1, NULL};
    struct kv_stats st;
    struct kv *kv;
    if (!CHECK(kv_new(&kv, &cfg, err, sizeof err) == 0, "%s", err))
        return;
    kv_stats(kv, &st);
    CHECK(st.cell_bytes == 1024 && st.page_bytes == 16384 && st.pages == 64 && kv_cfg(kv)->n_ctx == 1024,
          "1 MiB: %d pages of %zu bytes, cells of %zu, n_ctx %d", st.pages, st.page_bytes, st.cell_bytes,
          kv_cfg(kv)->n_ctx);
    CHECK(st.total_bytes >= (size_t)st.pages * st.page_bytes, "total %zu bytes", st.total_bytes);
    int a = kv_seq_new(kv, err, sizeof err), b = kv_seq_new(kv, err, sizeof err);
    int c = kv_seq_new(kv, err, sizeof err);
    CHECK(kv_seq_new(kv, err, sizeof err) < 0 && strstr(err, "slots"), "a fourth slot: '%s'", err);
    CHECK(kv_append(kv, a, NULL, 480, err, sizeof err) == 0, "%s", err); /* 30 pages */
    store_tagged(kv, a, 0, 480, 1);
    CHECK(kv_append(kv, b, NULL, 500, err, sizeof err) == 0, "%s", err); /* 32 pages */
    store_tagged(kv, b, 0, 500, 2);
    kv_stats(kv, &st);
    CHECK(st.free == 2, "%d pages free, want 2", st.free);
    /* c's request for three pages fails alone, changing nothing */
    err[0] = 0;
    CHECK(kv_append(kv, c, NULL, 40, err, sizeof err) != 0 && strstr(err, "exhausted"),
          "append past the pool: '%s'", err);
    kv_stats(kv, &st);
    CHECK(kv_seq_len(kv, c) == 0 && st.free == 2, "the failed append left len %d, %d free",
          kv_seq_len(kv, c), st.free);
    CHECK(kv_append(kv, c, NULL, 32, err, sizeof err) == 0, "two pages: %s", err);
    store_tagged(kv, c, 0, 32, 3);
    /* b still fills its own last page, then fails at the next page */
    CHECK(kv_append(kv, b, NULL, 12, err, sizeof err) == 0, "within b's page: %s", err);
    store_tagged(kv, b, 500, 12, 2);
    err[0] = 0;
    CHECK(kv_append(kv, b, NULL, 1, err, sizeof err) != 0 && strstr(err, "exhausted"), "'%s'", err);
    CHECK(kv_seq_len(kv, b) == 512, "b's length %d", kv_seq_len(kv, b));
    CHECK(check_tagged(kv, a, 0, 480, 1) == 0 && check_tagged(kv, b, 0, 512, 2) == 0 &&
              check_tagged(kv, c, 0, 32, 3) == 0,
          "contents after the failed appends");
    kv_seq_free(kv, c);
    CHECK(kv_append(kv, b, NULL, 1, err, sizeof err) == 0, "after freeing c: %s", err);
    kv_free(kv);
    /* a budget below one page */
    struct kv_config big = {4096, 8, 256, KV_CELL_F32, 16, 1, 0, 1, NULL};
    err[0] = 0;
    CHECK(kv_new(&kv, &big, err, sizeof err) != 0 && strstr(err, "holds no page"), "'%s'", err);
}

static void case_prefix(void)
{
    if (!test_begin("kv/prefix"))
        return;
    char err[256];
    struct kv *kv = small_kv(3, 64, 0, err, sizeof err); /* 3 x 4 pages */
    if (!CHECK(kv, "%s", err))
        return;
    int32_t *tok = seq_tokens(64, 0);
    struct kv_stats st;
    /* A: 56 cells with tokens: three whole pages and a partial one */
    int a = kv_seq_new(kv, err, sizeof err);
    CHECK(kv_append(kv, a, tok, 40, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, a, 0, 40, 1);
    kv_stats(kv, &st);
    CHECK(st.cached == 0, "%d pages cached before any were written", st.cached);
    CHECK(kv_append(kv, a, tok + 40, 16, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, a, 40, 16, 1);
    kv_stats(kv, &st);
    int pa[4];
    for (int i = 0; i < 4; i++)
        pa[i] = kv_page_of(kv, a, i * 16);
    /* the next append offers the pages that were whole before it (0, 1) */
    CHECK(st.cached == 2 && st.idle == 0 && kv_page_refs(kv, pa[0]) == 2, "after appends: %d cached, %d idle",
          st.cached, st.idle);
    /* B shares A's cached pages while A lives */
    int b = kv_seq_new(kv, err, sizeof err);
    int got = kv_prefix(kv, b, tok, 63);
    CHECK(got == 32 && kv_page_of(kv, b, 0) == pa[0] && kv_page_of(kv, b, 16) == pa[1],
          "prefix of a live sequence: %d cells", got);
    CHECK(kv_page_refs(kv, pa[0]) == 3, "refs %d", kv_page_refs(kv, pa[0]));
    CHECK(check_tagged(kv, b, 0, 32, 1) == 0, "shared cells");
    kv_seq_free(kv, b);
    /* freeing A caches page 2 too (page 3 is partial); all idle */
    kv_seq_free(kv, a);
    kv_stats(kv, &st);
    CHECK(st.cached == 3 && st.idle == 3 && st.free == st.pages - 3, "after free: %d cached, %d idle, %d free",
          st.cached, st.idle, st.free);
    /* an exact prefix: whole pages only, never past n */
    b = kv_seq_new(kv, err, sizeof err);
    got = kv_prefix(kv, b, tok, 47);
    CHECK(got == 32, "47 tokens matched %d cells, want 32", got);
    kv_seq_free(kv, b);
    b = kv_seq_new(kv, err, sizeof err);
    got = kv_prefix(kv, b, tok, 64);
    CHECK(got == 48 && kv_page_of(kv, b, 32) == pa[2], "64 tokens matched %d cells", got);
    CHECK(check_tagged(kv, b, 0, 48, 1) == 0, "reused cells");
    /* B continues past the prefix: its page 3 is new */
    CHECK(kv_append(kv, b, tok + 48, 10, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, b, 48, 10, 5);
    CHECK(check_tagged(kv, b, 0, 48, 1) == 0 && check_tagged(kv, b, 48, 10, 5) == 0, "B's cells");
    kv_seq_free(kv, b);
    /* one token changed in page 1: only page 0 matches */
    int32_t *tok2 = seq_tokens(64, 0);
    tok2[20] = 7;
    int c = kv_seq_new(kv, err, sizeof err);
    got = kv_prefix(kv, c, tok2, 64);
    CHECK(got == 16, "a changed token in page 1: %d cells matched", got);
    kv_seq_free(kv, c);
    /* a different first page matches nothing */
    tok2[3] = 9;
    c = kv_seq_new(kv, err, sizeof err);
    CHECK(kv_prefix(kv, c, tok2, 64) == 0, "a changed first page matched");
    kv_seq_free(kv, c);
    /* pressure: sequences that need the whole pool evict the idle cached
     * pages, least recently used first, and of one prefix the deepest first */
    kv_stats(kv, &st);
    CHECK(st.free == 9 && st.cached == 3 && st.idle == 3, "before pressure: %d free, %d cached", st.free,
          st.cached);
    int s1 = kv_seq_new(kv, err, sizeof err), s2 = kv_seq_new(kv, err, sizeof err);
    int s3 = kv_seq_new(kv, err, sizeof err);
    CHECK(kv_append(kv, s1, NULL, 64, err, sizeof err) == 0, "%s", err);
    CHECK(kv_append(kv, s2, NULL, 64, err, sizeof err) == 0, "%s", err);
    CHECK(kv_append(kv, s3, NULL, 32, err, sizeof err) == 0, "one page from the prefix cache: %s", err);
    kv_stats(kv, &st);
    CHECK(st.cached == 2 && st.free == 0, "eviction: %d cached, %d free", st.cached, st.free);
    CHECK(kv_append(kv, s3, NULL, 32, err, sizeof err) == 0, "two more from the cache: %s", err);
    kv_stats(kv, &st);
    CHECK(st.cached == 0 && st.idle == 0 && st.free == 0, "%d cached after evicting all", st.cached);
    kv_seq_free(kv, s2);
    kv_seq_free(kv, s3);
    int d = kv_seq_new(kv, err, sizeof err);
    CHECK(kv_prefix(kv, d, tok, 64) == 0, "an evicted prefix matched");
    /* cache A's prefix again; pressure for one page takes the deepest */
    CHECK(kv_append(kv, d, tok, 56, err, sizeof err) == 0, "%s", err);
    store_tagged(kv, d, 0, 56, 6);
    kv_seq_free(kv, d);
    s2 = kv_seq_new(kv, err, sizeof err);
    s3 = kv_seq_new(kv, err, sizeof err);
    CHECK(kv_append(kv, s2, NULL, 64, err, sizeof err) == 0, "%s", err);
    CHECK(kv_append(kv, s3, NULL, 17, err, sizeof err) == 0, "%s", err);
    kv_stats(kv, &st);
    CHECK(st.cached == 2 && st.free == 0, "one eviction: %d cached, %d free", st.cached, st.free);
    kv_seq_free(kv, s3);
    d = kv_seq_new(kv, err, sizeof err);
    got = kv_prefix(kv, d, tok, 64);
    CHECK(got == 32, "after evicting the deepest page, %d cells match (want 32)", got);
    CHECK(check_tagged(kv, d, 0, 32, 6) == 0, "cells of the surviving prefix");
    kv_truncate(kv, s1, 64);
    kv_stats(kv, &st);
    CHECK(st.free + st.idle + 4 + 2 == st.pages, "accounting: %d free + %d idle of %d", st.free, st.idle,
          st.pages);
    kv_seq_free(kv, s1);
    kv_seq_free(kv, s2);
    kv_seq_free(kv, d);
    kv_stats(kv, &st);
    CHECK(st.free + st.idle == st.pages && st.cached == st.idle, "all released: %d free, %d idle, %d cached",
          st.free, st.idle, st.cached);
    free(tok);
    free(tok2);
    kv_free(kv);
}

void test_kv(void)
{
    case_formats();
    case_append_truncate();
    case_fork_cow();
    case_exhaustion();
    case_prefix();
}
