/*
 * gguf.c — the GGUF v2/v3 container: a validating reader over mmap, and a
 * streaming writer (for tests and `strata synth`).
 *
 * The reader checks every count, length, type id and tensor extent against
 * the bytes that remain, with overflow-safe arithmetic, before it uses them;
 * a malformed file yields an error naming the field and its byte offset and
 * never a read outside the file. Values and tensor data are not copied: the
 * tables point into the mapping. It knows block sizes, not block contents
 * (quant.c owns those). It never prints or exits.
 */
#include "strata.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_DEFAULT_ALIGNMENT 32

/* ==== type tables ==== */

/* Elements and bytes per block of each ggml type id; 0 marks ids that are
 * unassigned or retired (4, 5, 31-33, 36-38) or whose size we do not know. */
static const struct { const char *name; int blck; int size; } type_info[QT_COUNT] = {
    [QT_F32] = {"F32", 1, 4},           [QT_F16] = {"F16", 1, 2},
    [QT_Q4_0] = {"Q4_0", 32, 18},       [QT_Q4_1] = {"Q4_1", 32, 20},
    [QT_Q5_0] = {"Q5_0", 32, 22},       [QT_Q5_1] = {"Q5_1", 32, 24},
    [QT_Q8_0] = {"Q8_0", 32, 34},       [QT_Q8_1] = {"Q8_1", 32, 36},
    [QT_Q2_K] = {"Q2_K", 256, 84},      [QT_Q3_K] = {"Q3_K", 256, 110},
    [QT_Q4_K] = {"Q4_K", 256, 144},     [QT_Q5_K] = {"Q5_K", 256, 176},
    [QT_Q6_K] = {"Q6_K", 256, 210},     [QT_Q8_K] = {"Q8_K", 256, 292},
    [QT_IQ2_XXS] = {"IQ2_XXS", 256, 66}, [QT_IQ2_XS] = {"IQ2_XS", 256, 74},
    [QT_IQ3_XXS] = {"IQ3_XXS", 256, 98}, [QT_IQ1_S] = {"IQ1_S", 256, 50},
    [QT_IQ4_NL] = {"IQ4_NL", 32, 18},   [QT_IQ3_S] = {"IQ3_S", 256, 110},
    [QT_IQ2_S] = {"IQ2_S", 256, 82},    [QT_IQ4_XS] = {"IQ4_XS", 256, 136},
    [QT_I8] = {"I8", 1, 1},             [QT_I16] = {"I16", 1, 2},
    [QT_I32] = {"I32", 1, 4},           [QT_I64] = {"I64", 1, 8},
    [QT_F64] = {"F64", 1, 8},           [QT_IQ1_M] = {"IQ1_M", 256, 56},
    [QT_BF16] = {"BF16", 1, 2},         [34] = {"TQ1_0", 256, 54},
    [35] = {"TQ2_0", 256, 66},          [39] = {"MXFP4", 32, 17},
};

static const uint8_t vtype_size[GGUF_NVTYPE] = {
    [GGUF_U8] = 1, [GGUF_I8] = 1, [GGUF_U16] = 2, [GGUF_I16] = 2, [GGUF_U32] = 4,
    [GGUF_I32] = 4, [GGUF_F32] = 4, [GGUF_BOOL] = 1, [GGUF_U64] = 8, [GGUF_I64] = 8,
    [GGUF_F64] = 8,
};

const char *gguf_type_name(int qtype)
{
    if (qtype < 0 || qtype >= QT_COUNT || !type_info[qtype].name)
        return "?";
    return type_info[qtype].name;
}

size_t gguf_vtype_size(int vtype)
{
    return vtype >= 0 && vtype < GGUF_NVTYPE ? vtype_size[vtype] : 0;
}

/* ==== reader ==== */

struct cursor {
    const uint8_t *p;
    size_t size, pos;
    char *err;
    size_t errlen;
};

