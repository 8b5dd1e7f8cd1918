/*
 * test_http.c — tests of `strata serve` (http.c) and the chat templates (chat.c).
 *
 * In process: the request parser against a table of requests fed whole and
 * cut at every prefix (valid ones must say "partial" until complete,
 * malformed ones must never be accepted), size flags, the chat templates'
 * exact renderings and the reasoning split at every prefix. End to end:
 * ./strata serve (STRATA_BIN overrides the path) on the demo model, on a
 * free loopback port, driven through real sockets by a small client written
 * here: byte-by-byte requests, the limit statuses (431/413/411/408/503/401),
 * bad JSON and fields, greedy completions and log-probabilities compared with
 * the exact ids and values of `strata generate --temp 0`, SSE framing,
 * /metrics counters, keep-alive and pipelining, parallel slots against serial
 * runs, a load of 16 clients with some leaving mid-stream, Python's
 * http.client and curl as independent clients, and SIGTERM → exit 0. With
 * node and the npm packages `.ci/run` puts in build/npm (they skip without):
 * the official OpenAI Node client (test_openai.mjs) and the chat page in
 * headless Chromium (test_chat_page.mjs), their texts compared with the
 * server's direct answers. /health's 503 while loading uses http.c's
 * STRATA_TEST_LOAD_DELAY_MS hook.
 */
#include "strata.h"
#include "test.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define DEMO_MODEL "demo/strata-demo-Q8_0.gguf"

/* ==== the parser, in process ==== */

struct parse_case {
    const char *text;
    const char *method, *target;
    int n_headers;
};

static const struct parse_case valid_requests[] = {
    { "GET / HTTP/1.1\r\n\r\n", "GET", "/", 0 },
    { "GET /health HTTP/1.0\r\nHost: x\r\n\r\n", "GET", "/health", 1 },
    { "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: localhost:8080\r\nContent-Type: application/json\r\n"
      "Content-Length: 2\r\nAuthorization: Bearer k\r\n\r\n", "POST", "/v1/chat/completions?x=1", 4 },
    { "GET /a HTTP/1.1\nX-Empty:\nX-Spaces:   v  \t\n\n", "GET", "/a", 2 },
    { "OPTIONS * HTTP/1.1\r\nX-Obs: caf\xc3\xa9\r\n\r\n", "OPTIONS", "*", 1 },
};

static const char *const malformed_requests[] = {
    "GET  / HTTP/1.1\r\n\r\n",              /* two spaces */
    " GET / HTTP/1.1\r\n\r\n",              /* leading space */
    "GET / HTTP/2.0\r\n\r\n",               /* not HTTP/1.x */
    "GET / HTTP/1.x\r\n\r\n",
    "G(T / HTTP/1.1\r\n\r\n",               /* not a token */
    "GET /a\x01 HTTP/1.1\r\n\r\n",          /* control byte in the target */
    "GET / HTTP/1.1\r\r\n\r\n",             /* CR without LF */
    "GET / HTTP/1.1\r\nNo colon\r\n\r\n",
    "GET / HTTP/1.1\r\n: empty name\r\n\r\n",
    "GET / HTTP/1.1\r\nName : space before colon\r\n\r\n",
    "GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n", /* obsolete line folding */
    "GET / HTTP/1.1\r\nA: b\x7f\r\n\r\n",
    "GET / HTTP/1.1 extra\r\n\r\n",
};

static void test_parser(void)
{
    if (!test_begin("http/parser-valid"))
        return;
    struct http_request h;
    for (size_t c = 0; c < sizeof valid_requests / sizeof *valid_requests; c++) {
        const struct parse_case *pc = &valid_requests[c];
        size_t n = strlen(pc->text);
        for (size_t k = 0; k < n; k++) {
            int rc = http_parse_request(pc->text, k, &h);
            if (!CHECK(rc == HTTP_PARTIAL, "case %zu prefix %zu: %d, expected partial", c, k, rc))
                break;
        }
        char buf[512];
        snprintf(buf, sizeof buf, "%s{\"body\":1}GET / HTTP/1.1", pc->text);
        for (int with_body = 0; with_body < 2; with_body++) {
            int rc = http_parse_request(with_body ? buf : pc->text, with_body ? strlen(buf) : n, &h);
            CHECK(rc == (int)n, "case %zu: consumed %d, expected %zu", c, rc, n);
            CHECK(h.method_len == strlen(pc->method) && memcmp(h.method, pc->method, h.method_len) == 0,
                  "case %zu: method", c);
            CHECK(h.target_len == strlen(pc->target) && memcmp(h.target, pc->target, h.target_len) == 0,
                  "case %zu: target", c);
            CHECK(h.n_headers == pc->n_headers, "case %zu: %d headers, expected %d", c, h.n_headers, pc->n_headers);
        }
    }
    http_parse_request(valid_requests[2].text, strlen(valid_requests[2].text), &h);
    const struct http_header *cl = http_header(&h, "CONTENT-length");
    CHECK(cl && cl->value_len == 1 && cl->value[0] == '2', "case-insensitive header lookup");
    CHECK(http_header(&h, "content") == NULL, "a header name prefix must not match");
    CHECK(h.minor == 1, "HTTP/1.1 minor");
    http_parse_request(valid_requests[3].text, strlen(valid_requests[3].text), &h);
    CHECK(h.headers[0].value_len == 0, "an empty value");
    CHECK(h.headers[1].value_len == 1 && h.headers[1].value[0] == 'v', "OWS trimmed around a value");

    if (!test_begin("http/parser-malformed"))
        return;
    for (size_t c = 0; c < sizeof malformed_requests / sizeof *malformed_requests; c++) {
        const char *t = malformed_requests[c];
        size_t n = strlen(t);
        int seen_bad = 0;
        for (size_t k = 0; k <= n; k++) {
            int rc = http_parse_request(t, k, &h);
            CHECK(rc == HTTP_PARTIAL || rc == HTTP_BAD, "malformed %zu prefix %zu: %d", c, k, rc);
            CHECK(!(seen_bad && rc != HTTP_BAD), "malformed %zu: an error at a prefix must stay an error", c);
            seen_bad |= rc == HTTP_BAD;
        }
        CHECK(seen_bad, "malformed %zu (%.20s…) was not rejected", c, t);
    }
    char many[4096];
    size_t n = (size_t)snprintf(many, sizeof many, "GET / HTTP/1.1\r\n");
    for (int i = 0; i <= HTTP_MAX_HEADERS; i++)
        n += (size_t)snprintf(many + n, sizeof many - n, "H%d: v\r\n", i);
    n += (size_t)snprintf(many + n, sizeof many - n, "\r\n");
    CHECK(http_parse_request(many, n, &h) == HTTP_TOO_MANY, "more than HTTP_MAX_HEADERS headers");

    if (!test_begin("http/size-flags"))
        return;
    static const struct { const char *s; long long v; } sizes[] = {
        { "8M", 8 << 20 }, { "512K", 512 << 10 }, { "1048576", 1048576 }, { "1k", 1024 }, { "0", 0 },
        { "", -1 }, { "M", -1 }, { "8MB", -1 }, { "-1", -1 }, { "2048M", -1 }, { "99999999999999999999", -1 },
    };
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        size_t v = 12345;
        int rc = http_parse_size(sizes[i].s, &v);
        if (sizes[i].v < 0)
            CHECK(rc == -1 && v == 12345, "size '%s' must be rejected", sizes[i].s);
        else
            CHECK(rc == 0 && v == (size_t)sizes[i].v, "size '%s': rc %d value %zu", sizes[i].s, rc, v);
    }
}

/* ==== chat templates, in process ==== */

/* tokenizer.chat_template of the Qwen2 vocabulary in ../shared/testdata */
static const char qwen2_template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/* the parts of Qwen3's template that matter: escaped newlines, the switch */
static const char qwen3_template[] =
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- set content = message.content.split('</think>')[-1] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
    "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";

static const char llama3_template[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}";

static const char llama2_template[] =
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
    "message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + "
    "' ' + eos_token }}{% endif %}{% endfor %}";

static int render_is(const struct chat_template *ct, const struct chat_msg *m, int n, int think, const char *want)
{
    size_t len;
    char *got = chat_render(ct, m, n, think, &len);
    int ok = got && len == strlen(want) && memcmp(got, want, len) == 0;
    if (!ok)
        test_failf(__FILE__, __LINE__, "rendered:\n%s\nexpected:\n%s", got ? got : "(null)", want);
    free(got);
    return ok;
}

#define MSG(r, c) { r, c, sizeof c - 1 }

