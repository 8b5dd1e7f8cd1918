/*
 * json.c — a strict RFC 8259 JSON reader into a tree, and a string writer.
 *
 * json_parse makes two passes over the text: the first validates it and
 * counts nodes, keys and string bytes; the second builds the tree inside one
 * allocation of exactly that size, so a parse costs one malloc and the input
 * bounds every size. Nesting is limited to JSON_MAX_DEPTH (recursion stays
 * shallow), numbers to JSON_NUM_MAX characters. Invalid UTF-8, lone
 * surrogates, control characters in strings, bad escapes and trailing bytes
 * are errors naming the byte offset. No printing, no global state.
 */
#include "strata.h"

#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 64 /* containers nested deeper are rejected */
#define JSON_NUM_MAX 320  /* longest number text accepted (RFC 8259 §9 allows a limit) */

/* ==== UTF-8 ==== */

/* Length of the well-formed UTF-8 character at s (n > 0 bytes available), or
 * 0 when it is ill-formed; then *bad is the length of its maximal subpart
 * (the Unicode rule for how many bytes one U+FFFD replaces). */
static size_t utf8_char(const uint8_t *s, size_t n, size_t *bad)
{
    uint8_t c = s[0], lo = 0x80, hi = 0xBF;
    size_t need;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0)
            lo = 0xA0; /* no overlong forms */
        if (c == 0xED)
            hi = 0x9F; /* no UTF-16 surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0)
            lo = 0x90;
        if (c == 0xF4)
            hi = 0x8F; /* nothing above U+10FFFF */
    } else {
        *bad = 1;
        return 0;
    }
    size_t k = 1;
    if (k < n && s[k] >= lo && s[k] <= hi) {
        k++;
        while (k < need && k < n && s[k] >= 0x80 && s[k] <= 0xBF)
            k++;
    }
    if (k == need)
        return need;
    *bad = k;
    return 0;
}

static size_t utf8_encode(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18);
    out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* ==== the parser ==== */

/*
 * Pass 2's arena: children of open containers are pushed at the bottom of the
 * node (and key) region; when a container closes, its children move to the
 * top, below the arrays finished before. Every node sits in exactly one of the
 * two parts, so they never collide, and the root's children, finished last,
 * land at offset 0: the root's items (or its str) is the allocation itself.
 */
struct jp {
    const uint8_t *s;
    size_t n, i;
    char *err;
    size_t errlen;
    int build;              /* 0: pass 1 (validate, count); 1: pass 2 (fill) */
    size_t n_nodes, n_keys, n_bytes;         /* pass 1's counts (root excluded) */
    struct json *nodes;     /* (n_nodes) */
    char **keys;            /* (n_keys) */
    char *bytes;            /* (n_bytes): every string, NUL-terminated */
    size_t node_lo, node_hi, key_lo, key_hi, byte_at;
};

static int fail(struct jp *p, size_t at, const char *what)
{
    if (p->errlen)
        snprintf(p->err, p->errlen, "json: %s at offset %zu", what, at);
    return -1;
}

static void skip_ws(struct jp *p)
{
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' ||
                           p->s[p->i] == '\n' || p->s[p->i] == '\r'))
        p->i++;
}

static int hex4(struct jp *p, size_t at, uint32_t *out)
{
    uint32_t v = 0;
    for (size_t k = 0; k < 4; k++) {
        if (at + k >= p->n)
            return fail(p, p->n, "unexpected end of input in \\u escape");
        uint8_t c = p->s[at + k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0)
            return fail(p, at + k, "invalid hex digit in \\u escape");
        v = v << 4 | (uint32_t)d;
    }
    *out = v;
    return 0;
}

/* Parses the string starting at the quote p->s[p->i]; in pass 2 writes the
 * decoded bytes and a NUL at dst. *len gets the decoded length. */
