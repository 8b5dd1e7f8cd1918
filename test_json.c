/*
 * test_json.c — tests of json.c: a table of valid documents against their
 * canonical re-serialisation, a table of invalid ones against the byte offset
 * the error must name, every proper prefix of valid documents rejected,
 * round trips, the string writer's escapes and U+FFFD replacement, and
 * mutated documents (no crash; whatever parses re-serialises and re-parses).
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a canonical writer for trees (independent of the parser's layout) ---- */

static void put_tree(FILE *f, const struct json *j)
{
    char num[64];
    switch (j->kind) {
    case JSON_NULL: fputs("null", f); break;
    case JSON_BOOL: fputs(j->num ? "true" : "false", f); break;
    case JSON_NUM:
        snprintf(num, sizeof num, "%.15g", j->num);
        if (strtod(num, NULL) != j->num)
            snprintf(num, sizeof num, "%.17g", j->num);
        fputs(num, f);
        break;
    case JSON_STR: json_put_str(f, j->str, j->len); break;
    case JSON_ARR:
        fputc('[', f);
        for (size_t k = 0; k < j->len; k++) {
            if (k)
                fputc(',', f);
            put_tree(f, &j->items[k]);
        }
        fputc(']', f);
        break;
    case JSON_OBJ:
        fputc('{', f);
        for (size_t k = 0; k < j->len; k++) {
            if (k)
                fputc(',', f);
            json_put_str(f, j->keys[k], strlen(j->keys[k]));
            fputc(':', f);
            put_tree(f, &j->items[k]);
        }
        fputc('}', f);
        break;
    }
}

/* malloc'd canonical text of a tree */
static char *canon(const struct json *j, size_t *len)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    put_tree(f, j);
    fclose(f);
    if (len)
        *len = n;
    return buf;
}

static char *put_str_text(const char *s, size_t len)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    json_put_str(f, s, len);
    fclose(f);
    return buf;
}

/* ---- tables ---- */

struct valid_case { const char *in, *canon; };

static const struct valid_case valid[] = {
    { "null", "null" },
    { " true ", "true" },
    { "\t\r\n false\n", "false" },
    { "0", "0" },
    { "-0", "-0" },
    { "123", "123" },
    { "-12.5e2", "-1250" },
    { "1E+2", "100" },
    { "2.5e-3", "0.0025" },
    { "0.1", "0.1" },
    { "1e308", "1e+308" },
    { "1e-400", "0" },
    { "9007199254740993", "9007199254740992" },
    { "\"\"", "\"\"" },
    { "\"abc\"", "\"abc\"" },
    { "\"\\\" \\\\ \\/ \\b \\f \\n \\r \\t\"", "\"\\\" \\\\ / \\b \\f \\n \\r \\t\"" },
    { "\"\\u0041\\u00e9\\u20AC\"", "\"A\xc3\xa9\xe2\x82\xac\"" },
    { "\"\\ud83d\\ude00\"", "\"\xf0\x9f\x98\x80\"" },
    { "\"\\uDBFF\\uDFFF\"", "\"\xf4\x8f\xbf\xbf\"" },
    { "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"", "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"" },
    { "\"\\u001f\\u007f\"", "\"\\u001f\x7f\"" },
    { "[]", "[]" },
    { "{}", "{}" },
    { "[ ]", "[]" },
    { "{ }", "{}" },
    { "[1,[2,[3,[]]],{}]", "[1,[2,[3,[]]],{}]" },
    { "{\"a\":1,\"b\":[true,false,null],\"c\":{\"d\":\"e\"}}",
      "{\"a\":1,\"b\":[true,false,null],\"c\":{\"d\":\"e\"}}" },
    { " { \"k\" : [ 1 , 2 ] , \"\" : \"\" } ", "{\"k\":[1,2],\"\":\"\"}" },
    { "{\"a\":1,\"a\":2}", "{\"a\":1,\"a\":2}" },
    { "[\"x\",{\"y\":[{}]},\"z\"]", "[\"x\",{\"y\":[{}]},\"z\"]" },
};

struct invalid_case { const char *in; size_t len, offset; };

