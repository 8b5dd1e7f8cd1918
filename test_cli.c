/*
 * test_cli.c — tests of the command line (strata.c), run as real
 * subprocesses of ./strata (built by `make` before `make test`; the tests run
 * from the repository root).
 *
 * Error exits (bad flags and values, missing and malformed files) need
 * nothing else. With ../shared/testdata: tokenize against the golden
 * tokenization, generate --temp 0 against the golden greedy ids (exact up to
 * the first step whose reference margin is <= 0.05, the parity rule),
 * perplexity against the golden mean NLL (0.2%), every --json stdout
 * parsed as exactly one JSON value by json.c, and the KV options (--kv
 * formats and their bytes per cell, --kv-mem, --prefill-chunk, --device,
 * bench's depth, prefix reuse, batch and sampling line, q4 refused for a head dim
 * of 16).
 */
#include "strata.h"
#include "test.h"

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CLI_BIN "./strata"
#define PARITY_MARGIN 0.05   /* ids may differ only after a step this close */
#define PPL_NLL_REL 0.002    /* mean NLL within 0.2% of the golden */

/* ---- running ./strata ---- */

struct run {
    int status;          /* exit code, or 128 + signal */
    char *out, *err;     /* captured stdout / stderr, NUL-terminated */
    size_t out_len, err_len;
};

static char *slurp_fd(int fd, size_t *len)
{
    off_t n = lseek(fd, 0, SEEK_END);
    char *buf = malloc(n > 0 ? (size_t)n + 1 : 1);
    size_t got = 0;
    if (n > 0 && lseek(fd, 0, SEEK_SET) == 0) {
        ssize_t r;
        while (got < (size_t)n && (r = read(fd, buf + got, (size_t)n - got)) > 0)
            got += (size_t)r;
    }
    buf[got] = 0;
    *len = got;
    return buf;
}

/* Runs ./strata with args (NULL-terminated, without argv[0]). */
static struct run run_cli(const char *const *args)
{
    struct run r = { -1, NULL, NULL, 0, 0 };
    char out_path[] = "/tmp/strata-cli-out-XXXXXX", err_path[] = "/tmp/strata-cli-err-XXXXXX";
    int fo = mkstemp(out_path), fe = mkstemp(err_path);
    if (fo < 0 || fe < 0) {
        if (fo >= 0)
            close(fo);
        if (fe >= 0)
            close(fe);
        r.out = calloc(1, 1);
        r.err = calloc(1, 1);
        return r;
    }
    unlink(out_path);
    unlink(err_path);
    const char *argv[64];
    int n = 0;
    argv[n++] = CLI_BIN;
    while (args[n - 1] && n < 63) {
        argv[n] = args[n - 1];
        n++;
    }
    argv[n] = NULL;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0)
            dup2(devnull, 0);
        dup2(fo, 1);
        dup2(fe, 2);
        execv(CLI_BIN, (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    if (pid > 0 && waitpid(pid, &st, 0) == pid)
        r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    r.out = slurp_fd(fo, &r.out_len);
    r.err = slurp_fd(fe, &r.err_len);
    close(fo);
    close(fe);
    return r;
}

static void run_free(struct run *r)
{
    free(r->out);
    free(r->err);
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* Writes data to a fresh temporary file; returns its path in buf. */
static const char *temp_file(char *buf, size_t cap, const void *data, size_t len)
{
    snprintf(buf, cap, "/tmp/strata-cli-XXXXXX");
    int fd = mkstemp(buf);
    if (fd < 0)
        return NULL;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, (const char *)data + done, len - done);
        if (w <= 0)
            break;
        done += (size_t)w;
    }
    close(fd);
    return buf;
}

/* A --json stdout must hold exactly one JSON value of the given kind
 * (json.c rejects anything after the value); the tree goes to *j. */
static int parse_stdout(const struct run *r, struct json *j, int kind, const char *what)
{
    char err[256];
    if (json_parse(j, r->out, r->out_len, err, sizeof err) != 0)
        return CHECK(0, "%s: stdout is not one JSON value: %s", what, err);
    int got = j->kind;
    if (got != kind) {
        json_free(j);
        return CHECK(0, "%s: stdout holds a JSON value of kind %d, want %d", what, got, kind);
    }
    return 1;
}

