/*
 * tok.c — tokenizers: SentencePiece-style merging ("llama", SPM) and
 * byte-level BPE ("gpt2") with the reference engine's pre-tokenizer rules;
 * special and control tokens, BOS/EOS and the end-of-generation set, and
 * detokenisation to exact bytes.
 *
 * Owns the vocabulary tables built once in tok_load (token text -> id and
 * merge pair -> rank hash maps) and the pre-tokenizers, written by hand over
 * code points with the classes of the generated tok_unicode.h (no regex
 * library). Must not print, exit, or keep pointers into the GGUF mapping:
 * everything is copied, so the file may be closed after tok_load.
 * Shape letters: V vocabulary size, M merges, S special tokens.
 */
#include "strata.h"

#include <stdlib.h>
#include <string.h>

#include "tok_unicode.h"

/* ==== code point classes ==== */

/* Bits of tok_uc_flags (written by gen_unicode.py with the same values). */
enum {
    TOK_UC_UNDEF = 0x001, TOK_UC_NUMBER = 0x002, TOK_UC_LETTER = 0x004,
    TOK_UC_SEPARATOR = 0x008, TOK_UC_MARK = 0x010, TOK_UC_PUNCT = 0x020,
    TOK_UC_SYMBOL = 0x040, TOK_UC_CONTROL = 0x080, TOK_UC_SPACE = 0x100
};

/* Classes of one code point; never 0, so 0 can mean "outside the piece". */
static unsigned tok_uc(uint32_t cp)
{
    if (cp >= 0x110000)
        return TOK_UC_UNDEF;
    size_t lo = 0, hi = TOK_UC_NRANGES;   /* last range starting <= cp */
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (tok_uc_start[mid] <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return tok_uc_flags[lo];
}

/* Length of the UTF-8 sequence a lead byte announces, as the reference
 * counts it (continuation and invalid bytes count as 1). */
static size_t tok_u8len(unsigned char c)
{
    static const unsigned char len[16] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4 };
    return len[c >> 4];
}

/* Decodes one code point at s[*i] (n bytes in all); an invalid or truncated
 * sequence yields U+FFFD and consumes one byte, like the reference. */
static uint32_t tok_u8dec(const unsigned char *s, size_t n, size_t *i)
{
    size_t k = *i;
    unsigned c = s[k];
    if (c < 0x80) {
        *i = k + 1;
        return c;
    }
    size_t len = (c & 0x40) == 0 ? 0 : (c & 0x20) == 0 ? 2 : (c & 0x10) == 0 ? 3 : (c & 0x08) == 0 ? 4 : 0;
    if (len == 0 || k + len > n) {
        *i = k + 1;
        return 0xFFFD;
    }
    uint32_t cp = c & (0x7F >> len);
    for (size_t j = 1; j < len; j++) {
        if ((s[k + j] & 0xC0) != 0x80) {
            *i = k + 1;
            return 0xFFFD;
        }
        cp = (cp << 6) | (s[k + j] & 0x3F);
    }
    *i = k + len;
    return cp;
}

/* Writes cp as UTF-8 into out (4 bytes room); returns the length. */
static size_t tok_u8enc(uint32_t cp, char *out)
{
    if (cp > 0x10FFFF)
        cp = 0xFFFD;
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* GPT-2's byte-level alphabet: bytes 0x21-0x7E, 0xA1-0xAC and 0xAE-0xFF stand
 * for themselves; the other 68 map, in byte order, to U+0100..U+0143. */
static uint32_t tok_byte_cp(unsigned b)
{
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)
        return b;
    if (b <= 0x20)
        return 0x100 + b;
    if (b <= 0xA0)
        return 0x100 + 33 + (b - 0x7F);
    return 0x143; /* 0xAD */
}

/* The inverse of tok_byte_cp; -1 for a code point outside the alphabet. */
static int tok_cp_byte(uint32_t cp)
{
    if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF))
        return (int)cp;
    if (cp >= 0x100 && cp <= 0x120)
        return (int)(cp - 0x100);
    if (cp >= 0x121 && cp <= 0x142)
        return (int)(cp - 0x121 + 0x7F);
    if (cp == 0x143)
        return 0xAD;
    return -1;
}

/* C-locale isspace, as the reference's LSTRIP/RSTRIP use it. */
static int tok_isspace(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}

/* ==== the tokenizer object ==== */

enum { TOK_SPM, TOK_BPE };

/* The regexes the pre-tokenizers are made of (the reference's spelling). */
enum tok_rx {
    RX_END,            /* ends a list */
    RX_LLAMA3,         /* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
    RX_QWEN2,          /* the same with \p{N} single digits */
    RX_QWEN35,         /* as qwen2 with [\p{L}\p{M}]+ letter runs and \p{M} out of the punctuation class */
    RX_GPT2,           /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S) */
    RX_DEFAULT_PUNCT,  /* [\p{P}\$\+<=>\^~\|]+ */
    RX_FALCON_PUNCT,   /* [\p{P}\$\+<=>\^~\|`]+ */
    RX_NUMBERS,        /* \p{N}+ */
    RX_DIGIT,          /* \p{N} */
    RX_TRIPLES,        /* [0-9][0-9][0-9] */
    RX_CRLF,           /* [\r\n] */
    RX_SP_LETTERS,     /* \s?\p{L}+ */
    RX_SP_PUNCT,       /* \s?\p{P}+ */
    RX_CJK,            /* [一-龥ࠀ-一가-\uD7FF]+ */
    RX_DSL_LETTERS,    /* \s?[A-Za-zµÀ-ÖØ-öø-ƺ...]+ (deepseek-llm) */
    RX_DSL_PUNCT,      /* \s?[!-/:-~！-／：-～‘-‟\u3000-。]+ */
    RX_TRAILING_SPACE, /* \s+$ */
};

#define TOK_MAX_RX 6

/* Token attributes: the reference's llama_token_attr bits, plus our EOG mark. */
enum {
    TOK_A_UNKNOWN = 1 << 0, TOK_A_UNUSED = 1 << 1, TOK_A_NORMAL = 1 << 2,
    TOK_A_CONTROL = 1 << 3, TOK_A_USER = 1 << 4, TOK_A_BYTE = 1 << 5,
    TOK_A_LSTRIP = 1 << 7, TOK_A_RSTRIP = 1 << 8,
    TOK_A_EOG = 1 << 15
};

/* Open-addressing hash table of indices (slot = index + 1, 0 = empty). */
struct tok_map {
    uint32_t *slot;   /* (mask + 1) */
    uint32_t mask;
};

struct tok {
    int model;              /* TOK_SPM or TOK_BPE */
    unsigned char rx[TOK_MAX_RX]; /* BPE pre-tokenizer: enum tok_rx list, RX_END-terminated */
    int n_vocab;
    char *text;             /* every token's text, each NUL-terminated */
    uint32_t *text_off;     /* (V + 1) start of token i in text */
    float *score;           /* (V) SPM merge priority */
    uint16_t *attr;         /* (V) TOK_A_* */
    struct tok_map vocab;   /* token text -> id */
    int n_merges;
    char *merge;            /* every merge string "left right", NUL-terminated */
    uint32_t *merge_off;    /* (M + 1) */
    struct tok_map merges;  /* merge string -> rank (first occurrence) */
    int32_t *special;       /* (S) CONTROL/USER_DEFINED/UNKNOWN ids, longest text first */
    int n_special;
    int32_t bos, eos, unk;
    int add_bos, add_eos, add_space_prefix, ignore_merges, clean_spaces;
    int32_t byte_tok[256];  /* SPM byte fallback per byte value, -1 if none */
};

static size_t tok_len(const struct tok *t, int32_t id)
{
    return t->text_off[id + 1] - t->text_off[id] - 1;
}

/* ---- hashing ---- */

#define TOK_FNV_BASIS 0xcbf29ce484222325ull