/* len 0 means strlen(in) */
static const struct invalid_case invalid[] = {
    { "", 0, 0 },
    { "   ", 0, 3 },
    { "nul", 0, 3 },
    { "nulx", 0, 3 },
    { "True", 0, 0 },
    { "tru e", 0, 3 },
    { "1 2", 0, 2 },
    { "[] x", 0, 3 },
    { "{}}", 0, 2 },
    { "01", 0, 1 },
    { "-", 0, 1 },
    { "-a", 0, 1 },
    { "+1", 0, 0 },
    { ".5", 0, 0 },
    { "1.", 0, 2 },
    { "1.e5", 0, 2 },
    { "1e", 0, 2 },
    { "1e+", 0, 3 },
    { "0x10", 0, 1 },
    { "1e309", 0, 0 },
    { "-1e309", 0, 0 },
    { "NaN", 0, 0 },
    { "Infinity", 0, 0 },
    { "[1,]", 0, 3 },
    { "[,1]", 0, 1 },
    { "[1 2]", 0, 3 },
    { "{\"a\" 1}", 0, 5 },
    { "{\"a\":1,}", 0, 7 },
    { "{a:1}", 0, 1 },
    { "{1:1}", 0, 1 },
    { "{\"a\":}", 0, 5 },
    { "[1}", 0, 2 },
    { "{\"a\":1]", 0, 6 },
    { "'a'", 0, 0 },
    { "\"abc", 0, 4 },
    { "\"a\\\"", 0, 4 },
    { "\"\\x\"", 0, 1 },
    { "\"\\U0041\"", 0, 1 },
    { "\"\\u00g0\"", 0, 5 },
    { "\"\\u00\"", 0, 5 },
    { "\"\\u12", 0, 5 },
    { "\"\\ud83d\"", 0, 1 },
    { "\"\\ud83dx\"", 0, 1 },
    { "\"\\ud83d\\u0041\"", 0, 1 },
    { "\"\\ud83d\\ud83d\"", 0, 1 },
    { "\"ab\\ude00\"", 0, 3 },
    { "\"a\nb\"", 0, 2 },
    { "\"a\tb\"", 0, 2 },
    { "\"a\x01\"", 0, 2 },
    { "\"a\0b\"", 5, 2 },
    { "\"\x80\"", 0, 1 },
    { "\"\xc0\xaf\"", 0, 1 },
    { "\"\xc3\"", 0, 1 },
    { "\"\xe2\x82\"", 0, 1 },
    { "\"\xed\xa0\x80\"", 0, 1 },
    { "\"\xf4\x90\x80\x80\"", 0, 1 },
    { "\"\xf5\x80\x80\x80\"", 0, 1 },
    { "\"\xff\"", 0, 1 },
    { "\xef\xbb\xbf{}", 0, 0 },
    { "[1]\0", 4, 3 },
};

/* A document using every construct, top-level an object: every proper
 * prefix is invalid. */
static const char *const big_doc =
    "{\"prompt_tokens\":[1,15043,3186],\"tokens\":[{\"id\":29892,\"text\":\"\\u00e9 \\\"q\\\"\","
    "\"bytes\":[195,169],\"logprob\":-0.25e1,\"top\":[{\"id\":1,\"logprob\":-1.5}]}],"
    "\"ok\":true,\"no\":false,\"nil\":null,\"emoji\":\"\\ud83d\\ude00\xf0\x9f\x98\x80\","
    "\"nested\":[[[]],{},{\"a\":{\"b\":[0,-0.0,1E-3]}}]}";

