/*
 * http.c — `strata serve`: an OpenAI-compatible HTTP/1.1 server in llama-server's
 * dialect (ARCH.md §5): the request parser, connections, routes, Server-Sent
 * Events, the slots and their scheduler, /metrics and the chat page.
 *
 * Threads: one per connection (at most --max-conns), sched.c's scheduler,
 * and the main thread, which loads the model and waits for SIGINT/SIGTERM.
 * The parser never allocates; a request body takes one allocation of its
 * Content-Length. No model code here: generation goes through sched.c. Only
 * http_serve_main's start-up and shutdown print (to stderr); every other
 * function returns its errors. V is the vocabulary.
 *
 * Test hook: STRATA_TEST_LOAD_DELAY_MS=N (at most 60000) makes the model load
 * wait N ms first, so that tests can see /health answer 503 while loading.
 */
#include "strata.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HTTP_HEAD_MAX 16384          /* request line + headers, bytes (431 beyond) */
#define HTTP_DEFAULT_MAX_BODY (8u << 20)
#define HTTP_DEFAULT_PORT 8080
#define HTTP_DEFAULT_PARALLEL 4
#define HTTP_DEFAULT_MAX_CONNS 64
#define HTTP_DEFAULT_TIMEOUT_S 30    /* idle connection / whole request */
#define HTTP_CTX_CAP 4096            /* default context: the model's, at most this */
#define HTTP_MAX_PROBS 100           /* top log-probabilities per token */
#define HTTP_MAX_STOPS (SCHED_MAX_STOPS - 1) /* stop strings per request (one more: the chat end) */
#define HTTP_MAX_STOP_LEN 512        /* bytes per stop string */
#define HTTP_POLL_MS 100             /* waiting threads look for disconnects and shutdown this often */
#define HTTP_DRAIN_S 10              /* on SIGINT/SIGTERM, running requests get this long */
#define HTTP_METRIC_ROWS 256         /* distinct (route, status) pairs counted */
#define HTTP_THREAD_STACK (256u << 10)

/* ==== the request parser ==== */

static int is_tchar(unsigned char c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        return 1;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* A line end at *i: CRLF or LF. */
static int parse_eol(const char *buf, size_t len, size_t *i)
{
    if (*i >= len)
        return HTTP_PARTIAL;
    if (buf[*i] == '\n') {
        (*i)++;
        return 0;
    }
    if (buf[*i] != '\r')
        return HTTP_BAD;
    if (*i + 1 >= len)
        return HTTP_PARTIAL;
    if (buf[*i + 1] != '\n')
        return HTTP_BAD;
    *i += 2;
    return 0;
}

int http_parse_request(const char *buf, size_t len, struct http_request *req)
{
    static const char version[] = "HTTP/1.";
    size_t i = 0, start;
    int rc;
    if (len > INT_MAX)
        len = INT_MAX;
    req->n_headers = 0;
    /* method SP target SP HTTP/1.x */
    for (start = i;; i++) {
        if (i == len)
            return HTTP_PARTIAL;
        if (buf[i] == ' ')
            break;
        if (!is_tchar((unsigned char)buf[i]))
            return HTTP_BAD;
    }
    if (i == start)
        return HTTP_BAD;
    req->method = buf + start;
    req->method_len = i - start;
    for (start = ++i;; i++) {
        if (i == len)
            return HTTP_PARTIAL;
        unsigned char c = (unsigned char)buf[i];
        if (c == ' ')
            break;
        if (c < 0x21 || c > 0x7e)
            return HTTP_BAD;
    }
    if (i == start)
        return HTTP_BAD;
    req->target = buf + start;
    req->target_len = i - start;
    i++;
    for (size_t k = 0; k < sizeof version - 1; k++, i++) {
        if (i == len)
            return HTTP_PARTIAL;
        if (buf[i] != version[k])
            return HTTP_BAD;
    }
    if (i == len)
        return HTTP_PARTIAL;
    if (buf[i] < '0' || buf[i] > '9')
        return HTTP_BAD;
    req->minor = buf[i++] - '0';
    if ((rc = parse_eol(buf, len, &i)) != 0)
        return rc;
    /* header fields until the empty line */
    for (;;) {
        if (i == len)
            return HTTP_PARTIAL;
        if (buf[i] == '\r' || buf[i] == '\n') {
            if ((rc = parse_eol(buf, len, &i)) != 0)
                return rc;
            return (int)i;
        }
        for (start = i;; i++) {
            if (i == len)
                return HTTP_PARTIAL;
            if (buf[i] == ':')
                break;
            if (!is_tchar((unsigned char)buf[i]))
                return HTTP_BAD; /* also rejects obsolete line folding */
        }
        if (i == start)
            return HTTP_BAD;
        size_t name = start, name_len = i - start;
        for (i++;; i++) {
            if (i == len)
                return HTTP_PARTIAL;
            if (buf[i] != ' ' && buf[i] != '\t')
                break;
        }
        for (start = i;; i++) {
            if (i == len)
                return HTTP_PARTIAL;
            unsigned char c = (unsigned char)buf[i];
            if (c == '\r' || c == '\n')
                break;
            if ((c < 0x20 && c != '\t') || c == 0x7f)
                return HTTP_BAD;
        }
        size_t end = i;
        while (end > start && (buf[end - 1] == ' ' || buf[end - 1] == '\t'))
            end--;
        if ((rc = parse_eol(buf, len, &i)) != 0)
            return rc;
        if (req->n_headers == HTTP_MAX_HEADERS)
            return HTTP_TOO_MANY;
        struct http_header *h = &req->headers[req->n_headers++];
        h->name = buf + name;
        h->name_len = name_len;
        h->value = buf + start;
        h->value_len = end - start;
    }
}

const struct http_header *http_header(const struct http_request *req, const char *name)
{
    size_t n = strlen(name);
    for (int i = 0; i < req->n_headers; i++)
        if (req->headers[i].name_len == n && strncasecmp(req->headers[i].name, name, n) == 0)
            return &req->headers[i];
    return NULL;
}

int http_parse_size(const char *s, size_t *out)
{
    uint64_t v = 0;
    size_t i = 0;
    if (!s[0])
        return -1;
    for (; s[i] >= '0' && s[i] <= '9'; i++) {
        v = v * 10 + (uint64_t)(s[i] - '0');
        if (v > (1u << 30))
            return -1;
    }
    if (i == 0)
        return -1;
    if (s[i] == 'K' || s[i] == 'k')
        v <<= 10, i++;
    else if (s[i] == 'M' || s[i] == 'm')
        v <<= 20, i++;
    if (s[i] || v > (1u << 30))
        return -1;
    *out = (size_t)v;
    return 0;
}

/* A header value equal to, or a comma-separated list containing, word
 * (case-insensitive): "Connection: keep-alive, Upgrade". */
static int header_has(const struct http_request *req, const char *name, const char *word)
{
    size_t wn = strlen(word);
    for (int i = 0; i < req->n_headers; i++) {
        const struct http_header *h = &req->headers[i];
        if (h->name_len != strlen(name) || strncasecmp(h->name, name, h->name_len) != 0)
            continue;
        const char *p = h->value, *end = h->value + h->value_len;
        while (p < end) {
            while (p < end && (*p == ' ' || *p == '\t' || *p == ','))
                p++;
            const char *q = p;
            while (q < end && *q != ',')
                q++;
            const char *e = q;
            while (e > p && (e[-1] == ' ' || e[-1] == '\t'))
                e--;
            if ((size_t)(e - p) == wn && strncasecmp(p, word, wn) == 0)
                return 1;
            p = q;
        }
    }
    return 0;
}

/* ==== small helpers ==== */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t random_u64(void)
{
    uint64_t x;
    if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x)
        x = (uint64_t)time(NULL) * 6364136223846793005ull ^ (uint64_t)getpid() ^ (uint64_t)(now_s() * 1e9);
    return x;
}

static void put_cstr(FILE *f, const char *s)
{
    json_put_str(f, s, strlen(s));
}

static int utf8_valid(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = u[i], need, lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF)
            need = 1;
        else if (c >= 0xE0 && c <= 0xEF)
            need = 2, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        else if (c >= 0xF0 && c <= 0xF4)
            need = 3, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        else
            return 0;
        if (i + need >= n)
            return 0;
        if (u[i + 1] < lo || u[i + 1] > hi)
            return 0;
        for (unsigned k = 2; k <= need; k++)
            if (u[i + k] < 0x80 || u[i + k] > 0xBF)
                return 0;
        i += need + 1;
    }
    return 1;
}

/* An in-memory text: a FILE from open_memstream. */
struct obuf {
    char *p;
    size_t n;
    FILE *f;
};

static int ob_open(struct obuf *o)
{
    o->p = NULL;
    o->n = 0;
    o->f = open_memstream(&o->p, &o->n);
    return o->f ? 0 : -1;
}

/* Closes the stream: p and n hold the text (free p); -1 on a write error. */
static int ob_close(struct obuf *o)
{
    int bad = ferror(o->f);
    if (fclose(o->f) != 0)
        bad = 1;
    o->f = NULL;
    return bad ? -1 : 0;
}

/* ==== server state ==== */

struct serve_opts {
    const char *model, *host, *api_key;
    int n_ctx, kv, kv_mem, parallel, port, threads, max_conns, timeout_s, device, prefill_chunk;
    size_t max_body;
    struct sample_params sp;   /* what a request without those fields gets */
    int have_seed;
    int max_tokens;            /* -1: until EOG or the context is full */
};

enum route { R_INDEX, R_HEALTH, R_MODELS, R_COMPLETION, R_V1_COMPLETIONS, R_CHAT, R_TOKENIZE,
             R_DETOKENIZE, R_METRICS, R_OTHER, R_COUNT };

static const char *const route_label[R_COUNT] = {
    "/", "/health", "/v1/models", "/completion", "/v1/completions", "/v1/chat/completions",
    "/tokenize", "/detokenize", "/metrics", "other",
};

/* requests answered, by route and status */
struct metrics {
    struct { int route, status; uint64_t n; } req[HTTP_METRIC_ROWS];
    int n_req;
};

struct server {
    struct serve_opts o;
    char model_name[256];
    int listen_fd;
    pthread_mutex_t lock;
    pthread_cond_t conn_cv;    /* shutdown waits here for connections to end */
    int ready;                 /* (lock) the model is loaded */
    int n_conns;               /* (lock) */
    struct metrics m;          /* (lock) */
    struct model *model;       /* set before ready; read-only afterwards */
    const struct tok *tok;
    int V, n_ctx;
    struct sched *sched;
    struct chat_template tmpl;
    time_t started;
};

static atomic_int g_stop;      /* set by SIGINT/SIGTERM */
static int g_sig_pipe[2] = { -1, -1 };

static int stopping(void)
{
    return atomic_load(&g_stop) != 0;
}

/* ==== metrics ==== */

static void metric_request(struct server *s, int route, int status)
{
    pthread_mutex_lock(&s->lock);
    struct metrics *m = &s->m;
    int i = 0;
    while (i < m->n_req && !(m->req[i].route == route && m->req[i].status == status))
        i++;
    if (i == m->n_req && m->n_req < HTTP_METRIC_ROWS) {
        m->req[i].route = route;
        m->req[i].status = status;
        m->req[i].n = 0;
        m->n_req++;
    }
    if (i < m->n_req)
        m->req[i].n++;
    pthread_mutex_unlock(&s->lock);
}

