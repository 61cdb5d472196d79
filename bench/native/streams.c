/* The client of the manystream scenario: REQUESTS connections to 127.0.0.1:PORT, opened
 * OPEN_BATCH at a time, each sending the request read from standard input and reading its SSE
 * answer raw. Once every stream flows (its first whole event came) or RAMP seconds passed, WARMUP
 * seconds more, then it prints "start", counts and times the chunks for SECONDS (receive time
 * minus the "ts" each carries, both CLOCK_MONOTONIC), prints "end", resets every connection and
 * prints "result {json}" (bench/scenarios/manystream.py reads the three lines). N is the choices
 * per request, STEP the upstream's seconds between chunks: together, the chunks offered.
 *
 *     streams PORT REQUESTS N STEP RAMP WARMUP SECONDS < request
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum {
    OPEN_BATCH = 100,  /* connections being opened at once: a listen backlog is not measured */
    MAX_HELD = 65536,  /* bytes of a head, or of an event not yet ended, kept per stream */
    MAX_REQUEST = 1 << 20,
    READ_SIZE = 1 << 18,
    MAX_ERRORS = 3,
    ERROR_BYTES = 200,
};

enum { CONNECTING, HEAD, BODY, DONE };

typedef struct {
    int fd, state, status, flowing;
    size_t held;       /* bytes in buf: a head not yet ended, or an event not yet ended */
    char *buf;         /* MAX_HELD */
    char error[ERROR_BYTES + 1];
} stream;

static stream *streams;
static int epoll_fd, port, count, opened, flowing, failed;
static char *request;
static size_t request_len;
static double *latencies;
static size_t latency_count, latency_cap;
static int measuring;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

/* Its first event came, or none will (``error`` says why): either way it is no longer awaited. */
static void settle(stream *s, const char *error, size_t len) {
    if (s->flowing) return;
    s->flowing = 1;
    flowing++;
    if (error) {
        failed++;
        len = len > ERROR_BYTES ? ERROR_BYTES : len;
        memcpy(s->error, error, len);
        s->error[len] = 0;
    }
}

static void finish(stream *s, const char *error) {
    settle(s, error, error ? strlen(error) : 0);
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
    s->state = DONE;
}

static void open_next(void) {
    stream *s = &streams[opened++];
    s->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (s->fd < 0) die("socket");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(s->fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS) {
        finish(s, strerror(errno));
        return;
    }
    struct epoll_event ev = {.events = EPOLLOUT, .data.u32 = (uint32_t)(s - streams)};
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, s->fd, &ev) < 0) die("epoll_ctl");
}

static void connected(stream *s) {
    int error = 0;
    socklen_t len = sizeof error;
    getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &error, &len);
    if (error) {
        finish(s, strerror(error));
    } else if (send(s->fd, request, request_len, MSG_NOSIGNAL) != (ssize_t)request_len) {
        finish(s, "the request was not sent whole");
    } else {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)(s - streams)};
        epoll_ctl(epoll_fd, EPOLL_CTL_MOD, s->fd, &ev);
        s->state = HEAD;
    }
    if (opened < count) open_next();
}

static void record(const char *block, size_t len, double at) {
    static const char key[] = "\"ts\":";
    const char *end = block + len;
    for (const char *p = block; (p = memmem(p, (size_t)(end - p), key, sizeof key - 1));) {
        p += sizeof key - 1;
        char *after;
        double stamp = strtod(p, &after);
        if (after == p || after >= end || *after != '}') continue;
        if (latency_count == latency_cap) {
            latency_cap = latency_cap ? latency_cap * 2 : 1 << 16;
            latencies = realloc(latencies, latency_cap * sizeof *latencies);
            if (!latencies) die("realloc");
        }
        latencies[latency_count++] = at - stamp;
    }
}

/* Whole events at the start of data go on, the rest is held for the next read. */
static void body(stream *s, char *data, size_t len, double at) {
    size_t whole = 0;
    for (size_t i = len; i >= 2; i--) {
        if (data[i - 1] == '\n' && data[i - 2] == '\n') {
            whole = i;
            break;
        }
    }
    if (whole) {
        settle(s, NULL, 0);
        if (measuring) record(data, whole, at);
    }
    size_t rest = len - whole;
    if (rest > MAX_HELD) {
        whole = len - MAX_HELD;
        rest = MAX_HELD;
    }
    memmove(s->buf, data + whole, rest);
    s->held = rest;
}