static int ids_equal(const struct json *arr, const struct json *want)
{
    if (!arr || !want || arr->kind != JSON_ARR || want->kind != JSON_ARR || arr->len != want->len)
        return 0;
    for (size_t i = 0; i < arr->len; i++)
        if (arr->items[i].num != want->items[i].num)
            return 0;
    return 1;
}

static struct json *load_golden(const char *path, struct json *j)
{
    size_t len;
    char err[256], *text = test_read_file(path, &len);
    if (!CHECK(text != NULL, "cannot read %s", path))
        return NULL;
    int rc = json_parse(j, text, len, err, sizeof err);
    free(text);
    return CHECK(rc == 0, "%s: %s", path, err) ? j : NULL;
}

/* ---- error exits ---- */

/* The command must fail with one line on stderr and nothing on stdout. */
static void expect_error(const char *const *args, const char *needle)
{
    struct run r = run_cli(args);
    char cmd[256] = "";
    for (int i = 0; args[i]; i++)
        snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " %.40s", args[i]);
    CHECK(r.status != 0 && r.status < 128, "strata%s: exit %d, want a non-zero exit", cmd, r.status);
    CHECK(r.out_len == 0, "strata%s: stdout not empty: %.80s", cmd, r.out);
    CHECK(count_lines(r.err) == 1 && r.err_len > 10, "strata%s: stderr is not one line: '%s'", cmd, r.err);
    CHECK(!needle || strstr(r.err, needle), "strata%s: stderr '%s' lacks '%s'", cmd, r.err, needle);
    run_free(&r);
}

static void case_errors(void)
{
    if (!test_begin("cli/errors"))
        return;
    if (!CHECK(access(CLI_BIN, X_OK) == 0, "no %s: run `make` first", CLI_BIN))
        return;
    struct run r = run_cli((const char *[]){ "--help", NULL });
    CHECK(r.status == 0 && strstr(r.out, "usage: strata") && r.err_len == 0, "--help: usage on stdout");
    run_free(&r);
    r = run_cli((const char *[]){ "help", NULL });
    CHECK(r.status == 0 && strstr(r.out, "perplexity"), "help: usage on stdout");
    run_free(&r);
    r = run_cli((const char *[]){ NULL });
    CHECK(r.status != 0 && r.out_len == 0 && strstr(r.err, "usage"), "no command: usage on stderr");
    run_free(&r);

    /* a malformed GGUF: a valid header claiming more tensors than the file holds */
    static const unsigned char bad_gguf[] = { 'G', 'G', 'U', 'F', 3, 0, 0, 0, 0xff, 0xff, 0xff, 0xff,
                                              0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0 };
    char bad[64], txt[64], empty[64];
    temp_file(bad, sizeof bad, bad_gguf, sizeof bad_gguf);
    temp_file(txt, sizeof txt, "not a model\n", 12);
    temp_file(empty, sizeof empty, "", 0);
    const char *missing = "/tmp/strata-cli-no-such-file.gguf";

    expect_error((const char *[]){ "frobnicate", NULL }, "unknown command");
    expect_error((const char *[]){ "generate", "-m", missing, "--bogus", NULL }, "--bogus");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", "-n", NULL }, "needs a value");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", "-n", "ten", NULL }, "-n");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", "-n", "-5", NULL }, "-n");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", "--temp", "nan", NULL }, "--temp");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", "--seed", "-1", NULL }, "--seed");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", "--kv", "f8", NULL }, "--kv");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", "-t", "0", NULL }, "-t");
    expect_error((const char *[]){ "tokenize", "-m", missing, "-p", "x", "--logprobs", "3", NULL },
                 "does not apply");
    expect_error((const char *[]){ "generate", "-p", "x", NULL }, "-m MODEL");
    expect_error((const char *[]){ "generate", "-m", missing, "-p", "x", NULL }, missing);
    expect_error((const char *[]){ "tokenize", "-m", missing, "-p", "x", NULL }, missing);
    expect_error((const char *[]){ "info", "-m", missing, NULL }, missing);
    expect_error((const char *[]){ "bench", "-m", missing, NULL }, missing);
    expect_error((const char *[]){ "generate", "-m", bad, "-p", "x", NULL }, bad);
    expect_error((const char *[]){ "tokenize", "-m", bad, "-p", "x", NULL }, bad);
    expect_error((const char *[]){ "info", "-m", txt, NULL }, txt);
    expect_error((const char *[]){ "info", "-m", empty, NULL }, empty);
    expect_error((const char *[]){ "perplexity", "-m", txt, "-f", missing, NULL }, missing);
    expect_error((const char *[]){ "generate", "-m", txt, NULL }, "-p TEXT or -f FILE");
    expect_error((const char *[]){ "generate", "-m", txt, "-p", "a", "-f", txt, NULL }, "exactly one");
    unlink(bad);
    unlink(txt);
    unlink(empty);

    char path[512], trunc[64];
    const char *model = test_data("tiny-llama-spm-Q8_0.gguf", path, sizeof path);
    if (!model)
        return;
    /* the real model cut short, at its header and inside its tensor data */
    size_t len;
    char *img = test_read_file(model, &len);
    if (!CHECK(img != NULL && len > 100000, "cannot read %s", model)) {
        free(img);
        return;
    }
    size_t cuts[] = { 7, 100, 5000, len / 2, len - 1 };
    for (size_t k = 0; k < sizeof cuts / sizeof *cuts; k++) {
        temp_file(trunc, sizeof trunc, img, cuts[k]);
        expect_error((const char *[]){ "generate", "-m", trunc, "-p", "x", NULL }, trunc);
        unlink(trunc);
    }
    free(img);
    char ppl[512];
    const char *text = test_data("ppl_text.txt", ppl, sizeof ppl);
    expect_error((const char *[]){ "perplexity", "-m", model, "-f", text, "-c", "2048", NULL },
                 "at least");
    expect_error((const char *[]){ "generate", "-m", model, "-p", "hello there", "-c", "3", NULL },
                 "context");
}