static int parse_str(struct jp *p, char *dst, size_t *len)
{
    size_t k = 0;
    p->i++;
    for (;;) {
        if (p->i >= p->n)
            return fail(p, p->n, "unterminated string");
        uint8_t c = p->s[p->i];
        if (c == '"') {
            p->i++;
            break;
        }
        if (c < 0x20)
            return fail(p, p->i, "control character in string");
        if (c != '\\') {
            size_t bad, m = utf8_char(p->s + p->i, p->n - p->i, &bad);
            if (m == 0 && p->i + bad == p->n)
                return fail(p, p->n, "unterminated string");
            if (m == 0)
                return fail(p, p->i, "invalid UTF-8 in string");
            if (dst)
                memcpy(dst + k, p->s + p->i, m);
            k += m;
            p->i += m;
            continue;
        }
        if (p->i + 1 >= p->n)
            return fail(p, p->n, "unterminated string");
        char esc = (char)p->s[p->i + 1], out = 0;
        switch (esc) {
        case '"': out = '"'; break;
        case '\\': out = '\\'; break;
        case '/': out = '/'; break;
        case 'b': out = '\b'; break;
        case 'f': out = '\f'; break;
        case 'n': out = '\n'; break;
        case 'r': out = '\r'; break;
        case 't': out = '\t'; break;
        case 'u': break;
        default: return fail(p, p->i, "invalid escape");
        }
        if (esc != 'u') {
            if (dst)
                dst[k] = out;
            k++;
            p->i += 2;
            continue;
        }
        uint32_t cp, lo;
        size_t at = p->i;
        if (hex4(p, p->i + 2, &cp))
            return -1;
        p->i += 6;
        if (cp >= 0xDC00 && cp <= 0xDFFF)
            return fail(p, at, "unpaired low surrogate");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            /* a high surrogate must be followed by an escaped low one */
            if ((p->i < p->n && p->s[p->i] != '\\') ||
                (p->i + 1 < p->n && p->s[p->i + 1] != 'u'))
                return fail(p, at, "unpaired high surrogate");
            if (p->i + 1 >= p->n)
                return fail(p, p->n, "unterminated string");
            if (hex4(p, p->i + 2, &lo))
                return -1;
            if (lo < 0xDC00 || lo > 0xDFFF)
                return fail(p, at, "unpaired high surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            p->i += 6;
        }
        char tmp[4];
        size_t m = utf8_encode(cp, tmp);
        if (dst)
            memcpy(dst + k, tmp, m);
        k += m;
    }
    if (dst)
        dst[k] = 0;
    *len = k;
    return 0;
}

/* A string value or key: counted in pass 1, stored in pass 2. */
static int take_str(struct jp *p, char **out, size_t *len)
{
    char *dst = p->build ? p->bytes + p->byte_at : NULL;
    if (parse_str(p, dst, len))
        return -1;
    if (p->build) {
        *out = dst;
        p->byte_at += *len + 1;
    } else {
        p->n_bytes += *len + 1;
    }
    return 0;
}

static int parse_num(struct jp *p, double *out)
{
    size_t start = p->i;
    const uint8_t *s = p->s;
    if (p->i < p->n && s[p->i] == '-')
        p->i++;
    if (p->i >= p->n)
        return fail(p, p->n, "unexpected end of input in number");
    if (s[p->i] == '0') {
        p->i++;
    } else if (s[p->i] >= '1' && s[p->i] <= '9') {
        while (p->i < p->n && s[p->i] >= '0' && s[p->i] <= '9')
            p->i++;
    } else {
        return fail(p, p->i, "invalid number");
    }
    if (p->i < p->n && s[p->i] == '.') {
        p->i++;
        if (p->i >= p->n || s[p->i] < '0' || s[p->i] > '9')
            return fail(p, p->i, "digit expected after decimal point");
        while (p->i < p->n && s[p->i] >= '0' && s[p->i] <= '9')
            p->i++;
    }
    if (p->i < p->n && (s[p->i] == 'e' || s[p->i] == 'E')) {
        p->i++;
        if (p->i < p->n && (s[p->i] == '+' || s[p->i] == '-'))
            p->i++;
        if (p->i >= p->n || s[p->i] < '0' || s[p->i] > '9')
            return fail(p, p->i, "digit expected in exponent");
        while (p->i < p->n && s[p->i] >= '0' && s[p->i] <= '9')
            p->i++;
    }
    size_t len = p->i - start;
    if (len > JSON_NUM_MAX)
        return fail(p, start, "number too long");
    /* strtod needs a terminated copy, and reads the decimal point of the
     * current locale: translate '.' for a program that changed LC_NUMERIC */
    char buf[JSON_NUM_MAX + 1];
    memcpy(buf, s + start, len);
    buf[len] = 0;
    char dp = localeconv()->decimal_point[0];
    char *dot = memchr(buf, '.', len);
    if (dot && dp && dp != '.')
        *dot = dp;
    *out = strtod(buf, NULL);
    if (isinf(*out))
        return fail(p, start, "number out of range");
    return 0;
}

