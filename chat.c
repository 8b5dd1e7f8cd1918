/*
 * chat.c — chat templates (ChatML/Qwen, Llama-3, Llama-2 [INST]) and the
 * split of generated text into reasoning (<think>…</think>) and content.
 *
 * The family is recognised from the text of tokenizer.chat_template; there is
 * no Jinja interpreter: each family's rendering is written out here, as the
 * reference engine's built-in templates do. Pure functions on strings: no
 * model, no tokenizer, no I/O; chat_render's result is the only allocation.
 */
#include "strata.h"

#include <stdlib.h>
#include <string.h>

#define THINK_OPEN "<think>"
#define THINK_CLOSE "</think>"

/* ==== recognising a template ==== */

static const char *find(const char *s, size_t n, const char *what)
{
    size_t k = strlen(what);
    for (size_t i = 0; k <= n && i + k <= n; i++)
        if (memcmp(s + i, what, k) == 0)
            return s + i;
    return NULL;
}

/* A ChatML template that writes a fixed system message when the first one is
 * not a system message (Qwen2/2.5): the literal text after
 * "<|im_start|>system" and a newline (real or the Jinja escape "\n") up to
 * "<|im_end|>", copied with \n unescaped. A quote, brace or '+' before the end
 * means an expression (the user's own system message), not a default. */
static void find_default_system(struct chat_template *ct, const char *s, size_t n)
{
    static const char tag[] = "<|im_start|>system";
    const char *p = s, *end = s + n;
    while ((p = find(p, (size_t)(end - p), tag)) != NULL) {
        p += sizeof tag - 1;
        const char *q = p;
        if (q < end && *q == '\n')
            q++;
        else if (end - q >= 2 && q[0] == '\\' && q[1] == 'n')
            q += 2;
        else
            continue;
        size_t k = 0;
        int ok = 0;
        while (q < end) {
            if (end - q >= 10 && memcmp(q, "<|im_end|>", 10) == 0) {
                ok = 1;
                break;
            }
            if (*q == '\'' || *q == '"' || *q == '{' || *q == '}' || *q == '+' || k + 1 >= sizeof ct->system_default)
                break;
            if (end - q >= 2 && q[0] == '\\' && q[1] == 'n') {
                ct->system_default[k++] = '\n';
                q += 2;
            } else {
                ct->system_default[k++] = *q++;
            }
        }
        if (ok && k > 0) {
            ct->system_default[k] = 0;
            return;
        }
    }
    ct->system_default[0] = 0;
}

void chat_detect(struct chat_template *ct, const char *tmpl, size_t len)
{
    memset(ct, 0, sizeof *ct);
    ct->family = CHAT_CHATML;
    if (!tmpl)
        return;
    if (find(tmpl, len, "<|im_start|>")) {
        ct->known = 1;
        ct->thinking_switch = find(tmpl, len, "enable_thinking") != NULL;
        ct->think_tags = find(tmpl, len, THINK_OPEN) != NULL;
        find_default_system(ct, tmpl, len);
    } else if (find(tmpl, len, "<|start_header_id|>")) {
        ct->family = CHAT_LLAMA3;
        ct->known = 1;
    } else if (find(tmpl, len, "[INST]")) {
        ct->family = CHAT_LLAMA2;
        ct->known = 1;
    }
}

const char *chat_family_name(int family)
{
    switch (family) {
    case CHAT_CHATML: return "chatml";
    case CHAT_LLAMA3: return "llama3";
    case CHAT_LLAMA2: return "llama2";
    }
    return "?";
}

/* ==== rendering ==== */

struct sb {
    char *p;
    size_t n, cap;
    int oom;
};