/* ---- tokenize ---- */

static void case_tokenize(void)
{
    if (!test_begin("cli/tokenize"))
        return;
    char vp[512], gp[512], ip[512], op[512], tmp[64];
    const char *vocab = test_data("vocab/ggml-vocab-llama-spm.gguf", vp, sizeof vp);
    const char *golden = test_data("tiny-llama-spm-Q8_0.golden.json", gp, sizeof gp);
    if (!vocab || !golden)
        return;
    struct json g;
    if (!load_golden(golden, &g))
        return;
    const struct json *prompts = json_get(json_get(&g, "tokenization"), "prompts");
    int n_ok = 0, n = 0;
    for (size_t i = 0; prompts && i < prompts->len; i++) {
        const struct json *p = &prompts->items[i], *text = json_get(p, "text");
        temp_file(tmp, sizeof tmp, text->str, text->len);
        struct run r = run_cli((const char *[]){ "tokenize", "-m", vocab, "-f", tmp, "--json", NULL });
        struct json got;
        n++;
        if (CHECK(r.status == 0, "%s: exit %d: %s", json_get(p, "id")->str, r.status, r.err) &&
            parse_stdout(&r, &got, JSON_ARR, "tokenize --json")) {
            int eq = ids_equal(&got, json_get(p, "tokens"));
            n_ok += eq;
            CHECK(eq, "%s: ids differ from the golden tokenization", json_get(p, "id")->str);
            json_free(&got);
        }
        run_free(&r);
        /* --no-bos --no-special is the golden tokens_raw mode, printed as plain ids */
        r = run_cli((const char *[]){ "tokenize", "-m", vocab, "-f", tmp, "--no-bos", "--no-special", NULL });
        const struct json *raw = json_get(p, "tokens_raw");
        char want[8192] = "";
        for (size_t k = 0; raw && k < raw->len; k++)
            snprintf(want + strlen(want), sizeof want - strlen(want), k ? " %.0f" : "%.0f",
                     raw->items[k].num);
        strcat(want, "\n");
        CHECK(r.status == 0 && strcmp(r.out, want) == 0, "%s raw: got '%.200s' want '%.200s'",
              json_get(p, "id")->str, r.out, want);
        run_free(&r);
        unlink(tmp);
    }
    printf("  %d of %d golden prompts tokenized identically\n", n_ok, n);
    CHECK(n == 12, "expected 12 golden prompts, found %d", n);
    json_free(&g);

    /* the vocabulary's own test file: the first cases, in raw mode */
    const char *inp = test_data("vocab/ggml-vocab-llama-spm.gguf.inp", ip, sizeof ip);
    const char *outp = test_data("vocab/ggml-vocab-llama-spm.gguf.out", op, sizeof op);
    char *in_text = test_read_file(inp, NULL), *out_text = test_read_file(outp, NULL);
    if (!CHECK(in_text && out_text, "cannot read the vocab test files")) {
        free(in_text);
        free(out_text);
        return;
    }
    static const char sep[] = "\n__ggml_vocab_test__\n";
    char *s = in_text, *line = out_text;
    for (int k = 0; k < 12 && s && line; k++) {
        char *end = strstr(s, sep), *eol = strchr(line, '\n');
        size_t len = end ? (size_t)(end - s) : strlen(s);
        if (!eol)
            break;
        temp_file(tmp, sizeof tmp, s, len);
        struct run r = run_cli((const char *[]){ "tokenize", "-m", vocab, "-f", tmp, "--no-bos",
                                                 "--no-special", NULL });
        /* the .out lines have a leading space */
        const char *want = line;
        while (*want == ' ')
            want++;
        CHECK(r.status == 0 && strncmp(r.out, want, (size_t)(eol + 1 - want)) == 0 &&
              r.out_len == (size_t)(eol + 1 - want), "vocab test %d: got '%.100s'", k, r.out);
        run_free(&r);
        unlink(tmp);
        s = end ? end + strlen(sep) : NULL;
        line = eol + 1;
    }
    free(in_text);
    free(out_text);
}