static int fail(struct cursor *c, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(struct cursor *c, size_t at, const char *fmt, ...)
{
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(c->err, c->errlen, "gguf: %s (at byte %zu)", msg, at);
    return -1;
}

static int take(struct cursor *c, void *out, size_t n, const char *what)
{
    if (c->size - c->pos < n)
        return fail(c, c->pos, "truncated file: %s needs %zu bytes, %zu remain", what, n,
                    c->size - c->pos);
    memcpy(out, c->p + c->pos, n);
    c->pos += n;
    return 0;
}

static int take_str(struct cursor *c, struct gguf_str *s, const char *what)
{
    size_t at = c->pos;
    uint64_t len = 0;
    if (take(c, &len, 8, what) != 0)
        return -1;
    if (len > c->size - c->pos)
        return fail(c, at, "%s: length %llu exceeds the %zu bytes that remain", what,
                    (unsigned long long)len, c->size - c->pos);
    s->len = len;
    s->ptr = (const char *)c->p + c->pos;
    c->pos += len;
    return 0;
}

static int str_eq(struct gguf_str a, struct gguf_str b)
{
    return a.len == b.len && memcmp(a.ptr, b.ptr, a.len) == 0;
}

/* Reads one value of type `vt` (not an array), leaving the cursor after it. */
static int skip_value(struct cursor *c, int vt, const char *what)
{
    if (vt == GGUF_STR) {
        struct gguf_str s;
        return take_str(c, &s, what);
    }
    size_t n = vtype_size[vt];
    if (c->size - c->pos < n)
        return fail(c, c->pos, "truncated file: %s needs %zu bytes", what, n);
    c->pos += n;
    return 0;
}

static int read_kv(struct cursor *c, struct gguf_kv *kv)
{
    size_t at = c->pos;
    if (take_str(c, &kv->key, "metadata key") != 0)
        return -1;
    if (kv->key.len == 0)
        return fail(c, at, "empty metadata key");
    char key[80];
    snprintf(key, sizeof key, "%.*s", (int)(kv->key.len < 64 ? kv->key.len : 64), kv->key.ptr);
    uint32_t vt = 0;
    size_t vt_at = c->pos;
    if (take(c, &vt, 4, "value type") != 0)
        return -1;
    if (vt >= GGUF_NVTYPE)
        return fail(c, vt_at, "metadata '%s': unknown value type %u", key, vt);
    kv->type = (int)vt;
    kv->arr_type = -1;
    kv->n = 1;
    if (vt != GGUF_ARR) {
        kv->data = c->p + c->pos;
        if (skip_value(c, (int)vt, key) != 0)
            return -1;
    } else {
        uint32_t et = 0;
        uint64_t n = 0;
        size_t et_at = c->pos;
        if (take(c, &et, 4, "array element type") != 0 || take(c, &n, 8, "array count") != 0)
            return -1;
        if (et >= GGUF_NVTYPE || et == GGUF_ARR)
            return fail(c, et_at, "metadata '%s': invalid array element type %u", key, et);
        kv->arr_type = (int)et;
        kv->n = n;
        kv->data = c->p + c->pos;
        if (et == GGUF_STR) {
            /* every string needs at least its 8-byte length */
            if (n > (c->size - c->pos) / 8)
                return fail(c, et_at + 4, "metadata '%s': array count %llu exceeds the file", key,
                            (unsigned long long)n);
            for (uint64_t i = 0; i < n; i++)
                if (skip_value(c, GGUF_STR, key) != 0)
                    return -1;
        } else {
            if (n > (c->size - c->pos) / vtype_size[et])
                return fail(c, et_at + 4, "metadata '%s': array count %llu exceeds the file", key,
                            (unsigned long long)n);
            c->pos += n * vtype_size[et];
        }
    }
    kv->nbytes = (size_t)(c->p + c->pos - kv->data);
    return 0;
}

static int read_tensor(struct cursor *c, struct gguf_tensor *t)
{
    size_t at = c->pos;
    struct gguf_str name;
    if (take_str(c, &name, "tensor name") != 0)
        return -1;
    if (name.len == 0 || name.len >= GGUF_NAME_MAX)
        return fail(c, at, "tensor name length %llu not in 1..%d", (unsigned long long)name.len,
                    GGUF_NAME_MAX - 1);
    memcpy(t->name, name.ptr, name.len);
    t->name[name.len] = 0;
    uint32_t n_dims = 0;
    size_t dims_at = c->pos;
    if (take(c, &n_dims, 4, "tensor n_dims") != 0)
        return -1;
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return fail(c, dims_at, "tensor '%s': n_dims %u not in 1..%d", t->name, n_dims,
                    GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        size_t ne_at = c->pos;
        if (take(c, &t->ne[d], 8, "tensor dimension") != 0)
            return -1;
        if (t->ne[d] < 0)
            return fail(c, ne_at, "tensor '%s': negative dimension %lld", t->name,
                        (long long)t->ne[d]);
    }
    uint32_t type = 0;
    size_t type_at = c->pos;
    if (take(c, &type, 4, "tensor type") != 0)
        return -1;
    if (type >= QT_COUNT || type_info[type].blck == 0)
        return fail(c, type_at, "tensor '%s': unknown tensor type id %u", t->name, type);
    t->type = (int)type;
    if (take(c, &t->offset, 8, "tensor offset") != 0)
        return -1;
    int blck = type_info[type].blck;
    if (t->ne[0] % blck != 0)
        return fail(c, dims_at, "tensor '%s': row length %lld is not a multiple of the %s block (%d)",
                    t->name, (long long)t->ne[0], type_info[type].name, blck);
    /* bytes = ne0/blck * size * ne1 * ne2 * ne3, each step checked */
    uint64_t bytes = (uint64_t)(t->ne[0] / blck) * (uint64_t)type_info[type].size;
    for (int d = 1; d < GGUF_MAX_DIMS; d++) {
        if (t->ne[d] != 0 && bytes > SIZE_MAX / (uint64_t)t->ne[d])
            return fail(c, dims_at, "tensor '%s': size overflows", t->name);
        bytes *= (uint64_t)t->ne[d];
    }
    t->nbytes = (size_t)bytes;
    return 0;
}

int gguf_parse(struct gguf *g, const void *buf, size_t size, char *err, size_t errlen)
{
    memset(g, 0, sizeof *g);
    struct cursor c = {buf, size, 0, err, errlen};
    char magic[4];
    if (take(&c, magic, 4, "magic") != 0)
        return -1;
    if (memcmp(magic, "GGUF", 4) != 0)
        return fail(&c, 0, "invalid magic '%.4s', expected 'GGUF'", magic);
    if (take(&c, &g->version, 4, "version") != 0)
        return -1;
    if (g->version != 2 && g->version != 3)
        return fail(&c, 4, "unsupported version %u (only 2 and 3)", g->version);
    int64_t n_tensors = 0, n_kv = 0;
    if (take(&c, &n_tensors, 8, "tensor count") != 0 || take(&c, &n_kv, 8, "metadata count") != 0)
        return -1;
    /* a kv takes at least 8+1+4+1 bytes and a tensor info 8+1+4+8+4+8 */
    if (n_kv < 0 || (uint64_t)n_kv > (size - c.pos) / 14)
        return fail(&c, 16, "metadata count %lld exceeds the file", (long long)n_kv);
    if (n_tensors < 0 || (uint64_t)n_tensors > (size - c.pos) / 33)
        return fail(&c, 8, "tensor count %lld exceeds the file", (long long)n_tensors);
    g->n_kv = (uint64_t)n_kv;
    g->n_tensors = (uint64_t)n_tensors;
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) {
        snprintf(err, errlen, "gguf: out of memory for %llu tensors", (unsigned long long)n_tensors);
        goto bad;
    }
    for (uint64_t i = 0; i < g->n_kv; i++) {
        size_t at = c.pos;
        if (read_kv(&c, &g->kv[i]) != 0)
            goto bad;
        for (uint64_t j = 0; j < i; j++)
            if (str_eq(g->kv[j].key, g->kv[i].key)) {
                fail(&c, at, "duplicate metadata key '%.*s'", (int)g->kv[i].key.len,
                     g->kv[i].key.ptr);
                goto bad;
            }
    }
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const struct gguf_kv *al = gguf_find(g, "general.alignment");
    if (al) {
        uint32_t a = 0;
        if (al->type != GGUF_U32) {
            fail(&c, (size_t)(al->data - c.p), "general.alignment must be a UINT32");
            goto bad;
        }
        memcpy(&a, al->data, 4);
        if (a == 0 || (a & (a - 1)) != 0) {
            fail(&c, (size_t)(al->data - c.p), "general.alignment %u is not a power of two", a);
            goto bad;
        }
        g->alignment = a;
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        size_t at = c.pos;
        if (read_tensor(&c, &g->tensors[i]) != 0)
            goto bad;
        for (uint64_t j = 0; j < i; j++)
            if (strcmp(g->tensors[j].name, g->tensors[i].name) == 0) {
                fail(&c, at, "duplicate tensor name '%s'", g->tensors[i].name);
                goto bad;
            }
    }
    size_t data = c.pos + (g->alignment - c.pos % g->alignment) % g->alignment;
    if (g->n_tensors > 0 && data > size) {
        fail(&c, c.pos, "truncated file: no data section after the tensor table");
        goto bad;
    }
    g->data_offset = data;
    size_t avail = g->n_tensors > 0 ? size - data : 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment != 0) {
            fail(&c, data, "tensor '%s': offset %llu is not a multiple of the alignment %u",
                 t->name, (unsigned long long)t->offset, g->alignment);
            goto bad;
        }
        if (t->offset > avail || t->nbytes > avail - t->offset) {
            fail(&c, data, "tensor '%s': bytes %llu..%llu lie beyond the end of the file (%zu data bytes)",
                 t->name, (unsigned long long)t->offset,
                 (unsigned long long)t->offset + (unsigned long long)t->nbytes, avail);
            goto bad;
        }
        t->data = (const uint8_t *)buf + data + t->offset;
    }
    g->base = buf;
    g->size = size;
    return 0;