static void put_metric(FILE *f, const char *name, const char *type, const char *help, double v)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static void put_metrics(struct server *s, FILE *f)
{
    pthread_mutex_lock(&s->lock);
    struct metrics m = s->m;
    pthread_mutex_unlock(&s->lock);
    struct sched_stats st;
    sched_stats(s->sched, &st);
    double pr = st.prompt_rate, gr = st.gen_rate;
    int processing = st.processing, queued = st.queued;
    fputs("# HELP strata_requests_total HTTP requests answered, by route and status.\n"
          "# TYPE strata_requests_total counter\n", f);
    for (int i = 0; i < m.n_req; i++)
        fprintf(f, "strata_requests_total{route=\"%s\",status=\"%d\"} %" PRIu64 "\n",
                route_label[m.req[i].route], m.req[i].status, m.req[i].n);
    put_metric(f, "strata_prompt_tokens_total", "counter", "Prompt tokens evaluated (reused cached prefixes excluded).", (double)st.prompt_tokens);
    put_metric(f, "strata_generated_tokens_total", "counter", "Tokens generated.", (double)st.gen_tokens);
    put_metric(f, "strata_prompt_seconds_total", "counter", "Seconds spent evaluating prompts.", st.prompt_s);
    put_metric(f, "strata_decode_seconds_total", "counter", "Seconds spent generating tokens.", st.decode_s);
    put_metric(f, "strata_prompt_tokens_per_second", "gauge", "Prompt tokens/s over the last 16 requests.", pr);
    put_metric(f, "strata_decode_tokens_per_second", "gauge", "Generated tokens/s over the last 16 requests.", gr);
    put_metric(f, "strata_requests_processing", "gauge", "Requests holding a slot.", processing);
    put_metric(f, "strata_requests_queued", "gauge", "Requests waiting for a slot.", queued);
    put_metric(f, "strata_kv_cells_used", "gauge", "KV cells held by running requests.", (double)st.kv_used);
    put_metric(f, "strata_kv_cells_cached", "gauge", "KV cells of finished requests kept for prefix reuse.", (double)st.kv_cached);
    put_metric(f, "strata_kv_cells_total", "gauge", "KV cells of the pool.", (double)st.kv_total);
    put_metric(f, "strata_decode_steps_total", "counter", "Batched decode passes (one token for each decoding request).", (double)st.decode_batches);
    put_metric(f, "strata_batch_rows_total", "counter", "Tokens evaluated by the batched decode passes.", (double)st.decode_rows);
    /* the reference server's names (ARCH.md §5) */
    put_metric(f, "llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", (double)st.prompt_tokens);
    put_metric(f, "llamacpp:prompt_seconds_total", "counter", "Prompt process time.", st.prompt_s);
    put_metric(f, "llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", (double)st.gen_tokens);
    put_metric(f, "llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time.", st.decode_s);
    put_metric(f, "llamacpp:n_decode_total", "counter", "Total number of scheduler steps.", (double)st.n_steps);
    put_metric(f, "llamacpp:n_tokens_max", "counter", "Largest observed n_tokens.", (double)st.n_tokens_max);
    put_metric(f, "llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", pr);
    put_metric(f, "llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", gr);
    put_metric(f, "llamacpp:requests_processing", "gauge", "Number of requests processing.", processing);
    put_metric(f, "llamacpp:requests_deferred", "gauge", "Number of requests deferred.", queued);
    put_metric(f, "llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per step.",
               st.n_steps ? (double)st.busy_slot_steps / (double)st.n_steps : 0);
}

/* ==== connections and responses ==== */

struct conn {
    struct server *s;
    int fd;
    size_t n;                  /* bytes in head not yet consumed */
    char head[HTTP_HEAD_MAX];  /* request line + headers (and what followed them) */
};

/* One request being answered. */
struct req {
    struct server *s;
    struct conn *c;
    const struct http_request *h;
    const char *path;
    size_t path_len;
    const char *body;
    size_t body_len;
    int route;
    int keep_alive;
    int head_only;             /* HEAD: headers without the body */
    int chunked;               /* a stream may use chunked encoding (HTTP/1.1) */
};

/* Sends every byte of iov[0..cnt), resuming after short writes. */
static int send_iov(int fd, struct iovec *iov, int cnt)
{
    size_t left = 0;
    for (int k = 0; k < cnt; k++)
        left += iov[k].iov_len;
    int at = 0;
    while (left > 0) {
        struct msghdr msg = { .msg_iov = iov + at, .msg_iovlen = (size_t)(cnt - at) };
        ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        left -= (size_t)w;
        while (at < cnt && (size_t)w >= iov[at].iov_len) {
            w -= (ssize_t)iov[at].iov_len;
            iov[at].iov_len = 0;
            at++;
        }
        if (at < cnt) {
            iov[at].iov_base = (char *)iov[at].iov_base + w;
            iov[at].iov_len -= (size_t)w;
        }
    }
    return 0;
}

static int send_all(int fd, const char *p, size_t n)
{
    struct iovec v = { (void *)p, n };
    return send_iov(fd, &v, 1);
}

static const char *status_text(int status)
{
    switch (status) {
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    }
    return "Unknown";
}

static const char *error_type(int status)
{
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 500: return "server_error";
    case 501: return "not_supported_error";
    case 503: return "unavailable_error";
    }
    return "invalid_request_error";
}

/* Status line and headers, then the body, in one writev; counts the request. */
static int respond(struct req *r, int status, const char *ctype, const char *body, size_t n,
                   const char *extra)
{
    char head[1024];
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nServer: strata\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                      "Connection: %s\r\nAccess-Control-Allow-Origin: *\r\n%s\r\n",
                      status, status_text(status), ctype, n, r->keep_alive ? "keep-alive" : "close",
                      extra ? extra : "");
    metric_request(r->s, r->route, status);
    if (hn < 0 || (size_t)hn >= sizeof head)
        return -1;
    struct iovec iov[2] = { { head, (size_t)hn }, { (void *)body, r->head_only ? 0 : n } };
    return send_iov(r->c->fd, iov, 2);
}

static void put_error(FILE *f, int status, const char *type, const char *msg)
{
    fprintf(f, "{\"error\":{\"code\":%d,\"message\":", status);
    put_cstr(f, msg);
    fputs(",\"type\":", f);
    put_cstr(f, type);
    fputs("}}", f);
}

__attribute__((format(printf, 4, 5)))
static int reply_error(struct req *r, int status, const char *type, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct obuf o;
    if (ob_open(&o))
        return -1;
    put_error(o.f, status, type ? type : error_type(status), msg);
    int rc = ob_close(&o);
    if (rc == 0)
        rc = respond(r, status, "application/json; charset=utf-8", o.p, o.n,
                     status == 401 ? "WWW-Authenticate: Bearer\r\n" : NULL);
    free(o.p);
    return rc;
}

static int reply_json(struct req *r, struct obuf *o)
{
    if (ob_close(o)) {
        free(o->p);
        return reply_error(r, 500, NULL, "out of memory");
    }
    int rc = respond(r, 200, "application/json; charset=utf-8", o->p, o->n, NULL);
    free(o->p);
    return rc;
}

/* ==== the chat page ==== */

static const char chat_page[] =
    "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
    "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
    "<title>Strata chat</title>\n<style>\n"
    "body{font-family:system-ui,sans-serif;max-width:46em;margin:0 auto;padding:1em;background:#fafafa}\n"
    "#log{min-height:50vh}.msg{white-space:pre-wrap;padding:.5em .8em;margin:.4em 0;border-radius:8px}\n"
    ".user{background:#dbeafe}.assistant{background:#fff;border:1px solid #ddd}\n"
    ".think{color:#777;font-style:italic}#stats{color:#555;font-size:.85em;min-height:1.2em}\n"
    "form{display:flex;gap:.5em}textarea{flex:1;font:inherit;padding:.4em}\n"
    "</style></head><body>\n<h1>Strata</h1>\n<div id=\"log\"></div>\n<div id=\"stats\"></div>\n"
    "<form id=\"f\"><textarea id=\"in\" rows=\"3\" placeholder=\"Type a message\"></textarea>"
    "<button id=\"send\" type=\"submit\">Send</button></form>\n<script>\n"
    "const log=document.getElementById('log'),stats=document.getElementById('stats');\n"
    "const input=document.getElementById('in'),send=document.getElementById('send');\n"
    "const history=[];\n"
    "function add(role,text){const d=document.createElement('div');d.className='msg '+role;"
    "d.textContent=text;log.appendChild(d);return d;}\n"
    "input.addEventListener('keydown',e=>{if(e.key==='Enter'&&!e.shiftKey){e.preventDefault();"
    "document.getElementById('f').requestSubmit();}});\n"
    "document.getElementById('f').addEventListener('submit',async e=>{\n"
    " e.preventDefault();const text=input.value.trim();if(!text)return;input.value='';\n"
    " add('user',text);history.push({role:'user',content:text});\n"
    " const out=add('assistant','');const think=document.createElement('div');think.className='think';\n"
    " out.before(think);send.disabled=true;let reply='',n=0,t0=performance.now(),first=0;\n"
    " try{\n"
    "  const res=await fetch('v1/chat/completions',{method:'POST',headers:{'Content-Type':'application/json'},\n"
    "   body:JSON.stringify({messages:history,stream:true})});\n"
    "  if(!res.ok){out.textContent='error '+res.status+': '+await res.text();return;}\n"
    "  const rd=res.body.getReader(),dec=new TextDecoder();let buf='';\n"
    "  for(;;){const {value,done}=await rd.read();if(done)break;buf+=dec.decode(value,{stream:true});\n"
    "   let i;while((i=buf.indexOf('\\n\\n'))>=0){const ev=buf.slice(0,i);buf=buf.slice(i+2);\n"
    "    if(!ev.startsWith('data: '))continue;const data=ev.slice(6);if(data==='[DONE]')continue;\n"
    "    const j=JSON.parse(data);if(j.error){out.textContent+='\\n[error: '+j.error.message+']';continue;}\n"
    "    const d=j.choices&&j.choices[0]&&j.choices[0].delta;\n"
    "    if(d&&d.reasoning_content)think.textContent+=d.reasoning_content;\n"
    "    if(d&&d.content){reply+=d.content;out.textContent=reply;}\n"
    "    if(d&&(d.content||d.reasoning_content)){n++;if(!first)first=performance.now();}\n"
    "    const s=(performance.now()-(first||t0))/1000;\n"
    "    stats.textContent=j.timings?(j.timings.predicted_n+' tokens, '+j.timings.predicted_per_second.toFixed(1)+' tokens/s')"
    ":(n+' tokens, '+(s>0?(n/s).toFixed(1):'-')+' tokens/s');\n"
    "   }}\n"
    "  history.push({role:'assistant',content:reply});\n"
    " }catch(err){out.textContent+='\\n[error: '+err+']';}\n"
    " finally{send.disabled=false;input.focus();}\n"
    "});\n</script></body></html>\n";

/* ==== request bodies: typed fields ==== */

/* The field key of o when present and not null; NULL otherwise. */
static const struct json *field(const struct json *o, const char *key)
{
    const struct json *v = json_get(o, key);
    return v && v->kind != JSON_NULL ? v : NULL;
}