static void check_valid(void)
{
    if (!test_begin("json/valid-table"))
        return;
    char err[128];
    int bad = 0;
    for (size_t c = 0; c < sizeof valid / sizeof *valid; c++) {
        struct json j;
        if (json_parse(&j, valid[c].in, strlen(valid[c].in), err, sizeof err)) {
            bad += !CHECK(0, "valid case %zu '%s' rejected: %s", c, valid[c].in, err);
            continue;
        }
        char *out = canon(&j, NULL);
        bad += !CHECK(strcmp(out, valid[c].canon) == 0, "case %zu '%s': got '%s', want '%s'",
                      c, valid[c].in, out, valid[c].canon);
        free(out);
        json_free(&j);
    }
    /* values and lengths that the canonical text does not show */
    struct json j;
    CHECK(json_parse(&j, "\"a\\u0000b\"", 10, err, sizeof err) == 0, "NUL escape: %s", err);
    CHECK(j.kind == JSON_STR && j.len == 3 && memcmp(j.str, "a\0b", 4) == 0, "\\u0000 decodes to a NUL");
    json_free(&j);
    CHECK(json_parse(&j, "-12.5e-1", 8, err, sizeof err) == 0 && j.kind == JSON_NUM && j.num == -1.25,
          "-12.5e-1 is -1.25");
    CHECK(json_parse(&j, "{\"a\":1,\"b\":{\"c\":[7]},\"a\":2}", 27, err, sizeof err) == 0, "dup keys");
    const struct json *a = json_get(&j, "a"), *b = json_get(&j, "b");
    CHECK(a && a->kind == JSON_NUM && a->num == 2, "json_get: the last duplicate wins");
    CHECK(b && json_get(b, "c") && json_get(b, "c")->items[0].num == 7, "json_get nested");
    CHECK(!json_get(&j, "zz") && !json_get(a, "a"), "json_get: absent key / not an object");
    json_free(&j);
    CHECK(json_parse(&j, "[1,2]x", 5, err, sizeof err) == 0 && j.len == 2, "len bounds the text");
    json_free(&j);
    printf("  %zu valid documents, %d mismatches\n", sizeof valid / sizeof *valid, bad);
}

static void check_invalid(void)
{
    if (!test_begin("json/invalid-table"))
        return;
    char err[128], want[32];
    for (size_t c = 0; c < sizeof invalid / sizeof *invalid; c++) {
        const struct invalid_case *t = &invalid[c];
        size_t len = t->len ? t->len : strlen(t->in);
        struct json j;
        memset(&j, 0x5a, sizeof j);
        err[0] = 0;
        int rc = json_parse(&j, t->in, len, err, sizeof err);
        if (!CHECK(rc == -1, "invalid case %zu '%s' accepted", c, t->in)) {
            json_free(&j);
            continue;
        }
        snprintf(want, sizeof want, "at offset %zu", t->offset);
        CHECK(strstr(err, want) != NULL, "case %zu '%s': error '%s', want '%s'", c, t->in, err, want);
        CHECK(j.kind == JSON_NULL && j.items == NULL && j.str == NULL, "case %zu: out zeroed", c);
    }
}

static void check_depth(void)
{
    if (!test_begin("json/depth-limit"))
        return;
    char doc[2 * 66 + 1], err[128];
    for (int depth = 63; depth <= 66; depth++) {
        for (int k = 0; k < depth; k++) {
            doc[k] = '[';
            doc[2 * depth - 1 - k] = ']';
        }
        struct json j;
        int rc = json_parse(&j, doc, 2 * (size_t)depth, err, sizeof err);
        if (depth <= 64) {
            CHECK(rc == 0, "depth %d rejected: %s", depth, err);
            const struct json *p = &j;
            int d = 1;
            while (p->len) {
                p = &p->items[0];
                d++;
            }
            CHECK(rc || d == depth, "depth %d: walked %d levels", depth, d);
            json_free(&j);
        } else {
            CHECK(rc == -1 && strstr(err, "offset 64"), "depth %d accepted (%s)", depth, err);
        }
    }
    /* objects count too */
    char obj[65 * 6 + 65 + 1];
    size_t n = 0;
    for (int k = 0; k < 65; k++)
        n += (size_t)sprintf(obj + n, "{\"a\":");
    obj[n++] = '1';
    for (int k = 0; k < 65; k++)
        obj[n++] = '}';
    struct json j;
    CHECK(json_parse(&j, obj, n, err, sizeof err) == -1, "65 nested objects accepted");
    CHECK(json_parse(&j, obj + 5, n - 6, err, sizeof err) == 0, "64 nested objects: %s", err);
    json_free(&j);
}