static uint64_t tok_fnv(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int tok_map_init(struct tok_map *m, size_t n)
{
    size_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    m->slot = calloc(cap, sizeof *m->slot);
    m->mask = (uint32_t)(cap - 1);
    return m->slot ? 0 : -1;
}

/* The id of the token whose text is s[0..n), or -1. */
static int32_t tok_find(const struct tok *t, const char *s, size_t n)
{
    uint32_t i = (uint32_t)tok_fnv(TOK_FNV_BASIS, s, n) & t->vocab.mask;
    for (uint32_t v; (v = t->vocab.slot[i]) != 0; i = (i + 1) & t->vocab.mask) {
        int32_t id = (int32_t)(v - 1);
        if (tok_len(t, id) == n && memcmp(t->text + t->text_off[id], s, n) == 0)
            return id;
    }
    return -1;
}

/* Inserts id (text already in t->text); returns the id already holding that
 * text, or -1 when it was new. */
static int32_t tok_insert(struct tok *t, int32_t id)
{
    const char *s = t->text + t->text_off[id];
    size_t n = tok_len(t, id);
    uint32_t i = (uint32_t)tok_fnv(TOK_FNV_BASIS, s, n) & t->vocab.mask;
    for (uint32_t v; (v = t->vocab.slot[i]) != 0; i = (i + 1) & t->vocab.mask) {
        int32_t other = (int32_t)(v - 1);
        if (tok_len(t, other) == n && memcmp(t->text + t->text_off[other], s, n) == 0)
            return other;
    }
    t->vocab.slot[i] = (uint32_t)id + 1;
    return -1;
}

/* Rank of the merge "l r", or -1. The key is the stored merge string: the
 * reference splits it at the first space after position 0, and byte-level
 * symbols never contain a space, so "l r" matches exactly that pair. */
static int tok_rank(const struct tok *t, const char *l, size_t nl, const char *r, size_t nr)
{
    uint64_t h = tok_fnv(tok_fnv(tok_fnv(TOK_FNV_BASIS, l, nl), " ", 1), r, nr);
    uint32_t i = (uint32_t)h & t->merges.mask;
    for (uint32_t v; (v = t->merges.slot[i]) != 0; i = (i + 1) & t->merges.mask) {
        const char *m = t->merge + t->merge_off[v - 1];
        size_t n = t->merge_off[v] - t->merge_off[v - 1] - 1;
        if (n == nl + 1 + nr && memcmp(m, l, nl) == 0 && m[nl] == ' ' && memcmp(m + nl + 1, r, nr) == 0)
            return (int)(v - 1);
    }
    return -1;
}

/* ==== loading ==== */

/* Pre-tokenizer names and their regex lists and flags, as the reference
 * maps them (tokenizer.ggml.pre). */
static const struct tok_pre_name {
    const char *name;
    unsigned char rx[TOK_MAX_RX];
    unsigned char ignore_merges, add_bos, clean_spaces;
} tok_pre_names[] = {
#define DEFAULT_RX { RX_DEFAULT_PUNCT, RX_GPT2, RX_NUMBERS, RX_TRIPLES }
#define STARCODER_RX { RX_DIGIT, RX_GPT2 }
    { "default", DEFAULT_RX, 0, 0, 1 },
    { "llama3", { RX_LLAMA3 }, 1, 1, 1 },
    { "llama-v3", { RX_LLAMA3 }, 1, 1, 1 },
    { "llama-bpe", { RX_LLAMA3 }, 1, 1, 1 },
    { "falcon3", { RX_LLAMA3 }, 1, 1, 1 },
    { "falcon-h1", { RX_LLAMA3 }, 1, 1, 1 },
    { "pixtral", { RX_LLAMA3 }, 1, 1, 1 },
    { "midm-2.0", { RX_LLAMA3 }, 1, 1, 1 },
    { "lfm2", { RX_LLAMA3 }, 1, 1, 1 },
    { "dbrx", { RX_LLAMA3 }, 0, 0, 1 },
    { "smaug-bpe", { RX_LLAMA3 }, 0, 0, 1 },
    { "qwen2", { RX_QWEN2 }, 0, 0, 0 },
    { "deepseek-r1-qwen", { RX_QWEN2 }, 0, 0, 0 },
    { "megrez", { RX_QWEN2 }, 0, 0, 1 },
    { "stablelm2", { RX_QWEN2 }, 0, 0, 1 },
    { "hunyuan", { RX_QWEN2 }, 0, 0, 0 },
    { "qwen35", { RX_QWEN35 }, 0, 0, 0 },
    { "gpt-2", { RX_GPT2 }, 0, 0, 1 },
    { "phi-2", { RX_GPT2 }, 0, 0, 1 },
    { "mpt", { RX_GPT2 }, 0, 0, 1 },
    { "olmo", { RX_GPT2 }, 0, 0, 1 },
    { "jais", { RX_GPT2 }, 0, 0, 1 },
    { "exaone4", { RX_GPT2 }, 0, 0, 1 },
    { "falcon", { RX_FALCON_PUNCT, RX_GPT2, RX_TRIPLES }, 0, 0, 1 },
    { "starcoder", STARCODER_RX, 0, 0, 1 },
    { "refact", STARCODER_RX, 0, 0, 1 },
    { "codeshell", STARCODER_RX, 0, 0, 1 },
    { "exaone", STARCODER_RX, 0, 0, 1 },
    { "minerva-7b", STARCODER_RX, 0, 0, 1 },
    { "command-r", STARCODER_RX, 0, 0, 0 },
    { "smollm", STARCODER_RX, 0, 0, 0 },
    { "deepseek-coder", { RX_CRLF, RX_SP_LETTERS, RX_SP_PUNCT, RX_CJK, RX_DIGIT }, 0, 0, 0 },
    { "deepseek-llm", { RX_CRLF, RX_DSL_LETTERS, RX_DSL_PUNCT, RX_TRAILING_SPACE, RX_CJK, RX_NUMBERS }, 0, 0, 0 },
#undef DEFAULT_RX
#undef STARCODER_RX
};

/* Token texts the reference treats as end of generation (and forces to CONTROL). */
static const char *const tok_eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
    "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
    "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
    "<turn|>", "<|tool_response>", "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
    "[e~[", NULL
};

/* Auto-detected roles when the metadata lacks their ids; NULL-separated
 * groups in the order eot, eom, fim_pre, fim_suf, fim_mid, fim_pad, fim_rep,
 * fim_sep (a role's first match, lowest id, is forced to CONTROL). */
enum { ROLE_EOT, ROLE_EOM, ROLE_FIM_PRE, ROLE_FIM_SUF, ROLE_FIM_MID, ROLE_FIM_PAD,
       ROLE_FIM_REP, ROLE_FIM_SEP, ROLE_N };
static const char *const tok_role_key[ROLE_N] = {
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id",
};
static const char *const tok_role_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
    "<end_of_utterance>", NULL,
    "<|eom_id|>", NULL,
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "begin\xEF\xBD\x9C>",
    "<PRE>", "\xE2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>", NULL,
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "hole\xEF\xBD\x9C>",
    "<SUF>", "\xE2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>", NULL,
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "end\xEF\xBD\x9C>",
    "<MID>", "\xE2\x96\x81<MID>", "<|code_middle|>", "<|middle|>", NULL,
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL,
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", NULL,
    "<|file_sep|>", NULL,
};

/* The lowest id whose text is in list (NULL-terminated), or -1: the first
 * match of a scan in id order. */
static int32_t tok_find_first(const struct tok *t, const char *const *list)
{
    int32_t best = -1;
    for (; *list; list++) {
        int32_t id = tok_find(t, *list, strlen(*list));
        if (id >= 0 && (best < 0 || id < best))
            best = id;
    }
    return best;
}

/* An id from metadata: kept in *id when present and inside the vocabulary. */
static void tok_key_id(const struct gguf *g, const char *key, int n_vocab, int32_t *id)
{
    int64_t v;
    if (gguf_get_int(g, key, &v) == 0 && v >= 0 && v < n_vocab)
        *id = (int32_t)v;
}

static void tok_key_flag(const struct gguf *g, const char *key, int *flag)
{
    int64_t v;
    if (gguf_get_int(g, key, &v) == 0)
        *flag = v != 0;
}

/* Special tokens are tried longest text first; ties by id, so the order is fixed. */
struct tok_special_key {
    size_t len;
    int32_t id;
};