static void readable(stream *s) {
    static char data[MAX_HELD + READ_SIZE];
    double at = now();
    memcpy(data, s->buf, s->held);
    ssize_t got = recv(s->fd, data + s->held, READ_SIZE, 0);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (got <= 0) {
        finish(s, "closed before the first event");
        return;
    }
    size_t len = s->held + (size_t)got;
    if (s->state == HEAD) {
        char *end = memmem(data, len, "\r\n\r\n", 4);
        if (!end) {
            size_t keep = len > MAX_HELD ? MAX_HELD : len;
            memmove(s->buf, data + len - keep, keep);
            s->held = keep;
            return;
        }
        s->status = len > 12 && strncmp(data, "HTTP/1.", 7) == 0 ? atoi(data + 9) : -1;
        if (s->status != 200) {
            settle(s, data, (size_t)(end - data));
            s->held = 0;
            s->state = BODY;
            return;
        }
        s->state = BODY;
        size_t head = (size_t)(end - data) + 4;
        body(s, data + head, len - head, at);
        return;
    }
    if (s->status == 200) body(s, data, len, at);
}

static void run_until(double deadline, int until_flowing) {
    struct epoll_event events[1024];
    for (;;) {
        double left = deadline - now();
        if (left <= 0 || (until_flowing && flowing == count)) return;
        int ready = epoll_wait(epoll_fd, events, 1024, (int)(left * 1000) + 1);
        if (ready < 0 && errno != EINTR) die("epoll_wait");
        for (int i = 0; i < ready; i++) {
            stream *s = &streams[events[i].data.u32];
            if (s->state == CONNECTING) connected(s);
            else if (s->state != DONE) readable(s);
        }
    }
}

static int ascending(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest rank, as bench.stats.percentile; NaN when empty. */
static double percentile(double q) {
    if (!latency_count) return NAN;
    double rank = ceil(q / 100 * (double)latency_count);
    size_t at = rank < 1 ? 1 : rank > (double)latency_count ? latency_count : (size_t)rank;
    return latencies[at - 1];
}

static void json_number(double x) {
    if (isnan(x)) printf("NaN"); /* as Python's json writes it, and reads it back */
    else printf("%.6f", x);
}

static void json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20 || c >= 0x7f) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

static void read_request(void) {
    request = malloc(MAX_REQUEST);
    if (!request) die("malloc");
    size_t got;
    while ((got = fread(request + request_len, 1, MAX_REQUEST - request_len, stdin)) > 0)
        request_len += got;
    if (!request_len || request_len == MAX_REQUEST) {
        fprintf(stderr, "streams: the request on standard input is empty or too large\n");
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s PORT REQUESTS N STEP RAMP WARMUP SECONDS < request\n", argv[0]);
        return 2;
    }
    port = atoi(argv[1]);
    count = atoi(argv[2]);
    int n = atoi(argv[3]);
    double step = atof(argv[4]), ramp_limit = atof(argv[5]), warmup = atof(argv[6]);
    double seconds = atof(argv[7]);
    if (count < 1 || n < 1 || step <= 0) {
        fprintf(stderr, "streams: REQUESTS and N must be positive, and STEP\n");
        return 2;
    }
    read_request();
    streams = calloc((size_t)count, sizeof *streams);
    epoll_fd = epoll_create1(0);
    if (!streams || epoll_fd < 0) die("setup");
    for (int i = 0; i < count; i++) {
        streams[i].fd = -1;
        streams[i].buf = malloc(MAX_HELD);
        if (!streams[i].buf) die("malloc");
    }
    double started = now();
    while (opened < count && opened < OPEN_BATCH) open_next();
    run_until(started + ramp_limit, 1);
    double ramp = now() - started;
    run_until(now() + warmup, 0);
    printf("start\n");
    fflush(stdout);
    measuring = 1;
    double window_start = now();
    run_until(window_start + seconds, 0);
    measuring = 0;
    double window = now() - window_start;
    printf("end\n");
    fflush(stdout);
    struct linger reset = {1, 0};
    for (int i = 0; i < count; i++) {
        if (streams[i].fd < 0) continue;
        setsockopt(streams[i].fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
        close(streams[i].fd);
    }
    qsort(latencies, latency_count, sizeof *latencies, ascending);
    double offered = (double)count * n * window / step;
    printf("result {\"requests\": %d, \"ramp_s\": %.6f, \"not_started\": %d, \"errors\": [",
           count, ramp, count - flowing + failed);
    for (int i = 0, shown = 0; i < count && shown < MAX_ERRORS; i++) {
        if (!streams[i].error[0]) continue;
        if (shown++) printf(", ");
        json_string(streams[i].error);
    }
    printf("], \"window_s\": %.6f, \"chunks\": %zu, \"offered\": %.3f, \"delivered\": ",
           window, latency_count, offered);
    json_number(offered > 0 ? (double)latency_count / offered : NAN);
    static const struct { const char *name; double q; } quantiles[] = {
        {"p50", 50}, {"p90", 90}, {"p99", 99}, {"max", 100}};
    for (size_t i = 0; i < sizeof quantiles / sizeof *quantiles; i++)
    {
        printf(", \"%s_ms\": ", quantiles[i].name);
        json_number(percentile(quantiles[i].q) * 1000);
    }
    printf("}\n");
    return 0;
}
