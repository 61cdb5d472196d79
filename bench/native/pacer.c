/* The paced upstream of the manystream scenario: HTTP/1.1 on 127.0.0.1, keep-alive and in order,
 * every POST answered with an SSE stream of max_tokens chunks (at most MAX_STREAM), one chunk to
 * every open stream per step from one timer, GET /health with 200, GET /v1/models with MODELS (a
 * gateway that routes by model reads it before it sends a worker anything). A chunk is PREFIX, its send
 * time (CLOCK_MONOTONIC, Python's time.monotonic(), as %.6f) and SUFFIX; a stream ends with FINISH
 * and the last chunk. A timer that fell behind skips steps rather than burst. bench/native.py
 * builds it and bench/pacer.py gives it the bytes:
 *
 *     pacer STEP_SECONDS PREFIX SUFFIX FINISH MODELS --port PORT
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

enum {
    MAX_FDS = 1 << 16,
    MAX_REQUEST = 1 << 20,  /* request bytes held unanswered: more closes the connection */
    MAX_PENDING = 8 << 20,  /* answer bytes the socket did not take: more closes it */
    MAX_STREAM = 100000,    /* chunks in one stream, whatever max_tokens says */
    DEFAULT_STREAM = 1000,  /* a POST without max_tokens */
    READ_SIZE = 65536,
};

static const char SSE_HEAD[] =
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    "Transfer-Encoding: chunked\r\n\r\n";
static const char HEALTHY[] =
    "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\nok\n";
static const char NOT_FOUND[] =
    "HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\nContent-Type: text/plain\r\n\r\nnot found\n";

typedef struct {
    char *data;
    size_t len, cap;
} buffer;

typedef struct {
    int open;
    buffer in;      /* request bytes not yet answered */
    buffer out;     /* answer bytes the socket did not take yet */
    long steps;     /* chunks left in this connection's stream; 0: not streaming */
    int slot;       /* its place in streams[] while it streams */
    int close_after; /* the request said Connection: close */
} connection;

static connection conns[MAX_FDS];
static int streams[MAX_FDS];
static int stream_count;
static int epoll_fd;
static const char *prefix, *suffix, *finish;
static char *models; /* the answer to GET /v1/models, head and body */

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int append(buffer *b, const char *data, size_t len) {
    if (b->len + len > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + len) cap *= 2;
        char *grown = realloc(b->data, cap);
        if (!grown) return -1;
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, data, len);
    b->len += len;
    return 0;
}

static void consume(buffer *b, size_t len) {
    memmove(b->data, b->data + len, b->len - len);
    b->len -= len;
}

static void watch(int fd, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.fd = fd};
    if (epoll_ctl(epoll_fd, EPOLL_CTL_MOD, fd, &ev) < 0) die("epoll_ctl");
}

static void stop_stream(int fd) {
    connection *c = &conns[fd];
    int last = streams[--stream_count];
    streams[c->slot] = last;
    conns[last].slot = c->slot;
    c->steps = 0;
}

static void close_conn(int fd) {
    connection *c = &conns[fd];
    if (c->steps) stop_stream(fd);
    free(c->in.data);
    free(c->out.data);
    memset(c, 0, sizeof *c);
    close(fd);
}

/* Writes what the socket takes, keeps the rest for EPOLLOUT; 0, or -1 when it closed the
 * connection. */
static int send_bytes(int fd, const char *data, size_t len) {
    connection *c = &conns[fd];
    if (c->out.len == 0) {
        ssize_t sent = send(fd, data, len, MSG_NOSIGNAL);
        if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            close_conn(fd);
            return -1;
        }
        if (sent < 0) sent = 0;
        data += sent;
        len -= (size_t)sent;
        if (len == 0) return 0;
        watch(fd, EPOLLIN | EPOLLOUT);
    }
    if (c->out.len + len > MAX_PENDING || append(&c->out, data, len) < 0) {
        close_conn(fd);
        return -1;
    }
    return 0;
}