/* Field readers: 0 absent (out untouched), 1 read, -1 wrong type or range
 * with a message in err. */
static int f_num(const struct json *o, const char *key, double lo, double hi, double *out, char *err, size_t errlen)
{
    const struct json *v = field(o, key);
    if (!v)
        return 0;
    if (v->kind != JSON_NUM || v->num < lo || v->num > hi) {
        snprintf(err, errlen, "'%s' must be a number in [%g, %g]", key, lo, hi);
        return -1;
    }
    *out = v->num;
    return 1;
}

static int f_int(const struct json *o, const char *key, double lo, double hi, double *out, char *err, size_t errlen)
{
    const struct json *v = field(o, key);
    if (!v)
        return 0;
    if (v->kind != JSON_NUM || v->num != floor(v->num) || v->num < lo || v->num > hi) {
        snprintf(err, errlen, "'%s' must be an integer in [%.0f, %.0f]", key, lo, hi);
        return -1;
    }
    *out = v->num;
    return 1;
}

static int f_bool(const struct json *o, const char *key, int *out, char *err, size_t errlen)
{
    const struct json *v = field(o, key);
    if (!v)
        return 0;
    if (v->kind != JSON_BOOL) {
        snprintf(err, errlen, "'%s' must be true or false", key);
        return -1;
    }
    *out = v->num != 0;
    return 1;
}

/* ==== generation requests ==== */

struct gen {
    int route;
    int stream, include_usage;
    int32_t *prompt;           /* (np) malloc'd */
    int np;
    struct sample_params sp;
    int n_predict;             /* -1: the server's default */
    int want_lp, n_top;
    int cache_prompt;
    const char *stop[HTTP_MAX_STOPS + 1];   /* into the request's JSON tree */
    size_t stop_len[HTTP_MAX_STOPS + 1];
    int n_stop;
    int parse_think;           /* chat: split <think> blocks into reasoning_content */
    char id[40];               /* "chatcmpl-…" / "cmpl-…" */
    time_t created;
};

/* The sampling fields every generation route shares. */
static int parse_sampling(struct server *s, const struct json *b, struct gen *g, char *err, size_t errlen)
{
    double v;
    int rc;
    g->sp = s->o.sp;
    if (!s->o.have_seed)
        g->sp.seed = random_u64();
    g->n_predict = -1;
    g->cache_prompt = 1;
    static const struct { const char *key; double lo, hi; size_t off; } floats[] = {
        { "temperature", -1e9, 1e9, offsetof(struct sample_params, temp) },
        { "top_p", 0, 1, offsetof(struct sample_params, top_p) },
        { "min_p", 0, 1, offsetof(struct sample_params, min_p) },
        { "presence_penalty", -2, 2, offsetof(struct sample_params, presence_penalty) },
        { "frequency_penalty", -2, 2, offsetof(struct sample_params, frequency_penalty) },
        { "repeat_penalty", 0, 1e9, offsetof(struct sample_params, repeat_penalty) },
    };
    for (size_t k = 0; k < sizeof floats / sizeof floats[0]; k++) {
        if ((rc = f_num(b, floats[k].key, floats[k].lo, floats[k].hi, &v, err, errlen)) < 0)
            return -1;
        if (rc)
            *(float *)((char *)&g->sp + floats[k].off) = (float)v;
    }
    if ((rc = f_int(b, "top_k", -1e9, 1e9, &v, err, errlen)) < 0)
        return -1;
    if (rc)
        g->sp.top_k = (int)v;
    if ((rc = f_int(b, "repeat_last_n", -1, 1 << 24, &v, err, errlen)) < 0)
        return -1;
    if (rc)
        g->sp.repeat_last_n = v < 0 ? s->n_ctx : (int)v;
    if ((rc = f_int(b, "seed", -1, 18446744073709549568.0, &v, err, errlen)) < 0)
        return -1;
    if (rc && v >= 0)
        g->sp.seed = (uint64_t)v;
    static const char *const n_names[] = { "n_predict", "max_tokens", "max_completion_tokens" };
    for (int k = 0; k < 3; k++) {
        if ((rc = f_int(b, n_names[k], -1, 1 << 30, &v, err, errlen)) < 0)
            return -1;
        if (rc)
            g->n_predict = (int)v;
    }
    static const char *const c_names[] = { "n", "n_cmpl" };
    for (int k = 0; k < 2; k++) {
        if ((rc = f_int(b, c_names[k], -1e9, 1e9, &v, err, errlen)) < 0)
            return -1;
        if (rc && v != 1) {
            snprintf(err, errlen, "'%s' must be 1: one completion per request is supported", c_names[k]);
            return -1;
        }
    }
    if (f_bool(b, "stream", &g->stream, err, errlen) < 0 || f_bool(b, "cache_prompt", &g->cache_prompt, err, errlen) < 0)
        return -1;
    const struct json *so = field(b, "stream_options");
    if (so && so->kind != JSON_OBJ) {
        snprintf(err, errlen, "'stream_options' must be an object");
        return -1;
    }
    if (so && f_bool(so, "include_usage", &g->include_usage, err, errlen) < 0)
        return -1;
    const struct json *st = field(b, "stop");
    if (st) {
        size_t n = st->kind == JSON_STR ? 1 : st->kind == JSON_ARR ? st->len : 0;
        if ((st->kind != JSON_STR && st->kind != JSON_ARR) || n > HTTP_MAX_STOPS) {
            snprintf(err, errlen, "'stop' must be a string or an array of at most %d strings", HTTP_MAX_STOPS);
            return -1;
        }
        for (size_t k = 0; k < n; k++) {
            const struct json *e = st->kind == JSON_STR ? st : &st->items[k];
            if (e->kind != JSON_STR || e->len > HTTP_MAX_STOP_LEN) {
                snprintf(err, errlen, "'stop' entries must be strings of at most %d bytes", HTTP_MAX_STOP_LEN);
                return -1;
            }
            if (e->len == 0)
                continue;
            g->stop[g->n_stop] = e->str;
            g->stop_len[g->n_stop++] = e->len;
        }
    }
    return 0;
}

/* ids of a string, tokenized as the reference server does (parse_special). */
static int32_t *tokenize(struct server *s, const char *text, size_t len, int add_special, int *n,
                         char *err, size_t errlen)
{
    return tok_encode(s->tok, text, len, add_special, 1, n, err, errlen);
}

static int push_ids(int32_t **ids, int *n, int *cap, const int32_t *add, int k)
{
    if (*n + k > *cap) {
        int nc = *cap ? *cap : 64;
        while (nc < *n + k)
            nc *= 2;
        int32_t *p = realloc(*ids, (size_t)nc * sizeof *p);
        if (!p)
            return -1;
        *ids = p;
        *cap = nc;
    }
    memcpy(*ids + *n, add, (size_t)k * sizeof *add);
    *n += k;
    return 0;
}

/* `prompt` of the completion routes: a string, token ids, ids mixed with
 * strings, or an array holding one of those. */
static int parse_prompt(struct server *s, const struct json *p, struct gen *g, char *err, size_t errlen)
{
    if (!p) {
        snprintf(err, errlen, "'prompt' is required");
        return -1;
    }
    if (p->kind == JSON_ARR && p->len == 1 && (p->items[0].kind == JSON_STR || p->items[0].kind == JSON_ARR))
        p = &p->items[0];
    if (p->kind == JSON_STR) {
        g->prompt = tokenize(s, p->str, p->len, 1, &g->np, err, errlen);
        return g->prompt ? 0 : -1;
    }
    if (p->kind != JSON_ARR) {
        snprintf(err, errlen, "'prompt' must be a string or an array of token ids");
        return -1;
    }
    size_t n_str = 0;
    for (size_t i = 0; i < p->len; i++)
        n_str += p->items[i].kind == JSON_STR;
    if (n_str > 1 && n_str == p->len) {
        snprintf(err, errlen, "several prompts per request are not supported: send one");
        return -1;
    }
    int cap = 0;
    g->np = 0;
    for (size_t i = 0; i < p->len; i++) {
        const struct json *e = &p->items[i];
        if (e->kind == JSON_NUM) {
            if (e->num != floor(e->num) || e->num < 0 || e->num >= s->V) {
                snprintf(err, errlen, "prompt token %zu is not a token id in [0, %d)", i, s->V);
                return -1;
            }
            int32_t id = (int32_t)e->num;
            if (push_ids(&g->prompt, &g->np, &cap, &id, 1))
                goto oom;
        } else if (e->kind == JSON_STR) {
            int n;
            int32_t *ids = tokenize(s, e->str, e->len, i == 0, &n, err, errlen);
            if (!ids)
                return -1;
            int rc = push_ids(&g->prompt, &g->np, &cap, ids, n);
            free(ids);
            if (rc)
                goto oom;
        } else {
            snprintf(err, errlen, "'prompt' must be a string, token ids, or one prompt in an array "
                     "(several prompts per request are not supported)");
            return -1;
        }
    }
    if (!g->prompt && !(g->prompt = malloc(sizeof *g->prompt)))
        goto oom;
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    return -1;
}

/* `messages` of the chat route, rendered with the chat template. */
static int parse_messages(struct server *s, const struct json *b, struct gen *g, char *err, size_t errlen)
{
    const struct json *msgs = field(b, "messages");
    if (!msgs || msgs->kind != JSON_ARR || msgs->len == 0) {
        snprintf(err, errlen, "'messages' must be a non-empty array");
        return -1;
    }
    int thinking = 1;
    const struct json *kw = field(b, "chat_template_kwargs");
    if (kw && (kw->kind != JSON_OBJ || f_bool(kw, "enable_thinking", &thinking, err, errlen) < 0)) {
        if (kw->kind != JSON_OBJ)
            snprintf(err, errlen, "'chat_template_kwargs' must be an object");
        return -1;
    }
    const struct json *effort = field(b, "reasoning_effort");
    if (effort && effort->kind != JSON_STR) {
        snprintf(err, errlen, "'reasoning_effort' must be a string");
        return -1;
    }
    if (effort && strcmp(effort->str, "none") == 0)
        thinking = 0;
    int n = (int)msgs->len, rc = -1;
    struct chat_msg *m = calloc((size_t)n, sizeof *m);
    char **owned = calloc((size_t)n, sizeof *owned);  /* joined text parts */
    char *text = NULL;
    if (!m || !owned) {
        snprintf(err, errlen, "out of memory");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        const struct json *e = &msgs->items[i];
        const struct json *role = field(e, "role"), *content = field(e, "content");
        if (e->kind != JSON_OBJ || !role || role->kind != JSON_STR) {
            snprintf(err, errlen, "messages[%d] must be an object with a 'role' string", i);
            goto done;
        }
        if (strcmp(role->str, "system") == 0 || strcmp(role->str, "developer") == 0)
            m[i].role = "system";
        else if (strcmp(role->str, "user") == 0)
            m[i].role = "user";
        else if (strcmp(role->str, "assistant") == 0)
            m[i].role = "assistant";
        else {
            snprintf(err, errlen, "messages[%d]: role '%.40s' is not supported (system, user, assistant)", i, role->str);
            goto done;
        }
        m[i].content = "";
        if (!content)
            continue;
        if (content->kind == JSON_STR) {
            m[i].content = content->str;
            m[i].len = content->len;
            continue;
        }
        if (content->kind != JSON_ARR) {
            snprintf(err, errlen, "messages[%d].content must be a string or an array of text parts", i);
            goto done;
        }
        struct obuf o;
        if (ob_open(&o)) {
            snprintf(err, errlen, "out of memory");
            goto done;
        }
        int bad = 0;
        for (size_t k = 0; k < content->len && !bad; k++) {
            const struct json *part = &content->items[k], *type = field(part, "type"), *t = field(part, "text");
            if (!type || type->kind != JSON_STR || strcmp(type->str, "text") != 0 || !t || t->kind != JSON_STR)
                bad = 1;
            else
                fwrite(t->str, 1, t->len, o.f);
        }
        int rc_ob = ob_close(&o);
        owned[i] = o.p;
        if (bad || rc_ob) {
            snprintf(err, errlen, bad ? "messages[%d].content: only parts {\"type\":\"text\",\"text\":…} are supported"
                                      : "out of memory", i);
            goto done;
        }
        m[i].content = o.p;
        m[i].len = o.n;
    }
    size_t len;
    text = chat_render(&s->tmpl, m, n, thinking, &len);
    if (!text) {
        snprintf(err, errlen, "out of memory");
        goto done;
    }
    g->prompt = tokenize(s, text, len, 1, &g->np, err, errlen);
    rc = g->prompt ? 0 : -1;
done:
    for (int i = 0; owned && i < n; i++)
        free(owned[i]);
    free(owned);
    free(m);
    free(text);
    return rc;
}