bad:
    free(g->kv);
    free(g->tensors);
    memset(g, 0, sizeof *g);
    return -1;
}

int gguf_open(struct gguf *g, const char *path, char *err, size_t errlen)
{
    memset(g, 0, sizeof *g);
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "not a regular file");
        close(fd);
        return -1;
    }
    if (st.st_size == 0) {
        snprintf(err, errlen, "empty file");
        close(fd);
        return -1;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "mmap: %s", strerror(errno));
        return -1;
    }
    if (gguf_parse(g, p, (size_t)st.st_size, err, errlen) != 0) {
        munmap(p, (size_t)st.st_size);
        return -1;
    }
    g->mapped = 1;
    return 0;
}

void gguf_close(struct gguf *g)
{
    free(g->kv);
    free(g->tensors);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    memset(g, 0, sizeof *g);
}

/* ==== lookups ==== */

const struct gguf_kv *gguf_find(const struct gguf *g, const char *key)
{
    size_t n = strlen(key);
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (g->kv[i].key.len == n && memcmp(g->kv[i].key.ptr, key, n) == 0)
            return &g->kv[i];
    return NULL;
}

const struct gguf_tensor *gguf_tensor(const struct gguf *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (strcmp(g->tensors[i].name, name) == 0)
            return &g->tensors[i];
    return NULL;
}