static const char *find_header(const char *head, size_t len, const char *name) {
    size_t n = strlen(name);
    for (const char *p = memchr(head, '\n', len); p && (size_t)(p - head) + n + 1 < len;
         p = memchr(p + 1, '\n', len - (size_t)(p + 1 - head))) {
        if (strncasecmp(p + 1, name, n) == 0) return p + 1 + n;
    }
    return NULL;
}

static long max_tokens(const char *body, size_t len) {
    static const char key[] = "\"max_tokens\"";
    const char *end = body + len;
    const char *p = memmem(body, len, key, sizeof key - 1);
    if (!p) return DEFAULT_STREAM;
    p += sizeof key - 1;
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    if (p >= end || *p++ != ':') return DEFAULT_STREAM;
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    long steps = 0;
    int digits = 0;
    for (; p < end && *p >= '0' && *p <= '9' && steps <= MAX_STREAM; p++, digits++)
        steps = steps * 10 + (*p - '0');
    if (!digits) return DEFAULT_STREAM;
    return steps < 1 ? 1 : steps > MAX_STREAM ? MAX_STREAM : steps;
}

/* Answers the requests buffered on fd, in order, until one starts a stream. */
static void serve(int fd) {
    connection *c = &conns[fd];
    while (c->open && !c->steps) {
        char *end = memmem(c->in.data, c->in.len, "\r\n\r\n", 4);
        if (!end) return;
        size_t head = (size_t)(end - c->in.data) + 4;
        const char *length = find_header(c->in.data, head, "content-length:");
        long body = length ? strtol(length, NULL, 10) : 0;
        if (find_header(c->in.data, head, "transfer-encoding:") || body < 0 || body > MAX_REQUEST) {
            close_conn(fd); /* chunked requests: not one this bench sends */
            return;
        }
        if (c->in.len < head + (size_t)body) return;
        const char *connection_value = find_header(c->in.data, head, "connection:");
        c->close_after = connection_value && strncasecmp(connection_value + strspn(connection_value, " "), "close", 5) == 0;
        int post = strncmp(c->in.data, "POST ", 5) == 0;
        int health = strncmp(c->in.data, "GET /health ", 12) == 0;
        int listing = strncmp(c->in.data, "GET /v1/models ", 15) == 0;
        long steps = post ? max_tokens(c->in.data + head, (size_t)body) : 0;
        consume(&c->in, head + (size_t)body);
        if (post) {
            if (send_bytes(fd, SSE_HEAD, sizeof SSE_HEAD - 1) < 0) return;
            c->steps = steps;
            c->slot = stream_count;
            streams[stream_count++] = fd;
            return;
        }
        const char *answer = health ? HEALTHY : listing ? models : NOT_FOUND;
        if (send_bytes(fd, answer, strlen(answer)) < 0) return;
        if (c->close_after) {
            if (c->out.len == 0) close_conn(fd);
            return; /* EPOLLOUT closes it once the answer is out */
        }
    }
}

static void readable(int fd) {
    char chunk[READ_SIZE];
    ssize_t got = recv(fd, chunk, sizeof chunk, 0);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    /* Bounded while a stream holds the requests pipelined behind it, too. */
    if (got <= 0 || conns[fd].in.len + (size_t)got > MAX_REQUEST ||
        append(&conns[fd].in, chunk, (size_t)got) < 0) {
        close_conn(fd);
        return;
    }
    serve(fd);
}

static void writable(int fd) {
    connection *c = &conns[fd];
    ssize_t sent = send(fd, c->out.data, c->out.len, MSG_NOSIGNAL);
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        close_conn(fd);
        return;
    }
    if (sent > 0) consume(&c->out, (size_t)sent);
    if (c->out.len) return;
    watch(fd, EPOLLIN);
    if (c->close_after && !c->steps) close_conn(fd);
}

static size_t framed(char *into, const char *data, size_t len) {
    int head = sprintf(into, "%zx\r\n", len);
    memcpy(into + head, data, len);
    memcpy(into + head + len, "\r\n", 2);
    return (size_t)head + len + 2;
}