/* The route's fields into g; on error an HTTP status with a message in err. */
static int parse_gen(struct server *s, int route, const struct json *b, struct gen *g, char *err, size_t errlen)
{
    double v;
    int rc;
    if (parse_sampling(s, b, g, err, errlen))
        return 400;
    if (route == R_CHAT) {
        int lp = 0;
        if (f_bool(b, "logprobs", &lp, err, errlen) < 0 ||
            (rc = f_int(b, "top_logprobs", 0, HTTP_MAX_PROBS, &v, err, errlen)) < 0)
            return 400;
        if (rc && !lp) {
            snprintf(err, errlen, "'top_logprobs' needs 'logprobs': true");
            return 400;
        }
        /* the reference server: logprobs alone gives 20 top entries */
        g->want_lp = lp;
        g->n_top = lp ? (rc ? (int)v : 20) : 0;
        if (parse_messages(s, b, g, err, errlen))
            return 400;
        g->parse_think = s->tmpl.family == CHAT_CHATML;
        g->stop[g->n_stop] = chat_end_marker(&s->tmpl);
        g->stop_len[g->n_stop] = strlen(g->stop[g->n_stop]);
        g->n_stop++;
    } else {
        const char *name = route == R_COMPLETION && field(b, "n_probs") ? "n_probs" : "logprobs";
        if ((rc = f_int(b, name, 0, 1e9, &v, err, errlen)) < 0)
            return 400;
        if (rc && (route == R_V1_COMPLETIONS || v > 0)) {
            g->want_lp = 1;
            g->n_top = v < HTTP_MAX_PROBS ? (int)v : HTTP_MAX_PROBS;
        }
        if (parse_prompt(s, field(b, "prompt"), g, err, errlen))
            return 400;
    }
    if (g->n_top > s->V)
        g->n_top = s->V;
    if (g->np == 0) {
        snprintf(err, errlen, "the prompt is empty");
        return 400;
    }
    if (g->np >= s->n_ctx) {
        snprintf(err, errlen, "the request exceeds the available context size: the prompt is %d tokens, "
                 "the context of a slot holds %d", g->np, s->n_ctx);
        return -400; /* exceed_context_size_error */
    }
    return 0;
}

/* ==== waiting for a job ==== */