static void check_prefixes(void)
{
    if (!test_begin("json/prefixes-rejected"))
        return;
    char err[128];
    size_t n = strlen(big_doc), accepted = 0;
    struct json j;
    CHECK(json_parse(&j, big_doc, n, err, sizeof err) == 0, "whole document: %s", err);
    json_free(&j);
    for (size_t len = 0; len < n; len++) {
        /* a heap copy of exactly len bytes, so a read past the end is a real overrun */
        char *copy = malloc(len ? len : 1);
        memcpy(copy, big_doc, len);
        if (json_parse(&j, copy, len, err, sizeof err) == 0) {
            accepted++;
            CHECK(0, "prefix of %zu bytes accepted", len);
            json_free(&j);
        } else {
            char want[32];
            snprintf(want, sizeof want, "offset %zu", len);
            /* a cut inside the text is always detected at the end of the input */
            CHECK(strstr(err, want) != NULL, "prefix %zu: '%s'", len, err);
        }
        free(copy);
    }
    printf("  %zu prefixes, %zu accepted\n", n, accepted);
}

static void check_roundtrip(void)
{
    if (!test_begin("json/roundtrip"))
        return;
    char err[128];
    struct json a, b;
    size_t la, lb;
    CHECK(json_parse(&a, big_doc, strlen(big_doc), err, sizeof err) == 0, "parse: %s", err);
    char *t1 = canon(&a, &la);
    CHECK(json_parse(&b, t1, la, err, sizeof err) == 0, "re-parse: %s", err);
    char *t2 = canon(&b, &lb);
    CHECK(la == lb && memcmp(t1, t2, la) == 0, "canonical text changed:\n%s\n%s", t1, t2);
    const struct json *tok = &json_get(&a, "tokens")->items[0];
    CHECK(strcmp(json_get(tok, "text")->str, "\xc3\xa9 \"q\"") == 0, "escaped text decoded");
    CHECK(json_get(tok, "logprob")->num == -2.5, "logprob -0.25e1");
    CHECK(json_get(&a, "emoji")->len == 8, "surrogate pair + raw emoji: 8 bytes");
    json_free(&a);
    json_free(&b);
    free(t1);
    free(t2);

    /* every byte 0..255 and every code point class through json_put_str and back */
    unsigned seed = 7;
    for (int round = 0; round < 200; round++) {
        char s[64];
        size_t n = 0;
        while (n < sizeof s - 4) {
            unsigned r = test_rand(&seed) % 6;
            uint32_t cp = r == 0 ? test_rand(&seed) % 0x20 : r == 1 ? 0x20 + test_rand(&seed) % 0x60
                        : r == 2 ? 0x80 + test_rand(&seed) % 0x780 : r == 3 ? 0x800 + test_rand(&seed) % 0xD000
                        : r == 4 ? 0xE000 + test_rand(&seed) % 0x2000 : 0x10000 + test_rand(&seed) % 0x100000;
            char tmp[4];
            int k = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
            if (k == 1) {
                tmp[0] = (char)cp;
            } else if (k == 2) {
                tmp[0] = (char)(0xC0 | cp >> 6);
                tmp[1] = (char)(0x80 | (cp & 63));
            } else if (k == 3) {
                tmp[0] = (char)(0xE0 | cp >> 12);
                tmp[1] = (char)(0x80 | (cp >> 6 & 63));
                tmp[2] = (char)(0x80 | (cp & 63));
            } else {
                tmp[0] = (char)(0xF0 | cp >> 18);
                tmp[1] = (char)(0x80 | (cp >> 12 & 63));
                tmp[2] = (char)(0x80 | (cp >> 6 & 63));
                tmp[3] = (char)(0x80 | (cp & 63));
            }
            memcpy(s + n, tmp, (size_t)k);
            n += (size_t)k;
        }
        char *lit = put_str_text(s, n);
        struct json j;
        if (!CHECK(json_parse(&j, lit, strlen(lit), err, sizeof err) == 0, "round %d: %s", round, err)) {
            free(lit);
            break;
        }
        CHECK(j.kind == JSON_STR && j.len == n && memcmp(j.str, s, n) == 0, "round %d: string changed", round);
        json_free(&j);
        free(lit);
    }
}

