/*
 * test_gguf.c — tests of gguf.c: a file written by the writer reads back
 * value for value; a table of malformed files each fails with the expected
 * message (no crash, no read outside the buffer: every buffer is a fresh
 * allocation of exactly its size, so ASan/valgrind catch any overrun); every
 * truncation of a valid file is rejected; the reference engine's files open.
 */
#include "strata.h"
#include "test.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#define TMP_GGUF "/tmp/strata-test-gguf.gguf"

/* A small valid file with every value type and two tensors. */
static char *write_sample(size_t *len)
{
    char err[256];
    struct gguf_writer *w = gguf_w_new();
    gguf_w_str(w, "general.architecture", "llama");
    gguf_w_u32(w, "general.alignment", 64);
    gguf_w_i32(w, "k.i32", -7);
    gguf_w_f32(w, "k.f32", 1.5f);
    gguf_w_bool(w, "k.bool", 1);
    const int32_t ints[3] = {1, -2, 3};
    gguf_w_arr(w, "k.ints", GGUF_I32, 3, ints);
    const char *strs[3] = {"x", "", "hello"};
    gguf_w_arr_str(w, "k.strs", 3, strs);
    const uint64_t big = 1ull << 40;
    gguf_w_arr(w, "k.u64", GGUF_U64, 1, &big);
    int64_t ne_a[2] = {32, 3}, ne_b[1] = {5};
    gguf_w_tensor(w, "a", QT_Q8_0, 2, ne_a);
    gguf_w_tensor(w, "b", QT_F32, 1, ne_b);
    if (gguf_w_begin(w, TMP_GGUF, err, sizeof err) != 0) {
        CHECK(0, "gguf_w_begin: %s", err);
        gguf_w_end(w, err, sizeof err);
        return NULL;
    }
    uint8_t a[3 * 34];
    for (size_t i = 0; i < sizeof a; i++)
        a[i] = (uint8_t)i;
    float b[5] = {0, 1, 2, 3, 4};
    gguf_w_data(w, a, 50);               /* split writes cross nothing special */
    gguf_w_data(w, a + 50, sizeof a - 50);
    gguf_w_data(w, b, sizeof b);
    if (!CHECK(gguf_w_end(w, err, sizeof err) == 0, "gguf_w_end: %s", err))
        return NULL;
    return test_read_file(TMP_GGUF, len);
}

static void case_roundtrip(void)
{
    if (!test_begin("gguf/writer-roundtrip"))
        return;
    size_t len;
    char *buf = write_sample(&len);
    if (!buf)
        return;
    struct gguf g;
    char err[256];
    if (!CHECK(gguf_parse(&g, buf, len, err, sizeof err) == 0, "parse: %s", err)) {
        free(buf);
        return;
    }
    int64_t i = 0;
    float f = 0;
    struct gguf_str s;
    CHECK(g.version == 3 && g.n_kv == 8 && g.n_tensors == 2, "counts %u %llu %llu", g.version,
          (unsigned long long)g.n_kv, (unsigned long long)g.n_tensors);
    CHECK(g.alignment == 64 && g.data_offset % 64 == 0, "alignment %u offset %zu", g.alignment,
          g.data_offset);
    CHECK(gguf_get_str(&g, "general.architecture", &s) == 0 && s.len == 5 &&
              memcmp(s.ptr, "llama", 5) == 0, "architecture");
    CHECK(gguf_get_int(&g, "k.i32", &i) == 0 && i == -7, "k.i32 = %lld", (long long)i);
    CHECK(gguf_get_f32(&g, "k.f32", &f) == 0 && f == 1.5f, "k.f32 = %g", f);
    CHECK(gguf_get_int(&g, "k.bool", &i) == 0 && i == 1, "k.bool");
    CHECK(gguf_get_int(&g, "k.f32", &i) != 0, "a float is not an int");
    CHECK(gguf_get_int(&g, "missing", &i) != 0, "missing key");
    const struct gguf_kv *kv = gguf_find(&g, "k.ints");
    CHECK(kv && kv->n == 3 && gguf_arr_int(kv, 1) == -2 && gguf_arr_f32(kv, 2) == 3.0f, "k.ints");
    kv = gguf_find(&g, "k.strs");
    struct gguf_str strs[3];
    if (CHECK(kv && kv->n == 3 && kv->arr_type == GGUF_STR, "k.strs")) {
        gguf_arr_strs(kv, strs);
        CHECK(strs[0].len == 1 && strs[1].len == 0 && strs[2].len == 5 &&
                  memcmp(strs[2].ptr, "hello", 5) == 0, "k.strs values");
    }
    kv = gguf_find(&g, "k.u64");
    CHECK(kv && gguf_arr_int(kv, 0) == (int64_t)1 << 40, "k.u64");
    const struct gguf_tensor *a = gguf_tensor(&g, "a"), *b = gguf_tensor(&g, "b");
    CHECK(a && a->type == QT_Q8_0 && a->ne[0] == 32 && a->ne[1] == 3 && a->nbytes == 102 &&
              ((const uint8_t *)a->data)[101] == 101, "tensor a");
    CHECK(b && b->offset % 64 == 0 && ((const float *)b->data)[4] == 4.0f, "tensor b");
    gguf_close(&g);
    free(buf);
}