static int parse_lit(struct jp *p, const char *word)
{
    size_t n = strlen(word);
    for (size_t k = 0; k < n; k++) {
        if (p->i + k >= p->n)
            return fail(p, p->n, "unexpected end of input");
        if (p->s[p->i + k] != (uint8_t)word[k])
            return fail(p, p->i + k, "invalid literal");
    }
    p->i += n;
    return 0;
}

static int parse_value(struct jp *p, int depth, struct json *v);

/* An array or object at p->s[p->i]: pushes its children (and keys) on the
 * stack part of the arena, then moves them into the finished part. */
static int parse_container(struct jp *p, int depth, struct json *v)
{
    int obj = p->s[p->i] == '{';
    uint8_t close = obj ? '}' : ']';
    if (depth >= JSON_MAX_DEPTH)
        return fail(p, p->i, "nesting deeper than 64");
    p->i++;
    v->kind = obj ? JSON_OBJ : JSON_ARR;
    size_t node_base = p->node_lo, key_base = p->key_lo, count = 0;
    struct json scratch;
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == close) {
        p->i++;
    } else {
        for (;;) {
            skip_ws(p);
            if (obj) {
                char *key = NULL;
                size_t klen;
                if (p->i >= p->n)
                    return fail(p, p->n, "unexpected end of input");
                if (p->s[p->i] != '"')
                    return fail(p, p->i, "string key expected");
                if (take_str(p, &key, &klen))
                    return -1;
                if (p->build)
                    p->keys[p->key_lo++] = key;
                skip_ws(p);
                if (p->i >= p->n)
                    return fail(p, p->n, "unexpected end of input");
                if (p->s[p->i] != ':')
                    return fail(p, p->i, "':' expected");
                p->i++;
            }
            struct json *child = p->build ? &p->nodes[p->node_lo++] : &scratch;
            if (parse_value(p, depth + 1, child))
                return -1;
            count++;
            skip_ws(p);
            if (p->i >= p->n)
                return fail(p, p->n, "unexpected end of input");
            if (p->s[p->i] == close) {
                p->i++;
                break;
            }
            if (p->s[p->i] != ',')
                return fail(p, p->i, obj ? "',' or '}' expected" : "',' or ']' expected");
            p->i++;
        }
    }
    v->len = count;
    if (!p->build) {
        p->n_nodes += count;
        if (obj)
            p->n_keys += count;
        return 0;
    }
    if (count) {
        p->node_hi -= count;
        memmove(p->nodes + p->node_hi, p->nodes + node_base, count * sizeof *p->nodes);
        v->items = p->nodes + p->node_hi;
        if (obj) {
            p->key_hi -= count;
            memmove(p->keys + p->key_hi, p->keys + key_base, count * sizeof *p->keys);
            v->keys = p->keys + p->key_hi;
        }
    }
    p->node_lo = node_base;
    p->key_lo = key_base;
    return 0;
}