static int tok_cmp_special(const void *a, const void *b)
{
    const struct tok_special_key *x = a, *y = b;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int tok_sort_special(struct tok *t)
{
    struct tok_special_key *k = malloc((size_t)(t->n_special ? t->n_special : 1) * sizeof *k);
    if (!k)
        return -1;
    for (int i = 0; i < t->n_special; i++)
        k[i] = (struct tok_special_key){ tok_len(t, t->special[i]), t->special[i] };
    qsort(k, (size_t)t->n_special, sizeof *k, tok_cmp_special);
    for (int i = 0; i < t->n_special; i++)
        t->special[i] = k[i].id;
    free(k);
    return 0;
}

/* Copies the token strings, renaming empty ones as the reference does. */
static int tok_load_texts(struct tok *t, const struct gguf_kv *kv, char *err, size_t errlen)
{
    int n = t->n_vocab;
    struct gguf_str *s = malloc((size_t)n * sizeof *s);
    t->text_off = malloc(((size_t)n + 1) * sizeof *t->text_off);
    if (!s || !t->text_off) {
        free(s);
        return strata_errf(err, errlen, "tokenizer: out of memory for %d tokens", n);
    }
    gguf_arr_strs(kv, s);
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (s[i].len ? s[i].len : 24) + 1;
    if (total > UINT32_MAX) {
        free(s);
        return strata_errf(err, errlen, "tokenizer.ggml.tokens: %zu bytes is too large", total);
    }
    t->text = malloc(total);
    if (!t->text) {
        free(s);
        return strata_errf(err, errlen, "tokenizer: out of memory for token texts");
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        t->text_off[i] = (uint32_t)off;
        if (s[i].len)
            memcpy(t->text + off, s[i].ptr, s[i].len), off += s[i].len;
        else
            off += (size_t)snprintf(t->text + off, 24, "[EMPTY_%d]", i);
        t->text[off++] = 0;
    }
    t->text_off[n] = (uint32_t)off;
    free(s);

    if (tok_map_init(&t->vocab, (size_t)n) != 0)
        return strata_errf(err, errlen, "tokenizer: out of memory for the vocabulary map");
    for (int i = 0; i < n; i++) {
        int32_t other = tok_insert(t, i);
        if (other >= 0)
            return strata_errf(err, errlen, "tokenizer: duplicate token '%s' has ids %d and %d",
                            t->text + t->text_off[i], other, i);
    }
    return 0;
}

static int tok_load_merges(struct tok *t, const struct gguf_kv *kv, char *err, size_t errlen)
{
    if (kv->n > INT32_MAX - 1)
        return strata_errf(err, errlen, "tokenizer.ggml.merges: %llu entries is too many",
                        (unsigned long long)kv->n);
    int n = (int)kv->n;
    struct gguf_str *s = malloc((size_t)(n ? n : 1) * sizeof *s);
    t->merge_off = malloc(((size_t)n + 1) * sizeof *t->merge_off);
    if (!s || !t->merge_off) {
        free(s);
        return strata_errf(err, errlen, "tokenizer: out of memory for %d merges", n);
    }
    gguf_arr_strs(kv, s);
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += s[i].len + 1;
    if (total > UINT32_MAX) {
        free(s);
        return strata_errf(err, errlen, "tokenizer.ggml.merges: %zu bytes is too large", total);
    }
    t->merge = malloc(total ? total : 1);
    if (!t->merge || tok_map_init(&t->merges, (size_t)n) != 0) {
        free(s);
        return strata_errf(err, errlen, "tokenizer: out of memory for the merges");
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        t->merge_off[i] = (uint32_t)off;
        memcpy(t->merge + off, s[i].ptr, s[i].len);
        off += s[i].len;
        t->merge[off++] = 0;
    }
    t->merge_off[n] = (uint32_t)off;
    t->n_merges = n;
    free(s);

    for (int i = 0; i < n; i++) {
        const char *m = t->merge + t->merge_off[i];
        size_t len = t->merge_off[i + 1] - t->merge_off[i] - 1;
        uint32_t h = (uint32_t)tok_fnv(TOK_FNV_BASIS, m, len) & t->merges.mask;
        int dup = 0;
        for (uint32_t v; (v = t->merges.slot[h]) != 0; h = (h + 1) & t->merges.mask) {
            size_t l2 = t->merge_off[v] - t->merge_off[v - 1] - 1;
            if (l2 == len && memcmp(t->merge + t->merge_off[v - 1], m, len) == 0) {
                dup = 1; /* the reference keeps the first rank */
                break;
            }
        }
        if (!dup)
            t->merges.slot[h] = (uint32_t)i + 1;
    }
    return 0;
}

/* Roles, EOG set and forced attributes, in the reference's order. */
static void tok_mark_special(struct tok *t, const struct gguf *g)
{
    int n = t->n_vocab;
    int32_t role[ROLE_N];
    for (int r = 0; r < ROLE_N; r++) {
        role[r] = -1;
        tok_key_id(g, tok_role_key[r], n, &role[r]);
    }
    /* deprecated spellings of the FIM ids */
    if (role[ROLE_FIM_PRE] < 0)
        tok_key_id(g, "tokenizer.ggml.prefix_token_id", n, &role[ROLE_FIM_PRE]);
    if (role[ROLE_FIM_SUF] < 0)
        tok_key_id(g, "tokenizer.ggml.suffix_token_id", n, &role[ROLE_FIM_SUF]);
    if (role[ROLE_FIM_MID] < 0)
        tok_key_id(g, "tokenizer.ggml.middle_token_id", n, &role[ROLE_FIM_MID]);

    const char *const *group = tok_role_texts;
    for (int r = 0; r < ROLE_N; r++) {
        const char *const *list = group;
        while (*group)
            group++;
        group++;
        if (role[r] >= 0)
            continue;
        role[r] = tok_find_first(t, list);
        if (role[r] >= 0)
            t->attr[role[r]] |= TOK_A_CONTROL;
    }

    /* control tokens whose text says "unused" */
    for (int32_t id = 0; id < n; id++)
        if ((t->attr[id] & TOK_A_CONTROL) && strstr(t->text + t->text_off[id], "unused"))
            t->attr[id] |= TOK_A_UNUSED;

    for (int r = ROLE_FIM_PAD; r <= ROLE_FIM_SEP; r++)
        if (role[r] >= 0)
            t->attr[role[r]] |= TOK_A_EOG;
    for (const char *const *s = tok_eog_texts; *s; s++) {
        int32_t id = tok_find(t, *s, strlen(*s));
        if (id >= 0)
            t->attr[id] |= TOK_A_EOG | TOK_A_CONTROL;
    }
    /* gpt-oss: these render as text even without special output */
    static const char *const always_text[] = { "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", NULL };
    for (const char *const *s = always_text; *s; s++) {
        int32_t id = tok_find(t, *s, strlen(*s));
        if (id >= 0)
            t->attr[id] = (uint16_t)(TOK_A_USER | (t->attr[id] & TOK_A_EOG));
    }

    if (t->eos >= 0)
        t->attr[t->eos] |= TOK_A_EOG;
    if (role[ROLE_EOT] >= 0)
        t->attr[role[ROLE_EOT]] |= TOK_A_EOG;
    if (role[ROLE_EOM] >= 0)
        t->attr[role[ROLE_EOM]] |= TOK_A_EOG;

    /* gpt-oss / solar-open: with <|return|> and <|call|> (or <|calls|> and
     * <|flush|>), <|end|> is not an end of generation */
    int has_return = 0, has_call = 0, has_flush = 0, has_tool_response = 0;
    int32_t end_id = -1, s_id = -1;
    for (int32_t id = 0; id < n; id++) {
        if (!(t->attr[id] & TOK_A_EOG))
            continue;
        const char *s = t->text + t->text_off[id];
        has_return |= strcmp(s, "<|return|>") == 0;
        has_call |= strcmp(s, "<|call|>") == 0 || strcmp(s, "<|calls|>") == 0;
        has_flush |= strcmp(s, "<|flush|>") == 0;
        has_tool_response |= strcmp(s, "<|tool_response>") == 0;
        if (strcmp(s, "<|end|>") == 0)
            end_id = id;
        if (strcmp(s, "</s>") == 0)
            s_id = id;
    }
    if (end_id >= 0 && has_call && (has_return || has_flush))
        t->attr[end_id] = TOK_A_USER;
    /* gemma4 / paddleocr: </s> is ordinary text there */
    if (s_id >= 0 && has_tool_response)
        t->attr[s_id] = TOK_A_NORMAL;
}

/* Per-model attributes the GGUF does not carry (phi-3: special tokens
 * swallow the whitespace after them). */
static void tok_model_attrs(struct tok *t, const struct gguf *g)
{
    struct gguf_str name;
    if (gguf_get_str(g, "general.name", &name) != 0)
        return;
    char low[256];
    size_t n = name.len < sizeof low - 1 ? name.len : sizeof low - 1;
    for (size_t i = 0; i < n; i++) {
        char c = name.ptr[i];
        low[i] = c >= 'A' && c <= 'Z' ? (char)(c + 32) : c;
    }
    low[n] = 0;
    if (!strstr(low, "phi-3") && !strstr(low, "phi3"))
        return;
    for (int i = 0; i < t->n_special; i++)
        t->attr[t->special[i]] |= TOK_A_RSTRIP;
    int32_t id = tok_find(t, "</s>", 4);
    if (id >= 0)
        t->attr[id] |= TOK_A_RSTRIP;
    static const char *const keep[] = { "<unk>", "<s>", "<|endoftext|>" };
    for (int i = 0; i < 3; i++)
        if ((id = tok_find(t, keep[i], strlen(keep[i]))) >= 0)
            t->attr[id] &= (uint16_t)~TOK_A_RSTRIP;
}

static int tok_load_inner(struct tok *t, const struct gguf *g, char *err, size_t errlen)
{
    struct gguf_str model;
    if (gguf_get_str(g, "tokenizer.ggml.model", &model) != 0)
        return strata_errf(err, errlen, "tokenizer.ggml.model is missing");
    if (model.len == 5 && memcmp(model.ptr, "llama", 5) == 0)
        t->model = TOK_SPM;
    else if (model.len == 4 && memcmp(model.ptr, "gpt2", 4) == 0)
        t->model = TOK_BPE;
    else
        return strata_errf(err, errlen, "unsupported tokenizer model '%.*s' (llama and gpt2 are)",
                        (int)(model.len < 64 ? model.len : 64), model.ptr);

    if (t->model == TOK_SPM) {
        t->bos = 1, t->eos = 2, t->unk = 0;
        t->add_space_prefix = 1, t->add_bos = 1;
    } else {
        struct gguf_str pre = { 0, "" };
        gguf_get_str(g, "tokenizer.ggml.pre", &pre);
        const struct tok_pre_name *p = NULL;
        if (pre.len == 0)
            p = &tok_pre_names[0]; /* a missing pre-tokenizer means "default" */
        for (size_t i = 0; !p && i < sizeof tok_pre_names / sizeof *tok_pre_names; i++)
            if (strlen(tok_pre_names[i].name) == pre.len && memcmp(tok_pre_names[i].name, pre.ptr, pre.len) == 0)
                p = &tok_pre_names[i];
        if (!p)
            return strata_errf(err, errlen, "unsupported pre-tokenizer '%.*s'",
                            (int)(pre.len < 64 ? pre.len : 64), pre.ptr);
        memcpy(t->rx, p->rx, sizeof t->rx);
        t->ignore_merges = p->ignore_merges;
        t->add_bos = p->add_bos;
        t->clean_spaces = p->clean_spaces;
        t->bos = 11, t->eos = 11, t->unk = -1;  /* the reference's BPE defaults */
    }
    tok_key_flag(g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix);

    const struct gguf_kv *kv = gguf_find(g, "tokenizer.ggml.tokens");
    if (!kv || kv->type != GGUF_ARR || kv->arr_type != GGUF_STR)
        return strata_errf(err, errlen, "tokenizer.ggml.tokens is missing or not a string array");
    if (kv->n == 0 || kv->n > INT32_MAX - 1)
        return strata_errf(err, errlen, "tokenizer.ggml.tokens: bad count %llu", (unsigned long long)kv->n);
    t->n_vocab = (int)kv->n;
    if (tok_load_texts(t, kv, err, errlen) != 0)
        return -1;
    int n = t->n_vocab;

    t->score = calloc((size_t)n, sizeof *t->score);
    t->attr = malloc((size_t)n * sizeof *t->attr);
    if (!t->score || !t->attr)
        return strata_errf(err, errlen, "tokenizer: out of memory");
    const struct gguf_kv *sc = gguf_find(g, "tokenizer.ggml.scores");
    if (sc) {
        if (sc->type != GGUF_ARR || (sc->arr_type != GGUF_F32 && sc->arr_type != GGUF_I32))
            return strata_errf(err, errlen, "tokenizer.ggml.scores: not an f32 or i32 array");
        if (sc->n < (uint64_t)n)
            return strata_errf(err, errlen, "tokenizer.ggml.scores: %llu entries for %d tokens",
                            (unsigned long long)sc->n, n);
        for (int i = 0; i < n; i++)
            t->score[i] = gguf_arr_f32(sc, (uint64_t)i);
    }
    const struct gguf_kv *ty = gguf_find(g, "tokenizer.ggml.token_type");
    if (ty && (ty->type != GGUF_ARR || ty->arr_type != GGUF_I32))
        return strata_errf(err, errlen, "tokenizer.ggml.token_type: not an i32 array");
    if (ty && ty->n < (uint64_t)n)
        return strata_errf(err, errlen, "tokenizer.ggml.token_type: %llu entries for %d tokens",
                        (unsigned long long)ty->n, n);
    static const uint16_t type_attr[7] = { 0, TOK_A_NORMAL, TOK_A_UNKNOWN, TOK_A_CONTROL,
                                           TOK_A_USER, TOK_A_UNUSED, TOK_A_BYTE };
    for (int i = 0; i < n; i++) {
        int64_t v = ty ? gguf_arr_int(ty, (uint64_t)i) : 1;
        t->attr[i] = v >= 0 && v < 7 ? type_attr[v] : 0;
    }

    if (t->model == TOK_BPE) {
        const struct gguf_kv *mk = gguf_find(g, "tokenizer.ggml.merges");
        if (!mk)
            return strata_errf(err, errlen, "tokenizer.ggml.merges is missing");
        if (mk->type != GGUF_ARR || mk->arr_type != GGUF_STR)
            return strata_errf(err, errlen, "tokenizer.ggml.merges: not a string array");
        if (tok_load_merges(t, mk, err, errlen) != 0)
            return -1;
    }

    /* defaults outside the vocabulary are disabled; keys override in range */
    if (t->bos >= n)
        t->bos = -1;
    if (t->eos >= n)
        t->eos = -1;
    if (t->unk >= n)
        t->unk = -1;
    tok_key_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos);
    tok_key_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos);
    tok_key_id(g, "tokenizer.ggml.unknown_token_id", n, &t->unk);
    tok_key_flag(g, "tokenizer.ggml.add_bos_token", &t->add_bos);
    tok_key_flag(g, "tokenizer.ggml.add_eos_token", &t->add_eos);
    if (t->add_bos && t->bos < 0)
        return strata_errf(err, errlen, "tokenizer.ggml.add_bos_token is true, but there is no BOS token");
    if (t->add_eos && t->eos < 0)
        return strata_errf(err, errlen, "tokenizer.ggml.add_eos_token is true, but there is no EOS token");

    tok_mark_special(t, g);

    t->special = malloc((size_t)n * sizeof *t->special);
    if (!t->special)
        return strata_errf(err, errlen, "tokenizer: out of memory");
    for (int32_t id = 0; id < n; id++)
        if (t->attr[id] & (TOK_A_CONTROL | TOK_A_USER | TOK_A_UNKNOWN))
            t->special[t->n_special++] = id;
    if (tok_sort_special(t) != 0)
        return strata_errf(err, errlen, "tokenizer: out of memory");
    tok_model_attrs(t, g);

    for (int b = 0; b < 256; b++) {
        char hex[8];
        snprintf(hex, sizeof hex, "<0x%02X>", b);
        char raw = (char)b;
        int32_t id = tok_find(t, hex, 6);
        t->byte_tok[b] = id >= 0 ? id : tok_find(t, &raw, 1);
    }
    return 0;
}