static void check_put_str(void)
{
    if (!test_begin("json/put-str"))
        return;
    static const struct { const char *in; size_t len; const char *out; } cases[] = {
        { "plain", 5, "\"plain\"" },
        { "\"\\/", 3, "\"\\\"\\\\/\"" },
        { "\n\r\t\b\f\x01\x1f\x7f", 8, "\"\\n\\r\\t\\b\\f\\u0001\\u001f\x7f\"" },
        { "a\0b", 3, "\"a\\u0000b\"" },
        { "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9, "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"" },
        /* invalid sequences: one U+FFFD per maximal subpart (as Python's
         * errors='replace' and the golden files' "content" do) */
        { "\x80", 1, "\"\xef\xbf\xbd\"" },
        { "a\xff" "b", 3, "\"a\xef\xbf\xbd" "b\"" },
        { "\xc3", 1, "\"\xef\xbf\xbd\"" },
        { "\xe2\x82", 2, "\"\xef\xbf\xbd\"" },
        { "\xe2\x82x", 3, "\"\xef\xbf\xbdx\"" },
        { "\xf0\x9f\x98", 3, "\"\xef\xbf\xbd\"" },
        { "\xf0\x9f\x98\xf0\x9f\x98\x80", 7, "\"\xef\xbf\xbd\xf0\x9f\x98\x80\"" },
        { "\xc0\xaf", 2, "\"\xef\xbf\xbd\xef\xbf\xbd\"" },
        { "\xed\xa0\x80", 3, "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"" },
        { "\xf4\x90\x80\x80", 4, "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"" },
        { "\xe0\x80\x80", 3, "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"" },
        { "\xe1\x80\x80", 3, "\"\xe1\x80\x80\"" },
        { "", 0, "\"\"" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char *out = put_str_text(cases[c].in, cases[c].len);
        CHECK(strcmp(out, cases[c].out) == 0, "case %zu: got '%s', want '%s'", c, out, cases[c].out);
        /* the output is always valid JSON */
        struct json j;
        char err[128];
        CHECK(json_parse(&j, out, strlen(out), err, sizeof err) == 0, "case %zu: output rejected: %s", c, err);
        json_free(&j);
        free(out);
    }
}

static void check_mutations(void)
{
    if (!test_begin("json/mutations"))
        return;
    static const char alphabet[] = "{}[]\",:\\u0123456789abcdefEe+-.tfn \t\n\x80\xc3\xed\xf0\xff";
    unsigned seed = 12345;
    size_t n = strlen(big_doc), parsed = 0, rounds = 20000;
    char err[128];
    for (size_t r = 0; r < rounds; r++) {
        char *doc = malloc(n + 8);
        memcpy(doc, big_doc, n);
        size_t len = n;
        int edits = 1 + (int)(test_rand(&seed) % 4);
        for (int e = 0; e < edits; e++) {
            size_t at = test_rand(&seed) % len;
            char ch = alphabet[test_rand(&seed) % (sizeof alphabet - 1)];
            switch (test_rand(&seed) % 3) {
            case 0: doc[at] = ch; break;
            case 1: memmove(doc + at, doc + at + 1, len - at - 1); len--; break;
            default:
                if (len < n + 8) {
                    memmove(doc + at + 1, doc + at, len - at);
                    doc[at] = ch;
                    len++;
                }
            }
        }
        /* an exact-size copy, so that a read past the end is a real overrun */
        char *exact = realloc(doc, len ? len : 1);
        if (exact)
            doc = exact;
        struct json j;
        if (json_parse(&j, doc, len, err, sizeof err) == 0) {
            parsed++;
            size_t l1, l2;
            char *t1 = canon(&j, &l1);
            struct json k;
            int rc = json_parse(&k, t1, l1, err, sizeof err);
            CHECK(rc == 0, "mutant re-parse failed: %s", err);
            if (rc == 0) {
                char *t2 = canon(&k, &l2);
                CHECK(l1 == l2 && memcmp(t1, t2, l1) == 0, "mutant canonical text changed");
                free(t2);
                json_free(&k);
            }
            free(t1);
            json_free(&j);
        } else {
            CHECK(strstr(err, "at offset ") != NULL, "error without offset: %s", err);
        }
        free(doc);
    }
    printf("  %zu mutants, %zu still valid\n", rounds, parsed);
}

void test_json(void)
{
    check_valid();
    check_invalid();
    check_depth();
    check_prefixes();
    check_roundtrip();
    check_put_str();
    check_mutations();
}