/* One number of type vt at p (unaligned); *isint says whether it is exact as an int. */
static double number_at(const uint8_t *p, int vt, int64_t *ival, int *isint)
{
    union { uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
            float f32; uint64_t u64; int64_t i64; double f64; } v;
    memcpy(&v, p, vtype_size[vt]);
    *isint = 1;
    switch (vt) {
    case GGUF_U8: case GGUF_BOOL: *ival = v.u8; break;
    case GGUF_I8: *ival = v.i8; break;
    case GGUF_U16: *ival = v.u16; break;
    case GGUF_I16: *ival = v.i16; break;
    case GGUF_U32: *ival = v.u32; break;
    case GGUF_I32: *ival = v.i32; break;
    case GGUF_I64: *ival = v.i64; break;
    case GGUF_U64:
        *ival = (int64_t)v.u64;
        if (v.u64 > INT64_MAX)
            *isint = 0;
        return (double)v.u64;
    case GGUF_F32: *isint = 0; return v.f32;
    case GGUF_F64: *isint = 0; return v.f64;
    default: *isint = 0; *ival = 0; return 0;
    }
    return (double)*ival;
}

int gguf_get_int(const struct gguf *g, const char *key, int64_t *out)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    if (!kv || kv->type == GGUF_STR || kv->type == GGUF_ARR)
        return -1;
    int64_t v;
    int isint;
    number_at(kv->data, kv->type, &v, &isint);
    if (!isint)
        return -1;
    *out = v;
    return 0;
}