static void test_chat(void)
{
    if (!test_begin("chat/templates"))
        return;
    struct chat_template ct;
    const struct chat_msg conv[] = { MSG("user", "Hi"), MSG("assistant", "<think>\nhmm\n</think>\n\nHello!"),
                                     MSG("user", " Bye ") };
    const struct chat_msg sys[] = { MSG("system", "Be brief."), MSG("user", "Hi") };

    chat_detect(&ct, qwen2_template, sizeof qwen2_template - 1);
    CHECK(ct.known && ct.family == CHAT_CHATML && !ct.thinking_switch, "qwen2: chatml, no switch");
    CHECK(strcmp(ct.system_default, "You are a helpful assistant") == 0, "qwen2 default system: '%s'", ct.system_default);
    render_is(&ct, conv, 1, 1,
              "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\n");
    render_is(&ct, sys, 2, 1,
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

    chat_detect(&ct, qwen3_template, sizeof qwen3_template - 1);
    CHECK(ct.known && ct.family == CHAT_CHATML && ct.thinking_switch && ct.think_tags, "qwen3: chatml with switch");
    CHECK(ct.system_default[0] == 0, "qwen3 has no default system message ('%s')", ct.system_default);
    render_is(&ct, conv, 3, 1,
              "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
              "<|im_start|>user\n Bye <|im_end|>\n<|im_start|>assistant\n");
    render_is(&ct, conv, 1, 0, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");

    chat_detect(&ct, llama3_template, sizeof llama3_template - 1);
    CHECK(ct.known && ct.family == CHAT_LLAMA3, "llama3 recognised");
    render_is(&ct, conv, 3, 1,
              "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\n<think>\nhmm\n</think>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n");
    CHECK(strcmp(chat_end_marker(&ct), "<|eot_id|>") == 0, "llama3 end marker");

    chat_detect(&ct, llama2_template, sizeof llama2_template - 1);
    CHECK(ct.known && ct.family == CHAT_LLAMA2, "llama2 recognised");
    const struct chat_msg l2[] = { MSG("system", "Be brief."), MSG("user", "Hi"), MSG("assistant", "Hello!"),
                                   MSG("user", "Bye") };
    render_is(&ct, l2, 4, 1, "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]");

    chat_detect(&ct, "{{ messages }}", 14);
    CHECK(!ct.known && ct.family == CHAT_CHATML, "an unknown template falls back to ChatML");
    chat_detect(&ct, NULL, 0);
    CHECK(!ct.known && ct.family == CHAT_CHATML, "no template falls back to ChatML");
    render_is(&ct, sys, 2, 0, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                              "<|im_start|>assistant\n");

    if (!test_begin("chat/reasoning-split"))
        return;
    static const struct { const char *text, *reasoning, *content; } cases[] = {
        { "\n<think>\nLet me see.\n\n</think>\n\nIt is 4.", "Let me see.", "It is 4." },
        { "<think>a < b </thin", "a < b </thin", "" },
        { "No thinking here.", "", "No thinking here." },
        { "  <thinking about it", "", "  <thinking about it" },
        { "<think></think>x", "", "x" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const char *t = cases[c].text;
        size_t n = strlen(t);
        struct chat_split fin, sp;
        chat_split(t, n, 1, &fin);
        CHECK(fin.r_len == strlen(cases[c].reasoning) && memcmp(t + fin.r_off, cases[c].reasoning, fin.r_len) == 0,
              "case %zu reasoning '%.*s'", c, (int)fin.r_len, t + fin.r_off);
        CHECK(fin.c_len == strlen(cases[c].content) && memcmp(t + fin.c_off, cases[c].content, fin.c_len) == 0,
              "case %zu content '%.*s'", c, (int)fin.c_len, t + fin.c_off);
        for (size_t k = 0; k <= n; k++) {
            chat_split(t, k, 0, &sp);
            CHECK(sp.r_len <= fin.r_len && memcmp(t + sp.r_off, t + fin.r_off, sp.r_len) == 0,
                  "case %zu prefix %zu: reasoning is not a prefix of the final one", c, k);
            CHECK(sp.c_len <= fin.c_len && memcmp(t + sp.c_off, t + fin.c_off, sp.c_len) == 0,
                  "case %zu prefix %zu: content is not a prefix of the final one", c, k);
        }
    }
}

/* ==== a small HTTP client ==== */

static int connect_port(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = { 20, 0 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int send_str(int fd, const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        if (w <= 0)
            return -1;
        s += w;
        n -= (size_t)w;
    }
    return 0;
}

struct reader {
    int fd;
    char buf[8192];
    size_t at, n;
};

static int rd_byte(struct reader *r)
{
    if (r->at == r->n) {
        ssize_t got = recv(r->fd, r->buf, sizeof r->buf, 0);
        if (got <= 0)
            return -1;
        r->at = 0;
        r->n = (size_t)got;
    }
    return (unsigned char)r->buf[r->at++];
}

/* A line without its CRLF into out; -1 at the end of the stream. */
static int rd_line(struct reader *r, char *out, size_t cap)
{
    size_t n = 0;
    int c;
    while ((c = rd_byte(r)) >= 0 && c != '\n')
        if (n + 1 < cap)
            out[n++] = (char)c;
    if (c < 0 && n == 0)
        return -1;
    if (n && out[n - 1] == '\r')
        n--;
    out[n] = 0;
    return 0;
}

struct resp {
    int status;
    char headers[4096];   /* lower-cased "name: value\n" lines */
    char *body;           /* malloc'd, NUL-terminated */
    size_t body_len;
};

static void resp_free(struct resp *r)
{
    free(r->body);
    r->body = NULL;
}

/* Header name's value (a lower-case name) into val (cap bytes), or NULL.
 * Into the caller's buffer: clients on several threads read responses at
 * once (a static one let a thread read another's Content-Length, and cut
 * its body short: http/batched and http/load failed a few runs in 100). */
static const char *resp_header(const struct resp *r, const char *name, char *val, size_t cap)
{
    size_t n = strlen(name);
    for (const char *p = r->headers; *p;) {
        const char *e = strchr(p, '\n');
        if (strncmp(p, name, n) == 0 && p[n] == ':') {
            const char *v = p + n + 1;
            while (*v == ' ')
                v++;
            size_t vn = (size_t)(e - v) < cap - 1 ? (size_t)(e - v) : cap - 1;
            memcpy(val, v, vn);
            val[vn] = 0;
            return val;
        }
        p = e + 1;
    }
    return NULL;
}

static int append(struct resp *r, size_t *cap, const char *p, size_t n)
{
    if (r->body_len + n + 1 > *cap) {
        *cap = (r->body_len + n + 1) * 2;
        char *b = realloc(r->body, *cap);
        if (!b)
            return -1;
        r->body = b;
    }
    memcpy(r->body + r->body_len, p, n);
    r->body_len += n;
    r->body[r->body_len] = 0;
    return 0;
}

/* Reads one response (Content-Length, chunked, or until close); 0 on success. */
static int read_resp(struct reader *rd, struct resp *r)
{
    char line[8192];
    memset(r, 0, sizeof *r);
    size_t cap = 0;
    do {
        if (rd_line(rd, line, sizeof line) < 0 || sscanf(line, "HTTP/1.%*d %d", &r->status) != 1)
            return -1;
        size_t hn = 0;
        r->headers[0] = 0;
        for (;;) {
            if (rd_line(rd, line, sizeof line) < 0)
                return -1;
            if (!line[0])
                break;
            for (char *p = line; *p && *p != ':'; p++)
                if (*p >= 'A' && *p <= 'Z')
                    *p += 32;
            hn += (size_t)snprintf(r->headers + hn, sizeof r->headers - hn, "%s\n", line);
            if (hn >= sizeof r->headers)
                return -1;
        }
    } while (r->status == 100);
    if (append(r, &cap, "", 0))
        return -1;
    char tev[256], clv[256];
    const char *te = resp_header(r, "transfer-encoding", tev, sizeof tev);
    const char *cl = resp_header(r, "content-length", clv, sizeof clv);
    if (te && strstr(te, "chunked")) {
        for (;;) {
            unsigned long n;
            if (rd_line(rd, line, sizeof line) < 0 || sscanf(line, "%lx", &n) != 1)
                return -1;
            if (n == 0) {
                rd_line(rd, line, sizeof line);
                return 0;
            }
            for (unsigned long i = 0; i < n; i++) {
                int c = rd_byte(rd);
                char ch = (char)c;
                if (c < 0 || append(r, &cap, &ch, 1))
                    return -1;
            }
            rd_line(rd, line, sizeof line);
        }
    }
    if (cl) {
        long n = atol(cl);
        for (long i = 0; i < n; i++) {
            int c = rd_byte(rd);
            char ch = (char)c;
            if (c < 0 || append(r, &cap, &ch, 1))
                return -1;
        }
        return 0;
    }
    int c;
    while ((c = rd_byte(rd)) >= 0) {
        char ch = (char)c;
        if (append(r, &cap, &ch, 1))
            return -1;
    }
    return 0;
}

/* One request on a new connection; status, or -1 (no connection), -2 (the
 * request could not be sent), -3 (no complete response). */
static int request(int port, const char *method, const char *path, const char *body, const char *extra,
                   struct resp *out)
{
    memset(out, 0, sizeof *out);
    int fd = connect_port(port);
    if (fd < 0)
        return -1;
    char head[1024];
    size_t bn = body ? strlen(body) : 0;
    int hn = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n%sContent-Length: %zu\r\n\r\n",
                      method, path, extra ? extra : "", bn);
    struct reader *rd = malloc(sizeof *rd);
    int rc = -2;
    if (rd && send_str(fd, head, (size_t)hn) == 0 && send_str(fd, body ? body : "", bn) == 0) {
        rd->fd = fd;
        rd->at = rd->n = 0;
        rc = read_resp(rd, out) == 0 ? out->status : -3;
    }
    free(rd);
    close(fd);
    return rc;
}

/* The error object's type of a response body ("" if there is none). */
static const char *error_type_of(const struct resp *r, char *buf, size_t cap)
{
    struct json j;
    char err[128];
    buf[0] = 0;
    if (!r->body || json_parse(&j, r->body, r->body_len, err, sizeof err))
        return buf;
    const struct json *t = json_get(json_get(&j, "error"), "type");
    const struct json *code = json_get(json_get(&j, "error"), "code");
    const struct json *msg = json_get(json_get(&j, "error"), "message");
    if (t && t->kind == JSON_STR && code && code->kind == JSON_NUM && code->num == r->status && msg &&
        msg->kind == JSON_STR)
        snprintf(buf, cap, "%s", t->str);
    json_free(&j);
    return buf;
}

/* The ids of an array of numbers at key (at most cap); count, or -1. */
static int json_ids(const struct json *o, const char *key, int32_t *ids, int cap)
{
    const struct json *a = json_get(o, key);
    if (!a || a->kind != JSON_ARR)
        return -1;
    int n = 0;
    for (size_t i = 0; i < a->len && n < cap; i++) {
        const struct json *e = &a->items[i];
        ids[n++] = e->kind == JSON_NUM ? (int32_t)e->num : -1;
        if (e->kind == JSON_OBJ && json_get(e, "id"))
            ids[n - 1] = (int32_t)json_get(e, "id")->num;
    }
    return n;
}

/* ==== the server as a subprocess ==== */

struct server_proc {
    pid_t pid;
    int port;
    char log[64];
};

static const char *strata_bin(void)
{
    const char *b = getenv("STRATA_BIN");
    return b && *b ? b : "./strata";
}

/* Starts strata serve with extra args; server_wait follows. */
static int server_spawn(struct server_proc *sp, const char *const *args)
{
    snprintf(sp->log, sizeof sp->log, "/tmp/strata-http-XXXXXX");
    int lf = mkstemp(sp->log);
    if (lf < 0)
        return -1;
    const char *argv[40];
    int n = 0;
    argv[n++] = strata_bin();
    argv[n++] = "serve";
    argv[n++] = "-m";
    argv[n++] = DEMO_MODEL;
    argv[n++] = "--port";
    argv[n++] = "0";
    argv[n++] = "-t";
    argv[n++] = "1";
    for (int i = 0; args[i] && n < 39; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    fflush(stdout);
    sp->pid = fork();
    if (sp->pid == 0) {
        dup2(lf, 2);
        int devnull = open("/dev/null", O_RDWR);
        dup2(devnull, 0);
        dup2(devnull, 1);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(lf);
    sp->port = 0;
    return 0;
}

/* Waits until the server listens (ready_too: and has said it is ready). */
static int server_wait(struct server_proc *sp, int ready_too)
{
    for (int tries = 0; tries < 400; tries++) {
        size_t len;
        char *log = test_read_file(sp->log, &len);
        const char *p = log ? strstr(log, "listening on http://127.0.0.1:") : NULL;
        if (p && strchr(p, '\n')) /* the whole line */
            sp->port = atoi(p + strlen("listening on http://127.0.0.1:"));
        int ready = log && strstr(log, "strata serve: ready");
        free(log);
        if ((ready || !ready_too) && sp->port > 0)
            return 0;
        int st;
        if (waitpid(sp->pid, &st, WNOHANG) == sp->pid) {
            sp->pid = -1;
            return -1;
        }
        usleep(25000);
    }
    return -1;
}

/* Starts strata serve with extra args and waits until it is ready. */
static int server_start(struct server_proc *sp, const char *const *args)
{
    return server_spawn(sp, args) == 0 ? server_wait(sp, 1) : -1;
}

/* SIGTERM; the exit status, or -1 if it did not exit within 20 s. */
static int server_stop(struct server_proc *sp)
{
    if (sp->pid <= 0)
        return -1;
    kill(sp->pid, SIGTERM);
    for (int i = 0; i < 800; i++) {
        int st;
        if (waitpid(sp->pid, &st, WNOHANG) == sp->pid) {
            int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            if (rc != 0) {
                char *log = test_read_file(sp->log, NULL);
                printf("  the server's stderr:\n%s", log ? log : "(none)\n");
                free(log);
            }
            unlink(sp->log);
            sp->pid = -1;
            return rc;
        }
        usleep(25000);
    }
    kill(sp->pid, SIGKILL);
    waitpid(sp->pid, NULL, 0);
    sp->pid = -1;
    return -1;
}

/* A metric's value from /metrics (-1 if absent). */
static double metric(int port, const char *name)
{
    struct resp r;
    double v = -1;
    if (request(port, "GET", "/metrics", NULL, NULL, &r) == 200) {
        size_t n = strlen(name);
        for (const char *p = r.body; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
            if (strncmp(p, name, n) == 0 && p[n] == ' ') {
                v = atof(p + n + 1);
                break;
            }
        }
    }
    resp_free(&r);
    return v;
}

/* `strata generate --temp 0 --json --logprobs n_top` for prompt: its JSON
 * output (malloc'd), NULL on failure. */
static char *generate_json(const char *prompt, int n, int n_top, size_t *len)
{
    char out[] = "/tmp/strata-http-gen-XXXXXX";
    int fd = mkstemp(out);
    if (fd < 0)
        return NULL;
    char nbuf[16], tbuf[16];
    snprintf(nbuf, sizeof nbuf, "%d", n);
    snprintf(tbuf, sizeof tbuf, "%d", n_top);
    const char *argv[] = { strata_bin(), "generate", "-m", DEMO_MODEL, "-p", prompt, "-n", nbuf, "--temp", "0",
                           "--json", "--logprobs", tbuf, "-t", "1", NULL };
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 1);
        int devnull = open("/dev/null", O_RDWR);
        dup2(devnull, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    close(fd);
    char *text = test_read_file(out, len);
    unlink(out);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
        free(text);
        return NULL;
    }
    return text;
}

/* ids of `strata generate --temp 0 --json` for prompt (with its prompt ids). */
static int generate_ids(const char *prompt, int n, int32_t *ids, int32_t *pids, int *np)
{
    size_t len;
    char *text = generate_json(prompt, n, 0, &len);
    struct json j;
    char err[128];
    int count = -1;
    if (text && json_parse(&j, text, len, err, sizeof err) == 0) {
        count = json_ids(&j, "tokens", ids, n);
        *np = json_ids(&j, "prompt_tokens", pids, 256);
        json_free(&j);
    }
    free(text);
    return count;
}

/* The `data:` payloads of an SSE body, in order (pointers into body, which
 * is modified); count. */
static int sse_events(char *body, char **ev, int cap)
{
    int n = 0;
    char *p = body;
    while (p && *p && n < cap) {
        char *end = strstr(p, "\n\n");
        if (!end)
            break;
        *end = 0;
        if (strncmp(p, "data: ", 6) != 0)
            return -1;
        ev[n++] = p + 6;
        p = end + 2;
    }
    return p && *p ? -1 : n;
}

/* ==== end-to-end cases ==== */

/* The server most cases share, started by the first case that runs. */
struct shared {
    struct server_proc sp;
    int tried, ok;
};

static int have_binary(void)
{
    if (access(strata_bin(), X_OK) == 0 && access(DEMO_MODEL, R_OK) == 0)
        return 1;
    test_skip("no ./strata or demo model");
    return 0;
}

/* The shared server's port; -1 (the case skipped or failed) without it. */
static int shared_port(struct shared *sh)
{
    if (!have_binary())
        return -1;
    if (!sh->tried) {
        /* a generous --timeout: on a loaded machine a niced client can stall for a second */
        const char *args[] = { "--parallel", "2", "--timeout", "20", "--max-body", "4K", "--max-conns", "32", NULL };
        sh->tried = 1;
        sh->ok = server_start(&sh->sp, args) == 0;
    }
    if (!CHECK(sh->ok, "strata serve did not become ready"))
        return -1;
    return sh->sp.port;
}

static void case_greedy(struct shared *sh)
{
    if (!test_begin("http/greedy-equals-generate"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    static const char *const prompts[] = { "It was a cold morning in November, and", "Hello there" };
    for (int p = 0; p < 2; p++) {
        int32_t want[24], pids[256], got[64];
        int np = 0, n = generate_ids(prompts[p], 24, want, pids, &np);
        if (!CHECK(n == 24 && np > 0, "strata generate gave %d ids", n))
            continue;
        char body[4096];
        for (int form = 0; form < 3; form++) {
            size_t bn = 0;
            if (form == 1) {
                bn += (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
                for (int i = 0; i < np; i++)
                    bn += (size_t)snprintf(body + bn, sizeof body - bn, i ? ",%d" : "%d", pids[i]);
                bn += (size_t)snprintf(body + bn, sizeof body - bn, "],");
            } else {
                bn += (size_t)snprintf(body, sizeof body, "{\"prompt\":\"%s\",", prompts[p]);
            }
            snprintf(body + bn, sizeof body - bn, "\"n_predict\":24,\"temperature\":0,\"cache_prompt\":%s%s}",
                     form == 1 ? "true" : "false", form == 2 ? ",\"stream\":true" : "");
            struct resp r;
            int st = request(port, "POST", "/completion", body, NULL, &r);
            CHECK(st == 200, "prompt %d form %d: status %d", p, form, st);
            int k = 0;
            if (form < 2) {
                struct json j;
                char err[128];
                if (CHECK(st == 200 && json_parse(&j, r.body, r.body_len, err, sizeof err) == 0, "JSON: %s", r.body)) {
                    k = json_ids(&j, "tokens", got, 64);
                    const struct json *tp = json_get(&j, "tokens_predicted"), *te = json_get(&j, "tokens_evaluated");
                    const struct json *stop = json_get(&j, "stop_type"), *tm = json_get(json_get(&j, "timings"), "predicted_n");
                    CHECK(tp && tp->num == 24 && te && te->num == np, "tokens_predicted/evaluated");
                    CHECK(stop && stop->kind == JSON_STR && strcmp(stop->str, "limit") == 0, "stop_type limit");
                    CHECK(tm && tm->num == 24, "timings.predicted_n");
                    json_free(&j);
                }
            } else {
                char *ev[128];
                int ne = st == 200 ? sse_events(r.body, ev, 128) : -1;
                CHECK(ne >= 2, "SSE events: %d", ne);
                for (int e = 0; e < ne; e++) {
                    struct json j;
                    char err[128];
                    if (!CHECK(json_parse(&j, ev[e], strlen(ev[e]), err, sizeof err) == 0, "event %d: %s", e, ev[e]))
                        break;
                    const struct json *stop = json_get(&j, "stop");
                    CHECK(stop && stop->kind == JSON_BOOL && (stop->num != 0) == (e == ne - 1),
                          "event %d: stop must be true only on the last", e);
                    int m = json_ids(&j, "tokens", got + k, 64 - k);
                    if (m > 0)
                        k += m;
                    json_free(&j);
                }
            }
            int same = k == 24;
            for (int i = 0; same && i < 24; i++)
                same = got[i] == want[i];
            CHECK(same, "prompt %d form %d: %d ids, first difference from strata generate", p, form, k);
            resp_free(&r);
        }
    }
}

static void case_logprobs(struct shared *sh)
{
    if (!test_begin("http/logprobs"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    static const char prompt[] = "Mr. Darcy said";
    size_t len;
    /* -n 512 gives generate's context the server's 512 cells: model.c's
     * numerics depend on the context size, by up to ~1e-2 in a logprob */
    char *gen = generate_json(prompt, 512, 3, &len);
    struct json want, got;
    char err[128];
    if (!CHECK(gen && json_parse(&want, gen, len, err, sizeof err) == 0, "strata generate --json")) {
        free(gen);
        return;
    }
    struct resp r;
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"n_predict\":8,\"temperature\":0,\"n_probs\":3}", prompt);
    CHECK(request(port, "POST", "/completion", body, NULL, &r) == 200, "n_probs status");
    if (CHECK(r.body && json_parse(&got, r.body, r.body_len, err, sizeof err) == 0, "JSON")) {
        const struct json *wt = json_get(&want, "tokens"), *gp = json_get(&got, "completion_probabilities");
        double max_err = 0;
        int n = wt && gp && wt->kind == JSON_ARR && gp->kind == JSON_ARR && wt->len >= gp->len ? (int)gp->len : -1;
        CHECK(n == 8, "8 probability entries");
        for (int i = 0; i < n; i++) {
            const struct json *w = &wt->items[i], *g = &gp->items[i];
            const struct json *wtop = json_get(w, "top"), *gtop = json_get(g, "top_logprobs");
            CHECK(json_get(g, "id") && json_get(g, "id")->num == json_get(w, "id")->num, "token %d: id", i);
            double d = fabs(json_get(g, "logprob")->num - json_get(w, "logprob")->num);
            max_err = d > max_err ? d : max_err;
            if (!CHECK(wtop && gtop && gtop->len == 3 && wtop->len == 3, "token %d: 3 top entries", i))
                continue;
            for (int k = 0; k < 3; k++) {
                CHECK(json_get(&gtop->items[k], "id")->num == json_get(&wtop->items[k], "id")->num, "token %d top %d id", i, k);
                d = fabs(json_get(&gtop->items[k], "logprob")->num - json_get(&wtop->items[k], "logprob")->num);
                max_err = d > max_err ? d : max_err;
            }
        }
        printf("     logprobs vs strata generate: max abs diff %.3g over %d tokens\n", max_err, n);
        CHECK(max_err <= 1e-6, "logprobs differ from strata generate by %g", max_err);
        json_free(&got);
    }
    resp_free(&r);
    json_free(&want);
    free(gen);
    /* the OpenAI shapes */
    CHECK(request(port, "POST", "/v1/chat/completions",
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4,\"logprobs\":true,\"top_logprobs\":2}",
                  NULL, &r) == 200, "chat logprobs status");
    if (CHECK(r.body && json_parse(&got, r.body, r.body_len, err, sizeof err) == 0, "chat JSON")) {
        const struct json *c = json_get(json_get(&json_get(&got, "choices")->items[0], "logprobs"), "content");
        CHECK(c && c->kind == JSON_ARR && c->len >= 1 && c->len <= 4, "logprobs.content entries");
        for (size_t i = 0; c && i < c->len; i++)
            CHECK(json_get(&c->items[i], "token") && json_get(&c->items[i], "bytes") &&
                  json_get(&c->items[i], "top_logprobs")->len == 2, "entry %zu shape", i);
        json_free(&got);
    }
    resp_free(&r);
    CHECK(request(port, "POST", "/v1/completions", "{\"prompt\":\"It was\",\"max_tokens\":4,\"logprobs\":2}", NULL,
                  &r) == 200, "completions logprobs status");
    if (CHECK(r.body && json_parse(&got, r.body, r.body_len, err, sizeof err) == 0, "completions JSON")) {
        const struct json *lp = json_get(&json_get(&got, "choices")->items[0], "logprobs");
        const struct json *t = json_get(lp, "tokens"), *tl = json_get(lp, "token_logprobs"), *tt = json_get(lp, "top_logprobs");
        CHECK(t && tl && tt && t->len == tl->len && t->len == tt->len && json_get(lp, "text_offset"),
              "legacy logprobs arrays of one length");
        json_free(&got);
    }
    resp_free(&r);
}

static void case_streams(struct shared *sh)
{
    if (!test_begin("http/streams"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    static const char chat[] =
        "{\"messages\":[{\"role\":\"system\",\"content\":\"You write like Jane Austen.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Tell me of Bath.\"}]}],"
        "\"max_tokens\":20,\"temperature\":0%s}";
    char body[512];
    struct resp plain, streamed;
    snprintf(body, sizeof body, chat, "");
    CHECK(request(port, "POST", "/v1/chat/completions", body, NULL, &plain) == 200, "chat status");
    snprintf(body, sizeof body, chat, ",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
    CHECK(request(port, "POST", "/v1/chat/completions", body, NULL, &streamed) == 200, "chat stream status");
    char ctv[256];
    const char *ct = resp_header(&streamed, "content-type", ctv, sizeof ctv);
    CHECK(ct && strncmp(ct, "text/event-stream", 17) == 0, "stream content type");
    struct json j;
    char err[128], want[4096] = "", got[4096] = "";
    if (CHECK(json_parse(&j, plain.body, plain.body_len, err, sizeof err) == 0, "chat JSON")) {
        const struct json *ch = json_get(&j, "choices");
        const struct json *c0 = ch && ch->kind == JSON_ARR && ch->len == 1 ? &ch->items[0] : NULL;
        const struct json *msg = json_get(c0, "message"), *content = json_get(msg, "content");
        const struct json *obj = json_get(&j, "object"), *usage = json_get(&j, "usage");
        const struct json *fr = json_get(c0, "finish_reason"), *id = json_get(&j, "id");
        CHECK(content && content->kind == JSON_STR, "message.content");
        CHECK(obj && obj->kind == JSON_STR && strcmp(obj->str, "chat.completion") == 0, "object");
        CHECK(id && id->kind == JSON_STR && strncmp(id->str, "chatcmpl-", 9) == 0, "id");
        CHECK(fr && fr->kind == JSON_STR && (strcmp(fr->str, "length") == 0 || strcmp(fr->str, "stop") == 0), "finish_reason");
        CHECK(json_get(usage, "completion_tokens") && json_get(usage, "prompt_tokens") && json_get(usage, "total_tokens"), "usage");
        CHECK(json_get(json_get(&j, "timings"), "predicted_ms") != NULL, "timings");
        if (content && content->kind == JSON_STR)
            snprintf(want, sizeof want, "%s", content->str);
        json_free(&j);
    }
    char *ev[128];
    int ne = sse_events(streamed.body, ev, 128);
    CHECK(ne >= 4 && strcmp(ev[ne - 1], "[DONE]") == 0, "%d events; the last must be [DONE]", ne);
    for (int e = 0; e < ne - 1; e++) {
        if (!CHECK(json_parse(&j, ev[e], strlen(ev[e]), err, sizeof err) == 0, "event %d JSON", e))
            break;
        const struct json *obj = json_get(&j, "object"), *ch = json_get(&j, "choices");
        CHECK(obj && obj->kind == JSON_STR && strcmp(obj->str, "chat.completion.chunk") == 0, "chunk object");
        if (e == ne - 2) {
            CHECK(ch && ch->kind == JSON_ARR && ch->len == 0 && json_get(&j, "usage"), "the usage chunk");
        } else if (ch && ch->kind == JSON_ARR && ch->len == 1) {
            const struct json *d = json_get(&ch->items[0], "delta"), *c = json_get(d, "content");
            const struct json *fr = json_get(&ch->items[0], "finish_reason");
            if (e == 0)
                CHECK(json_get(d, "role") && strcmp(json_get(d, "role")->str, "assistant") == 0, "first delta: role");
            CHECK(fr && (fr->kind == JSON_NULL) == (e < ne - 3), "event %d: finish_reason only on the last choice", e);
            if (c && c->kind == JSON_STR)
                strncat(got, c->str, sizeof got - strlen(got) - 1);
        } else {
            CHECK(0, "event %d: choices", e);
        }
        json_free(&j);
    }
    CHECK(strcmp(want, got) == 0, "streamed text '%s' != '%s'", got, want);
    resp_free(&plain);
    resp_free(&streamed);

    struct resp r;
    CHECK(request(port, "POST", "/v1/completions", "{\"prompt\":\"It was\",\"max_tokens\":5,\"stream\":true}", NULL, &r) == 200,
          "completions stream");
    ne = sse_events(r.body, ev, 128);
    CHECK(ne >= 2 && strcmp(ev[ne - 1], "[DONE]") == 0, "/v1/completions stream ends with [DONE]");
    resp_free(&r);
    CHECK(request(port, "POST", "/completion", "{\"prompt\":\"It was\",\"n_predict\":3,\"stream\":true}", NULL, &r) == 200,
          "native stream");
    ne = sse_events(r.body, ev, 128);
    CHECK(ne >= 2 && strcmp(ev[ne - 1], "[DONE]") != 0, "/completion stream ends without [DONE]");
    resp_free(&r);
}

static void case_errors(struct shared *sh)
{
    if (!test_begin("http/bad-requests"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    char big[4000];
    memset(big, 0, sizeof big);
    strcpy(big, "{\"prompt\":\"");
    for (int i = 0; i < 600; i++)
        strcat(big, "word ");
    strcat(big, "\"}");
    static const struct { const char *method, *path, *body; int status; const char *type; } cases[] = {
        { "POST", "/completion", "{bad json", 400, "invalid_request_error" },
        { "POST", "/completion", "", 400, "invalid_request_error" },
        { "POST", "/completion", "[1,2]", 400, "invalid_request_error" },
        { "POST", "/completion", "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "invalid_request_error" },
        { "POST", "/completion", "{\"prompt\":[1,99999999]}", 400, "invalid_request_error" },
        { "POST", "/completion", "{\"prompt\":[\"a\",\"b\"]}", 400, "invalid_request_error" },
        { "POST", "/completion", "{\"n_predict\":3}", 400, "invalid_request_error" },
        { "POST", "/v1/chat/completions", "{\"max_tokens\":3}", 400, "invalid_request_error" },
        { "POST", "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":2}", 400, "invalid_request_error" },
        { "POST", "/v1/chat/completions", "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", 400, "invalid_request_error" },
        { "POST", "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "invalid_request_error" },
        { "POST", "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400, "invalid_request_error" },
        { "POST", "/v1/chat/completions", "{\"messages\":\"hi\"}", 400, "invalid_request_error" },
        { "POST", "/tokenize", "{\"content\":7}", 400, "invalid_request_error" },
        { "POST", "/detokenize", "{\"tokens\":[-1]}", 400, "invalid_request_error" },
        { "GET", "/nowhere", NULL, 404, "not_found_error" },
        { "GET", "/v1/chat/completions", NULL, 405, "invalid_request_error" },
        { "POST", "/health", "{}", 405, "invalid_request_error" },
        { "POST", "/completion", NULL, 400, "exceed_context_size_error" },
    };
    char type[64];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        struct resp r;
        const char *body = cases[i].type[0] == 'e' ? big : cases[i].body;
        int st = request(port, cases[i].method, cases[i].path, body, NULL, &r);
        CHECK(st == cases[i].status, "case %zu (%s %s): status %d, expected %d", i, cases[i].method, cases[i].path,
              st, cases[i].status);
        CHECK(strcmp(error_type_of(&r, type, sizeof type), cases[i].type) == 0, "case %zu: error type '%s' in %s", i,
              type, r.body ? r.body : "");
        if (i == sizeof cases / sizeof *cases - 1)
            CHECK(r.body && strstr(r.body, "512"), "the message names the context size: %s", r.body);
        resp_free(&r);
    }
    struct resp r;
    CHECK(request(port, "GET", "/health", NULL, NULL, &r) == 200 && strstr(r.body, "\"ok\""), "healthy afterwards");
    resp_free(&r);
}

/* Sends raw bytes on a new connection; the response status (-1 none). */
static int raw_status(int port, const char *data, size_t n, int wait_ms)
{
    int fd = connect_port(port);
    if (fd < 0)
        return -1;
    send_str(fd, data, n);
    if (wait_ms)
        usleep((useconds_t)wait_ms * 1000);
    struct reader *rd = malloc(sizeof *rd);
    struct resp r;
    int st = -1;
    if (rd) {
        rd->fd = fd;
        rd->at = rd->n = 0;
        if (read_resp(rd, &r) == 0)
            st = r.status;
        resp_free(&r);
    }
    free(rd);
    close(fd);
    return st;
}

static void case_limits(struct shared *sh)
{
    if (!test_begin("http/limits"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    size_t hn = 17 * 1024;
    char *huge = malloc(hn + 64);
    int n = snprintf(huge, hn + 64, "GET /health HTTP/1.1\r\nX-Big: ");
    memset(huge + n, 'a', hn - (size_t)n);
    memcpy(huge + hn, "\r\n\r\n", 5);
    CHECK(raw_status(port, huge, hn + 4, 0) == 431, "17 KiB of headers: 431");
    free(huge);
    static const char too_big[] = "POST /completion HTTP/1.1\r\nContent-Length: 5000\r\n\r\n{";
    CHECK(raw_status(port, too_big, sizeof too_big - 1, 0) == 413, "a body over --max-body 4K: 413");
    static const char chunked[] = "POST /completion HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
    CHECK(raw_status(port, chunked, sizeof chunked - 1, 0) == 411, "chunked body: 411");
    static const char malformed[] = "GET /health HTTP/1.1\r\nBad Header\r\n\r\n";
    CHECK(raw_status(port, malformed, sizeof malformed - 1, 0) == 400, "malformed header: 400");
    static const char bad_len[] = "POST /completion HTTP/1.1\r\nContent-Length: 1x\r\n\r\n";
    CHECK(raw_status(port, bad_len, sizeof bad_len - 1, 0) == 400, "bad Content-Length: 400");
    /* 408 on a server of its own, with a 1 s timeout */
    struct server_proc quick;
    const char *args[] = { "--timeout", "1", "--parallel", "1", NULL };
    if (!CHECK(server_start(&quick, args) == 0, "the --timeout 1 server did not start"))
        return;
    double t0 = (double)time(NULL);
    static const char slow[] = "GET /health HTTP/1.1\r\nHost:";
    CHECK(raw_status(quick.port, slow, sizeof slow - 1, 0) == 408, "an unfinished request: 408");
    static const char slow_body[] = "POST /tokenize HTTP/1.1\r\nContent-Length: 20\r\n\r\n{\"con";
    CHECK(raw_status(quick.port, slow_body, sizeof slow_body - 1, 0) == 408, "an unfinished body: 408");
    CHECK((double)time(NULL) - t0 < 10, "408 arrives after the timeout, not later");
    int fd = connect_port(quick.port);
    char c;
    CHECK(fd >= 0 && recv(fd, &c, 1, 0) == 0, "an idle connection is closed without a response");
    if (fd >= 0)
        close(fd);
    CHECK(server_stop(&quick) == 0, "SIGTERM: exit 0");
}

static void case_byte_by_byte(struct shared *sh)
{
    if (!test_begin("http/byte-by-byte"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    static const char *const reqs[] = {
        "GET /health HTTP/1.1\r\nHost: t\r\n\r\n",
        "POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length: 19\r\n\r\n{\"content\":\"Hello\"}",
    };
    static const int want[] = { 200, 200 };
    for (int q = 0; q < 2; q++) {
        int fd = connect_port(port);
        if (!CHECK(fd >= 0, "connect"))
            return;
        size_t n = strlen(reqs[q]);
        int early = 0;
        for (size_t k = 0; k < n; k++) {
            send_str(fd, reqs[q] + k, 1);
            struct pollfd p = { fd, POLLIN, 0 };
            if (k + 1 < n && poll(&p, 1, k % 8 == 0 ? 5 : 0) > 0)
                early = 1;
        }
        CHECK(!early, "request %d: a response before the request was complete", q);
        struct reader *rd = malloc(sizeof *rd);
        struct resp r;
        rd->fd = fd;
        rd->at = rd->n = 0;
        CHECK(read_resp(rd, &r) == 0 && r.status == want[q], "request %d: status %d", q, r.status);
        if (q == 1)
            CHECK(r.body && strcmp(r.body, "{\"tokens\":[15043]}") == 0, "tokenize: %s", r.body);
        resp_free(&r);
        free(rd);
        close(fd);
    }
    /* Expect: 100-continue: the interim answer comes before the body is sent */
    int fd = connect_port(port);
    static const char head[] = "POST /tokenize HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 19\r\n\r\n";
    char line[64] = "";
    struct reader *rd = malloc(sizeof *rd);
    rd->fd = fd;
    rd->at = rd->n = 0;
    send_str(fd, head, sizeof head - 1);
    CHECK(rd_line(rd, line, sizeof line) == 0 && strcmp(line, "HTTP/1.1 100 Continue") == 0, "interim: '%s'", line);
    rd_line(rd, line, sizeof line);
    send_str(fd, "{\"content\":\"Hello\"}", 19);
    struct resp r;
    CHECK(read_resp(rd, &r) == 0 && r.status == 200 && r.body && strcmp(r.body, "{\"tokens\":[15043]}") == 0,
          "after 100 Continue: %d %s", r.status, r.body ? r.body : "");
    resp_free(&r);
    free(rd);
    close(fd);
}

static void case_keep_alive(struct shared *sh)
{
    if (!test_begin("http/keep-alive"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    int fd = connect_port(port);
    if (!CHECK(fd >= 0, "connect"))
        return;
    struct reader *rd = malloc(sizeof *rd);
    rd->fd = fd;
    rd->at = rd->n = 0;
    static const char post[] = "POST /completion HTTP/1.1\r\nHost: t\r\nContent-Length: %zu\r\n\r\n%s";
    static const char b1[] = "{\"prompt\":\"Hello\",\"n_predict\":3,\"seed\":1}";
    static const char b3[] = "{\"prompt\":\"Hi\",\"n_predict\":4,\"stream\":true,\"seed\":1}";
    char p1[256], p3[256];
    snprintf(p1, sizeof p1, post, sizeof b1 - 1, b1);
    snprintf(p3, sizeof p3, post, sizeof b3 - 1, b3);
    const char *const seq[] = {
        "GET /health HTTP/1.1\r\nHost: t\r\n\r\n",
        p1,
        "GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n",
        p3,
        "GET /health HTTP/1.1\r\nHost: t\r\n\r\nGET /tokenize HTTP/1.1\r\nHost: t\r\n\r\n",
    };
    static const int want[][2] = { { 200, 0 }, { 200, 0 }, { 200, 0 }, { 200, 0 }, { 200, 405 } };
    for (int i = 0; i < 5; i++) {
        CHECK(send_str(fd, seq[i], strlen(seq[i])) == 0, "send %d", i);
        for (int k = 0; k < 2 && want[i][k]; k++) {
            struct resp r;
            int ok = read_resp(rd, &r) == 0;
            CHECK(ok && r.status == want[i][k], "request %d.%d: status %d", i, k, ok ? r.status : -1);
            char cv[256];
            const char *conn = resp_header(&r, "connection", cv, sizeof cv);
            CHECK(conn && strcmp(conn, "keep-alive") == 0, "request %d.%d: Connection: keep-alive", i, k);
            resp_free(&r);
        }
    }
    free(rd);
    close(fd);
}

struct par_arg {
    int port, stream, leave;
    char body[256];
    char text[2048];
    int status;
    int ended;            /* the answer (a stream's last event) had "stop": true */
};

static void *par_client(void *p)
{
    struct par_arg *a = p;
    if (a->leave) {
        /* starts a long stream, reads a little, and hangs up */
        int fd = connect_port(a->port);
        char req[512], buf[256];
        int n = snprintf(req, sizeof req, "POST /completion HTTP/1.1\r\nHost: t\r\nContent-Length: %zu\r\n\r\n%s",
                         strlen(a->body), a->body);
        send_str(fd, req, (size_t)n);
        a->status = recv(fd, buf, sizeof buf, 0) > 0 ? 200 : -1;
        close(fd);
        return NULL;
    }
    struct resp r;
    a->status = request(a->port, "POST", "/completion", a->body, NULL, &r);
    if (a->status == 200 && !a->stream) {
        struct json j;
        char err[128];
        if (json_parse(&j, r.body, r.body_len, err, sizeof err) == 0) {
            const struct json *c = json_get(&j, "content"), *stop = json_get(&j, "stop");
            if (c && c->kind == JSON_STR)
                snprintf(a->text, sizeof a->text, "%s", c->str);
            a->ended = c && c->kind == JSON_STR && stop && stop->kind == JSON_BOOL && stop->num != 0;
            json_free(&j);
        }
    } else if (a->status == 200) {
        char **ev = malloc(1024 * sizeof *ev);
        int ne = ev ? sse_events(r.body, ev, 1024) : -1;
        if (ne < 0)
            a->status = -2; /* not a well-formed event stream */
        for (int e = 0; e < ne; e++) {
            struct json j;
            char err[128];
            if (json_parse(&j, ev[e], strlen(ev[e]), err, sizeof err) == 0) {
                const struct json *c = json_get(&j, "content"), *stop = json_get(&j, "stop");
                if (c && c->kind == JSON_STR)
                    strncat(a->text, c->str, sizeof a->text - strlen(a->text) - 1);
                a->ended = e == ne - 1 && stop && stop->kind == JSON_BOOL && stop->num != 0;
                json_free(&j);
            }
        }
        free(ev);
    }
    resp_free(&r);
    return NULL;
}

static void case_parallel(struct shared *sh)
{
    if (!test_begin("http/parallel-slots"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    static const char *const prompts[] = { "The morning was", "Mr. Darcy said", "She walked into the", "It was" };
    struct par_arg serial[4], par[6];
    pthread_t th[6];
    for (int i = 0; i < 4; i++) {
        memset(&serial[i], 0, sizeof serial[i]);
        serial[i].port = port;
        snprintf(serial[i].body, sizeof serial[i].body,
                 "{\"prompt\":\"%s\",\"n_predict\":32,\"temperature\":0,\"cache_prompt\":false}", prompts[i]);
        par_client(&serial[i]);
        CHECK(serial[i].status == 200 && serial[i].text[0], "serial %d", i);
    }
    double gen0 = metric(port, "strata_generated_tokens_total");
    for (int i = 0; i < 6; i++) {
        memset(&par[i], 0, sizeof par[i]);
        par[i].port = port;
        par[i].stream = i % 2;
        par[i].leave = i >= 4;
        if (par[i].leave)
            snprintf(par[i].body, sizeof par[i].body, "{\"prompt\":\"Once\",\"n_predict\":400,\"stream\":true}");
        else
            snprintf(par[i].body, sizeof par[i].body,
                     "{\"prompt\":\"%s\",\"n_predict\":32,\"temperature\":0,\"cache_prompt\":false%s}", prompts[i],
                     par[i].stream ? ",\"stream\":true" : "");
        pthread_create(&th[i], NULL, par_client, &par[i]);
    }
    for (int i = 0; i < 6; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++)
        CHECK(par[i].status == 200 && strcmp(par[i].text, serial[i].text) == 0,
              "parallel %d (stream %d): '%s' != serial '%s'", i, par[i].stream, par[i].text, serial[i].text);
    double used = -1, processing = -1;
    for (int tries = 0; tries < 100; tries++) {
        used = metric(port, "strata_kv_cells_used");
        processing = metric(port, "strata_requests_processing");
        if (used == 0 && processing == 0)
            break;
        usleep(20000);
    }
    CHECK(used == 0 && processing == 0, "after the clients: kv cells used %g, processing %g", used, processing);
    double gen1 = metric(port, "strata_generated_tokens_total");
    CHECK(gen1 - gen0 > 0 && gen1 - gen0 <= 4 * 32 + 2 * 400, "generated tokens moved by %g", gen1 - gen0);
    CHECK(metric(port, "strata_kv_cells_total") == 2 * 512, "kv cells total: 2 slots of 512");
}

struct load_arg {
    int port, id, ok, refused, bad;
    char first_bad[300];
};

static void *load_client(void *p)
{
    struct load_arg *a = p;
    for (int i = 0; i < 6; i++) {
        struct par_arg q;
        memset(&q, 0, sizeof q);
        q.port = a->port;
        q.stream = (a->id + i) % 2;
        q.leave = (a->id + i) % 3 == 0;
        snprintf(q.body, sizeof q.body, "{\"prompt\":\"Chapter %d.\",\"n_predict\":%d%s}", a->id * 10 + i,
                 q.leave ? 300 : 8 + i, q.stream || q.leave ? ",\"stream\":true" : "");
        par_client(&q);
        /* (a sampled answer may be empty: its first token can be the end) */
        if (q.status == 200 && (q.leave || q.ended))
            a->ok++;
        else if (q.status == 503)
            a->refused++;
        else if (a->bad++ == 0)
            snprintf(a->first_bad, sizeof a->first_bad, "status %d for %s", q.status, q.body);
    }
    return NULL;
}

static void case_load(struct shared *sh)
{
    if (!test_begin("http/load"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    struct load_arg a[16];
    pthread_t th[16];
    for (int i = 0; i < 16; i++) {
        a[i] = (struct load_arg){ port, i, 0, 0, 0, "" };
        pthread_create(&th[i], NULL, load_client, &a[i]);
    }
    int ok = 0, refused = 0, bad = 0;
    const char *first_bad = "";
    for (int i = 0; i < 16; i++) {
        pthread_join(th[i], NULL);
        ok += a[i].ok;
        refused += a[i].refused;
        bad += a[i].bad;
        if (a[i].bad && !first_bad[0])
            first_bad = a[i].first_bad;
    }
    CHECK(bad == 0 && ok + refused == 96 && ok > 0, "%d answered, %d refused, %d bad (first: %s)", ok, refused, bad,
          first_bad);
    double used = -1, busy = -1, queued = -1;
    for (int tries = 0; tries < 200; tries++) {
        used = metric(port, "strata_kv_cells_used");
        busy = metric(port, "strata_requests_processing");
        queued = metric(port, "strata_requests_queued");
        if (used == 0 && busy == 0 && queued == 0)
            break;
        usleep(20000);
    }
    CHECK(used == 0 && busy == 0 && queued == 0, "after the load: kv used %g, processing %g, queued %g", used, busy, queued);
    struct resp r;
    CHECK(request(port, "GET", "/health", NULL, NULL, &r) == 200, "healthy after the load");
    resp_free(&r);
}

static void case_metrics(struct shared *sh)
{
    if (!test_begin("http/metrics"))
        return;
    int port = shared_port(sh);
    if (port < 0)
        return;
    struct resp r;
    CHECK(request(port, "GET", "/metrics", NULL, NULL, &r) == 200, "metrics status");
    CHECK(r.body && strstr(r.body, "# TYPE strata_requests_total counter") &&
          strstr(r.body, "# TYPE strata_decode_tokens_per_second gauge") && strstr(r.body, "llamacpp:prompt_tokens_total"),
          "HELP/TYPE lines and the llamacpp: names");
    resp_free(&r);
    int n_prompt = -1;
    if (request(port, "POST", "/tokenize", "{\"content\":\"Upon my word\",\"add_special\":true}", NULL, &r) == 200) {
        struct json j;
        char err[128];
        int32_t ids[64];
        if (json_parse(&j, r.body, r.body_len, err, sizeof err) == 0) {
            n_prompt = json_ids(&j, "tokens", ids, 64);
            json_free(&j);
        }
    }
    resp_free(&r);
    double g0 = metric(port, "strata_generated_tokens_total"), p0 = metric(port, "strata_prompt_tokens_total");
    char line[] = "strata_requests_total{route=\"/completion\",status=\"200\"}";
    double c0 = metric(port, line);
    CHECK(request(port, "POST", "/completion", "{\"prompt\":\"Upon my word\",\"n_predict\":7,\"cache_prompt\":false}",
                  NULL, &r) == 200, "completion");
    resp_free(&r);
    CHECK(metric(port, "strata_generated_tokens_total") - g0 == 7, "generated tokens +7");
    CHECK(n_prompt > 1 && metric(port, "strata_prompt_tokens_total") - p0 == n_prompt, "prompt tokens +%d", n_prompt);
    CHECK(metric(port, line) - (c0 < 0 ? 0 : c0) == 1, "requests_total{/completion,200} +1");
}

static void case_auth_and_conns(void)
{
    if (!test_begin("http/api-key-max-conns"))
        return;
    if (!have_binary())
        return;
    struct server_proc sp;
    const char *args[] = { "--api-key", "s3cret", "--max-conns", "2", "--parallel", "1", NULL };
    if (!CHECK(server_start(&sp, args) == 0, "server did not start"))
        return;
    /* on one keep-alive connection: closed ones could still count against --max-conns 2 */
    static const struct { const char *path, *auth; int status; } auth[] = {
        { "/v1/models", "", 401 },
        { "/v1/models", "Authorization: Bearer s3cre\r\n", 401 },
        { "/v1/models", "Authorization: Bearer s3cretX\r\n", 401 },
        { "/v1/models", "Authorization: Basic s3cret\r\n", 401 },
        { "/v1/models", "Authorization: Bearer s3cret\r\n", 200 },
        { "/metrics", "Authorization: bearer s3cret\r\n", 200 },
        { "/health", "", 200 },
    };
    int fd = connect_port(sp.port);
    struct reader *rd = malloc(sizeof *rd);
    rd->fd = fd;
    rd->at = rd->n = 0;
    struct resp r;
    for (size_t i = 0; i < sizeof auth / sizeof *auth; i++) {
        char req[256];
        int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: t\r\n%s\r\n", auth[i].path, auth[i].auth);
        int ok = send_str(fd, req, (size_t)n) == 0 && read_resp(rd, &r) == 0;
        CHECK(ok && r.status == auth[i].status, "case %zu (%s%s): status %d, expected %d", i, auth[i].path,
              auth[i].auth, ok ? r.status : -1, auth[i].status);
        char hv[256];
        if (ok && auth[i].status == 401)
            CHECK(resp_header(&r, "www-authenticate", hv, sizeof hv) != NULL, "WWW-Authenticate on 401");
        resp_free(&r);
    }
    free(rd);
    close(fd);
    usleep(200000);
    int a = connect_port(sp.port), b = connect_port(sp.port);
    usleep(200000);
    CHECK(raw_status(sp.port, "", 0, 0) == 503, "a third connection: 503");
    close(a);
    close(b);
    int st = -1;
    for (int tries = 0; tries < 50 && st != 200; tries++) {
        usleep(50000);
        st = request(sp.port, "GET", "/health", NULL, NULL, &r);
        resp_free(&r);
    }
    CHECK(st == 200, "served again once they close");
    CHECK(server_stop(&sp) == 0, "SIGTERM: exit 0");
}

static int run_cmd(const char *cmd)
{
    fflush(stdout);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void case_real_clients(struct shared *sh)
{
    int port;
    if (test_begin("http/python-client") && (port = shared_port(sh)) >= 0) {
        if (run_cmd("command -v python3 >/dev/null 2>&1") != 0) {
            test_skip("no python3");
        } else {
            char cmd[4096];
            snprintf(cmd, sizeof cmd,
                     "python3 - %d <<'EOF'\n"
                     "import http.client, json, sys\n"
                     "c = http.client.HTTPConnection('127.0.0.1', int(sys.argv[1]), timeout=20)\n"
                     "def post(path, body):\n"
                     "    c.request('POST', path, json.dumps(body), {'Content-Type': 'application/json'})\n"
                     "    r = c.getresponse(); return r.status, r.getheader('Content-Type'), r.read()\n"
                     "st, ct, b = post('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'Hello'}], 'max_tokens': 8})\n"
                     "j = json.loads(b); assert st == 200 and ct.startswith('application/json'), st\n"
                     "assert j['object'] == 'chat.completion' and j['choices'][0]['message']['role'] == 'assistant'\n"
                     "assert 0 < j['usage']['completion_tokens'] <= 8 and j['usage']['prompt_tokens'] > 0\n"
                     "st, ct, b = post('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'Hello'}], 'max_tokens': 8, 'stream': True})\n"
                     "ev = [e for e in b.decode().split('\\n\\n') if e]\n"
                     "assert st == 200 and ct.startswith('text/event-stream') and ev[-1] == 'data: [DONE]', ev[-1:]\n"
                     "for e in ev[:-1]: assert json.loads(e[6:])['object'] == 'chat.completion.chunk'\n"
                     "st, ct, b = post('/tokenize', {'content': 'Hello world'})\n"
                     "assert st == 200 and json.loads(b) == {'tokens': [15043, 3186]}, b\n"
                     "st, ct, b = post('/detokenize', {'tokens': [15043, 3186]})\n"
                     "assert st == 200 and json.loads(b) == {'content': ' Hello world'}, b\n"
                     "st, ct, b = post('/completion', {'prompt': 'x', 'n_predict': 2, 'n': 3})\n"
                     "assert st == 400 and json.loads(b)['error']['code'] == 400\n"
                     "c.request('GET', '/v1/models'); r = c.getresponse(); j = json.loads(r.read())\n"
                     "assert r.status == 200 and j['object'] == 'list' and j['data'][0]['id'] == 'strata-demo-Q8_0.gguf'\n"
                     "EOF",
                     port);
            CHECK(run_cmd(cmd) == 0, "the Python client's checks failed (its traceback is above)");
        }
    }
    if (test_begin("http/curl") && (port = shared_port(sh)) >= 0) {
        if (run_cmd("command -v curl >/dev/null 2>&1") != 0) {
            test_skip("no curl");
        } else {
            char cmd[2048];
            snprintf(cmd, sizeof cmd,
                     "set -e; u=http://127.0.0.1:%d; "
                     "curl -sf $u/health | grep -q '\"ok\"'; "
                     "curl -sf $u/ | grep -q '<title>Strata chat</title>'; "
                     "curl -sf $u/metrics | grep -q '^strata_kv_cells_total 1024'; "
                     "curl -sfN $u/v1/chat/completions -H 'Content-Type: application/json' "
                     "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4,\"stream\":true}' | tail -n 2 | grep -q '^data: \\[DONE\\]$'; "
                     "test \"$(curl -s -o /dev/null -w '%%{http_code}' $u/v1/chat/completions -d '{')\" = 400; "
                     "curl -sf $u/health >/dev/null",
                     port);
            CHECK(run_cmd(cmd) == 0, "a curl check failed");
        }
    }
}

/* The string at a path of keys and array indices ("0" picks an element). */
static const struct json *json_path(const struct json *j, const char *const *keys)
{
    for (; j && *keys; keys++) {
        if (j->kind == JSON_ARR)
            j = (size_t)atoi(*keys) < j->len ? &j->items[atoi(*keys)] : NULL;
        else
            j = json_get(j, *keys);
    }
    return j;
}

static int same_str(const struct json *a, const struct json *b)
{
    return a && b && a->kind == JSON_STR && b->kind == JSON_STR && a->len == b->len && memcmp(a->str, b->str, a->len) == 0;
}

/* The official OpenAI Node client (test_openai.mjs, from build/npm) checks
 * its own view of the answers; its greedy texts and log-probabilities must
 * be the ones the server gives for the same requests made directly. */
static void case_openai_node(struct shared *sh)
{
    int port;
    if (!test_begin("http/openai-node-client") || (port = shared_port(sh)) < 0)
        return;
    if (run_cmd("command -v node >/dev/null 2>&1") != 0) {
        test_skip("no node");
        return;
    }
    if (access("build/npm/node_modules/openai/package.json", R_OK) != 0) {
        test_skip("no openai package (npm install --prefix build/npm openai)");
        return;
    }
    char out[] = "/tmp/strata-http-node-XXXXXX";
    int fd = mkstemp(out);
    if (fd < 0)
        return;
    close(fd);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "STRATA_NPM=build/npm node test_openai.mjs %d > %s", port, out);
    int rc = run_cmd(cmd);
    size_t len = 0;
    char *text = test_read_file(out, &len);
    unlink(out);
    struct json got;
    char err[128];
    if (!CHECK(rc == 0 && text, "node test_openai.mjs exited %d (its error is above)", rc) ||
        !CHECK(json_parse(&got, text, len, err, sizeof err) == 0, "its output: %s", text)) {
        free(text);
        return;
    }
    struct resp r;
    struct json j;
    const char *chat_body = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":12,"
                            "\"temperature\":0,\"logprobs\":true,\"top_logprobs\":3}";
    if (CHECK(request(port, "POST", "/v1/chat/completions", chat_body, NULL, &r) == 200, "direct chat: %d", r.status) &&
        CHECK(json_parse(&j, r.body, r.body_len, err, sizeof err) == 0, "direct chat JSON")) {
        const char *content[] = { "choices", "0", "message", "content", NULL };
        const char *lps[] = { "choices", "0", "logprobs", "content", NULL };
        CHECK(same_str(json_path(&j, content), json_get(&got, "chat")), "the client's chat text differs: %s", text);
        const struct json *want = json_path(&j, lps), *have = json_get(&got, "logprobs");
        int same = want && have && want->kind == JSON_ARR && have->kind == JSON_ARR && want->len == have->len &&
                   want->len > 0;
        double maxd = 0;
        for (size_t i = 0; same && i < want->len; i++) {
            const struct json *w = json_get(&want->items[i], "logprob");
            same = w && have->items[i].kind == JSON_NUM;
            if (same && fabs(w->num - have->items[i].num) > maxd)
                maxd = fabs(w->num - have->items[i].num);
        }
        printf("  log-probabilities through the client: max abs difference %.3g\n", maxd);
        CHECK(same && maxd == 0, "the client's log-probabilities differ (max %.3g)", maxd);
        json_free(&j);
    }
    resp_free(&r);
    const char *cmpl_body =
        "{\"model\":\"m\",\"prompt\":\"It was a cold morning in November, and\",\"max_tokens\":12,\"temperature\":0}";
    if (CHECK(request(port, "POST", "/v1/completions", cmpl_body, NULL, &r) == 200, "direct completion: %d", r.status) &&
        CHECK(json_parse(&j, r.body, r.body_len, err, sizeof err) == 0, "direct completion JSON")) {
        const char *txt[] = { "choices", "0", "text", NULL };
        CHECK(same_str(json_path(&j, txt), json_get(&got, "completion")), "the client's completion differs: %s", text);
        json_free(&j);
    }
    resp_free(&r);
    if (CHECK(request(port, "GET", "/v1/models", NULL, NULL, &r) == 200, "direct models: %d", r.status) &&
        CHECK(json_parse(&j, r.body, r.body_len, err, sizeof err) == 0, "direct models JSON")) {
        const char *id[] = { "data", "0", "id", NULL };
        CHECK(same_str(json_path(&j, id), json_get(&got, "model")), "the client's model id differs: %s", text);
        json_free(&j);
    }
    resp_free(&r);
    json_free(&got);
    free(text);
}

/* The chat page in headless Chromium (test_chat_page.mjs, puppeteer-core from
 * build/npm): a message typed and sent; the streamed reply the page renders
 * must be the server's greedy answer (--temp 0: the page sends no sampling
 * fields) to the same message. */
static void case_chat_page(void)
{
    if (!test_begin("http/chat-page-chromium") || !have_binary())
        return;
    const char *chromium = getenv("CHROMIUM") ? getenv("CHROMIUM") : "/usr/bin/chromium";
    if (run_cmd("command -v node >/dev/null 2>&1") != 0 || access(chromium, X_OK) != 0 ||
        access("build/npm/node_modules/puppeteer-core/package.json", R_OK) != 0) {
        test_skip("needs node, chromium and puppeteer-core in build/npm");
        return;
    }
    struct server_proc sp;
    memset(&sp, 0, sizeof sp);
    const char *args[] = { "--parallel", "1", "--temp", "0", "--max-tokens", "16", NULL };
    if (!CHECK(server_start(&sp, args) == 0, "strata serve did not become ready")) {
        server_stop(&sp);
        return;
    }
    char out[] = "/tmp/strata-http-page-XXXXXX";
    int fd = mkstemp(out);
    if (fd >= 0)
        close(fd);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "STRATA_NPM=build/npm node test_chat_page.mjs %d 'Hello there' > %s", sp.port, out);
    int rc = fd >= 0 ? run_cmd(cmd) : -1;
    size_t len = 0;
    char *text = test_read_file(out, &len);
    unlink(out);
    if (text)
        len = strcspn(text, "\n"), text[len] = 0; /* its one line */
    struct json got, j;
    char err[128];
    struct resp r;
    if (CHECK(rc == 0 && text, "node test_chat_page.mjs exited %d (its error is above)", rc) &&
        CHECK(json_parse(&got, text, len, err, sizeof err) == 0, "its output: %s", text)) {
        const struct json *upd = json_get(&got, "updates"), *stats = json_get(&got, "stats");
        printf("  the page: %s\n", text);
        CHECK(upd && upd->kind == JSON_NUM && upd->num >= 1, "the reply was never rendered");
        CHECK(stats && stats->kind == JSON_STR && strstr(stats->str, "16 tokens"), "the tokens/s line");
        const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello there\"}]}";
        if (CHECK(request(sp.port, "POST", "/v1/chat/completions", body, NULL, &r) == 200, "direct chat: %d",
                  r.status) &&
            CHECK(json_parse(&j, r.body, r.body_len, err, sizeof err) == 0, "direct chat JSON")) {
            const char *content[] = { "choices", "0", "message", "content", NULL };
            CHECK(same_str(json_path(&j, content), json_get(&got, "reply")), "the page's reply differs: %s", r.body);
            json_free(&j);
        }
        resp_free(&r);
        json_free(&got);
    }
    free(text);
    CHECK(server_stop(&sp) == 0, "exit status after SIGTERM");
}

/* While the model loads (slowed by http.c's test hook) the server listens and
 * /health answers 503 with an OpenAI-style error; once loaded, 200. */
static void case_loading(void)
{
    if (!test_begin("http/health-503-while-loading") || !have_binary())
        return;
    struct server_proc sp;
    memset(&sp, 0, sizeof sp);
    const char *args[] = { "--parallel", "1", NULL };
    setenv("STRATA_TEST_LOAD_DELAY_MS", "1500", 1);
    int rc = server_spawn(&sp, args);
    unsetenv("STRATA_TEST_LOAD_DELAY_MS");
    if (!CHECK(rc == 0 && server_wait(&sp, 0) == 0, "strata serve did not start listening")) {
        server_stop(&sp);
        return;
    }
    struct resp r;
    char type[64];
    int st = request(sp.port, "GET", "/health", NULL, NULL, &r);
    CHECK(st == 503 && strcmp(error_type_of(&r, type, sizeof type), "unavailable_error") == 0 && r.body &&
              strstr(r.body, "Loading model"),
          "/health while loading: %d %s", st, r.body ? r.body : "");
    resp_free(&r);
    st = request(sp.port, "POST", "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":1}", NULL, &r);
    CHECK(st == 503 && strcmp(error_type_of(&r, type, sizeof type), "unavailable_error") == 0,
          "a completion while loading: %d", st);
    resp_free(&r);
    int n503 = 0;
    for (int tries = 0; tries < 800; tries++) {
        st = request(sp.port, "GET", "/health", NULL, NULL, &r);
        resp_free(&r);
        if (st != 503)
            break;
        n503++;
        usleep(25000);
    }
    printf("  /health answered 503 %d more times, then %d\n", n503, st);
    CHECK(st == 200, "/health after loading: %d", st);
    CHECK(server_wait(&sp, 1) == 0, "the log says ready");
    CHECK(server_stop(&sp) == 0, "exit status after SIGTERM");
}

/* ==== parallel slots: batched decode, prefix reuse, an exhausted pool ==== */

struct bat_arg {
    int port, status;
    const char *body;
    struct resp r;
};

static void *bat_client(void *p)
{
    struct bat_arg *a = p;
    a->status = request(a->port, "POST", "/completion", a->body, NULL, &a->r);
    return NULL;
}

/* What a /completion answer says: its ids, timings, or its error message. */
struct bat_out {
    int32_t ids[320];
    int n_ids, prompt_n, cache_n, evaluated, predicted;
    char msg[256];
};

static int bat_parse(const struct resp *r, struct bat_out *o)
{
    struct json j;
    char err[128];
    memset(o, 0, sizeof *o);
    o->n_ids = o->prompt_n = o->cache_n = o->evaluated = o->predicted = -1;
    if (!r->body || json_parse(&j, r->body, r->body_len, err, sizeof err) != 0) {
        snprintf(o->msg, sizeof o->msg, "not JSON: %s (%zu bytes)", r->body ? err : "no body", r->body_len);
        return -1;
    }
    const struct json *t = json_get(&j, "timings"), *m = json_get(json_get(&j, "error"), "message");
    const struct json *pn = json_get(t, "prompt_n"), *cn = json_get(t, "cache_n");
    const struct json *ev = json_get(&j, "tokens_evaluated"), *pr = json_get(&j, "tokens_predicted");
    o->n_ids = json_ids(&j, "tokens", o->ids, 320);
    o->prompt_n = pn ? (int)pn->num : -1;
    o->cache_n = cn ? (int)cn->num : -1;
    o->evaluated = ev ? (int)ev->num : -1;
    o->predicted = pr ? (int)pr->num : -1;
    if (m && m->kind == JSON_STR)
        snprintf(o->msg, sizeof o->msg, "%s", m->str);
    json_free(&j);
    return 0;
}

static int same_ids(const struct bat_out *a, const struct bat_out *b)
{
    return a->n_ids > 0 && a->n_ids == b->n_ids && memcmp(a->ids, b->ids, (size_t)a->n_ids * sizeof *a->ids) == 0;
}

/* The batching cases' server: 4 slots (started by the first case that runs). */
static int slots_port(struct shared *ss)
{
    if (!have_binary())
        return -1;
    if (!ss->tried) {
        const char *args[] = { "--parallel", "4", NULL };
        ss->tried = 1;
        ss->ok = server_start(&ss->sp, args) == 0;
    }
    if (!CHECK(ss->ok, "strata serve --parallel 4 did not become ready"))
        return -1;
    return ss->sp.port;
}

/* Four greedy requests at once give the ids they give one at a time: with
 * at most 4 rows a batched decode pass is bit-identical to single steps on
 * the Q8_0 demo model (test_model.c's model/decode batch case says why). */
static void case_batched(struct shared *ss)
{
    if (!test_begin("http/batched-decode-equals-single"))
        return;
    int port = slots_port(ss);
    if (port < 0)
        return;
    static const char *const prompts[4] = { "The morning was", "Mr. Darcy said", "She walked into the", "Chapter 3." };
    enum { NP = 4, N = 40 };
    char body[NP][256];
    struct bat_arg a[NP];
    struct bat_out one[NP], many[NP];
    memset(many, 0, sizeof many);   /* (read by the message where a request failed before bat_parse) */
    pthread_t th[NP];
    for (int i = 0; i < NP; i++) {
        snprintf(body[i], sizeof body[i], "{\"prompt\":\"%s\",\"n_predict\":%d,\"temperature\":0}", prompts[i], N);
        a[i] = (struct bat_arg){ .port = port, .body = body[i] };
        bat_client(&a[i]);
        CHECK(a[i].status == 200 && bat_parse(&a[i].r, &one[i]) == 0 && one[i].n_ids == N, "alone %d: status %d",
              i, a[i].status);
        resp_free(&a[i].r);
    }
    double s0 = metric(port, "strata_decode_steps_total"), r0 = metric(port, "strata_batch_rows_total");
    for (int i = 0; i < NP; i++) {
        a[i] = (struct bat_arg){ .port = port, .body = body[i] };
        pthread_create(&th[i], NULL, bat_client, &a[i]);
    }
    for (int i = 0; i < NP; i++) {
        pthread_join(th[i], NULL);
        int parsed = a[i].status == 200 && bat_parse(&a[i].r, &many[i]) == 0, at = 0;
        while (parsed && at < many[i].n_ids && at < one[i].n_ids && many[i].ids[at] == one[i].ids[at])
            at++;
        CHECK(parsed && same_ids(&many[i], &one[i]),
              "request %d at once (status %d, %d ids, \"%s\"): its ids differ from the same request alone from id %d "
              "(%d there, %d alone); the body: %.300s", i, a[i].status, parsed ? many[i].n_ids : -1, many[i].msg,
              at, parsed && at < many[i].n_ids ? many[i].ids[at] : -1, at < one[i].n_ids ? one[i].ids[at] : -1,
              a[i].r.body ? a[i].r.body : "(none)");
        resp_free(&a[i].r);
    }
    double steps = metric(port, "strata_decode_steps_total") - s0, rows = metric(port, "strata_batch_rows_total") - r0;
    printf("     %d requests at once: %g tokens in %g decode passes (%.2f rows per pass)\n", NP, rows, steps,
           steps > 0 ? rows / steps : 0);
    /* every token but each request's last is evaluated, in passes of up to 4 rows */
    CHECK(rows == NP * (N - 1), "batch rows moved by %g, want %d", rows, NP * (N - 1));
    CHECK(steps > 0 && rows / steps >= 1.5, "%g rows in %g passes: the requests were not batched", rows, steps);
}

/* A prompt sharing a long prefix with an earlier one evaluates only the rest
 * (timings.prompt_n) and gives the ids it gives without the cache. */
static void case_prefix_reuse(struct shared *ss)
{
    if (!test_begin("http/prompt-prefix-reuse"))
        return;
    int port = slots_port(ss);
    if (port < 0)
        return;
    static const char head[] =
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        "considered as the rightful property of some one or other of their daughters. My dear Mr. Bennet, said "
        "his lady to him one day, have you heard that Netherfield Park is let at last? Mr. Bennet replied that he "
        "had not. But it is, returned she; for Mrs. Long has just been here, and she told me all about it.";
    static const char *const tails[3] = { " Then", " And so", " And so" };
    static const char *const cache[3] = { "true", "false", "true" };
    char body[3][1024];
    struct bat_out o[3];
    double p0 = 0;
    for (int i = 0; i < 3; i++) {
        snprintf(body[i], sizeof body[i], "{\"prompt\":\"%s%s\",\"n_predict\":24,\"temperature\":0,\"cache_prompt\":%s}",
                 head, tails[i], cache[i]);
        struct bat_arg a = { .port = port, .body = body[i] };
        if (i == 2)
            p0 = metric(port, "strata_prompt_tokens_total");
        bat_client(&a);
        CHECK(a.status == 200 && bat_parse(&a.r, &o[i]) == 0 && o[i].n_ids == 24, "request %d: status %d", i,
              a.status);
        resp_free(&a.r);
    }
    printf("     prompt of %d ids: %d evaluated without the cache, %d with it (%d cached)\n", o[1].evaluated,
           o[1].prompt_n, o[2].prompt_n, o[2].cache_n);
    CHECK(o[1].evaluated > 128 && o[1].prompt_n == o[1].evaluated && o[1].cache_n == 0,
          "cache_prompt false: %d of %d prompt ids evaluated, %d cached", o[1].prompt_n, o[1].evaluated, o[1].cache_n);
    CHECK(o[2].cache_n >= 128 && o[2].cache_n % 64 == 0 && o[2].prompt_n + o[2].cache_n == o[2].evaluated &&
              o[2].prompt_n < o[1].prompt_n,
          "the shared prefix: %d evaluated + %d cached of %d", o[2].prompt_n, o[2].cache_n, o[2].evaluated);
    CHECK(metric(port, "strata_prompt_tokens_total") - p0 == o[2].prompt_n, "prompt tokens counted: the evaluated ones");
    CHECK(same_ids(&o[2], &o[1]), "the ids with the cached prefix differ from those without");
}

/* A pool too small for two long requests fails one of them (503, naming the
 * KV cache); the other runs to its end and the server keeps serving. */
static void case_kv_exhausted(void)
{
    if (!test_begin("http/kv-pool-exhausted") || !have_binary())
        return;
    struct server_proc sp;
    /* 1 MiB of f16 cells of the demo model (3 KiB each): 5 pages of 64, one sequence's worth */
    const char *args[] = { "--parallel", "2", "--kv-mem", "1", NULL };
    if (!CHECK(server_start(&sp, args) == 0, "strata serve --kv-mem 1 did not become ready"))
        return;
    int port = sp.port;
    CHECK(metric(port, "strata_kv_cells_total") == 320, "kv cells total %g, want 5 pages of 64",
          metric(port, "strata_kv_cells_total"));
    const char *body[2] = { "{\"prompt\":\"Chapter 1. The\",\"n_predict\":300,\"temperature\":0}",
                            "{\"prompt\":\"Chapter 2. The\",\"n_predict\":300,\"temperature\":0}" };
    struct bat_arg a[2];
    struct bat_out o[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        a[i] = (struct bat_arg){ .port = port, .body = body[i] };
        pthread_create(&th[i], NULL, bat_client, &a[i]);
    }
    int ok = 0, full = 0;
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        bat_parse(&a[i].r, &o[i]);
        if (a[i].status == 200 && o[i].predicted == 300)
            ok++;
        else if (a[i].status == 503 && strstr(o[i].msg, "KV cache"))
            full++;
        else
            CHECK(0, "request %d: status %d, %d tokens, '%s'", i, a[i].status, o[i].predicted, o[i].msg);
        resp_free(&a[i].r);
    }
    CHECK(ok == 1 && full == 1, "%d ran to the end, %d refused for the KV cache", ok, full);
    struct resp r;
    CHECK(request(port, "POST", "/completion", "{\"prompt\":\"Hello\",\"n_predict\":8}", NULL, &r) == 200,
          "a request after the refusal");
    resp_free(&r);
    double used = -1;
    for (int tries = 0; tries < 100 && (used = metric(port, "strata_kv_cells_used")) != 0; tries++)
        usleep(20000);
    CHECK(used == 0, "kv cells used %g after the requests", used);
    CHECK(server_stop(&sp) == 0, "exit status");
}

static void test_slots(void)
{
    struct shared ss;
    memset(&ss, 0, sizeof ss);
    case_batched(&ss);
    case_prefix_reuse(&ss);
    if (ss.ok && ss.sp.pid > 0)
        server_stop(&ss.sp);
    case_kv_exhausted();
}

static void test_server(void)
{
    struct shared sh;
    memset(&sh, 0, sizeof sh);
    case_greedy(&sh);
    case_logprobs(&sh);
    case_streams(&sh);
    case_errors(&sh);
    case_limits(&sh);
    case_byte_by_byte(&sh);
    case_keep_alive(&sh);
    case_parallel(&sh);
    case_load(&sh);
    case_metrics(&sh);
    case_real_clients(&sh);
    case_openai_node(&sh);
    int port;
    if (test_begin("http/sigterm") && (port = shared_port(&sh)) >= 0) {
        struct resp r;
        CHECK(request(port, "GET", "/health", NULL, NULL, &r) == 200, "still healthy at the end");
        resp_free(&r);
        struct par_arg q;
        memset(&q, 0, sizeof q);
        q.port = port;
        q.stream = 1;
        snprintf(q.body, sizeof q.body, "{\"prompt\":\"It\",\"n_predict\":300,\"temperature\":0,\"stream\":true}");
        pthread_t th;
        pthread_create(&th, NULL, par_client, &q);
        usleep(100000);
        CHECK(server_stop(&sh.sp) == 0, "exit status after SIGTERM");
        pthread_join(th, NULL);
        /* it runs to its end, unless that takes longer than the drain period */
        CHECK(q.status == 200 && q.ended && q.text[0], "the stream in flight ended cleanly (status %d, %zu bytes)",
              q.status, strlen(q.text));
    }
    if (sh.ok && sh.sp.pid > 0)
        server_stop(&sh.sp);
    case_auth_and_conns();
    case_loading();
    case_chat_page();
    test_slots();
}

void test_http(void)
{
    test_parser();
    test_chat();
    test_server();
}