static int parse_value(struct jp *p, int depth, struct json *v)
{
    memset(v, 0, sizeof *v);
    skip_ws(p);
    if (p->i >= p->n)
        return fail(p, p->n, "unexpected end of input");
    switch (p->s[p->i]) {
    case '{':
    case '[':
        return parse_container(p, depth, v);
    case '"':
        v->kind = JSON_STR;
        return take_str(p, &v->str, &v->len);
    case 't':
        v->kind = JSON_BOOL;
        v->num = 1;
        return parse_lit(p, "true");
    case 'f':
        v->kind = JSON_BOOL;
        return parse_lit(p, "false");
    case 'n':
        v->kind = JSON_NULL;
        return parse_lit(p, "null");
    default:
        v->kind = JSON_NUM;
        return parse_num(p, &v->num);
    }
}

int json_parse(struct json *out, const char *text, size_t len, char *err, size_t errlen)
{
    struct jp p = { .s = (const uint8_t *)text, .n = len, .err = err, .errlen = errlen };
    memset(out, 0, sizeof *out);
    struct json root;
    if (parse_value(&p, 0, &root))
        return -1;
    skip_ws(&p);
    if (p.i != p.n)
        return fail(&p, p.i, "unexpected characters after the value");

    /* every count is at most len, so only the multiplications can overflow */
    if (p.n_nodes > SIZE_MAX / 2 / sizeof(struct json) || p.n_keys > SIZE_MAX / 4 / sizeof(char *))
        return fail(&p, 0, "document too large");
    size_t node_bytes = p.n_nodes * sizeof(struct json), key_bytes = p.n_keys * sizeof(char *);
    size_t total = node_bytes + key_bytes + p.n_bytes;
    if (total == 0) {
        *out = root;
        return 0;
    }
    char *arena = malloc(total);
    if (!arena)
        return fail(&p, 0, "out of memory");
    p.build = 1;
    p.i = 0;
    p.nodes = (struct json *)arena;
    p.keys = (char **)(arena + node_bytes);
    p.bytes = arena + node_bytes + key_bytes;
    p.node_hi = p.n_nodes;
    p.key_hi = p.n_keys;
    parse_value(&p, 0, out); /* cannot fail: pass 1 accepted the same text */
    return 0;
}

void json_free(struct json *j)
{
    /* the whole tree is one allocation starting at the root's items or str */
    if (j->kind == JSON_ARR || j->kind == JSON_OBJ)
        free(j->items);
    else if (j->kind == JSON_STR)
        free(j->str);
    memset(j, 0, sizeof *j);
}

const struct json *json_get(const struct json *obj, const char *key)
{
    if (!obj || obj->kind != JSON_OBJ)
        return NULL;
    /* from the end: with duplicate keys the last one wins */
    for (size_t k = obj->len; k-- > 0;)
        if (strcmp(obj->keys[k], key) == 0)
            return &obj->items[k];
    return NULL;
}

/* ==== the writer ==== */

void json_put_num(FILE *f, double v, const char *fmt)
{
    if (isfinite(v))
        fprintf(f, fmt, v);
    else
        fputs("null", f);
}

void json_put_str(FILE *f, const char *s, size_t len)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0, run = 0; /* u[run..i) is pending verbatim output */
    putc('"', f);
    while (i < len) {
        uint8_t c = u[i];
        const char *esc = NULL;
        char hex[8];
        size_t adv = 1, bad;
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c == '\b')
            esc = "\\b";
        else if (c == '\f')
            esc = "\\f";
        else if (c < 0x20) {
            snprintf(hex, sizeof hex, "\\u%04x", c);
            esc = hex;
        } else if (c >= 0x80) {
            adv = utf8_char(u + i, len - i, &bad);
            if (adv == 0) {
                esc = "\xEF\xBF\xBD"; /* U+FFFD for each maximal invalid subpart */
                adv = bad;
            }
        }
        if (esc) {
            fwrite(u + run, 1, i - run, f);
            fputs(esc, f);
            run = i + adv;
        }
        i += adv;
    }
    fwrite(u + run, 1, i - run, f);
    putc('"', f);
}