/* The peer closed its side (or the socket failed). */
static int peer_gone(int fd)
{
    struct pollfd p = { fd, POLLIN | POLLRDHUP, 0 };
    if (poll(&p, 1, 0) <= 0)
        return 0;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* Waits for progress of j beyond v, or its end; a client that disconnects
 * meanwhile cancels it. Returns 1 when the client was found gone. */
static int job_progress(struct server *s, struct conn *c, struct sched_job *j, struct sched_view *v)
{
    struct sched_view old = *v;
    int gone = 0;
    for (;;) {
        sched_wait(s->sched, j, v, HTTP_POLL_MS);
        if (v->end != SCHED_RUNNING || v->n_ids != old.n_ids || v->ready != old.ready)
            return gone;
        if (!gone && peer_gone(c->fd)) {
            gone = 1;
            sched_cancel(s->sched, j);
        }
    }
}

/* Cancels j and waits for its end, so it can be freed. */
static void job_abandon(struct server *s, struct sched_job *j, struct sched_view *v)
{
    sched_cancel(s->sched, j);
    while (v->end == SCHED_RUNNING)
        sched_wait(s->sched, j, v, HTTP_POLL_MS);
}

/* ==== generation responses ==== */

static const char *finish_reason(int stop_type)
{
    return stop_type == SCHED_EOS || stop_type == SCHED_WORD ? "stop" : "length";
}

static const char *stop_type_name(int stop_type)
{
    switch (stop_type) {
    case SCHED_EOS: return "eos";
    case SCHED_LIMIT: return "limit";
    case SCHED_WORD: return "word";
    }
    return "none";
}

/* Tokens whose text is part of the output: all but a final EOG. */
static int n_output_ids(struct server *s, const struct sched_job *j, const struct sched_view *v)
{
    int n = v->n_ids;
    return n > 0 && v->end == SCHED_EOS && tok_is_eog(s->tok, j->ids[n - 1]) ? n - 1 : n;
}

static void put_timings(FILE *f, const struct sched_job *j)
{
    int prompt_n = j->t_prompt > 0 ? j->req.n_prompt - j->n_cached : 0;
    double pms = j->t_prompt > 0 ? (j->t_prompt - j->t_start) * 1e3 : 0;
    double gms = j->t_prompt > 0 ? ((j->t_end > 0 ? j->t_end : now_s()) - j->t_prompt) * 1e3 : 0;
    fprintf(f, "\"timings\":{\"cache_n\":%d,\"prompt_n\":%d,\"prompt_ms\":", j->n_cached, prompt_n);
    json_put_num(f, pms, "%.3f");
    fputs(",\"prompt_per_token_ms\":", f);
    json_put_num(f, prompt_n ? pms / prompt_n : 0, "%.3f");
    fputs(",\"prompt_per_second\":", f);
    json_put_num(f, pms > 0 ? prompt_n / (pms / 1e3) : 0, "%.3f");
    fprintf(f, ",\"predicted_n\":%d,\"predicted_ms\":", j->n_ids);
    json_put_num(f, gms, "%.3f");
    fputs(",\"predicted_per_token_ms\":", f);
    json_put_num(f, j->n_ids ? gms / j->n_ids : 0, "%.3f");
    fputs(",\"predicted_per_second\":", f);
    json_put_num(f, gms > 0 ? j->n_ids / (gms / 1e3) : 0, "%.3f");
    fputc('}', f);
}

static void put_usage(FILE *f, const struct sched_job *j)
{
    fprintf(f, "\"usage\":{\"completion_tokens\":%d,\"prompt_tokens\":%d,\"total_tokens\":%d,"
            "\"prompt_tokens_details\":{\"cached_tokens\":%d}}", j->n_ids, j->req.n_prompt,
            j->req.n_prompt + j->n_ids, j->n_cached);
}

/* A token's text (special tokens spelled out) as "token" and "bytes". */
static void put_token(FILE *f, struct server *s, int32_t id, const char *key)
{
    char buf[256];
    size_t n = tok_piece(s->tok, id, buf, sizeof buf, 1);
    if (n > sizeof buf)
        n = sizeof buf;
    fprintf(f, "\"%s\":", key);
    json_put_str(f, buf, n);
    fputs(",\"bytes\":[", f);
    for (size_t k = 0; k < n; k++)
        fprintf(f, k ? ",%u" : "%u", (unsigned char)buf[k]);
    fputc(']', f);
}

/* llama-server's completion_probabilities entries for tokens [a, b). */
static void put_probs_native(FILE *f, struct server *s, const struct sched_job *j, int a, int b)
{
    for (int i = a; i < b; i++) {
        fprintf(f, "%s{\"id\":%" PRId32 ",", i > a ? "," : "", j->ids[i]);
        put_token(f, s, j->ids[i], "token");
        fputs(",\"logprob\":", f);
        json_put_num(f, j->lp[i], "%.9g");
        fputs(",\"top_logprobs\":[", f);
        const struct sample_top *t = j->top + (size_t)i * (size_t)j->req.n_top;
        for (int k = 0; k < j->req.n_top; k++) {
            fprintf(f, "%s{\"id\":%" PRId32 ",", k ? "," : "", t[k].id);
            put_token(f, s, t[k].id, "token");
            fputs(",\"logprob\":", f);
            json_put_num(f, t[k].logprob, "%.9g");
            fputc('}', f);
        }
        fputs("]}", f);
    }
}

/* OpenAI chat logprobs.content entries for tokens [a, b). */
static void put_probs_chat(FILE *f, struct server *s, const struct sched_job *j, int a, int b)
{
    for (int i = a; i < b; i++) {
        fputs(i > a ? ",{" : "{", f);
        put_token(f, s, j->ids[i], "token");
        fputs(",\"logprob\":", f);
        json_put_num(f, j->lp[i], "%.9g");
        fputs(",\"top_logprobs\":[", f);
        const struct sample_top *t = j->top + (size_t)i * (size_t)j->req.n_top;
        for (int k = 0; k < j->req.n_top; k++) {
            fputs(k ? ",{" : "{", f);
            put_token(f, s, t[k].id, "token");
            fputs(",\"logprob\":", f);
            json_put_num(f, t[k].logprob, "%.9g");
            fputc('}', f);
        }
        fputs("]}", f);
    }
}

/* OpenAI legacy completions logprobs for tokens [a, b); text offsets from off. */
static void put_probs_legacy(FILE *f, struct server *s, const struct sched_job *j, int a, int b, size_t off)
{
    char buf[256];
    fputs("{\"tokens\":[", f);
    for (int i = a; i < b; i++) {
        size_t n = tok_piece(s->tok, j->ids[i], buf, sizeof buf, 1);
        if (i > a)
            fputc(',', f);
        json_put_str(f, buf, n < sizeof buf ? n : sizeof buf);
    }
    fputs("],\"token_logprobs\":[", f);
    for (int i = a; i < b; i++) {
        if (i > a)
            fputc(',', f);
        json_put_num(f, j->lp[i], "%.9g");
    }
    fputs("],\"top_logprobs\":[", f);
    for (int i = a; i < b; i++) {
        fputs(i > a ? ",{" : "{", f);
        const struct sample_top *t = j->top + (size_t)i * (size_t)j->req.n_top;
        for (int k = 0; k < j->req.n_top; k++) {
            size_t n = tok_piece(s->tok, t[k].id, buf, sizeof buf, 1);
            if (k)
                fputc(',', f);
            json_put_str(f, buf, n < sizeof buf ? n : sizeof buf);
            fputc(':', f);
            json_put_num(f, t[k].logprob, "%.9g");
        }
        fputc('}', f);
    }
    fputs("],\"text_offset\":[", f);
    for (int i = a; i < b; i++) {
        fprintf(f, i > a ? ",%zu" : "%zu", off);
        off += tok_piece(s->tok, j->ids[i], buf, sizeof buf, 0);
    }
    fputs("]}", f);
}

static void put_head_v1(FILE *f, struct server *s, const struct gen *g, const char *object)
{
    fputs("{\"id\":", f);
    put_cstr(f, g->id);
    fprintf(f, ",\"object\":\"%s\",\"created\":%lld,\"model\":", object, (long long)g->created);
    put_cstr(f, s->model_name);
    fputs(",\"system_fingerprint\":\"strata\"", f);
}

/* The native /completion object for ids [a, b) and their text; final: the
 * stop fields and timings. */
static void put_native(FILE *f, struct server *s, const struct gen *g, const struct sched_job *j,
                       const struct sched_view *v, const char *content, size_t clen, int a, int b)
{
    int final = v->end != SCHED_RUNNING;
    fputs("{\"index\":0,\"content\":", f);
    json_put_str(f, content, clen);
    fputs(",\"tokens\":[", f);
    for (int i = a; i < b; i++)
        fprintf(f, i > a ? ",%" PRId32 : "%" PRId32, j->ids[i]);
    fprintf(f, "],\"id_slot\":%d,\"stop\":%s,\"model\":", v->slot, final ? "true" : "false");
    put_cstr(f, s->model_name);
    fprintf(f, ",\"tokens_predicted\":%d,\"tokens_evaluated\":%d", v->n_ids, j->req.n_prompt);
    if (g->want_lp && b > a) {
        fputs(",\"completion_probabilities\":[", f);
        put_probs_native(f, s, j, a, b);
        fputc(']', f);
    }
    if (final) {
        fprintf(f, ",\"generation_settings\":{\"n_predict\":%d,\"temperature\":", g->n_predict);
        json_put_num(f, g->sp.temp, "%.9g");
        fprintf(f, ",\"top_k\":%d,\"top_p\":", g->sp.top_k);
        json_put_num(f, g->sp.top_p, "%.9g");
        fputs(",\"min_p\":", f);
        json_put_num(f, g->sp.min_p, "%.9g");
        fputs(",\"presence_penalty\":", f);
        json_put_num(f, g->sp.presence_penalty, "%.9g");
        fputs(",\"frequency_penalty\":", f);
        json_put_num(f, g->sp.frequency_penalty, "%.9g");
        fputs(",\"repeat_penalty\":", f);
        json_put_num(f, g->sp.repeat_penalty, "%.9g");
        fprintf(f, ",\"repeat_last_n\":%d,\"seed\":%" PRIu64 ",\"n_probs\":%d,\"cache_prompt\":%s,\"stream\":%s}",
                g->sp.repeat_last_n, g->sp.seed, g->n_top, g->cache_prompt ? "true" : "false",
                g->stream ? "true" : "false");
        fputs(",\"prompt\":", f);
        size_t pn = tok_decode(s->tok, j->req.prompt, j->req.n_prompt, NULL, 0, 1);
        char *pt = malloc(pn + 1);
        if (pt) {
            tok_decode(s->tok, j->req.prompt, j->req.n_prompt, pt, pn, 1);
            json_put_str(f, pt, pn);
            free(pt);
        } else {
            fputs("\"\"", f);
        }
        fprintf(f, ",\"has_new_line\":%s,\"truncated\":false,\"stop_type\":\"%s\",\"stopping_word\":",
                memchr(j->text, '\n', j->text_len) ? "true" : "false", stop_type_name(j->end));
        if (j->end == SCHED_WORD && j->stop_word >= 0)
            json_put_str(f, j->req.stop[j->stop_word], j->req.stop_len[j->stop_word]);
        else
            fputs("\"\"", f);
        fprintf(f, ",\"tokens_cached\":%d,", j->n_past);
        put_timings(f, j);
    }
    fputc('}', f);
}

/* The whole response of a finished job (not streaming). */
static void put_final(FILE *f, struct server *s, const struct gen *g, const struct sched_job *j,
                      const struct sched_view *v)
{
    int n_out = n_output_ids(s, j, v);
    if (g->route == R_COMPLETION) {
        put_native(f, s, g, j, v, j->text, j->text_len, 0, n_out);
        return;
    }
    if (g->route == R_V1_COMPLETIONS) {
        put_head_v1(f, s, g, "text_completion");
        fputs(",\"choices\":[{\"text\":", f);
        json_put_str(f, j->text, j->text_len);
        fputs(",\"index\":0,\"logprobs\":", f);
        if (g->want_lp)
            put_probs_legacy(f, s, j, 0, n_out, 0);
        else
            fputs("null", f);
        fprintf(f, ",\"finish_reason\":\"%s\"}],", finish_reason(j->end));
    } else {
        struct chat_split sp = { 0, 0, 0, j->text_len };
        if (g->parse_think)
            chat_split(j->text, j->text_len, 1, &sp);
        put_head_v1(f, s, g, "chat.completion");
        fputs(",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":", f);
        json_put_str(f, j->text + sp.c_off, sp.c_len);
        if (sp.r_len) {
            fputs(",\"reasoning_content\":", f);
            json_put_str(f, j->text + sp.r_off, sp.r_len);
        }
        fputs("},\"logprobs\":", f);
        if (g->want_lp) {
            fputs("{\"content\":[", f);
            put_probs_chat(f, s, j, 0, n_out);
            fputs("]}", f);
        } else {
            fputs("null", f);
        }
        fprintf(f, ",\"finish_reason\":\"%s\"}],", finish_reason(j->end));
    }
    put_usage(f, j);
    fputc(',', f);
    put_timings(f, j);
    fputc('}', f);
}

/* ---- Server-Sent Events ---- */

struct sse {
    struct req *r;
    int failed;
};

/* Sends one event (`data: …` and a blank line), one chunk when chunked. */
static int sse_send(struct sse *e, const char *data, size_t n)
{
    if (e->failed)
        return -1;
    char pre[32];
    int pn = e->r->chunked ? snprintf(pre, sizeof pre, "%zx\r\ndata: ", n + 8) : snprintf(pre, sizeof pre, "data: ");
    const char *post = e->r->chunked ? "\n\n\r\n" : "\n\n";
    struct iovec iov[3] = { { pre, (size_t)pn }, { (void *)data, n }, { (void *)post, strlen(post) } };
    if (send_iov(e->r->c->fd, iov, 3) != 0) {
        e->failed = 1;
        return -1;
    }
    return 0;
}

static int sse_send_ob(struct sse *e, struct obuf *o)
{
    int rc = ob_close(o) == 0 ? sse_send(e, o->p, o->n) : -1;
    free(o->p);
    if (rc)
        e->failed = 1;
    return rc;
}

static int sse_start(struct req *r)
{
    char head[512];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 200 OK\r\nServer: strata\r\nContent-Type: text/event-stream\r\n"
                     "Cache-Control: no-cache\r\nAccess-Control-Allow-Origin: *\r\n%s\r\n",
                     r->chunked ? (r->keep_alive ? "Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n"
                                                 : "Transfer-Encoding: chunked\r\nConnection: close\r\n")
                                : "Connection: close\r\n");
    if (!r->chunked)
        r->keep_alive = 0;
    metric_request(r->s, r->route, 200);
    return send_all(r->c->fd, head, (size_t)n);
}

static void sse_end(struct sse *e)
{
    if (!e->failed && e->r->chunked && send_all(e->r->c->fd, "0\r\n\r\n", 5))
        e->failed = 1;
}

/* A chat chunk's start: head and the choices array up to the delta. */
static void put_chat_chunk_head(FILE *f, struct server *s, const struct gen *g)
{
    put_head_v1(f, s, g, "chat.completion.chunk");
    fputs(",\"choices\":[{\"index\":0,\"delta\":", f);
}

/* Streams job j to the client as it is generated. */
static void stream_job(struct req *r, const struct gen *g, struct sched_job *j)
{
    struct server *s = r->s;
    struct sse e = { r, 0 };
    struct obuf o;
    struct sched_view v = { 0, 0, SCHED_RUNNING, -1 };
    size_t sent = 0, r_sent = 0, c_sent = 0;   /* text, reasoning and content bytes sent */
    int ids_sent = 0;
    if (sse_start(r)) {
        r->keep_alive = 0;
        job_abandon(s, j, &v);
        return;
    }
    if (g->route == R_CHAT && ob_open(&o) == 0) {
        put_chat_chunk_head(o.f, s, g);
        fputs("{\"role\":\"assistant\",\"content\":null},\"logprobs\":null,\"finish_reason\":null}]}", o.f);
        sse_send_ob(&e, &o);
    }
    while (!e.failed) {
        job_progress(s, r->c, j, &v);
        int done = v.end != SCHED_RUNNING;
        /* text below v.ready and ids below v.n_ids are final: read without the lock */
        const char *text = j->text;
        size_t text_len = v.ready;
        if (v.end == SCHED_ERROR || v.end == SCHED_REFUSED) {
            int status = v.end == SCHED_ERROR ? 500 : 503;
            if (ob_open(&o) == 0) {
                put_error(o.f, status, error_type(status), j->err);
                sse_send_ob(&e, &o);
            }
            break;
        }
        int n_out = n_output_ids(s, j, &v);
        if (ob_open(&o))
            break;
        int any = 0;
        if (g->route == R_COMPLETION) {
            any = n_out > ids_sent || text_len > sent;
            if (any) {
                struct sched_view running = v;
                running.end = SCHED_RUNNING;
                put_native(o.f, s, g, j, &running, text + sent, text_len - sent, ids_sent, n_out);
            }
        } else if (g->route == R_V1_COMPLETIONS) {
            any = n_out > ids_sent || text_len > sent;
            if (any) {
                put_head_v1(o.f, s, g, "text_completion");
                fputs(",\"choices\":[{\"text\":", o.f);
                json_put_str(o.f, text + sent, text_len - sent);
                fputs(",\"index\":0,\"logprobs\":", o.f);
                if (g->want_lp)
                    put_probs_legacy(o.f, s, j, ids_sent, n_out, sent);
                else
                    fputs("null", o.f);
                fputs(",\"finish_reason\":null}]}", o.f);
            }
        } else {
            struct chat_split sp = { 0, 0, 0, text_len };
            if (g->parse_think)
                chat_split(text, text_len, done, &sp);
            size_t rn = sp.r_len > r_sent ? sp.r_len - r_sent : 0, cn = sp.c_len > c_sent ? sp.c_len - c_sent : 0;
            any = rn || cn || (g->want_lp && n_out > ids_sent);
            if (any) {
                put_chat_chunk_head(o.f, s, g);
                fputc('{', o.f);
                if (rn) {
                    fputs("\"reasoning_content\":", o.f);
                    json_put_str(o.f, text + sp.r_off + r_sent, rn);
                }
                if (cn || !rn) {
                    fputs(rn ? ",\"content\":" : "\"content\":", o.f);
                    json_put_str(o.f, text + sp.c_off + c_sent, cn);
                }
                fputs("},\"logprobs\":", o.f);
                if (g->want_lp) {
                    fputs("{\"content\":[", o.f);
                    put_probs_chat(o.f, s, j, ids_sent, n_out);
                    fputs("]}", o.f);
                } else {
                    fputs("null", o.f);
                }
                fputs(",\"finish_reason\":null}]}", o.f);
            }
            r_sent += rn;
            c_sent += cn;
        }
        if (any) {
            sse_send_ob(&e, &o);
            ids_sent = n_out;
            sent = text_len;
        } else {
            ob_close(&o);
            free(o.p);
        }
        if (!done || e.failed || ob_open(&o))
            continue;
        /* the last events */
        if (g->route == R_COMPLETION) {
            put_native(o.f, s, g, j, &v, "", 0, 0, 0);
            sse_send_ob(&e, &o);
            break;
        }
        if (g->route == R_CHAT)
            put_chat_chunk_head(o.f, s, g);
        else {
            put_head_v1(o.f, s, g, "text_completion");
            fputs(",\"choices\":[{\"text\":\"\",\"index\":0,\"logprobs\":null", o.f);
        }
        fprintf(o.f, "%s\"finish_reason\":\"%s\"}]", g->route == R_CHAT ? "{},\"logprobs\":null," : ",",
                finish_reason(v.end));
        if (!g->include_usage) {
            fputc(',', o.f);
            put_timings(o.f, j);
        }
        fputc('}', o.f);
        sse_send_ob(&e, &o);
        if (g->include_usage && ob_open(&o) == 0) {
            put_head_v1(o.f, s, g, g->route == R_CHAT ? "chat.completion.chunk" : "text_completion");
            fputs(",\"choices\":[],", o.f);
            put_usage(o.f, j);
            fputc(',', o.f);
            put_timings(o.f, j);
            fputc('}', o.f);
            sse_send_ob(&e, &o);
        }
        sse_send(&e, "[DONE]", 6);
        break;
    }
    if (!e.failed)
        sse_end(&e);
    if (e.failed)
        r->keep_alive = 0;
    job_abandon(s, j, &v);
}

static void random_id(char *out, size_t cap, const char *prefix)
{
    static const char abc[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    size_t n = (size_t)snprintf(out, cap, "%s", prefix);
    uint64_t a = random_u64(), b = random_u64();
    for (int i = 0; i < 24 && n + 1 < cap; i++) {
        uint64_t *x = i < 12 ? &a : &b;
        out[n++] = abc[*x % (sizeof abc - 1)];
        *x /= sizeof abc - 1;
    }
    out[n] = 0;
}

/* POST /completion, /v1/completions, /v1/chat/completions. */
static int handle_generate(struct req *r, const struct json *b)
{
    struct server *s = r->s;
    struct gen g;
    char err[512];
    memset(&g, 0, sizeof g);
    g.route = r->route;
    g.created = time(NULL);
    random_id(g.id, sizeof g.id, r->route == R_CHAT ? "chatcmpl-" : "cmpl-");
    int st = parse_gen(s, r->route, b, &g, err, sizeof err);
    if (st) {
        free(g.prompt);
        return reply_error(r, st < 0 ? -st : st, st < 0 ? "exceed_context_size_error" : NULL, "%s", err);
    }
    struct sched_req q = { .prompt = g.prompt, .n_prompt = g.np, .sp = g.sp, .want_lp = g.want_lp,
                           .n_top = g.n_top, .cache_prompt = g.cache_prompt, .n_stop = g.n_stop };
    q.n_predict = g.n_predict >= 0 ? g.n_predict : s->o.max_tokens;
    memcpy(q.stop, g.stop, (size_t)g.n_stop * sizeof *q.stop);
    memcpy(q.stop_len, g.stop_len, (size_t)g.n_stop * sizeof *q.stop_len);
    struct sched_job *j = sched_job_new(s->sched, &q);
    if (!j) {
        free(g.prompt);
        return reply_error(r, 500, NULL, "out of memory");
    }
    int rc = 0;
    if (sched_submit(s->sched, j)) {
        rc = reply_error(r, 503, NULL, "the server is shutting down");
    } else if (g.stream) {
        stream_job(r, &g, j);
    } else {
        struct sched_view v = { 0, 0, SCHED_RUNNING, -1 };
        int gone = 0;
        while (v.end == SCHED_RUNNING)
            gone |= job_progress(s, r->c, j, &v);
        struct obuf o;
        if (v.end == SCHED_CANCEL && gone) {
            rc = -1; /* the client left */
        } else if (v.end == SCHED_ERROR) {
            rc = reply_error(r, 500, NULL, "%s", j->err);
        } else if (v.end == SCHED_REFUSED) {
            rc = reply_error(r, 503, NULL, "%s", j->err);
        } else if (ob_open(&o)) {
            rc = reply_error(r, 500, NULL, "out of memory");
        } else {
            put_final(o.f, s, &g, j, &v);
            rc = reply_json(r, &o);
        }
    }
    sched_job_free(j);
    free(g.prompt);
    return rc;
}

/* ==== the other routes ==== */

static int handle_tokenize(struct req *r, const struct json *b)
{
    struct server *s = r->s;
    char err[256];
    int add_special = 0, parse_special = 1, with_pieces = 0, n;
    const struct json *content = field(b, "content");
    if (!content || content->kind != JSON_STR)
        return reply_error(r, 400, NULL, "'content' must be a string");
    if (f_bool(b, "add_special", &add_special, err, sizeof err) < 0 ||
        f_bool(b, "parse_special", &parse_special, err, sizeof err) < 0 ||
        f_bool(b, "with_pieces", &with_pieces, err, sizeof err) < 0)
        return reply_error(r, 400, NULL, "%s", err);
    int32_t *ids = tok_encode(s->tok, content->str, content->len, add_special, parse_special, &n, err, sizeof err);
    if (!ids)
        return reply_error(r, 400, NULL, "%s", err);
    struct obuf o;
    if (ob_open(&o)) {
        free(ids);
        return reply_error(r, 500, NULL, "out of memory");
    }
    fputs("{\"tokens\":[", o.f);
    char buf[256];
    for (int i = 0; i < n; i++) {
        if (i)
            fputc(',', o.f);
        if (!with_pieces) {
            fprintf(o.f, "%" PRId32, ids[i]);
            continue;
        }
        size_t pn = tok_piece(s->tok, ids[i], buf, sizeof buf, 1);
        pn = pn < sizeof buf ? pn : sizeof buf;
        fprintf(o.f, "{\"id\":%" PRId32 ",\"piece\":", ids[i]);
        if (utf8_valid(buf, pn)) {
            json_put_str(o.f, buf, pn);
        } else {
            fputc('[', o.f);
            for (size_t k = 0; k < pn; k++)
                fprintf(o.f, k ? ",%u" : "%u", (unsigned char)buf[k]);
            fputc(']', o.f);
        }
        fputc('}', o.f);
    }
    fputs("]}", o.f);
    free(ids);
    return reply_json(r, &o);
}

static int handle_detokenize(struct req *r, const struct json *b)
{
    struct server *s = r->s;
    const struct json *t = field(b, "tokens");
    if (!t || t->kind != JSON_ARR)
        return reply_error(r, 400, NULL, "'tokens' must be an array of token ids");
    struct obuf text;
    if (ob_open(&text))
        return reply_error(r, 500, NULL, "out of memory");
    char buf[256];
    for (size_t i = 0; i < t->len; i++) {
        const struct json *e = &t->items[i];
        if (e->kind != JSON_NUM || e->num != floor(e->num) || e->num < 0 || e->num >= s->V) {
            ob_close(&text);
            free(text.p);
            return reply_error(r, 400, NULL, "tokens[%zu] is not a token id in [0, %d)", i, s->V);
        }
        size_t n = tok_piece(s->tok, (int32_t)e->num, buf, sizeof buf, 1);
        fwrite(buf, 1, n < sizeof buf ? n : sizeof buf, text.f);
    }
    if (ob_close(&text)) {
        free(text.p);
        return reply_error(r, 500, NULL, "out of memory");
    }
    struct obuf o;
    if (ob_open(&o)) {
        free(text.p);
        return reply_error(r, 500, NULL, "out of memory");
    }
    fputs("{\"content\":", o.f);
    json_put_str(o.f, text.p, text.n);
    fputc('}', o.f);
    free(text.p);
    return reply_json(r, &o);
}

static int handle_models(struct req *r)
{
    struct server *s = r->s;
    const struct gguf *gg = model_gguf(s->model);
    const struct model_hp *hp = model_hp(s->model);
    struct gguf_str tm;
    int vocab_type = gguf_get_str(gg, "tokenizer.ggml.model", &tm) == 0 && tm.len == 4 &&
                     memcmp(tm.ptr, "gpt2", 4) == 0 ? 2 : 1;
    uint64_t n_params = 0;
    for (uint64_t i = 0; i < gg->n_tensors; i++) {
        uint64_t e = 1;
        for (int d = 0; d < GGUF_MAX_DIMS; d++)
            e *= (uint64_t)gg->tensors[i].ne[d];
        n_params += e;
    }
    struct obuf o;
    if (ob_open(&o))
        return reply_error(r, 500, NULL, "out of memory");
    fputs("{\"object\":\"list\",\"data\":[{\"id\":", o.f);
    put_cstr(o.f, s->model_name);
    fprintf(o.f, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"llamacpp\",\"meta\":{\"vocab_type\":%d,"
            "\"n_vocab\":%d,\"n_ctx_train\":%d,\"n_embd\":%d,\"n_params\":%" PRIu64 ",\"size\":%zu}}]}",
            (long long)s->started, vocab_type, hp->n_vocab, hp->n_ctx_train, hp->n_embd, n_params,
            model_weight_bytes(s->model));
    return reply_json(r, &o);
}

/* Compares the Authorization header with "Bearer KEY" in time that depends
 * only on the key's length. */
static int authorized(const struct req *r)
{
    const char *key = r->s->o.api_key;
    const struct http_header *h = http_header(r->h, "authorization");
    if (!h || h->value_len < 7 || strncasecmp(h->value, "bearer ", 7) != 0)
        return 0;
    const char *v = h->value + 7;
    size_t vn = h->value_len - 7, kn = strlen(key);
    unsigned char diff = vn != kn;
    for (size_t i = 0; i < kn; i++)
        diff |= (unsigned char)((i < vn ? v[i] : 0) ^ key[i]);
    return diff == 0;
}

static const struct { const char *path; int route, post; } routes[] = {
    { "/", R_INDEX, 0 },
    { "/index.html", R_INDEX, 0 },
    { "/health", R_HEALTH, 0 },
    { "/v1/health", R_HEALTH, 0 },
    { "/v1/models", R_MODELS, 0 },
    { "/models", R_MODELS, 0 },
    { "/completion", R_COMPLETION, 1 },
    { "/completions", R_COMPLETION, 1 },
    { "/v1/completions", R_V1_COMPLETIONS, 1 },
    { "/v1/chat/completions", R_CHAT, 1 },
    { "/chat/completions", R_CHAT, 1 },
    { "/tokenize", R_TOKENIZE, 1 },
    { "/detokenize", R_DETOKENIZE, 1 },
    { "/metrics", R_METRICS, 0 },
};

static int method_is(const struct http_request *h, const char *m)
{
    return h->method_len == strlen(m) && memcmp(h->method, m, h->method_len) == 0;
}

/* Routes one parsed request; returns -1 when the connection must close. */
static int dispatch(struct req *r)
{
    struct server *s = r->s;
    const struct http_request *h = r->h;
    int post = -1;
    r->route = R_OTHER;
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        if (strlen(routes[i].path) == r->path_len && memcmp(routes[i].path, r->path, r->path_len) == 0) {
            r->route = routes[i].route;
            post = routes[i].post;
        }
    }
    if (method_is(h, "OPTIONS"))
        return respond(r, 204, "text/plain", "", 0,
                       "Access-Control-Allow-Methods: GET, POST, OPTIONS\r\n"
                       "Access-Control-Allow-Headers: Authorization, Content-Type\r\n");
    if (post < 0)
        return reply_error(r, 404, NULL, "no route %.*s", (int)(r->path_len < 200 ? r->path_len : 200), r->path);
    r->head_only = method_is(h, "HEAD") && !post;
    if (!(post ? method_is(h, "POST") : method_is(h, "GET") || r->head_only))
        return reply_error(r, 405, NULL, "%s expects %s", route_label[r->route], post ? "POST" : "GET");
    if (s->o.api_key && r->route != R_INDEX && r->route != R_HEALTH && !authorized(r))
        return reply_error(r, 401, NULL, "invalid or missing API key (Authorization: Bearer KEY)");
    if (r->route == R_INDEX)
        return respond(r, 200, "text/html; charset=utf-8", chat_page, sizeof chat_page - 1, NULL);
    pthread_mutex_lock(&s->lock);
    int ready = s->ready;
    pthread_mutex_unlock(&s->lock);
    if (!ready)
        return reply_error(r, 503, NULL, "Loading model");
    if (r->route == R_HEALTH) {
        static const char ok[] = "{\"status\":\"ok\"}";
        return respond(r, 200, "application/json; charset=utf-8", ok, sizeof ok - 1, NULL);
    }
    if (r->route == R_MODELS)
        return handle_models(r);
    if (r->route == R_METRICS) {
        struct obuf o;
        if (ob_open(&o))
            return reply_error(r, 500, NULL, "out of memory");
        put_metrics(s, o.f);
        if (ob_close(&o)) {
            free(o.p);
            return reply_error(r, 500, NULL, "out of memory");
        }
        int rc = respond(r, 200, "text/plain; version=0.0.4; charset=utf-8", o.p, o.n, NULL);
        free(o.p);
        return rc;
    }
    struct json b;
    char err[256];
    if (json_parse(&b, r->body, r->body_len, err, sizeof err) != 0)
        return reply_error(r, 400, NULL, "invalid JSON body: %s", err);
    int rc;
    if (b.kind != JSON_OBJ)
        rc = reply_error(r, 400, NULL, "the body must be a JSON object");
    else if (r->route == R_TOKENIZE)
        rc = handle_tokenize(r, &b);
    else if (r->route == R_DETOKENIZE)
        rc = handle_detokenize(r, &b);
    else
        rc = handle_generate(r, &b);
    json_free(&b);
    return rc;
}

/* ---- reading requests ---- */

/* A bare response on a connection about to close (limits, malformed input). */
static void reply_close(struct conn *c, int status, const char *msg)
{
    struct http_request h = { 0 };
    struct req r = { .s = c->s, .c = c, .h = &h, .route = R_OTHER, .keep_alive = 0 };
    reply_error(&r, status, NULL, "%s", msg);
}

/* Waits until fd is readable or deadline passes (checking for shutdown);
 * 1 readable, 0 timed out, -1 shutdown. */
static int wait_readable(int fd, double deadline, int idle)
{
    for (;;) {
        if (idle && stopping())
            return -1;
        double left = deadline - now_s();
        if (left <= 0)
            return 0;
        int ms = left * 1e3 < HTTP_POLL_MS ? (int)(left * 1e3) + 1 : HTTP_POLL_MS;
        struct pollfd p = { fd, POLLIN, 0 };
        int rc = poll(&p, 1, ms);
        if (rc > 0)
            return 1;
        if (rc < 0 && errno != EINTR)
            return -1;
    }
}

/* Reads and answers one request; returns 1 to keep the connection. */
static int serve_one(struct conn *c)
{
    struct server *s = c->s;
    struct http_request h;
    double timeout = s->o.timeout_s, deadline = now_s() + timeout;
    int rc;
    /* the request line and headers */
    for (;;) {
        rc = c->n ? http_parse_request(c->head, c->n, &h) : HTTP_PARTIAL;
        if (rc != HTTP_PARTIAL)
            break;
        if (c->n == sizeof c->head) {
            reply_close(c, 431, "the request line and headers exceed 16 KiB");
            return 0;
        }
        int w = wait_readable(c->fd, deadline, c->n == 0);
        if (w < 0)
            return 0;
        if (w == 0) {
            if (c->n > 0)
                reply_close(c, 408, "the request did not arrive in time");
            return 0;
        }
        ssize_t got = recv(c->fd, c->head + c->n, sizeof c->head - c->n, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return 0;
        if (c->n == 0)
            deadline = now_s() + timeout; /* the whole request has `timeout` from its first byte */
        c->n += (size_t)got;
    }
    if (rc == HTTP_TOO_MANY) {
        reply_close(c, 431, "too many header fields");
        return 0;
    }
    if (rc < 0) {
        reply_close(c, 400, "malformed request line or header");
        return 0;
    }
    size_t head_len = (size_t)rc;
    /* framing of the body */
    if (http_header(&h, "transfer-encoding")) {
        reply_close(c, 411, "chunked request bodies are not supported: send Content-Length");
        return 0;
    }
    size_t body_len = 0;
    int have_len = 0;
    for (int i = 0; i < h.n_headers; i++) {
        const struct http_header *hd = &h.headers[i];
        if (hd->name_len != 14 || strncasecmp(hd->name, "content-length", 14) != 0)
            continue;
        uint64_t v = 0;
        int ok = hd->value_len > 0 && hd->value_len <= 19;
        for (size_t k = 0; ok && k < hd->value_len; k++) {
            ok = hd->value[k] >= '0' && hd->value[k] <= '9';
            v = v * 10 + (uint64_t)(hd->value[k] - '0');
        }
        if (!ok || (have_len && v != body_len) || v > SIZE_MAX / 2) {
            reply_close(c, 400, "invalid Content-Length");
            return 0;
        }
        have_len = 1;
        body_len = (size_t)v;
    }
    if (body_len > s->o.max_body) {
        char msg[128];
        snprintf(msg, sizeof msg, "the body is %zu bytes; the limit is %zu (--max-body)", body_len, s->o.max_body);
        reply_close(c, 413, msg);
        return 0;
    }
    struct req r = { .s = s, .c = c, .h = &h, .route = R_OTHER, .chunked = h.minor >= 1 };
    r.keep_alive = h.minor >= 1 ? !header_has(&h, "connection", "close") : header_has(&h, "connection", "keep-alive");
    if (stopping())
        r.keep_alive = 0;
    r.path = h.target;
    const char *q = memchr(h.target, '?', h.target_len);
    r.path_len = q ? (size_t)(q - h.target) : h.target_len;
    /* the body: one allocation; part of it may already be in head */
    char *body = malloc(body_len + 1);
    if (!body) {
        reply_close(c, 500, "out of memory");
        return 0;
    }
    size_t have = c->n - head_len < body_len ? c->n - head_len : body_len;
    memcpy(body, c->head + head_len, have);
    if (have < body_len && header_has(&h, "expect", "100-continue") &&
        send_all(c->fd, "HTTP/1.1 100 Continue\r\n\r\n", 25)) {
        free(body);
        return 0;
    }
    while (have < body_len) {
        int w = wait_readable(c->fd, deadline, 0);
        if (w <= 0) {
            if (w == 0)
                reply_close(c, 408, "the request body did not arrive in time");
            free(body);
            return 0;
        }
        ssize_t got = recv(c->fd, body + have, body_len - have, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            free(body);
            return 0;
        }
        have += (size_t)got;
    }
    body[body_len] = 0;
    r.body = body;
    r.body_len = body_len;
    rc = dispatch(&r);
    free(body);
    /* bytes after this request (a pipelined one) move to the front; the
     * head's pointers are dead from here on */
    size_t used = head_len + (c->n - head_len < body_len ? c->n - head_len : body_len);
    memmove(c->head, c->head + used, c->n - used);
    c->n -= used;
    return rc == 0 && r.keep_alive && !stopping();
}

static void *conn_main(void *arg)
{
    struct conn *c = arg;
    struct server *s = c->s;
    while (serve_one(c))
        ;
    close(c->fd);
    free(c);
    pthread_mutex_lock(&s->lock);
    s->n_conns--;
    pthread_cond_broadcast(&s->conn_cv);
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* Answers 503 on a connection beyond --max-conns, without a thread. */
static void refuse(int fd)
{
    static const char body[] =
        "{\"error\":{\"code\":503,\"message\":\"too many connections\",\"type\":\"unavailable_error\"}}";
    char msg[512];
    int n = snprintf(msg, sizeof msg,
                     "HTTP/1.1 503 Service Unavailable\r\nServer: strata\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s",
                     sizeof body - 1, body);
    if (send(fd, msg, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) > 0)
        shutdown(fd, SHUT_WR);
    /* a request already received and left unread would make close() reset
     * the connection, and the client could lose the 503 */
    char sink[4096];
    while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0)
        ;
    close(fd);
}

static void *accept_main(void *arg)
{
    struct server *s = arg;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, HTTP_THREAD_STACK);
    while (!stopping()) {
        struct pollfd p = { s->listen_fd, POLLIN, 0 };
        if (poll(&p, 1, HTTP_POLL_MS) <= 0)
            continue;
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        pthread_mutex_lock(&s->lock);
        int full = s->n_conns >= s->o.max_conns;
        if (!full)
            s->n_conns++;
        pthread_mutex_unlock(&s->lock);
        if (full) {
            metric_request(s, R_OTHER, 503);
            refuse(fd);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct timeval tv = { s->o.timeout_s, 0 };
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        struct conn *c = malloc(sizeof *c);
        pthread_t t;
        if (c) {
            c->s = s;
            c->fd = fd;
            c->n = 0;
        }
        if (!c || pthread_create(&t, &attr, conn_main, c) != 0) {
            free(c);
            close(fd);
            pthread_mutex_lock(&s->lock);
            s->n_conns--;
            pthread_cond_broadcast(&s->conn_cv);
            pthread_mutex_unlock(&s->lock);
        }
    }
    pthread_attr_destroy(&attr);
    close(s->listen_fd);
    s->listen_fd = -1;
    return NULL;
}

/* ==== start-up and shutdown ==== */

static const char serve_usage[] =
    "usage: strata serve -m MODEL [options]\n"
    "  -m, --model F       GGUF model file\n"
    "  -c, --ctx N         context cells per slot (default: the model's, at most 4096)\n"
    "  --kv F              KV cache cells: f16 (default), f32, int8, q4, k8v4\n"
    "  --kv-mem MIB        one KV pool of this many MiB shared by the slots\n"
    "                      (default: --parallel sequences of -c cells)\n"
    "  --parallel N        slots: requests generated at once (default 4)\n"
    "  --device D          auto (default: the GPU when the build has one and finds a\n"
    "                      device), cpu, or gpu (cuda, hip)\n"
    "  --prefill-chunk N   prompt tokens per forward chunk (default 512; 2048 on a GPU)\n"
    "  --host H            address to listen on (default 127.0.0.1)\n"
    "  --port P            port (default 8080; 0: any free port, printed at start-up)\n"
    "  --api-key KEY       require Authorization: Bearer KEY\n"
    "  --max-body N        largest request body, K/M suffixes (default 8M)\n"
    "  --max-conns N       open connections at most (default 64; 503 beyond)\n"
    "  --timeout S         idle and slow-client timeout in seconds (default 30)\n"
    "  -t, --threads N     compute threads (default: the cores)\n"
    "request defaults: --temp 0.8 --top-p 0.95 --top-k 40 --min-p 0.05 --seed S (random)\n"
    "  --max-tokens N (-1: until EOG or the context is full)\n";

static int opt_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int opt_fail(const char *fmt, ...)
{
    va_list ap;
    fputs("strata serve: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return -1;
}

static int opt_int(const char *name, const char *v, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi)
        return opt_fail("%s: '%s' is not an integer in [%ld, %ld]", name, v, lo, hi);
    *out = (int)x;
    return 0;
}

static int opt_float(const char *name, const char *v, float *out)
{
    char *end;
    errno = 0;
    float x = strtof(v, &end);
    if (end == v || *end || errno || !isfinite(x))
        return opt_fail("%s: '%s' is not a number", name, v);
    *out = x;
    return 0;
}

/* 0 ok, -1 error (printed), 1 help printed */
static int parse_serve_opts(int argc, char **argv, struct serve_opts *o)
{
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = HTTP_DEFAULT_PORT;
    o->parallel = HTTP_DEFAULT_PARALLEL;
    o->max_conns = HTTP_DEFAULT_MAX_CONNS;
    o->timeout_s = HTTP_DEFAULT_TIMEOUT_S;
    o->max_body = HTTP_DEFAULT_MAX_BODY;
    o->kv = KV_CELL_F16;
    o->max_tokens = -1;
    o->sp = (struct sample_params){ .temp = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                                    .repeat_penalty = 1.0f, .repeat_last_n = 64 };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(serve_usage, stdout);
            return 1;
        }
        if (i + 1 >= argc)
            return opt_fail("option %s needs a value (see strata serve --help)", a);
        const char *v = argv[++i];
        int rc = 0;
        if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx"))
            rc = opt_int(a, v, 1, 1 << 24, &o->n_ctx);
        else if (!strcmp(a, "--kv")) {
            if ((o->kv = kv_cell_parse(v)) < 0)
                rc = opt_fail("--kv: '%s' is not f16, f32, int8, q4 or k8v4", v);
        } else if (!strcmp(a, "--kv-mem"))
            rc = opt_int(a, v, 1, 1 << 24, &o->kv_mem);
        else if (!strcmp(a, "--device")) {
            if ((o->device = model_device_parse(v)) < 0)
                rc = opt_fail("--device: '%s' is not auto, cpu, gpu, cuda or hip", v);
        } else if (!strcmp(a, "--prefill-chunk"))
            rc = opt_int(a, v, 1, 1 << 16, &o->prefill_chunk);
        else if (!strcmp(a, "--parallel") || !strcmp(a, "-np"))
            rc = opt_int(a, v, 1, 256, &o->parallel);
        else if (!strcmp(a, "--host"))
            o->host = v;
        else if (!strcmp(a, "--port"))
            rc = opt_int(a, v, 0, 65535, &o->port);
        else if (!strcmp(a, "--api-key"))
            o->api_key = v;
        else if (!strcmp(a, "--max-body")) {
            if (http_parse_size(v, &o->max_body) || o->max_body == 0)
                rc = opt_fail("--max-body: '%s' is not a size from 1 to 1G (K/M suffixes)", v);
        } else if (!strcmp(a, "--max-conns"))
            rc = opt_int(a, v, 1, 65536, &o->max_conns);
        else if (!strcmp(a, "--timeout"))
            rc = opt_int(a, v, 1, 86400, &o->timeout_s);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads"))
            rc = opt_int(a, v, 1, 1024, &o->threads);
        else if (!strcmp(a, "--temp"))
            rc = opt_float(a, v, &o->sp.temp);
        else if (!strcmp(a, "--top-p"))
            rc = opt_float(a, v, &o->sp.top_p);
        else if (!strcmp(a, "--top-k"))
            rc = opt_int(a, v, -1, 1 << 24, &o->sp.top_k);
        else if (!strcmp(a, "--min-p"))
            rc = opt_float(a, v, &o->sp.min_p);
        else if (!strcmp(a, "--max-tokens") || !strcmp(a, "-n"))
            rc = opt_int(a, v, -1, 1 << 30, &o->max_tokens);
        else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            o->sp.seed = strtoull(v, &end, 10);
            if (end == v || *end || errno || v[0] == '-')
                rc = opt_fail("--seed: '%s' is not an unsigned integer", v);
            o->have_seed = 1;
        } else
            rc = opt_fail("unknown option '%s' (see strata serve --help)", a);
        if (rc)
            return -1;
    }
    if (!o->model)
        return opt_fail("a model is required (-m MODEL)");
    if (o->threads == 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        o->threads = nc > 0 ? (int)nc : 1;
    }
    return 0;
}