int gguf_get_f32(const struct gguf *g, const char *key, float *out)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    if (!kv || kv->type == GGUF_STR || kv->type == GGUF_ARR)
        return -1;
    int64_t v;
    int isint;
    *out = (float)number_at(kv->data, kv->type, &v, &isint);
    return 0;
}

int gguf_get_str(const struct gguf *g, const char *key, struct gguf_str *out)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    if (!kv || kv->type != GGUF_STR)
        return -1;
    memcpy(&out->len, kv->data, 8);
    out->ptr = (const char *)kv->data + 8;
    return 0;
}

int64_t gguf_arr_int(const struct gguf_kv *kv, uint64_t i)
{
    if (kv->type != GGUF_ARR || kv->arr_type == GGUF_STR || i >= kv->n)
        return 0;
    int64_t v;
    int isint;
    double d = number_at(kv->data + i * vtype_size[kv->arr_type], kv->arr_type, &v, &isint);
    return isint ? v : (int64_t)d;
}

float gguf_arr_f32(const struct gguf_kv *kv, uint64_t i)
{
    if (kv->type != GGUF_ARR || kv->arr_type == GGUF_STR || i >= kv->n)
        return 0;
    int64_t v;
    int isint;
    return (float)number_at(kv->data + i * vtype_size[kv->arr_type], kv->arr_type, &v, &isint);
}

void gguf_arr_strs(const struct gguf_kv *kv, struct gguf_str *out)
{
    if (kv->type != GGUF_ARR || kv->arr_type != GGUF_STR)
        return;
    /* lengths were validated by the reader, so the walk stays inside the file */
    const uint8_t *p = kv->data;
    for (uint64_t i = 0; i < kv->n; i++) {
        memcpy(&out[i].len, p, 8);
        out[i].ptr = (const char *)p + 8;
        p += 8 + out[i].len;
    }
}

/* ==== writer ==== */

struct wtensor {
    char name[GGUF_NAME_MAX];
    int type, n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    uint64_t offset, nbytes;
};

struct gguf_writer {
    uint8_t *meta;           /* serialised key/value pairs */
    size_t meta_len, meta_cap;
    uint64_t n_kv;
    struct wtensor *t;
    uint64_t n_t, cap_t;
    uint32_t alignment;
    int oom;                 /* sticky: an append failed or a declaration was invalid */
    char bad[160];
    FILE *f;
    uint64_t cur, cur_written; /* streaming position: tensor index, bytes of it written */
};

struct gguf_writer *gguf_w_new(void)
{
    struct gguf_writer *w = calloc(1, sizeof *w);
    if (w)
        w->alignment = GGUF_DEFAULT_ALIGNMENT;
    return w;
}

static void put(struct gguf_writer *w, const void *p, size_t n)
{
    if (w->oom)
        return;
    if (w->meta_len + n > w->meta_cap) {
        size_t cap = w->meta_cap ? w->meta_cap : 4096;
        while (cap < w->meta_len + n)
            cap *= 2;
        uint8_t *m = realloc(w->meta, cap);
        if (!m) {
            w->oom = 1;
            snprintf(w->bad, sizeof w->bad, "out of memory");
            return;
        }
        w->meta = m;
        w->meta_cap = cap;
    }
    memcpy(w->meta + w->meta_len, p, n);
    w->meta_len += n;
}

static void put_str(struct gguf_writer *w, const char *s, size_t n)
{
    uint64_t len = n;
    put(w, &len, 8);
    put(w, s, n);
}