int tok_load(struct tok **out, const struct gguf *g, char *err, size_t errlen)
{
    *out = NULL;
    struct tok *t = calloc(1, sizeof *t);
    if (!t)
        return strata_errf(err, errlen, "tokenizer: out of memory");
    if (tok_load_inner(t, g, err, errlen) != 0) {
        tok_free(t);
        return -1;
    }
    *out = t;
    return 0;
}

void tok_free(struct tok *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->text_off);
    free(t->score);
    free(t->attr);
    free(t->vocab.slot);
    free(t->merge);
    free(t->merge_off);
    free(t->merges.slot);
    free(t->special);
    free(t);
}

int tok_n_vocab(const struct tok *t) { return t->n_vocab; }
int32_t tok_bos(const struct tok *t) { return t->bos; }
int32_t tok_eos(const struct tok *t) { return t->eos; }
int tok_add_bos(const struct tok *t) { return t->add_bos; }

int tok_is_eog(const struct tok *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && (t->attr[id] & TOK_A_EOG) != 0;
}

const char *tok_text(const struct tok *t, int32_t id)
{
    if (id < 0 || id >= t->n_vocab)
        return NULL;
    return t->text + t->text_off[id];
}

/* ==== encoding: scratch space ==== */

/* A fragment of the input: raw text [off, off + len), or a special token. */
struct tok_frag {
    int32_t id;     /* -1 for raw text */
    size_t off, len;
};

/* One symbol of a word being merged; symbols form a linked list. */
struct tok_sym {
    int32_t prev, next;
    uint32_t off, n;   /* bytes of the word buffer; n = 0 once merged away */
};

/* A candidate merge of two adjacent symbols. The key orders the queue as
 * the reference does: priority (BPE rank; SPM score, higher first) in the
 * high half, then the left symbol's index (leftmost first). */
struct tok_bigram {
    uint64_t key;      /* priority << 32 | left */
    int32_t right;
    uint32_t size;     /* combined length when queued (stale if it differs) */
};

struct tok_ws {
    int32_t *ids;            size_t n_ids, cap_ids;
    struct tok_frag *frag;   size_t n_frag, cap_frag;
    struct tok_frag *frag2;  size_t cap_frag2;
    uint32_t *cp;            size_t cap_cp;   /* code points of one fragment */
    uint16_t *fl;            size_t cap_fl;   /* their classes */
    size_t *piece;           size_t n_piece, cap_piece;   /* pre-tokenizer output, code points */
    size_t *piece2;          size_t n_piece2, cap_piece2;
    char *buf;               size_t cap_buf;  /* one word, byte-encoded, or SPM text */
    struct tok_sym *sym;     size_t cap_sym;
    struct tok_bigram *heap; size_t n_heap, cap_heap;
};