static void on_signal(int sig)
{
    (void)sig;
    int saved = errno;
    atomic_store(&g_stop, 1);
    if (g_sig_pipe[1] >= 0 && write(g_sig_pipe[1], "x", 1) < 0) {
        /* the pipe is full: a stop is already pending */
    }
    errno = saved;
}

static int listen_on(struct server *s)
{
    char port[16];
    snprintf(port, sizeof port, "%d", s->o.port);
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, *res;
    int rc = getaddrinfo(s->o.host, port, &hints, &res);
    if (rc != 0)
        return opt_fail("cannot resolve %s: %s", s->o.host, gai_strerror(rc));
    int fd = -1, err = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0)
            continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return opt_fail("cannot listen on %s:%d: %s", s->o.host, s->o.port, strerror(err ? err : EADDRNOTAVAIL));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char host[INET6_ADDRSTRLEN] = "?";
    int p = s->o.port;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET6) {
            struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
            inet_ntop(AF_INET6, &a6->sin6_addr, host, sizeof host);
            p = ntohs(a6->sin6_port);
        } else {
            struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
            inet_ntop(AF_INET, &a4->sin_addr, host, sizeof host);
            p = ntohs(a4->sin_port);
        }
    }
    s->listen_fd = fd;
    fprintf(stderr, "strata serve: listening on http://%s%s%s:%d\n", ss.ss_family == AF_INET6 ? "[" : "", host,
            ss.ss_family == AF_INET6 ? "]" : "", p);
    return 0;
}