/* ---- malformed files: each row patches the sample file ---- */

struct patch {
    const char *what;
    const char *find;   /* bytes to locate (NULL: absolute offset `at`) */
    size_t find_len;
    long at;            /* offset from the match (or from the start) */
    const void *bytes;
    size_t n;
    const char *expect; /* substring of the error */
};

static const uint32_t v1 = 1, v4 = 4, vt99 = 99, arr9 = GGUF_ARR, nd5 = 5, ty4 = 4, ty99 = 99,
                      align3 = 3;
static const uint64_t huge = 0x7fffffffffffffffull, len70 = 70, off_far = 1 << 20, off_odd = 1;
static const int64_t neg = -5, ne33 = 33;

static const struct patch patches[] = {
    {"bad magic", NULL, 0, 0, "GGUX", 4, "invalid magic"},
    {"version 1", NULL, 0, 4, &v1, 4, "unsupported version 1"},
    {"version 4", NULL, 0, 4, &v4, 4, "unsupported version 4"},
    {"tensor count", NULL, 0, 8, &huge, 8, "tensor count"},
    {"metadata count", NULL, 0, 16, &huge, 8, "metadata count"},
    {"key length", NULL, 0, 24, &huge, 8, "metadata key: length"},
    {"empty key", NULL, 0, 24, "\0\0\0\0\0\0\0\0", 8, "metadata key"},
    {"value type", "general.architecture", 20, 20, &vt99, 4, "unknown value type 99"},
    {"string length", "general.architecture", 20, 24, &huge, 8, "length"},
    {"nested array", "k.ints", 6, 10, &arr9, 4, "invalid array element type 9"},
    {"array count", "k.ints", 6, 14, &huge, 8, "array count"},
    {"string array count", "k.strs", 6, 14, &huge, 8, "array count"},
    {"duplicate key", "k.i32", 5, 0, "k.f32", 5, "duplicate metadata key 'k.f32'"},
    {"alignment", "general.alignment", 17, 21, &align3, 4, "not a power of two"},
    {"tensor name length", "\x01\0\0\0\0\0\0\0a", 9, 0, &len70, 8, "tensor name length"},
    {"n_dims", "\x01\0\0\0\0\0\0\0a", 9, 9, &nd5, 4, "n_dims 5"},
    {"negative dim", "\x01\0\0\0\0\0\0\0a", 9, 13, &neg, 8, "negative dimension"},
    {"row not a block multiple", "\x01\0\0\0\0\0\0\0a", 9, 13, &ne33, 8, "not a multiple"},
    {"retired type id", "\x01\0\0\0\0\0\0\0a", 9, 29, &ty4, 4, "unknown tensor type id 4"},
    {"unknown type id", "\x01\0\0\0\0\0\0\0a", 9, 29, &ty99, 4, "unknown tensor type id 99"},
    {"offset beyond the file", "\x01\0\0\0\0\0\0\0b", 9, 25, &off_far, 8, "beyond the end"},
    {"misaligned offset", "\x01\0\0\0\0\0\0\0b", 9, 25, &off_odd, 8, "alignment"},
    {"duplicate tensor", "\x01\0\0\0\0\0\0\0b", 9, 8, "a", 1, "duplicate tensor name 'a'"},
};

static long find(const char *buf, size_t len, const char *pat, size_t n)
{
    for (size_t i = 0; i + n <= len; i++)
        if (memcmp(buf + i, pat, n) == 0)
            return (long)i;
    return -1;
}