/* One step: a chunk to every open stream; a stream that is done gets its end, and the next
 * request on its connection, if one came, is answered. */
static void tick(void) {
    static char data[65536], chunk[65536 + 32], last[65536 + 32];
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int len = snprintf(data, sizeof data, "%s%.6f%s", prefix,
                       (double)now.tv_sec + (double)now.tv_nsec / 1e9, suffix);
    size_t chunk_len = framed(chunk, data, (size_t)len);
    size_t last_len = framed(last, finish, strlen(finish));
    memcpy(last + last_len, "0\r\n\r\n", 5);
    last_len += 5;
    /* Downwards: a stream that ends or closes swaps the last one, already served, into its slot. */
    for (int i = stream_count - 1; i >= 0; i--) {
        int fd = streams[i];
        if (send_bytes(fd, chunk, chunk_len) < 0) continue;
        if (--conns[fd].steps > 0) continue;
        stop_stream(fd);
        if (send_bytes(fd, last, last_len) < 0) continue;
        if (conns[fd].close_after) {
            if (conns[fd].out.len == 0) close_conn(fd);
            continue;
        }
        serve(fd);
    }
}

static int listen_on(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(fd, 4096) < 0)
        die("listen");
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 8 || strcmp(argv[6], "--port") != 0) {
        fprintf(stderr, "usage: %s STEP_SECONDS PREFIX SUFFIX FINISH MODELS --port PORT\n", argv[0]);
        return 2;
    }
    double step = atof(argv[1]);
    prefix = argv[2], suffix = argv[3], finish = argv[4];
    if (step <= 0 || strlen(prefix) + strlen(suffix) > 60000 || strlen(finish) > 60000 ||
        strlen(argv[5]) > 60000) {
        fprintf(stderr, "pacer: the step must be positive and the chunks under 60000 bytes\n");
        return 2;
    }
    size_t models_len = strlen(argv[5]) + 128;
    models = malloc(models_len);
    if (!models) die("malloc");
    snprintf(models, models_len,
             "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nContent-Type: application/json\r\n\r\n%s",
             strlen(argv[5]), argv[5]);
    int port = atoi(argv[7]);
    signal(SIGPIPE, SIG_IGN);
    int listener = listen_on(port);
    int timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    long ns = (long)(step * 1e9);
    struct itimerspec every = {{ns / 1000000000, ns % 1000000000}, {ns / 1000000000, ns % 1000000000}};
    epoll_fd = epoll_create1(0);
    if (timer < 0 || timerfd_settime(timer, 0, &every, NULL) < 0 || epoll_fd < 0) die("timer");
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = listener};
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listener, &ev);
    ev.data.fd = timer;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, timer, &ev);
    struct epoll_event events[512];
    for (;;) {
        int ready = epoll_wait(epoll_fd, events, 512, -1);
        if (ready < 0 && errno != EINTR) die("epoll_wait");
        int accepting = 0;
        for (int i = 0; i < ready; i++) {
            int fd = events[i].data.fd;
            if (fd == timer) {
                uint64_t expired; /* several: the timer fell behind, and they make one step */
                if (read(timer, &expired, sizeof expired) == sizeof expired) tick();
            } else if (fd == listener) {
                accepting = 1;
            } else if (conns[fd].open) { /* an earlier event of this wake-up may have closed it */
                if (events[i].events & (EPOLLERR | EPOLLHUP)) {
                    close_conn(fd);
                    continue;
                }
                if (events[i].events & EPOLLOUT) writable(fd);
                if (conns[fd].open && (events[i].events & EPOLLIN)) readable(fd);
            }
        }
        /* Last, so that no event of this wake-up is taken for a new connection on a reused fd. */
        for (int client; accepting && (client = accept4(listener, NULL, NULL, SOCK_NONBLOCK)) >= 0;) {
            if (client >= MAX_FDS) {
                close(client);
                continue;
            }
            conns[client].open = 1;
            struct epoll_event in = {.events = EPOLLIN, .data.fd = client};
            epoll_ctl(epoll_fd, EPOLL_CTL_ADD, client, &in);
        }
    }
}