/* Grows *p to hold need elements of esz bytes; returns the (maybe moved)
 * array, or NULL when memory runs out (the old array is then still valid). */
static void *tok_grow(void *p, size_t *cap, size_t need, size_t esz)
{
    if (need <= *cap)
        return p;
    size_t c = *cap ? *cap : 64;
    while (c < need) {
        if (c > SIZE_MAX / 2 / esz)
            return NULL;
        c *= 2;
    }
    void *q = realloc(p, c * esz);
    if (q)
        *cap = c;
    return q;
}

#define TOK_GROW(ptr, cap, need) \
    (((ptr) = tok_grow_keep((ptr), &(cap), (need), sizeof *(ptr))) != NULL)

/* tok_grow that keeps the old array on failure (freed with the workspace). */
static void *tok_grow_keep(void *p, size_t *cap, size_t need, size_t esz)
{
    if (need == 0)
        need = 1;
    void *q = tok_grow(p, cap, need, esz);
    if (!q) {
        free(p);
        *cap = 0;
    }
    return q;
}

static int tok_push_id(struct tok_ws *w, int32_t id)
{
    if (!TOK_GROW(w->ids, w->cap_ids, w->n_ids + 1))
        return -1;
    w->ids[w->n_ids++] = id;
    return 0;
}

static int tok_push_piece(struct tok_ws *w, size_t len)
{
    if (!TOK_GROW(w->piece, w->cap_piece, w->n_piece + 1))
        return -1;
    w->piece[w->n_piece++] = len;
    return 0;
}

static void tok_ws_free(struct tok_ws *w)
{
    free(w->ids);
    free(w->frag);
    free(w->frag2);
    free(w->cp);
    free(w->fl);
    free(w->piece);
    free(w->piece2);
    free(w->buf);
    free(w->sym);
    free(w->heap);
}

/* ---- the merge queue (a binary min-heap on key) ---- */

static int tok_bigram_less(const struct tok_bigram *a, const struct tok_bigram *b)
{
    return a->key < b->key;
}

/* Maps a score to a 32-bit priority where a higher score sorts first
 * (IEEE order via the sign-flip trick; -0 counts as +0, as == does). */
static uint32_t tok_score_priority(float score)
{
    if (score == 0)
        score = 0;
    uint32_t u;
    memcpy(&u, &score, sizeof u);
    u = (u & 0x80000000u) ? ~u : u | 0x80000000u;
    return ~u;
}

static int tok_heap_push(struct tok_ws *w, struct tok_bigram b)
{
    if (!TOK_GROW(w->heap, w->cap_heap, w->n_heap + 1))
        return -1;
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!tok_bigram_less(&b, &w->heap[p]))
            break;
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = b;
    return 0;
}

static struct tok_bigram tok_heap_pop(struct tok_ws *w)
{
    struct tok_bigram top = w->heap[0], last = w->heap[--w->n_heap];
    size_t i = 0, n = w->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && tok_bigram_less(&w->heap[c + 1], &w->heap[c]))
            c++;
        if (!tok_bigram_less(&w->heap[c], &last))
            break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n)
        w->heap[i] = last;
    return top;
}

/* Splits w->buf[0..n) into symbols of one UTF-8 character each (by lead byte). */
static int tok_symbols(struct tok_ws *w, size_t n)
{
    if (n > INT32_MAX)
        return -1;
    if (!TOK_GROW(w->sym, w->cap_sym, n + 1))
        return -1;
    int32_t k = 0;
    for (size_t off = 0; off < n; k++) {
        size_t len = tok_u8len((unsigned char)w->buf[off]);
        if (len > n - off)
            len = n - off;
        w->sym[k].off = (uint32_t)off;
        w->sym[k].n = (uint32_t)len;
        w->sym[k].prev = k - 1;
        off += len;
        w->sym[k].next = off == n ? -1 : k + 1;
    }
    return (int)k;
}

/* Queues the merge of symbols l and r if the vocabulary allows it. */
static int tok_try_pair(const struct tok *t, struct tok_ws *w, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return 0;
    const struct tok_sym *a = &w->sym[l], *b = &w->sym[r];
    uint32_t priority;
    if (t->model == TOK_SPM) {
        int32_t id = tok_find(t, w->buf + a->off, a->n + b->n);
        if (id < 0)
            return 0;
        priority = tok_score_priority(t->score[id]);
    } else {
        int rank = tok_rank(t, w->buf + a->off, a->n, w->buf + b->off, b->n);
        if (rank < 0)
            return 0;
        priority = (uint32_t)rank;
    }
    struct tok_bigram bg = { (uint64_t)priority << 32 | (uint32_t)l, r, a->n + b->n };
    return tok_heap_push(w, bg);
}

/* Merges the symbols of w->buf until no queued pair applies. The queue
 * holds stale pairs too; a pair is live only while both symbols exist with
 * the lengths it was queued with (symbols only grow to the right). */
static int tok_merge(const struct tok *t, struct tok_ws *w, int n_sym)
{
    w->n_heap = 0;
    for (int32_t i = 1; i < n_sym; i++)
        if (tok_try_pair(t, w, i - 1, i) != 0)
            return -1;
    while (w->n_heap) {
        struct tok_bigram bg = tok_heap_pop(w);
        int32_t left = (int32_t)(uint32_t)bg.key;
        struct tok_sym *a = &w->sym[left], *b = &w->sym[bg.right];
        if (a->n == 0 || b->n == 0 || a->n + b->n != bg.size)
            continue;
        a->n += b->n;
        b->n = 0;
        a->next = b->next;
        if (b->next >= 0)
            w->sym[b->next].prev = left;
        if (tok_try_pair(t, w, a->prev, left) != 0 || tok_try_pair(t, w, left, a->next) != 0)
            return -1;
    }
    return 0;
}

/* ==== SPM ==== */

/* Tokenises w->buf[0..n) (spaces already escaped as U+2581). */
static int tok_spm(const struct tok *t, struct tok_ws *w, size_t n)
{
    if (n == 0)
        return 0;
    int n_sym = tok_symbols(w, n);
    if (n_sym < 0 || tok_merge(t, w, n_sym) != 0)
        return -1;
    for (int32_t i = 0; i != -1; i = w->sym[i].next) {
        const struct tok_sym *s = &w->sym[i];
        int32_t id = tok_find(t, w->buf + s->off, s->n);
        if (id >= 0) {
            if (tok_push_id(w, id) != 0)
                return -1;
            continue;
        }
        /* only single characters can miss the vocabulary: merged symbols
         * were tokens when they were formed, so fall back to bytes */
        for (uint32_t j = 0; j < s->n; j++) {
            int32_t b = t->byte_tok[(unsigned char)w->buf[s->off + j]];
            if (b < 0)
                b = t->unk;
            if (b >= 0 && tok_push_id(w, b) != 0)
                return -1;
        }
    }
    return 0;
}

static int tok_spm_fragment(const struct tok *t, struct tok_ws *w, const char *s, size_t len, int prefix)
{
    if (!TOK_GROW(w->buf, w->cap_buf, 3 * (len + 1)))
        return -1;
    size_t n = 0;
    if (prefix)
        memcpy(w->buf, "\xE2\x96\x81", 3), n = 3;
    for (size_t i = 0; i < len; i++) {
        if (s[i] == ' ')
            memcpy(w->buf + n, "\xE2\x96\x81", 3), n += 3;
        else
            w->buf[n++] = s[i];
    }
    return tok_spm(t, w, n);
}

/* ==== pre-tokenizers ==== */

/* Emits pieces up to a position; pieces are lengths in code points. */
struct tok_cut {
    struct tok_ws *w;
    size_t prev;
    int err;
};

static size_t tok_cut_at(struct tok_cut *c, size_t end)
{
    size_t len = end - c->prev;
    if (len > 0 && tok_push_piece(c->w, len) != 0)
        c->err = 1;
    c->prev = end;
    return len;
}

#define TOK_NONE 0xFFFFFFFFu

/* Code point / classes at i, or TOK_NONE / 0 past the end of the piece. */
static uint32_t tok_cp_at(const struct tok_ws *w, size_t i, size_t end)
{
    return i < end ? w->cp[i] : TOK_NONE;
}

static unsigned tok_fl_at(const struct tok_ws *w, size_t i, size_t end)
{
    return i < end ? w->fl[i] : 0;
}