/* ---- generate ---- */

static void case_generate(void)
{
    if (!test_begin("cli/generate-greedy"))
        return;
    char mp[512], gp[512], tmp[64];
    const char *model = test_data("tiny-llama-spm-Q8_0.gguf", mp, sizeof mp);
    /* the float function (--kv f32 --float) is the one held to the parity
     * rule; see test_goldens in test_model.c */
    const char *golden = test_data("tiny-llama-spm-Q8_0.f32ref.golden.json", gp, sizeof gp);
    if (!model || !golden)
        return;
    struct json g;
    if (!load_golden(golden, &g))
        return;
    const struct json *results = json_get(json_get(&g, "generation"), "results");
    double max_lp = 0;
    int checked = 0;
    for (size_t i = 0; results && i < results->len; i++) {
        const struct json *res = &results->items[i], *steps = json_get(res, "steps");
        const struct json *want = json_get(res, "tokens"), *ptext = json_get(res, "prompt");
        const char *id = json_get(res, "id")->str;
        temp_file(tmp, sizeof tmp, ptext->str, ptext->len);
        struct run r = run_cli((const char *[]){ "generate", "-m", model, "-f", tmp, "--temp", "0", "-n",
                                                 "32", "--kv", "f32", "--float", "--json", "--logprobs",
                                                 "3", NULL });
        struct json got;
        if (!CHECK(r.status == 0, "%s: exit %d: %s", id, r.status, r.err) ||
            !parse_stdout(&r, &got, JSON_OBJ, "generate --json")) {
            run_free(&r);
            unlink(tmp);
            continue;
        }
        const struct json *toks = json_get(&got, "tokens"), *tim = json_get(&got, "timings");
        CHECK(ids_equal(json_get(&got, "prompt_tokens"), json_get(res, "prompt_tokens")),
              "%s: prompt tokens differ", id);
        CHECK(tim && json_get(tim, "prompt_ms") && json_get(tim, "prompt_tok_s") &&
              json_get(tim, "decode_ms") && json_get(tim, "decode_tok_s"), "%s: timings incomplete", id);
        if (!CHECK(toks && toks->kind == JSON_ARR && toks->len == want->len, "%s: %zu tokens, want %zu",
                   id, toks ? toks->len : 0, want->len)) {
            json_free(&got);
            run_free(&r);
            unlink(tmp);
            continue;
        }
        /* the parity rule: identical ids until the first step where the
         * reference's top-2 margin is <= 0.05; nothing is required after */
        size_t k = 0;
        for (; k < toks->len; k++) {
            const struct json *t = &toks->items[k], *st = &steps->items[k];
            const struct json *bytes = json_get(t, "bytes"), *text = json_get(t, "text");
            const struct json *top = json_get(t, "top");
            /* text = the bytes as UTF-8 with U+FFFD replacements */
            char raw[256], *lit = NULL;
            size_t nb = bytes ? bytes->len : 0, ll = 0;
            for (size_t b = 0; b < nb && b < sizeof raw; b++)
                raw[b] = (char)bytes->items[b].num;
            FILE *f = open_memstream(&lit, &ll);
            json_put_str(f, raw, nb);
            fclose(f);
            struct json expect_text;
            char err[128];
            if (json_parse(&expect_text, lit, ll, err, sizeof err) == 0) {
                CHECK(text && text->len == expect_text.len && memcmp(text->str, expect_text.str, text->len) == 0,
                      "%s step %zu: text is not the bytes with replacement", id, k);
                json_free(&expect_text);
            }
            free(lit);
            CHECK(top && top->len == 3 && top->items[0].items[0].num == t->items[0].num,
                  "%s step %zu: top[0] is not the greedy id", id, k);
            if (json_get(st, "margin")->num <= PARITY_MARGIN)
                break;
            if (!CHECK(json_get(t, "id")->num == want->items[k].num, "%s step %zu: id %.0f, golden %.0f "
                       "(margin %.3f)", id, k, json_get(t, "id")->num, want->items[k].num,
                       json_get(st, "margin")->num))
                break;
            double d = fabs(json_get(t, "logprob")->num - json_get(st, "logprob")->num);
            if (d > max_lp)
                max_lp = d;
            checked++;
        }
        /* plain output: the streamed continuation is the tokens' text */
        struct run p = run_cli((const char *[]){ "generate", "-m", model, "-f", tmp, "--temp", "0", "-n",
                                                 "32", "--kv", "f32", "--float", NULL });
        char *joined = malloc(32 * 256 + 1);
        size_t jl = 0;
        for (size_t t = 0; t < toks->len; t++) {
            const struct json *bytes = json_get(&toks->items[t], "bytes");
            for (size_t b = 0; b < bytes->len; b++)
                joined[jl++] = (char)bytes->items[b].num;
        }
        CHECK(p.status == 0 && p.out_len == jl && memcmp(p.out, joined, jl) == 0,
              "%s: plain stdout differs from the JSON tokens' bytes (%zu vs %zu bytes)", id, p.out_len, jl);
        free(joined);
        run_free(&p);
        json_free(&got);
        run_free(&r);
        unlink(tmp);
    }
    printf("  %d greedy steps compared before a low-margin step; max |logprob - golden| %.3g\n",
           checked, max_lp);
    CHECK(max_lp < 1e-2, "logprobs differ from the golden by %.3g", max_lp);
    json_free(&g);
}