static void put_key(struct gguf_writer *w, const char *key, uint32_t vt)
{
    put_str(w, key, strlen(key));
    put(w, &vt, 4);
    w->n_kv++;
}

void gguf_w_u32(struct gguf_writer *w, const char *key, uint32_t v)
{
    put_key(w, key, GGUF_U32);
    put(w, &v, 4);
    if (strcmp(key, "general.alignment") == 0) {
        if (v == 0 || (v & (v - 1)) != 0) {
            w->oom = 1;
            snprintf(w->bad, sizeof w->bad, "general.alignment %u is not a power of two", v);
        } else {
            w->alignment = v;
        }
    }
}

void gguf_w_i32(struct gguf_writer *w, const char *key, int32_t v)
{
    put_key(w, key, GGUF_I32);
    put(w, &v, 4);
}

void gguf_w_f32(struct gguf_writer *w, const char *key, float v)
{
    put_key(w, key, GGUF_F32);
    put(w, &v, 4);
}

void gguf_w_bool(struct gguf_writer *w, const char *key, int v)
{
    uint8_t b = v != 0;
    put_key(w, key, GGUF_BOOL);
    put(w, &b, 1);
}

void gguf_w_str(struct gguf_writer *w, const char *key, const char *v)
{
    put_key(w, key, GGUF_STR);
    put_str(w, v, strlen(v));
}

void gguf_w_arr(struct gguf_writer *w, const char *key, int elem_vtype, uint64_t n, const void *data)
{
    uint32_t et = (uint32_t)elem_vtype;
    put_key(w, key, GGUF_ARR);
    put(w, &et, 4);
    put(w, &n, 8);
    put(w, data, n * vtype_size[elem_vtype]);
}

void gguf_w_arr_str(struct gguf_writer *w, const char *key, uint64_t n, const char *const *v)
{
    uint32_t et = GGUF_STR;
    put_key(w, key, GGUF_ARR);
    put(w, &et, 4);
    put(w, &n, 8);
    for (uint64_t i = 0; i < n; i++)
        put_str(w, v[i], strlen(v[i]));
}

void gguf_w_copy(struct gguf_writer *w, const struct gguf_kv *kv)
{
    uint32_t vt = (uint32_t)kv->type;
    put_str(w, kv->key.ptr, kv->key.len);
    put(w, &vt, 4);
    if (kv->type == GGUF_ARR) {
        uint32_t et = (uint32_t)kv->arr_type;
        put(w, &et, 4);
        put(w, &kv->n, 8);
    }
    put(w, kv->data, kv->nbytes);
    w->n_kv++;
}

void gguf_w_tensor(struct gguf_writer *w, const char *name, int qtype, int n_dims, const int64_t *ne)
{
    if (w->oom)
        return;
    if (strlen(name) >= GGUF_NAME_MAX || n_dims < 1 || n_dims > GGUF_MAX_DIMS ||
        qtype < 0 || qtype >= QT_COUNT || type_info[qtype].blck == 0 ||
        ne[0] % type_info[qtype].blck != 0) {
        w->oom = 1;
        snprintf(w->bad, sizeof w->bad, "invalid tensor declaration '%.63s'", name);
        return;
    }
    if (w->n_t == w->cap_t) {
        uint64_t cap = w->cap_t ? 2 * w->cap_t : 64;
        struct wtensor *t = realloc(w->t, cap * sizeof *t);
        if (!t) {
            w->oom = 1;
            snprintf(w->bad, sizeof w->bad, "out of memory");
            return;
        }
        w->t = t;
        w->cap_t = cap;
    }
    struct wtensor *t = &w->t[w->n_t++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = qtype;
    t->n_dims = n_dims;
    t->nbytes = (uint64_t)(ne[0] / type_info[qtype].blck) * (uint64_t)type_info[qtype].size;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        t->ne[d] = d < n_dims ? ne[d] : 1;
        if (d > 0)
            t->nbytes *= (uint64_t)t->ne[d];
    }
}