static uint32_t tok_lower_ascii(uint32_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* The llama3 / qwen2 / qwen35 regex over cp[ini..end):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?L+ | \p{N}{1,max_digits}
 *   |  ?[^\s L \p{N}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+
 * where L is \p{L}, or [\p{L}\p{M}] when marks is set. */
static void tok_split_llama3(struct tok_ws *w, size_t ini, size_t end, int max_digits, int marks)
{
    const uint32_t *cp = w->cp;
    const uint16_t *fl = w->fl;
    const unsigned letter = TOK_UC_LETTER | (marks ? TOK_UC_MARK : 0);
    struct tok_cut c = { w, ini, 0 };
    for (size_t pos = ini; pos < end && !c.err;) {
        uint32_t ch = cp[pos];
        unsigned f = fl[pos];

        if (ch == '\'' && pos + 1 < end) {
            uint32_t n1 = tok_lower_ascii(cp[pos + 1]);
            if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
                pos += tok_cut_at(&c, pos + 2);
                continue;
            }
            if (pos + 2 < end) {
                uint32_t n2 = tok_lower_ascii(cp[pos + 2]);
                if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
                    pos += tok_cut_at(&c, pos + 3);
                    continue;
                }
            }
        }

        int lead_ok = !(ch == '\r' || ch == '\n' || (f & TOK_UC_NUMBER));
        if (lead_ok && ((f & letter) || (tok_fl_at(w, pos + 1, end) & letter))) {
            pos++;
            while (tok_fl_at(w, pos, end) & letter)
                pos++;
            tok_cut_at(&c, pos);
            continue;
        }

        if (f & TOK_UC_NUMBER) {
            size_t start = pos;
            while (tok_fl_at(w, pos, end) & TOK_UC_NUMBER) {
                if (++pos - start >= (size_t)max_digits) {
                    tok_cut_at(&c, pos);
                    start = pos;
                }
            }
            tok_cut_at(&c, pos);
            continue;
        }

        const unsigned not_punct = TOK_UC_SPACE | letter | TOK_UC_NUMBER;
        unsigned f2 = ch == ' ' ? tok_fl_at(w, pos + 1, end) : f;
        if (!(f2 & not_punct)) {
            pos += ch == ' ';
            while (!(f2 & not_punct) && f2)
                f2 = tok_fl_at(w, ++pos, end);
            while (tok_cp_at(w, pos, end) == '\r' || tok_cp_at(w, pos, end) == '\n')
                pos++;
            tok_cut_at(&c, pos);
            continue;
        }

        size_t n_ws = 0, last_rn = 0;
        while (tok_fl_at(w, pos + n_ws, end) & TOK_UC_SPACE) {
            uint32_t c2 = cp[pos + n_ws];
            if (c2 == '\r' || c2 == '\n')
                last_rn = pos + n_ws + 1;
            n_ws++;
        }
        if (last_rn > 0) {
            pos = last_rn;
            tok_cut_at(&c, pos);
        } else if (n_ws > 1 && pos + n_ws < end) {
            pos += n_ws - 1;      /* \s+(?!\S) leaves the last space to the next word */
            tok_cut_at(&c, pos);
        } else if (n_ws > 0) {
            pos += n_ws;
            tok_cut_at(&c, pos);
        } else {
            tok_cut_at(&c, ++pos);
        }
    }
    if (c.err)
        w->n_piece = SIZE_MAX;
}

/* The GPT-2 regex over cp[ini..end) (with the implied trailing \s+):
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static void tok_split_gpt2(struct tok_ws *w, size_t ini, size_t end)
{
    const uint32_t *cp = w->cp;
    const uint16_t *fl = w->fl;
    struct tok_cut c = { w, ini, 0 };
    for (size_t pos = ini; pos < end && !c.err;) {
        uint32_t ch = cp[pos];
        unsigned f = fl[pos];

        if (ch == '\'' && pos + 1 < end) {
            uint32_t n1 = cp[pos + 1];
            if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
                pos += tok_cut_at(&c, pos + 2);
                continue;
            }
            if (pos + 2 < end) {
                uint32_t n2 = cp[pos + 2];
                if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
                    pos += tok_cut_at(&c, pos + 3);
                    continue;
                }
            }
        }

        unsigned f2 = ch == ' ' ? tok_fl_at(w, pos + 1, end) : f;
        if (f2 & (TOK_UC_LETTER | TOK_UC_NUMBER)) {
            unsigned cls = f2 & TOK_UC_LETTER ? TOK_UC_LETTER : TOK_UC_NUMBER;
            pos += ch == ' ';
            while (f2 & cls)
                f2 = tok_fl_at(w, ++pos, end);
            tok_cut_at(&c, pos);
            continue;
        }
        const unsigned not_punct = TOK_UC_SPACE | TOK_UC_LETTER | TOK_UC_NUMBER;
        if (!(f2 & not_punct) && f2) {
            pos += ch == ' ';
            while (!(f2 & not_punct) && f2)
                f2 = tok_fl_at(w, ++pos, end);
            tok_cut_at(&c, pos);
            continue;
        }

        size_t n_ws = 0;
        while (tok_fl_at(w, pos + n_ws, end) & TOK_UC_SPACE)
            n_ws++;
        if (n_ws > 1 && pos + n_ws < end) {
            pos += n_ws - 1;
            tok_cut_at(&c, pos);
        } else if (n_ws > 0) {
            pos += n_ws;
            tok_cut_at(&c, pos);
        } else {
            tok_cut_at(&c, ++pos);
        }
    }
    if (c.err)
        w->n_piece = SIZE_MAX;
}

/* ---- single-class regexes ----
 * The reference runs its other regexes through std::regex on a copy of the
 * text where every non-ASCII code point is collapsed to one byte per class
 * (whitespace to \v); these predicates give the same membership. */

static int tok_in_ranges(uint32_t cp, const uint32_t (*r)[2], size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (cp >= r[i][0] && cp <= r[i][1])
            return 1;
    return 0;
}

static int tok_c_space(uint32_t cp, unsigned f) { (void)cp; return (f & TOK_UC_SPACE) != 0; }
static int tok_c_letter(uint32_t cp, unsigned f) { (void)cp; return (f & TOK_UC_LETTER) != 0; }
static int tok_c_punct(uint32_t cp, unsigned f) { (void)cp; return (f & TOK_UC_PUNCT) != 0; }
static int tok_c_number(uint32_t cp, unsigned f) { (void)cp; return (f & TOK_UC_NUMBER) != 0; }
static int tok_c_crlf(uint32_t cp, unsigned f) { (void)f; return cp == '\r' || cp == '\n'; }

/* [\p{P}\$\+<=>\^~\|]+ (default) and the same with ` (falcon) */
static int tok_c_default_punct(uint32_t cp, unsigned f)
{
    return (f & TOK_UC_PUNCT) || (cp && cp < 128 && strchr("$+<=>^~|", (int)cp));
}

static int tok_c_falcon_punct(uint32_t cp, unsigned f)
{
    return tok_c_default_punct(cp, f) || cp == '`';
}

/* Explicit ranges apply to the text with non-ASCII whitespace replaced by
 * \v, so such code points never match them. */
static int tok_c_cjk(uint32_t cp, unsigned f)
{
    static const uint32_t r[][2] = { { 0x4E00, 0x9FA5 }, { 0x0800, 0x4E00 }, { 0xAC00, 0xD7FF } };
    return !(cp >= 0x80 && (f & TOK_UC_SPACE)) && tok_in_ranges(cp, r, sizeof r / sizeof *r);
}