/* ---- perplexity ---- */

static void case_perplexity(void)
{
    if (!test_begin("cli/perplexity"))
        return;
    char mp[512], gp[512], tp[512];
    const char *model = test_data("tiny-llama-spm-Q8_0.gguf", mp, sizeof mp);
    const char *golden = test_data("tiny-llama-spm-Q8_0.golden.json", gp, sizeof gp);
    const char *text = test_data("ppl_text.txt", tp, sizeof tp);
    if (!model || !golden || !text)
        return;
    struct json g, got;
    if (!load_golden(golden, &g))
        return;
    const struct json *p = json_get(&g, "perplexity");
    struct run r = run_cli((const char *[]){ "perplexity", "-m", model, "-f", text, "-c", "128", "--json", NULL });
    if (CHECK(r.status == 0, "exit %d: %s", r.status, r.err) && parse_stdout(&r, &got, JSON_OBJ, "perplexity --json")) {
        double ppl = json_get(&got, "ppl")->num, err = json_get(&got, "ppl_err")->num;
        double want = json_get(p, "mean_nll")->num, rel = fabs(log(ppl) - want) / want;
        double chunks = json_get(p, "n_chunks")->num;
        printf("  mean NLL %.6f vs golden %.6f (rel %.2e); ppl_err %.4g vs %.4g\n", log(ppl), want, rel,
               err, json_get(p, "ppl_stderr")->num);
        CHECK(rel <= PPL_NLL_REL, "mean NLL off by %.3g relative", rel);
        CHECK(json_get(&got, "chunks")->num == chunks, "chunks %.0f, golden %.0f",
              json_get(&got, "chunks")->num, chunks);
        CHECK(json_get(&got, "tokens")->num == 63 * chunks, "scored %.0f tokens, want 63 per chunk",
              json_get(&got, "tokens")->num);
        CHECK(fabs(err / json_get(p, "ppl_stderr")->num - 1) < 0.1, "ppl_err off by more than 10%%");
        json_free(&got);
    }
    run_free(&r);
    r = run_cli((const char *[]){ "perplexity", "-m", model, "-f", text, "-c", "128", NULL });
    CHECK(r.status == 0 && strncmp(r.out, "Final estimate: PPL = ", 22) == 0 && count_lines(r.out) == 1,
          "plain output: '%s'", r.out);
    run_free(&r);
    json_free(&g);
}