static void case_malformed(void)
{
    if (!test_begin("gguf/malformed-table"))
        return;
    size_t len;
    char *good = write_sample(&len);
    if (!good)
        return;
    for (size_t k = 0; k < sizeof patches / sizeof patches[0]; k++) {
        const struct patch *p = &patches[k];
        long at = p->at;
        if (p->find) {
            long m = find(good, len, p->find, p->find_len);
            if (!CHECK(m >= 0, "%s: pattern not found", p->what))
                continue;
            at += m;
        }
        char *buf = malloc(len);
        memcpy(buf, good, len);
        memcpy(buf + at, p->bytes, p->n);
        struct gguf g;
        char err[256] = "";
        int rc = gguf_parse(&g, buf, len, err, sizeof err);
        if (CHECK(rc != 0, "%s: accepted", p->what)) {
            CHECK(strstr(err, p->expect) != NULL && strstr(err, "at byte") != NULL,
                  "%s: message '%s' lacks '%s' or the byte offset", p->what, err, p->expect);
        } else {
            gguf_close(&g);
        }
        free(buf);
    }
    free(good);
}

static void case_truncated(void)
{
    if (!test_begin("gguf/every-truncation"))
        return;
    size_t len;
    char *good = write_sample(&len);
    if (!good)
        return;
    int bad = 0;
    for (size_t n = 0; n < len; n++) {
        char *buf = malloc(n ? n : 1);
        memcpy(buf, good, n);
        struct gguf g;
        char err[256];
        /* the last tensor's padding is not needed, so prefixes reaching past
         * its data legitimately parse */
        int rc = gguf_parse(&g, buf, n, err, sizeof err);
        if (rc == 0) {
            const struct gguf_tensor *b = gguf_tensor(&g, "b");
            if (!b || g.data_offset + b->offset + b->nbytes > n)
                bad++;
            gguf_close(&g);
        }
        free(buf);
    }
    CHECK(bad == 0, "%d truncated prefixes accepted", bad);
    free(good);
}

static void case_writer_errors(void)
{
    if (!test_begin("gguf/writer-checks"))
        return;
    char err[256];
    struct gguf_writer *w = gguf_w_new();
    int64_t ne[1] = {32};
    gguf_w_tensor(w, "t", QT_Q8_0, 1, ne);
    CHECK(gguf_w_begin(w, TMP_GGUF, err, sizeof err) == 0, "begin: %s", err);
    gguf_w_data(w, "x", 1);
    CHECK(gguf_w_end(w, err, sizeof err) != 0 && strstr(err, "got 1 of its 34 bytes"),
          "short data not reported: %s", err);
    w = gguf_w_new();
    int64_t bad_ne[1] = {33};
    gguf_w_tensor(w, "t", QT_Q8_0, 1, bad_ne);
    CHECK(gguf_w_begin(w, TMP_GGUF, err, sizeof err) != 0 && strstr(err, "invalid tensor"),
          "bad declaration not reported: %s", err);
    gguf_w_end(w, err, sizeof err);
}

/* Every GGUF the reference engine wrote opens and its tensors lie in the file. */
static void case_reference_files(void)
{
    if (!test_begin("gguf/reference-files"))
        return;
    const char *dirs[] = {"", "quant/", "vocab/", "vocab-more/"};
    int n_files = 0;
    for (int d = 0; d < 4; d++) {
        char path[512];
        if (!test_data(dirs[d], path, sizeof path))
            return;
        DIR *dir = opendir(path);
        if (!CHECK(dir != NULL, "cannot list %s", path))
            continue;
        struct dirent *e;
        while ((e = readdir(dir))) {
            size_t n = strlen(e->d_name);
            if (n < 5 || strcmp(e->d_name + n - 5, ".gguf") != 0)
                continue;
            char file[1024];
            snprintf(file, sizeof file, "%s%s", path, e->d_name);
            struct gguf g;
            char err[512];
            if (CHECK(gguf_open(&g, file, err, sizeof err) == 0, "%s: %s", file, err)) {
                CHECK(gguf_find(&g, "general.architecture") != NULL, "%s: no architecture", file);
                n_files++;
                gguf_close(&g);
            }
        }
        closedir(dir);
    }
    CHECK(n_files >= 30, "only %d files", n_files);
}

void test_gguf(void)
{
    case_roundtrip();
    case_malformed();
    case_truncated();
    case_writer_errors();
    case_reference_files();
}