/* deepseek-llm's explicit letter class */
static int tok_c_dsl_letter(uint32_t cp, unsigned f)
{
    static const uint32_t r[][2] = {
        {0x41, 0x5A}, {0x61, 0x7A}, {0xB5, 0xB5}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x1BA},
        {0x1BC, 0x1BF}, {0x1C4, 0x293}, {0x295, 0x2AF}, {0x370, 0x373}, {0x376, 0x377},
        {0x37B, 0x37D}, {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C},
        {0x38E, 0x3A1}, {0x3A3, 0x3F5}, {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556},
        {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD}, {0x1C90, 0x1CBA}, {0x1CBD, 0x1CBF},
        {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A}, {0x1E00, 0x1F15}, {0x1F18, 0x1F1D},
        {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B},
        {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE},
        {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC},
        {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC}, {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113},
        {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126}, {0x2128, 0x2128},
        {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139}, {0x213C, 0x213F}, {0x2145, 0x2149},
        {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B}, {0x2C7E, 0x2CE4}, {0x2CEB, 0x2CEE},
        {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F}, {0xA771, 0xA787},
        {0xA78B, 0xA78E}, {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17}, {0xFF21, 0xFF3A},
        {0xFF41, 0xFF5A}, {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
        {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
    };
    (void)f;
    return tok_in_ranges(cp, r, sizeof r / sizeof *r);
}

/* deepseek-llm's punctuation class [!-/:-~！-／：-～‘-‟　-。] */
static int tok_c_dsl_punct(uint32_t cp, unsigned f)
{
    static const uint32_t r[][2] = { { 0x21, 0x2F }, { 0x3A, 0x7E }, { 0xFF01, 0xFF0F },
                                     { 0xFF1A, 0xFF5E }, { 0x2018, 0x201F }, { 0x3000, 0x3002 } };
    return !(cp >= 0x80 && (f & TOK_UC_SPACE)) && tok_in_ranges(cp, r, sizeof r / sizeof *r);
}

/* A regex "P?C+" or "P?C" (P an optional one-character class, C a class):
 * its leftmost matches and the spans between them become pieces. */
static void tok_split_class(struct tok_ws *w, size_t ini, size_t end, int (*prefix)(uint32_t, unsigned),
                            int (*cls)(uint32_t, unsigned), int run)
{
    const uint32_t *cp = w->cp;
    const uint16_t *fl = w->fl;
    struct tok_cut c = { w, ini, 0 };
    for (size_t pos = ini; pos < end;) {
        size_t q = pos;
        if (prefix && prefix(cp[q], fl[q]) && q + 1 < end && cls(cp[q + 1], fl[q + 1]))
            q++;
        if (!cls(cp[q], fl[q])) {
            pos++;
            continue;
        }
        q++;
        while (run && q < end && cls(cp[q], fl[q]))
            q++;
        tok_cut_at(&c, pos);
        tok_cut_at(&c, q);
        pos = q;
    }
    tok_cut_at(&c, end);
    if (c.err)
        w->n_piece = SIZE_MAX;
}

/* [0-9][0-9][0-9]: leftmost triples of ASCII digits. */
static void tok_split_triples(struct tok_ws *w, size_t ini, size_t end)
{
    struct tok_cut c = { w, ini, 0 };
    const uint32_t *cp = w->cp;
    for (size_t pos = ini; pos < end;) {
        if (pos + 3 <= end && cp[pos] - '0' < 10 && cp[pos + 1] - '0' < 10 && cp[pos + 2] - '0' < 10) {
            tok_cut_at(&c, pos);
            tok_cut_at(&c, pos + 3);
            pos += 3;
        } else {
            pos++;
        }
    }
    tok_cut_at(&c, end);
    if (c.err)
        w->n_piece = SIZE_MAX;
}

/* \s+$: the trailing whitespace of the piece. */
static void tok_split_trailing_space(struct tok_ws *w, size_t ini, size_t end)
{
    struct tok_cut c = { w, ini, 0 };
    size_t s = end;
    while (s > ini && (w->fl[s - 1] & TOK_UC_SPACE))
        s--;
    tok_cut_at(&c, s);
    tok_cut_at(&c, end);
    if (c.err)
        w->n_piece = SIZE_MAX;
}

/* Runs one regex of the pre-tokenizer's list over every current piece. */
static int tok_pass(struct tok_ws *w, int rx)
{
    size_t *old = w->piece, n_old = w->n_piece;
    size_t cap_old = w->cap_piece;
    w->piece = w->piece2;
    w->cap_piece = w->cap_piece2;
    w->n_piece = 0;
    w->piece2 = old;
    w->cap_piece2 = cap_old;
    size_t ini = 0;
    for (size_t i = 0; i < n_old && w->n_piece != SIZE_MAX; i++) {
        size_t end = ini + old[i];
        switch (rx) {
        case RX_LLAMA3: tok_split_llama3(w, ini, end, 3, 0); break;
        case RX_QWEN2: tok_split_llama3(w, ini, end, 1, 0); break;
        case RX_QWEN35: tok_split_llama3(w, ini, end, 1, 1); break;
        case RX_GPT2: tok_split_gpt2(w, ini, end); break;
        case RX_DEFAULT_PUNCT: tok_split_class(w, ini, end, NULL, tok_c_default_punct, 1); break;
        case RX_FALCON_PUNCT: tok_split_class(w, ini, end, NULL, tok_c_falcon_punct, 1); break;
        case RX_NUMBERS: tok_split_class(w, ini, end, NULL, tok_c_number, 1); break;
        case RX_DIGIT: tok_split_class(w, ini, end, NULL, tok_c_number, 0); break;
        case RX_TRIPLES: tok_split_triples(w, ini, end); break;
        case RX_CRLF: tok_split_class(w, ini, end, NULL, tok_c_crlf, 0); break;
        case RX_SP_LETTERS: tok_split_class(w, ini, end, tok_c_space, tok_c_letter, 1); break;
        case RX_SP_PUNCT: tok_split_class(w, ini, end, tok_c_space, tok_c_punct, 1); break;
        case RX_CJK: tok_split_class(w, ini, end, NULL, tok_c_cjk, 1); break;
        case RX_DSL_LETTERS: tok_split_class(w, ini, end, tok_c_space, tok_c_dsl_letter, 1); break;
        case RX_DSL_PUNCT: tok_split_class(w, ini, end, tok_c_space, tok_c_dsl_punct, 1); break;
        case RX_TRAILING_SPACE: tok_split_trailing_space(w, ini, end); break;
        }
        ini = end;
    }
    return w->n_piece == SIZE_MAX ? -1 : 0;
}

/* ==== BPE ==== */

/* Merges one byte-encoded word w->buf[0..n) and appends its ids. */
static int tok_bpe_word(const struct tok *t, struct tok_ws *w, size_t n)
{
    int n_sym;
    if (t->ignore_merges && tok_find(t, w->buf, n) >= 0) {
        if (!TOK_GROW(w->sym, w->cap_sym, 1))
            return -1;
        w->sym[0] = (struct tok_sym){ -1, -1, 0, (uint32_t)n };
        n_sym = 1;
    } else {
        n_sym = tok_symbols(w, n);
        if (n_sym < 0)
            return -1;
    }
    if (tok_merge(t, w, n_sym) != 0)
        return -1;
    for (int32_t i = 0; i != -1; i = w->sym[i].next) {
        const struct tok_sym *s = &w->sym[i];
        int32_t id = tok_find(t, w->buf + s->off, s->n);
        if (id >= 0) {
            if (tok_push_id(w, id) != 0)
                return -1;
            continue;
        }
        /* the reference then tries each byte of the symbol as a token */
        for (uint32_t j = 0; j < s->n; j++) {
            int32_t b = tok_find(t, w->buf + s->off + j, 1);
            if (b >= 0 && tok_push_id(w, b) != 0)
                return -1;
        }
    }
    return 0;
}

static int tok_bpe_fragment(const struct tok *t, struct tok_ws *w, const char *s, size_t len)
{
    if (!TOK_GROW(w->cp, w->cap_cp, len) || !TOK_GROW(w->fl, w->cap_fl, len))
        return -1;
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        w->cp[n] = tok_u8dec((const unsigned char *)s, len, &i);
        w->fl[n] = (uint16_t)tok_uc(w->cp[n]);
        n++;
    }
    w->n_piece = 0;
    if (tok_push_piece(w, n) != 0)
        return -1;
    for (int p = 0; p < TOK_MAX_RX && t->rx[p] != RX_END; p++)
        if (tok_pass(w, t->rx[p]) != 0)
            return -1;

    size_t ini = 0;
    for (size_t i = 0; i < w->n_piece; i++) {
        size_t end = ini + w->piece[i];
        /* each code point becomes up to 4 bytes, each byte up to 2 */
        if (!TOK_GROW(w->buf, w->cap_buf, 8 * (end - ini) + 1))
            return -1;
        size_t nb = 0;
        for (size_t k = ini; k < end; k++) {
            char u[4];
            size_t m = tok_u8enc(w->cp[k], u);
            for (size_t j = 0; j < m; j++)
                nb += tok_u8enc(tok_byte_cp((unsigned char)u[j]), w->buf + nb);
        }
        if (tok_bpe_word(t, w, nb) != 0)
            return -1;
        ini = end;
    }
    return 0;
}

/* ==== special tokens ==== */

/* Cuts every occurrence of the special tokens (longest first) out of the raw
 * fragments. CONTROL and UNKNOWN tokens count only with parse_special;
 * USER_DEFINED ones always do. LSTRIP/RSTRIP swallow adjacent whitespace. */