/* ---- info and bench: they run and report what the file holds ---- */

static void case_info_bench(void)
{
    if (!test_begin("cli/info-bench"))
        return;
    char mp[512];
    const char *model = test_data("tiny-llama-spm-Q8_0.gguf", mp, sizeof mp);
    if (!model)
        return;
    struct run r = run_cli((const char *[]){ "info", "-m", model, NULL });
    CHECK(r.status == 0 && strstr(r.out, "architecture       llama") && strstr(r.out, "n_layer            4") &&
          strstr(r.out, "Q8_0 29"), "info: %s", r.out);
    run_free(&r);
    r = run_cli((const char *[]){ "bench", "-m", model, "-p", "32", "-n", "8", "-r", "1", NULL });
    CHECK(r.status == 0 && strstr(r.out, "prompt         32") && strstr(r.out, "decode         8") &&
          strstr(r.out, "decode/bound") && strstr(r.out, "(the sampling chain on the host: --temp 0.8 --top-k 40"),
          "bench: %s %s", r.out, r.err);
    run_free(&r);
    /* the sampling line takes generate's options */
    r = run_cli((const char *[]){ "bench", "-m", model, "-p", "0", "-n", "2", "-r", "1", "--temp", "0", "--top-k", "5",
                                  NULL });
    CHECK(r.status == 0 && strstr(r.out, "sample ") && strstr(r.out, "--temp 0 --top-k 5 "), "bench --temp: %s %s",
          r.out, r.err);
    run_free(&r);
}

/* ---- KV cache options ---- */