static int pad_to(FILE *f, uint64_t pos, uint32_t alignment)
{
    static const uint8_t zeros[256];
    uint64_t n = (alignment - pos % alignment) % alignment;
    while (n > 0) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        if (fwrite(zeros, 1, k, f) != k)
            return -1;
        n -= k;
    }
    return 0;
}

int gguf_w_begin(struct gguf_writer *w, const char *path, char *err, size_t errlen)
{
    if (w->oom) {
        snprintf(err, errlen, "gguf writer: %s", w->bad);
        return -1;
    }
    uint64_t off = 0;
    for (uint64_t i = 0; i < w->n_t; i++) {
        w->t[i].offset = off;
        off += w->t[i].nbytes;
        off += (w->alignment - off % w->alignment) % w->alignment;
    }
    w->f = fopen(path, "wb");
    if (!w->f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    uint32_t version = 3;
    int64_t nt = (int64_t)w->n_t, nkv = (int64_t)w->n_kv;
    int ok = fwrite("GGUF", 1, 4, w->f) == 4 && fwrite(&version, 4, 1, w->f) == 1 &&
             fwrite(&nt, 8, 1, w->f) == 1 && fwrite(&nkv, 8, 1, w->f) == 1 &&
             fwrite(w->meta, 1, w->meta_len, w->f) == w->meta_len;
    uint64_t pos = 24 + w->meta_len;
    for (uint64_t i = 0; ok && i < w->n_t; i++) {
        struct wtensor *t = &w->t[i];
        uint64_t len = strlen(t->name);
        uint32_t nd = (uint32_t)t->n_dims, ty = (uint32_t)t->type;
        ok = fwrite(&len, 8, 1, w->f) == 1 && fwrite(t->name, 1, len, w->f) == len &&
             fwrite(&nd, 4, 1, w->f) == 1 && fwrite(t->ne, 8, nd, w->f) == nd &&
             fwrite(&ty, 4, 1, w->f) == 1 && fwrite(&t->offset, 8, 1, w->f) == 1;
        pos += 8 + len + 4 + 8 * nd + 4 + 8;
    }
    if (ok && w->n_t > 0)
        ok = pad_to(w->f, pos, w->alignment) == 0;
    if (!ok) {
        snprintf(err, errlen, "%s: write failed: %s", path, strerror(errno));
        return -1;
    }
    w->cur = 0;
    w->cur_written = 0;
    return 0;
}

int gguf_w_data(struct gguf_writer *w, const void *data, size_t n)
{
    const uint8_t *p = data;
    while (n > 0) {
        if (!w->f || w->cur >= w->n_t)
            return -1;
        struct wtensor *t = &w->t[w->cur];
        uint64_t room = t->nbytes - w->cur_written;
        size_t k = n < room ? n : (size_t)room;
        if (fwrite(p, 1, k, w->f) != k)
            return -1;
        p += k;
        n -= k;
        w->cur_written += k;
        if (w->cur_written == t->nbytes) {
            if (pad_to(w->f, t->offset + t->nbytes, w->alignment) != 0)
                return -1;
            w->cur++;
            w->cur_written = 0;
        }
    }
    return 0;
}

int gguf_w_end(struct gguf_writer *w, char *err, size_t errlen)
{
    int rc = 0;
    /* zero-sized tensors complete without data */
    while (w->f && w->cur < w->n_t && w->t[w->cur].nbytes == 0 && w->cur_written == 0)
        w->cur++;
    if (!w->f) {
        snprintf(err, errlen, "gguf writer: %s", w->oom ? w->bad : "gguf_w_begin was not called");
        rc = -1;
    } else if (w->cur != w->n_t) {
        snprintf(err, errlen, "gguf writer: tensor '%s' got %llu of its %llu bytes",
                 w->t[w->cur].name, (unsigned long long)w->cur_written,
                 (unsigned long long)w->t[w->cur].nbytes);
        rc = -1;
    }
    if (w->f && fclose(w->f) != 0 && rc == 0) {
        snprintf(err, errlen, "gguf writer: close failed: %s", strerror(errno));
        rc = -1;
    }
    free(w->meta);
    free(w->t);
    free(w);
    return rc;
}