static int tok_partition(const struct tok *t, struct tok_ws *w, const char *text, size_t len, int parse_special)
{
    w->n_frag = 0;
    if (len == 0)
        return 0;
    if (!TOK_GROW(w->frag, w->cap_frag, 1))
        return -1;
    w->frag[0] = (struct tok_frag){ -1, 0, len };
    w->n_frag = 1;
    for (int k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        uint16_t a = t->attr[id];
        if (!parse_special && (a & (TOK_A_CONTROL | TOK_A_UNKNOWN)))
            continue;
        const char *s = t->text + t->text_off[id];
        size_t sl = tok_len(t, id);
        if (!memmem(text, len, s, sl))
            continue;
        size_t n_new = 0;
        for (size_t f = 0; f < w->n_frag; f++) {
            struct tok_frag fr = w->frag[f];
            /* a fragment splits into at most 2 pieces per match, plus one */
            if (!TOK_GROW(w->frag2, w->cap_frag2, n_new + 1))
                return -1;
            if (fr.id >= 0) {
                w->frag2[n_new++] = fr;
                continue;
            }
            size_t off = fr.off, rem = fr.len;
            const char *m;
            while (rem > 0 && (m = memmem(text + off, rem, s, sl)) != NULL) {
                size_t at = (size_t)(m - text);
                size_t left = at - off;
                if (a & TOK_A_LSTRIP)
                    while (left > 0 && tok_isspace((unsigned char)text[off + left - 1]))
                        left--;
                if (!TOK_GROW(w->frag2, w->cap_frag2, n_new + 3))
                    return -1;
                if (left > 0)
                    w->frag2[n_new++] = (struct tok_frag){ -1, off, left };
                w->frag2[n_new++] = (struct tok_frag){ id, 0, 0 };
                size_t r_off = at + sl, r_len = off + rem - r_off;
                if (a & TOK_A_RSTRIP)
                    while (r_len > 0 && tok_isspace((unsigned char)text[r_off]))
                        r_off++, r_len--;
                off = r_off;
                rem = r_len;
            }
            if (rem > 0)
                w->frag2[n_new++] = (struct tok_frag){ -1, off, rem };
        }
        struct tok_frag *tmp = w->frag;
        size_t tcap = w->cap_frag;
        w->frag = w->frag2;
        w->cap_frag = w->cap_frag2;
        w->frag2 = tmp;
        w->cap_frag2 = tcap;
        w->n_frag = n_new;
    }
    return 0;
}

int32_t *tok_encode(const struct tok *t, const char *text, size_t len, int add_special,
                    int parse_special, int *n, char *err, size_t errlen)
{
    *n = 0;
    if (!text && len) {
        strata_errf(err, errlen, "tok_encode: NULL text");
        return NULL;
    }
    struct tok_ws w;
    memset(&w, 0, sizeof w);
    int rc = tok_partition(t, &w, text, len, parse_special);
    if (rc == 0 && add_special && t->add_bos)
        rc = tok_push_id(&w, t->bos);
    int prev_special = 1; /* SPM: the first text fragment gets the space prefix */
    for (size_t f = 0; rc == 0 && f < w.n_frag; f++) {
        const struct tok_frag *fr = &w.frag[f];
        if (fr->id >= 0) {
            rc = tok_push_id(&w, fr->id);
            prev_special = 1;
        } else if (t->model == TOK_SPM) {
            rc = tok_spm_fragment(t, &w, text + fr->off, fr->len, t->add_space_prefix && prev_special);
            prev_special = 0;
        } else {
            rc = tok_bpe_fragment(t, &w, text + fr->off, fr->len);
        }
    }
    if (rc == 0 && add_special && t->add_eos)
        rc = tok_push_id(&w, t->eos);
    if (rc == 0 && w.n_ids > INT32_MAX)
        rc = -1;
    if (rc == 0 && !TOK_GROW(w.ids, w.cap_ids, 1))
        rc = -1;
    int32_t *ids = NULL;
    if (rc == 0) {
        ids = w.ids;
        *n = (int)w.n_ids;
        w.ids = NULL;
    } else {
        strata_errf(err, errlen, "tok_encode: out of memory (%zu bytes of text)", len);
    }
    tok_ws_free(&w);
    return ids;
}

/* ==== decoding ==== */

/* A bounded writer that still counts what did not fit. */
struct tok_out {
    char *p;
    size_t cap, n;
    int skip_space;    /* drop one leading ' ' of the next piece */
};

static void tok_put(struct tok_out *o, const char *s, size_t n)
{
    if (o->skip_space && n > 0) {
        o->skip_space = 0;
        if (s[0] == ' ')
            s++, n--;
    }
    if (o->n < o->cap)
        memcpy(o->p + o->n, s, n < o->cap - o->n ? n : o->cap - o->n);
    o->n += n;
}

/* Writes token id's piece; lstrip drops one leading space (the SPM prefix). */
static void tok_piece_out(const struct tok *t, int32_t id, int special, int lstrip, struct tok_out *o)
{
    if (id < 0 || id >= t->n_vocab)
        return;
    uint16_t a = t->attr[id];
    if (!special && (a & (TOK_A_UNKNOWN | TOK_A_CONTROL)))
        return;
    const char *s = t->text + t->text_off[id];
    size_t n = tok_len(t, id);
    o->skip_space = lstrip;
    if (a & (TOK_A_UNKNOWN | TOK_A_CONTROL | TOK_A_USER)) {
        tok_put(o, s, n);
    } else if (a & TOK_A_NORMAL) {
        if (t->model == TOK_SPM) {
            size_t start = 0;
            for (size_t i = 0; i + 3 <= n; i++) {
                if (memcmp(s + i, "\xE2\x96\x81", 3) == 0) {
                    tok_put(o, s + start, i - start);
                    tok_put(o, " ", 1);
                    start = i + 3;
                    i += 2;
                }
            }
            tok_put(o, s + start, n - start);
        } else {
            for (size_t i = 0; i < n;) {
                uint32_t cp = tok_u8dec((const unsigned char *)s, n, &i);
                int b = tok_cp_byte(cp);
                if (b >= 0) {
                    char c = (char)b;
                    tok_put(o, &c, 1);
                    continue;
                }
                /* the reference's marker for a character outside the byte alphabet */
                char u[4], hex[3];
                size_t m = tok_u8enc(cp, u);
                tok_put(o, "[UNK_BYTE_0x", 12);
                for (size_t j = 0; j < m; j++) {
                    snprintf(hex, sizeof hex, "%02x", (unsigned char)u[j]);
                    tok_put(o, hex, 2);
                }
                tok_put(o, s, n);
                tok_put(o, "]", 1);
            }
        }
    } else if (a & TOK_A_BYTE) {
        char hex[3] = { n > 3 ? s[3] : 0, n > 4 ? s[4] : 0, 0 };
        char c = (char)strtol(hex, NULL, 16);
        tok_put(o, &c, 1);
    }
    o->skip_space = 0;
}

size_t tok_piece(const struct tok *t, int32_t id, char *buf, size_t cap, int special)
{
    struct tok_out o = { buf, cap, 0, 0 };
    tok_piece_out(t, id, special, 0, &o);
    return o.n;
}

/* The reference's clean_up_tokenization_spaces passes, in place. */
static size_t tok_clean_spaces(char *text, size_t total)
{
    /* " ?", " !", " .", " ,": drop the space */
    size_t n1 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < n1; i++) {
        char x = text[i];
        if (text[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ','))
            total--;
        text[total++] = x;
    }
    /* " ' ": drop both spaces */
    size_t n2 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < n2; i++) {
        char x = text[i];
        if (x == '\'' && i + 1 < n2 && text[i - 1] == ' ' && text[i + 1] == ' ') {
            total--;
            text[++i] = '\0';
        }
        text[total++] = x;
    }
    /* " 's", " 'm", " 're", " 've": drop the space */
    size_t n3 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < n3; i++) {
        char x = text[i];
        if (text[i - 1] == ' ' && x == '\'' && i + 1 < n3) {
            char x1 = text[i + 1];
            if (x1 == 's' || x1 == 'm')
                total--;
            else if (i + 2 < n3 && ((x1 == 'r' && text[i + 2] == 'e') || (x1 == 'v' && text[i + 2] == 'e')))
                total--;
        }
        text[total++] = x;
    }
    return total;
}

size_t tok_decode(const struct tok *t, const int32_t *ids, int n, char *buf, size_t cap, int special)
{
    /* measure, then render everything (the clean-up needs the whole text) */
    struct tok_out o = { NULL, 0, 0, 0 };
    for (int i = 0; i < n; i++)
        tok_piece_out(t, ids[i], special, i == 0 && t->add_space_prefix, &o);
    char *tmp = malloc(o.n ? o.n : 1);
    if (!tmp)
        return 0;
    struct tok_out r = { tmp, o.n, 0, 0 };
    for (int i = 0; i < n; i++)
        tok_piece_out(t, ids[i], special, i == 0 && t->add_space_prefix, &r);
    size_t total = t->clean_spaces ? tok_clean_spaces(tmp, r.n) : r.n;
    if (cap)
        memcpy(buf, tmp, total < cap ? total : cap);
    free(tmp);
    return total;
}

size_t tok_utf8_complete(const char *buf, size_t n)
{
    /* find the last lead byte; if its sequence runs past the end with only
     * continuation bytes so far, stop before it */
    size_t i = n;
    int back = 0;
    while (i > 0 && back < 4) {
        unsigned char c = (unsigned char)buf[i - 1];
        i--;
        back++;
        if ((c & 0xC0) == 0x80)
            continue;
        size_t need = c >= 0xF0 && c <= 0xF7 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC0 && c <= 0xDF ? 2 : 1;
        return (size_t)back < need ? i : n;
    }
    return n;
}