static void case_kv(void)
{
    if (!test_begin("cli/kv-options"))
        return;
    char mp[512];
    const char *model = test_data("tiny-llama-spm-Q8_0.gguf", mp, sizeof mp);
    if (!model)
        return;
    /* tiny-llama: 4 layers x 2 kv heads x K and V rows of 64 */
    struct run r = run_cli((const char *[]){ "info", "-m", model, "-c", "1000", "--kv", "q4", NULL });
    CHECK(r.status == 0 && strstr(r.out, "KV bytes per cell  f32 4096 f16 2048 int8 1088 q4 576 k8v4 832") &&
          strstr(r.out, "(1000 cells, q4)"), "info: %s", r.out);
    run_free(&r);
    r = run_cli((const char *[]){ "generate", "-m", model, "-p", "Once upon a time", "-n", "4", "--temp", "0",
                                  "--kv", "int8", "--prefill-chunk", "2", "--kv-mem", "1", NULL });
    CHECK(r.status == 0 && r.out_len > 0 && strstr(r.err, "kv cache: int8 cells") && strstr(r.err, "1.0 MiB"),
          "generate --kv int8: exit %d: %s", r.status, r.err);
    run_free(&r);
    r = run_cli((const char *[]){ "bench", "-m", model, "-p", "16", "-n", "4", "-r", "1", "-d", "64", "--prefix",
                                  "128", "--kv", "k8v4", "--split", "2", NULL });
    CHECK(r.status == 0 && strstr(r.out, "depth          64 cells") && strstr(r.out, "k8v4") &&
          strstr(r.out, "prefix cold    144") && strstr(r.out, "(128 from the prefix cache)"), "bench: %s %s",
          r.out, r.err);
    run_free(&r);
    /* three sequences of the depth's cells decoding together */
    r = run_cli((const char *[]){ "bench", "-m", model, "-p", "8", "-n", "4", "-r", "1", "-d", "40", "--batch", "3",
                                  NULL });
    CHECK(r.status == 0 && strstr(r.out, "decode x3      4") && strstr(r.out, "(3 sequences"), "bench --batch: %s %s",
          r.out, r.err);
    run_free(&r);
    expect_error((const char *[]){ "generate", "-m", model, "-p", "x", "--device", "tpu", NULL }, "--device");
    expect_error((const char *[]){ "bench", "-m", model, "--split", "99", NULL }, "--split");
    expect_error((const char *[]){ "bench", "-m", model, "--batch", "0", NULL }, "--batch");
    if (strcmp(gpu_backend(), "none") == 0)
        expect_error((const char *[]){ "generate", "-m", model, "-p", "x", "--device", "cuda", NULL },
                     "without a GPU backend");
    expect_error((const char *[]){ "generate", "-m", model, "-p", "x", "--kv-mem", "0", NULL }, "--kv-mem");
    /* a pool too small for the prompt: 1 MiB of f32 cells is 256 cells */
    char big[4096];
    size_t n = 0;
    while (n + 8 < sizeof big) {
        memcpy(big + n, "hello w ", 8);
        n += 8;
    }
    big[n] = 0;
    r = run_cli((const char *[]){ "generate", "-m", model, "-p", big, "-c", "4096", "--kv", "f32", "--kv-mem", "1",
                                  NULL });
    CHECK(r.status == 1 && r.out_len == 0 && strstr(r.err, "256 per sequence") && strstr(r.err, "exceed 256 cells"),
          "a prompt past the pool: exit %d: %s", r.status, r.err);
    run_free(&r);

    /* Q4_0 blocks need a head dim that is a multiple of 32: a model with 16 */
    const char *small = "/tmp/strata-cli-e16.gguf";
    r = run_cli((const char *[]){ "synth", "--arch", "llama", "--set", "n_vocab=64", "--set", "n_embd=64", "--set",
                                  "n_layer=1", "--set", "n_head=4", "--set", "n_head_kv=2", "--set", "head_dim=16",
                                  "--set", "n_ff=64", "--type", "q8_0", "-o", small, NULL });
    if (CHECK(r.status == 0, "synth: %s", r.err)) {
        for (int k = 0; k < 2; k++)
            expect_error((const char *[]){ "bench", "-m", small, "-p", "4", "-n", "1", "-r", "1", "--kv",
                                           k ? "k8v4" : "q4", NULL }, "not a multiple of 32");
        struct run ok = run_cli((const char *[]){ "bench", "-m", small, "-p", "4", "-n", "1", "-r", "1", "--kv",
                                                  "int8", NULL });
        CHECK(ok.status == 0, "bench --kv int8 on head dim 16: %s", ok.err);
        run_free(&ok);
    }
    run_free(&r);
    unlink(small);
}

void test_cli(void)
{
    case_errors();
    case_tokenize();
    case_generate();
    case_perplexity();
    case_info_bench();
    case_kv();
}