/* The model, the chat template, and the slots (sched.c). */
static int load(struct server *s)
{
    char err[512];
    /* test hook (see the header): a slow load, so /health's 503 can be seen */
    const char *delay = getenv("STRATA_TEST_LOAD_DELAY_MS");
    long ms = delay ? strtol(delay, NULL, 10) : 0;
    if (ms > 0 && ms <= 60000) {
        struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR && !stopping())
            ;
    }
    if (model_load(&s->model, s->o.model, err, sizeof err) != 0)
        return opt_fail("cannot load %s: %s", s->o.model, err);
    s->tok = model_tok(s->model);
    if (!s->tok)
        return opt_fail("%s has no tokenizer", s->o.model);
    const struct model_hp *hp = model_hp(s->model);
    s->V = hp->n_vocab;
    s->n_ctx = s->o.n_ctx ? s->o.n_ctx
                          : hp->n_ctx_train > 0 && hp->n_ctx_train < HTTP_CTX_CAP ? hp->n_ctx_train : HTTP_CTX_CAP;
    const char *base = strrchr(s->o.model, '/');
    snprintf(s->model_name, sizeof s->model_name, "%s", base ? base + 1 : s->o.model);
    struct gguf_str t;
    int have = gguf_get_str(model_gguf(s->model), "tokenizer.chat_template", &t) == 0;
    chat_detect(&s->tmpl, have ? t.ptr : NULL, have ? (size_t)t.len : 0);
    if (!s->tmpl.known)
        fprintf(stderr, "strata serve: warning: %s chat template; chat prompts use ChatML\n",
                have ? "unrecognised" : "the model has no");
    struct sched_opts so = { .n_slots = s->o.parallel, .n_ctx = s->n_ctx, .kv_cell = s->o.kv,
                             .kv_mem_mib = s->o.kv_mem, .n_threads = s->o.threads,
                             .prefill_chunk = s->o.prefill_chunk, .device = s->o.device };
    if (sched_new(&s->sched, s->model, &so, err, sizeof err) != 0)
        return opt_fail("%s", err);
    s->n_ctx = sched_n_ctx(s->sched);
    fprintf(stderr, "strata serve: %s, %d slots of %d cells, %d threads, chat template %s%s\n", s->model_name,
            s->o.parallel, s->n_ctx, s->o.threads, chat_family_name(s->tmpl.family),
            s->tmpl.thinking_switch ? " (thinking switch)" : "");
    return 0;
}