static void sb_put(struct sb *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_str(struct sb *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

static int is_ws(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

/* content with leading and trailing whitespace removed (Jinja's trim) */
static void sb_trimmed(struct sb *b, const char *s, size_t n)
{
    while (n && is_ws(*s))
        s++, n--;
    while (n && is_ws(s[n - 1]))
        n--;
    sb_put(b, s, n);
}

/* Qwen3's template drops an earlier assistant turn's reasoning: only the
 * text after "</think>", without the newlines that follow it. */
static void sb_without_think(struct sb *b, const char *s, size_t n)
{
    const char *close = find(s, n, THINK_CLOSE);
    if (close) {
        size_t skip = (size_t)(close - s) + sizeof THINK_CLOSE - 1;
        s += skip;
        n -= skip;
        while (n && *s == '\n')
            s++, n--;
    }
    sb_put(b, s, n);
}

static void render_chatml(const struct chat_template *ct, const struct chat_msg *m, int n,
                          int enable_thinking, struct sb *b)
{
    if (ct->system_default[0] && (n == 0 || strcmp(m[0].role, "system") != 0)) {
        sb_str(b, "<|im_start|>system\n");
        sb_str(b, ct->system_default);
        sb_str(b, "<|im_end|>\n");
    }
    for (int i = 0; i < n; i++) {
        sb_str(b, "<|im_start|>");
        sb_str(b, m[i].role);
        sb_str(b, "\n");
        if (ct->think_tags && strcmp(m[i].role, "assistant") == 0)
            sb_without_think(b, m[i].content, m[i].len);
        else
            sb_put(b, m[i].content, m[i].len);
        sb_str(b, "<|im_end|>\n");
    }
    sb_str(b, "<|im_start|>assistant\n");
    /* Qwen3: with thinking off the template writes an empty reasoning block */
    if (ct->thinking_switch && !enable_thinking)
        sb_str(b, "<think>\n\n</think>\n\n");
}

static void render_llama3(const struct chat_msg *m, int n, struct sb *b)
{
    for (int i = 0; i < n; i++) {
        sb_str(b, "<|start_header_id|>");
        sb_str(b, m[i].role);
        sb_str(b, "<|end_header_id|>\n\n");
        sb_trimmed(b, m[i].content, m[i].len);
        sb_str(b, "<|eot_id|>");
    }
    sb_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

/* Llama-2: the system messages go into a <<SYS>> block at the start of the
 * first user turn; every turn after the first starts with the BOS text (the
 * tokenizer adds the first BOS). */
static void render_llama2(const struct chat_msg *m, int n, struct sb *b)
{
    int first = 1, sys_done = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(m[i].role, "system") == 0)
            continue;
        if (strcmp(m[i].role, "assistant") == 0) {
            sb_str(b, " ");
            sb_trimmed(b, m[i].content, m[i].len);
            sb_str(b, " </s>");
            continue;
        }
        sb_str(b, first ? "[INST] " : "<s>[INST] ");
        first = 0;
        if (!sys_done) {
            sys_done = 1;
            int any = 0;
            for (int k = 0; k < n; k++) {
                if (strcmp(m[k].role, "system") != 0)
                    continue;
                sb_str(b, any ? "\n" : "<<SYS>>\n");
                sb_trimmed(b, m[k].content, m[k].len);
                any = 1;
            }
            if (any)
                sb_str(b, "\n<</SYS>>\n\n");
        }
        sb_trimmed(b, m[i].content, m[i].len);
        sb_str(b, " [/INST]");
    }
}

char *chat_render(const struct chat_template *ct, const struct chat_msg *msgs, int n,
                  int enable_thinking, size_t *len)
{
    struct sb b = { 0 };
    sb_put(&b, "", 0);
    switch (ct->family) {
    case CHAT_LLAMA3: render_llama3(msgs, n, &b); break;
    case CHAT_LLAMA2: render_llama2(msgs, n, &b); break;
    default: render_chatml(ct, msgs, n, enable_thinking, &b); break;
    }
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.n;
    return b.p;
}

const char *chat_end_marker(const struct chat_template *ct)
{
    switch (ct->family) {
    case CHAT_LLAMA3: return "<|eot_id|>";
    case CHAT_LLAMA2: return "</s>";
    default: return "<|im_end|>";
    }
}

/* ==== reasoning blocks ==== */

/* Longest k such that the last k bytes of s[0..n) are a proper prefix of tag. */
static size_t partial_suffix(const char *s, size_t n, const char *tag)
{
    size_t t = strlen(tag);
    for (size_t k = t - 1 < n ? t - 1 : n; k > 0; k--)
        if (memcmp(s + n - k, tag, k) == 0)
            return k;
    return 0;
}

void chat_split(const char *text, size_t len, int final, struct chat_split *out)
{
    memset(out, 0, sizeof *out);
    if (len == 0)
        return;
    size_t i = 0;
    while (i < len && is_ws(text[i]))
        i++;
    size_t open_len = sizeof THINK_OPEN - 1, close_len = sizeof THINK_CLOSE - 1;
    size_t r0;
    if (len - i >= open_len && memcmp(text + i, THINK_OPEN, open_len) == 0) {
        r0 = i + open_len;
    } else if (!final && len - i < open_len && memcmp(text + i, THINK_OPEN, len - i) == 0) {
        return; /* whitespace, or the start of "<think>": not settled yet */
    } else {
        out->c_off = 0;
        out->c_len = len;
        return;
    }
    while (r0 < len && is_ws(text[r0]))
        r0++;
    const char *close = find(text + r0, len - r0, THINK_CLOSE);
    size_t r1 = close ? (size_t)(close - text) : len;
    if (!close && !final)
        r1 -= partial_suffix(text + r0, len - r0, THINK_CLOSE);
    /* trailing whitespace of the reasoning is held back until more comes */
    while (r1 > r0 && is_ws(text[r1 - 1]))
        r1--;
    out->r_off = r0;
    out->r_len = r1 - r0;
    if (!close)
        return;
    size_t c0 = (size_t)(close - text) + close_len;
    while (c0 < len && is_ws(text[c0]))
        c0++;
    out->c_off = c0;
    out->c_len = len - c0;
}