/* Waits until pred holds or the deadline passes. */
static void wait_until(struct server *s, double deadline, int (*pred)(struct server *))
{
    pthread_mutex_lock(&s->lock);
    while (!pred(s) && now_s() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += HTTP_POLL_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L)
            ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&s->conn_cv, &s->lock, &ts);
    }
    pthread_mutex_unlock(&s->lock);
}

/* (lock held) */
static int no_jobs(struct server *s)
{
    struct sched_stats st;
    sched_stats(s->sched, &st);
    return st.processing == 0 && st.queued == 0;
}

/* (lock held) */
static int no_conns(struct server *s)
{
    return s->n_conns == 0;
}

int http_serve_main(int argc, char **argv)
{
    static struct server srv;
    struct server *s = &srv;
    int rc = parse_serve_opts(argc, argv, &s->o);
    if (rc)
        return rc > 0 ? 0 : 1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->conn_cv, NULL);
    s->started = time(NULL);
    if (pipe2(g_sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        opt_fail("pipe: %s", strerror(errno));
        return 1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (listen_on(s))
        return 1;
    pthread_t acceptor;
    if (pthread_create(&acceptor, NULL, accept_main, s) != 0) {
        opt_fail("cannot start a thread");
        return 1;
    }
    /* /health answers 503 while this runs */
    int loaded = load(s) == 0;
    if (loaded) {
        pthread_mutex_lock(&s->lock);
        s->ready = 1;
        pthread_mutex_unlock(&s->lock);
        fprintf(stderr, "strata serve: ready\n");
        while (!stopping()) {
            struct pollfd p = { g_sig_pipe[0], POLLIN, 0 };
            poll(&p, 1, 1000);
        }
        fprintf(stderr, "strata serve: stopping: no new connections; finishing running requests\n");
    } else {
        atomic_store(&g_stop, 1);
    }
    pthread_join(acceptor, NULL);
    if (loaded) {
        /* queued requests are refused; running ones get HTTP_DRAIN_S to finish */
        sched_close(s->sched, 0);
        wait_until(s, now_s() + HTTP_DRAIN_S, no_jobs);
        sched_close(s->sched, 1);
    }
    wait_until(s, now_s() + s->o.timeout_s + 1, no_conns);
    pthread_mutex_lock(&s->lock);
    int left = s->n_conns;
    pthread_mutex_unlock(&s->lock);
    if (left) {
        /* a connection still runs: leave the model and slots to it and exit */
        fprintf(stderr, "strata serve: %d connections did not close\n", left);
        return loaded ? 0 : 1;
    }
    sched_free(s->sched);
    model_free(s->model);
    if (loaded)
        fprintf(stderr, "strata serve: stopped\n");
    return loaded ? 0 : 1;
}
