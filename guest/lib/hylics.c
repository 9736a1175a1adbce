/* libhylics: see hylics.h. The wire format is vmsight_proto::hylics: one JSON object per line
 * each way. Requests are built here with snprintf; replies are vmsight's own
 * ({"ok":true,...} or {"ok":false,"error":"..."}), read with a small lenient JSON scanner that
 * looks up the top-level keys it needs and ignores the others. A reply it cannot read is
 * EPROTO, "malformed reply from vmsight".
 *
 * hylics_send_file opens a connection per call (a send can take long). The task reports and
 * the advice requests of hylics_evict share one connection per process: a static descriptor
 * guarded by a mutex, reopened once when a write or read on it fails, and never shared with a
 * forked child (the child notices the changed pid and connects anew). */
#define _GNU_SOURCE
#include "hylics.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

#define LINE_MAX_BYTES 4096      /* longest request line (the service's limit too) */
#define REPLY_MAX_BYTES 65536    /* longest reply line, newline excluded */
#define IO_TIMEOUT_SECS 10       /* per read or write on the shared connection */
#define EVICT_MAX_ROUNDS 64
#define EVICT_MAX_PATHS 64       /* per advice reply; more are ignored */
#define COPY_BUF_BYTES (128 * 1024)
#define JSON_MAX_DEPTH 32

static const char MALFORMED[] = "malformed reply from vmsight";
static const char UNREACHABLE[] =
    "cannot reach vmsight's Hylics service over vsock (is the VM run with --shared-mem?)";

static __thread char last_error[512];

const char *hylics_last_error(void)
{
    return last_error;
}

static void set_error(const char *msg)
{
    snprintf(last_error, sizeof last_error, "%s", msg);
}

static void set_errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_errorf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
}

/* Appends `s` as a JSON string (quotes included) to buf[*n..cap); 0 on success. */
static int put_json_string(char *buf, size_t cap, size_t *n, const char *s)
{
    if (*n + 1 >= cap)
        return -1;
    buf[(*n)++] = '"';
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        size_t len;
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            len = 2;
        } else if (*p < 0x20) {
            len = (size_t)snprintf(esc, sizeof esc, "\\u%04x", *p);
        } else {
            esc[0] = (char)*p;
            len = 1;
        }
        if (*n + len + 1 >= cap)
            return -1;
        memcpy(buf + *n, esc, len);
        *n += len;
    }
    buf[(*n)++] = '"';
    return 0;
}

/* The share's mount point ($HYLICS_ROOT or the default) and its length without trailing '/'. */
static const char *share_root(size_t *len)
{
    const char *root = getenv("HYLICS_ROOT");
    size_t rl;
    if (!root || !*root)
        root = HYLICS_DEFAULT_ROOT;
    rl = strlen(root);
    while (rl > 1 && root[rl - 1] == '/')
        rl--;
    *len = rl;
    return root;
}

/* The path relative to the share: strips the mount point if `path` is under it. */
static const char *share_relative(const char *path)
{
    size_t rl;
    const char *root = share_root(&rl);
    if (strncmp(path, root, rl) == 0 && (path[rl] == '/' || path[rl] == '\0'))
        return path[rl] ? path + rl : "/";
    return path;
}

/* ---- Transport ---------------------------------------------------------------------------- */

static int connect_service(void)
{
    struct sockaddr_vm addr;
    int fd = socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    memset(&addr, 0, sizeof addr);
    addr.svm_family = AF_VSOCK;
    addr.svm_cid = VMADDR_CID_HOST;
    addr.svm_port = HYLICS_PORT;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* Writes all of buf; MSG_NOSIGNAL: a connection the host closed is EPIPE, not SIGPIPE. */
static int write_all(int fd, const char *buf, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, buf, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Reads one reply line into buf (NUL-terminated, newline removed). 0 on success (*extra = 1
 * when bytes followed the newline: the stream is out of step); -1 on a read error or end of
 * stream (errno set, ECONNRESET for the end); -2 when the line does not fit (EPROTO). */
static int read_line(int fd, char *buf, size_t cap, int *extra)
{
    size_t n = 0;
    *extra = 0;
    while (n + 1 < cap) {
        char *nl;
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0) {
            errno = ECONNRESET;
            return -1;
        }
        nl = memchr(buf + n, '\n', (size_t)r);
        n += (size_t)r;
        if (nl) {
            *extra = (size_t)(nl - buf) + 1 < n;
            *nl = '\0';
            return 0;
        }
    }
    errno = EPROTO;
    return -2;
}

/* ---- Lenient JSON reading: top-level keys of one object ------------------------------------ */

static const char *skip_ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
        p++;
    return p;
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int read_hex4(const char *p, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int d = hex_digit(p[i]);
        if (d < 0)
            return -1;
        v = v * 16 + (unsigned)d;
    }
    *out = v;
    return 0;
}

/* Appends code point cp as UTF-8 to out[*n..cap) (when out != NULL); *bad on overflow. */
static void put_utf8(char *out, size_t cap, size_t *n, unsigned cp, int *bad)
{
    char u[4];
    size_t len;
    if (cp < 0x80) {
        u[0] = (char)cp;
        len = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xc0 | (cp >> 6));
        u[1] = (char)(0x80 | (cp & 0x3f));
        len = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xe0 | (cp >> 12));
        u[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        u[2] = (char)(0x80 | (cp & 0x3f));
        len = 3;
    } else {
        u[0] = (char)(0xf0 | (cp >> 18));
        u[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
        u[3] = (char)(0x80 | (cp & 0x3f));
        len = 4;
    }
    if (!out)
        return;
    if (*n + len >= cap) {
        *bad = 1;
        return;
    }
    memcpy(out + *n, u, len);
    *n += len;
}

/* Reads the JSON string at p (at its opening quote). When out != NULL, decodes it into
 * out[0..cap) NUL-terminated; *bad is set when it does not fit, holds a NUL or a lone
 * surrogate (the string is still well-formed). Returns the position after the closing quote,
 * or NULL when the string is malformed. */
static const char *json_string(const char *p, char *out, size_t cap, int *bad)
{
    size_t n = 0;
    *bad = 0;
    if (*p++ != '"')
        return NULL;
    for (;;) {
        unsigned char c = (unsigned char)*p++;
        unsigned cp;
        if (c == '"')
            break;
        if (c < 0x20)
            return NULL; /* also the terminating NUL */
        if (c != '\\') {
            if (out && n + 1 < cap)
                out[n++] = (char)c;
            else if (out)
                *bad = 1;
            continue;
        }
        c = (unsigned char)*p++;
        switch (c) {
        case '"': case '\\': case '/': cp = c; break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u':
            if (read_hex4(p, &cp))
                return NULL;
            p += 4;
            if (cp >= 0xd800 && cp < 0xdc00 && p[0] == '\\' && p[1] == 'u') {
                unsigned lo;
                if (read_hex4(p + 2, &lo))
                    return NULL;
                if (lo >= 0xdc00 && lo < 0xe000) {
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    p += 6;
                }
            }
            if ((cp >= 0xd800 && cp < 0xe000) || cp == 0)
                *bad = 1;
            break;
        default:
            return NULL;
        }
        put_utf8(out, cap, &n, cp, bad);
    }
    if (out)
        out[n] = '\0';
    return p;
}

/* Skips one JSON value at p (after white space); returns the position after it, or NULL. */
static const char *skip_value(const char *p, int depth)
{
    int bad;
    p = skip_ws(p);
    if (*p == '"')
        return json_string(p, NULL, 0, &bad);
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        if (depth >= JSON_MAX_DEPTH)
            return NULL;
        p = skip_ws(p + 1);
        if (*p == close)
            return p + 1;
        for (;;) {
            if (close == '}') {
                p = json_string(p, NULL, 0, &bad);
                if (!p || *(p = skip_ws(p)) != ':')
                    return NULL;
                p++;
            }
            p = skip_value(p, depth + 1);
            if (!p)
                return NULL;
            p = skip_ws(p);
            if (*p == close)
                return p + 1;
            if (*p != ',')
                return NULL;
            p = skip_ws(p + 1);
        }
    }
    {
        const char *start = p;
        while ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
               *p == '-' || *p == '+' || *p == '.')
            p++;
        return p > start ? p : NULL;
    }
}

/* The value (white space skipped) of the top-level key `key` in the object `line`, or NULL when
 * the key is missing or the object is malformed before it. */
static const char *json_member(const char *line, const char *key)
{
    const char *p = skip_ws(line);
    if (*p++ != '{')
        return NULL;
    p = skip_ws(p);
    if (*p == '}')
        return NULL;
    for (;;) {
        char name[64];
        int bad;
        p = json_string(p, name, sizeof name, &bad);
        if (!p || *(p = skip_ws(p)) != ':')
            return NULL;
        p = skip_ws(p + 1);
        if (!bad && strcmp(name, key) == 0)
            return p;
        p = skip_value(p, 1);
        if (!p)
            return NULL;
        p = skip_ws(p);
        if (*p != ',')
            return NULL;
        p = skip_ws(p + 1);
    }
}

/* 1 if v starts with the literal `word` (not followed by more of a literal), else 0. */
static int json_is(const char *v, const char *word)
{
    size_t n = strlen(word);
    return v && strncmp(v, word, n) == 0 &&
           !((v[n] >= 'a' && v[n] <= 'z') || (v[n] >= '0' && v[n] <= '9'));
}

/* Reads a non-negative JSON integer; 0 on success. */
static int json_u64(const char *v, unsigned long long *out)
{
    char *end;
    if (!v || *v < '0' || *v > '9')
        return -1;
    errno = 0;
    *out = strtoull(v, &end, 10);
    if (errno || *end == '.' || *end == 'e' || *end == 'E')
        return -1;
    return 0;
}

/* Checks {"ok":true,...}: 0 if so; else -1 with errno EPROTO and the service's sentence (or
 * "malformed reply from vmsight") in last_error. */
static int check_ok(const char *line)
{
    const char *ok, *err, *end = skip_ws(line);
    char msg[sizeof last_error];
    int bad;
    /* The whole line must be one well-formed object (a cut reply is no "ok"). */
    if (*end != '{' || !(end = skip_value(end, 0)) || *skip_ws(end) != '\0') {
        set_error(MALFORMED);
        errno = EPROTO;
        return -1;
    }
    ok = json_member(line, "ok");
    if (json_is(ok, "true"))
        return 0;
    errno = EPROTO;
    err = json_member(line, "error");
    if (json_is(ok, "false") && err && *err == '"' && json_string(err, msg, sizeof msg, &bad)) {
        set_error(msg);
        return -1;
    }
    set_error(MALFORMED);
    return -1;
}

/* ---- The send offload (a connection per call) ---------------------------------------------- */

/* Decodes {"ok":true,"bytes":N} or {"ok":false,"error":"..."}. */
static long long parse_send_reply(const char *line)
{
    unsigned long long bytes;
    if (check_ok(line))
        return -1;
    if (json_u64(json_member(line, "bytes"), &bytes) || bytes > (unsigned long long)LLONG_MAX) {
        set_error(MALFORMED);
        errno = EPROTO;
        return -1;
    }
    return (long long)bytes;
}

long long hylics_send_file(const char *dest, const char *path, unsigned long long offset,
                           unsigned long long len)
{
    char req[LINE_MAX_BYTES], rep[LINE_MAX_BYTES];
    size_t n = 0;
    int fd, extra, r;

    set_error("");
    if (!dest || !path) {
        errno = EINVAL;
        return -1;
    }
    n += (size_t)snprintf(req, sizeof req, "{\"op\":\"send-file\",\"dest\":");
    if (put_json_string(req, sizeof req, &n, dest) ||
        n + 9 >= sizeof req)
        goto too_long;
    memcpy(req + n, ",\"path\":", 8);
    n += 8;
    if (put_json_string(req, sizeof req, &n, share_relative(path)))
        goto too_long;
    n += (size_t)snprintf(req + n, sizeof req - n, ",\"offset\":%llu,\"len\":%llu}\n", offset, len);
    if (n >= sizeof req)
        goto too_long;

    fd = connect_service();
    if (fd < 0) {
        set_error(UNREACHABLE);
        return -1;
    }
    if (write_all(fd, req, n) || (r = read_line(fd, rep, sizeof rep, &extra)) == -1) {
        int e = errno ? errno : EPROTO;
        close(fd);
        set_error("the Hylics service closed the connection");
        errno = e;
        return -1;
    }
    close(fd);
    if (r == -2) {
        set_error(MALFORMED);
        errno = EPROTO;
        return -1;
    }
    return parse_send_reply(rep);

too_long:
    set_error("request too long");
    errno = ENAMETOOLONG;
    return -1;
}

/* ---- The shared connection (task reports, advice) ----------------------------------------- */

static pthread_mutex_t conn_lock = PTHREAD_MUTEX_INITIALIZER;
static int conn_fd = -1;      /* the process's connection, or -1 */
static pid_t conn_pid;        /* the process that opened it */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* fork() waits for a request in flight, so a child never inherits the mutex locked. */
static void atfork_prepare(void)
{
    pthread_mutex_lock(&conn_lock);
}

static void atfork_release(void)
{
    pthread_mutex_unlock(&conn_lock);
}

static void register_atfork(void)
{
    pthread_atfork(atfork_prepare, atfork_release, atfork_release);
}

/* Forgets the connection; after a fork the child only closes its copy if it still is a vsock
 * socket (a program may have reused the descriptor's number meanwhile). */
static void conn_drop(void)
{
    if (conn_fd >= 0 && conn_pid != getpid()) {
        int domain = 0;
        socklen_t len = sizeof domain;
        if (getsockopt(conn_fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_VSOCK)
            close(conn_fd);
    } else if (conn_fd >= 0) {
        close(conn_fd);
    }
    conn_fd = -1;
}

static int conn_open(void)
{
    struct timeval tv = { .tv_sec = IO_TIMEOUT_SECS, .tv_usec = 0 };
    int fd = connect_service();
    if (fd < 0)
        return -1;
    /* A service that stops answering must not hang the program forever. */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    conn_fd = fd;
    conn_pid = getpid();
    return 0;
}

/* Sends the request line req[0..n) on the shared connection and reads the reply line into
 * rep[0..cap). A write or read failure reconnects and retries once. 0 on success; -1 with errno
 * and last_error set. The reply's content is not checked here. */
static int shared_request(const char *req, size_t n, char *rep, size_t cap)
{
    int rc = -1, err = EPROTO;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&conn_lock);
    for (int attempt = 0; attempt < 2; attempt++) {
        int r, extra = 0;
        if (conn_fd >= 0 && conn_pid != getpid())
            conn_drop();
        if (conn_fd < 0 && conn_open() < 0) {
            err = errno;
            set_error(UNREACHABLE);
            break;
        }
        r = write_all(conn_fd, req, n);
        if (r == 0)
            r = read_line(conn_fd, rep, cap, &extra);
        if (r == 0) {
            if (extra) /* out of step with the service: start afresh next time */
                conn_drop();
            rc = 0;
            break;
        }
        err = errno;
        conn_drop();
        if (r == -2) {
            err = EPROTO;
            set_error(MALFORMED);
            break;
        }
        if (err == EAGAIN || err == EWOULDBLOCK) {
            err = ETIMEDOUT;
            set_error("vmsight's Hylics service did not answer in time");
            break;
        }
        set_error("the Hylics service closed the connection");
    }
    pthread_mutex_unlock(&conn_lock);
    if (rc == 0)
        set_error("");
    else
        errno = err;
    return rc;
}

/* One request whose answer is just {"ok":true}; 0 or -1 with errno. */
static int simple_request(const char *req, size_t n)
{
    char *rep = malloc(REPLY_MAX_BYTES + 2);
    int rc;
    if (!rep) {
        set_error("out of memory");
        errno = ENOMEM;
        return -1;
    }
    rc = shared_request(req, n, rep, REPLY_MAX_BYTES + 2);
    if (rc == 0)
        rc = check_ok(rep);
    free(rep);
    return rc;
}

int hylics_task_arrived(void)
{
    static const char req[] = "{\"op\":\"arrive\"}\n";
    set_error("");
    return simple_request(req, sizeof req - 1);
}

int hylics_task_done(double response_secs)
{
    char req[512];
    int n;
    set_error("");
    if (!isfinite(response_secs) || response_secs < 0) {
        set_error("the response time must be finite and >= 0");
        errno = EINVAL;
        return -1;
    }
    if (response_secs < 1e12) {
        /* By hand, "%.6f" without the locale's decimal comma. */
        unsigned long long us = (unsigned long long)(response_secs * 1e6 + 0.5);
        n = snprintf(req, sizeof req, "{\"op\":\"task\",\"response_secs\":%llu.%06llu}\n",
                     us / 1000000, us % 1000000);
    } else {
        n = snprintf(req, sizeof req, "{\"op\":\"task\",\"response_secs\":%.0f}\n",
                     response_secs);
    }
    if (n < 0 || (size_t)n >= sizeof req) {
        set_error("request too long");
        errno = EINVAL;
        return -1;
    }
    return simple_request(req, (size_t)n);
}

/* ---- Eviction ------------------------------------------------------------------------------ */

/* Moves one file: the share directory `sdir` holds `name`; it goes to `name` in `ddir`. */
struct move {
    int sdir, ddir;
    const char *name;
    const char *rel;      /* for messages: the advised path */
    const char *dest;     /* for messages: the destination directory */
    char *buf;            /* COPY_BUF_BYTES */
};

static int move_fail(const struct move *mv, const char *what, int e)
{
    set_errorf("cannot move %s to %s: %s: %s", mv->rel, mv->dest, what, strerror(e));
    errno = e;
    return -1;
}

/* Copies src to dst until the end of src; the bytes copied, or -1 with errno. */
static long long copy_data(int src, int dst, char *buf)
{
    long long total = 0;
    for (;;) {
        ssize_t r = read(src, buf, COPY_BUF_BYTES);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            return total;
        for (ssize_t off = 0; off < r;) {
            ssize_t w = write(dst, buf + off, (size_t)(r - off));
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0)
                return -1;
            off += w;
        }
        total += r;
    }
}

/* Creates a temporary file in mv->ddir; its descriptor (name in tmp), or -1 with errno. */
static int create_temp(const struct move *mv, char *tmp, size_t cap)
{
    static unsigned counter;
    for (int i = 0; i < 100; i++) {
        int fd;
        snprintf(tmp, cap, ".hylics-evict.%ld.%u", (long)getpid(),
                 __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
        fd = openat(mv->ddir, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0 || errno != EEXIST)
            return fd;
    }
    errno = EEXIST;
    return -1;
}

/* The share file, open and checked (regular file, not a symlink); *st its status. The
 * descriptor, -2 when it is to be skipped, -1 with errno on an error. */
static int open_source(const struct move *mv, struct stat *st)
{
    struct stat lst;
    int fd;
    if (fstatat(mv->sdir, mv->name, &lst, AT_SYMLINK_NOFOLLOW) < 0)
        return errno == ENOENT || errno == ENOTDIR ? -2 : -1;
    if (!S_ISREG(lst.st_mode))
        return -2;
    /* O_NONBLOCK: should it have become a FIFO meanwhile, do not wait for a writer. */
    fd = openat(mv->sdir, mv->name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ELOOP || errno == ENXIO || errno == ENOTDIR ? -2 : -1;
    if (fstat(fd, st) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    if (!S_ISREG(st->st_mode) || st->st_dev != lst.st_dev || st->st_ino != lst.st_ino) {
        close(fd);
        return -2;
    }
    return fd;
}

/* Moves one file. 1 when moved (*bytes set), 0 when skipped, -1 with errno and last_error. */
static int move_file(const struct move *mv, unsigned long long *bytes)
{
    struct stat st, after, now;
    struct timespec times[2];
    char tmp[64];
    long long copied;
    int src, dst, e;
    const char *what;

    src = open_source(mv, &st);
    if (src == -2)
        return 0;
    if (src < 0)
        return move_fail(mv, "cannot open it in the share", errno);
    dst = create_temp(mv, tmp, sizeof tmp);
    if (dst < 0) {
        e = errno;
        close(src);
        return move_fail(mv, "cannot create a file", e);
    }
    what = "cannot copy it";
    copied = copy_data(src, dst, mv->buf);
    if (copied < 0)
        goto fail;
    times[0] = st.st_atim;
    times[1] = st.st_mtim;
    what = "cannot set the copy's mode";
    if (fchmod(dst, st.st_mode & 07777) < 0)
        goto fail;
    futimens(dst, times); /* nice to have */
    what = "cannot sync the copy";
    if (fsync(dst) < 0 || fstat(dst, &after) < 0)
        goto fail;
    if (fstat(src, &now) < 0 || now.st_size != st.st_size || copied != (long long)st.st_size ||
        now.st_mtim.tv_sec != st.st_mtim.tv_sec || now.st_mtim.tv_nsec != st.st_mtim.tv_nsec) {
        /* Written to meanwhile: in use, so not cold after all. */
        close(src);
        close(dst);
        unlinkat(mv->ddir, tmp, 0);
        return 0;
    }
    what = "the copy has the wrong size";
    if (after.st_size != st.st_size) {
        errno = EIO;
        goto fail;
    }
    close(dst);
    dst = -1;
    what = "cannot rename the copy";
    if (renameat(mv->ddir, tmp, mv->ddir, mv->name) < 0)
        goto fail;
    fsync(mv->ddir);
    /* Remove the share's file only if it still is the one copied. */
    if (fstatat(mv->sdir, mv->name, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        now.st_dev == st.st_dev && now.st_ino == st.st_ino &&
        unlinkat(mv->sdir, mv->name, 0) < 0 && errno != ENOENT) {
        e = errno;
        close(src);
        return move_fail(mv, "copied, but cannot remove it from the share", e);
    }
    close(src);
    *bytes = (unsigned long long)copied;
    return 1;

fail:
    e = errno;
    close(src);
    if (dst >= 0)
        close(dst);
    unlinkat(mv->ddir, tmp, 0);
    return move_fail(mv, what, e);
}

/* Opens (with mkdir when `create`) the directory `name` in `dir`, not following symlinks. */
static int open_subdir(int dir, const char *name, int create)
{
    if (create && mkdirat(dir, name, 0755) < 0 && errno != EEXIST)
        return -1;
    return openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

/* Walks `ncomp - 1` directories from `dir` (creating them when `create`); the last one's
 * descriptor (`dir` itself when there are none), or -1 with errno. */
static int walk_dirs(int dir, char **comp, size_t ncomp, int create)
{
    int cur = dir;
    for (size_t i = 0; i + 1 < ncomp; i++) {
        int next = open_subdir(cur, comp[i], create);
        int e = errno;
        if (cur != dir)
            close(cur);
        if (next < 0) {
            errno = e;
            return -1;
        }
        cur = next;
    }
    return cur;
}

/* Moves the advised path `rel` (relative to the share). 1 moved, 0 skipped, -1 error. */
static int evict_path(int share, int dest, const char *rel, const char *dest_name, char *buf,
                      unsigned long long *bytes)
{
    char path[PATH_MAX], *comp[PATH_MAX / 2], *save = NULL;
    struct move mv = { .sdir = -1, .ddir = -1, .rel = rel, .dest = dest_name, .buf = buf };
    struct stat st;
    size_t ncomp = 0;
    int rc = 0, e;

    if (strlen(rel) >= sizeof path)
        return 0;
    strcpy(path, rel);
    for (char *c = strtok_r(path, "/", &save); c; c = strtok_r(NULL, "/", &save)) {
        if (strcmp(c, "..") == 0)
            return 0;
        if (strcmp(c, ".") != 0)
            comp[ncomp++] = c;
    }
    if (ncomp == 0)
        return 0;
    mv.name = comp[ncomp - 1];
    mv.sdir = walk_dirs(share, comp, ncomp, 0);
    if (mv.sdir < 0) {
        if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP)
            return 0;
        return move_fail(&mv, "cannot open its directory in the share", errno);
    }
    /* Skip what is no regular file before making directories for it. */
    if (fstatat(mv.sdir, mv.name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(st.st_mode))
        goto out;
    mv.ddir = walk_dirs(dest, comp, ncomp, 1);
    if (mv.ddir < 0)
        rc = move_fail(&mv, "cannot create its directory", errno);
    else
        rc = move_file(&mv, bytes);
out:
    e = errno;
    if (mv.sdir != share)
        close(mv.sdir);
    if (mv.ddir >= 0 && mv.ddir != dest)
        close(mv.ddir);
    errno = e;
    return rc;
}

/* Reads the next string of the advice's "evict" array at *pp into out; 1 got one (*bad when
 * it is unusable, e.g. too long), 0 at the end of the array, -1 when malformed. Elements that
 * are no strings are skipped. */
static int next_path(const char **pp, char *out, size_t cap, int *bad)
{
    const char *p = skip_ws(*pp);
    for (;;) {
        if (*p == ']') {
            *pp = p + 1;
            return 0;
        }
        if (*p == ',')
            p = skip_ws(p + 1);
        if (*p == '"') {
            p = json_string(p, out, cap, bad);
            if (!p)
                return -1;
            p = skip_ws(p);
            if (*p != ',' && *p != ']')
                return -1;
            *pp = p;
            return 1;
        }
        p = skip_value(p, 2);
        if (!p)
            return -1;
        p = skip_ws(p);
        if (*p != ',' && *p != ']')
            return -1;
    }
}

/* The "evict" array of an advice reply (after its '['), NULL (EPROTO) when the reply is not
 * {"ok":true,...,"evict":[strings]}. */
static const char *advice_list(const char *rep)
{
    const char *list, *p;
    char path[PATH_MAX];
    int bad, r;
    if (check_ok(rep))
        return NULL;
    list = json_member(rep, "evict");
    if (!list || *list != '[')
        goto malformed;
    /* Check the whole array before moving anything. */
    p = list + 1;
    while ((r = next_path(&p, path, sizeof path, &bad)) == 1)
        ;
    if (r < 0)
        goto malformed;
    return list + 1;
malformed:
    set_error(MALFORMED);
    errno = EPROTO;
    return NULL;
}

/* One advice round: asks, then moves what is advised. The files moved, or -1. */
static long evict_round(int share, int dest, const char *dest_name, char *rep, char *buf,
                        unsigned long long *bytes)
{
    static const char req[] = "{\"op\":\"advice\"}\n";
    char path[PATH_MAX];
    const char *p;
    long moved = 0;
    int bad, r;

    if (shared_request(req, sizeof req - 1, rep, REPLY_MAX_BYTES + 2))
        return -1;
    p = advice_list(rep);
    if (!p)
        return -1;
    for (int i = 0; i < EVICT_MAX_PATHS && (r = next_path(&p, path, sizeof path, &bad)) == 1;
         i++) {
        unsigned long long b = 0;
        if (bad)
            continue;
        r = evict_path(share, dest, path, dest_name, buf, &b);
        if (r < 0)
            return -1;
        if (r == 1) {
            moved++;
            *bytes += b;
        }
    }
    return moved;
}

/* Opens the share's root and the destination (created when missing; not on the share). */
static int open_evict_dirs(const char *dest_dir, int *share, int *dest)
{
    size_t rl;
    const char *root = share_root(&rl);
    struct stat ss, ds;
    int e;
    *share = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*share < 0) {
        e = errno;
        set_errorf("cannot open the share %s: %s", root, strerror(e));
        errno = e;
        return -1;
    }
    if (mkdir(dest_dir, 0755) < 0 && errno != EEXIST)
        goto dest_fail;
    *dest = open(dest_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*dest < 0)
        goto dest_fail;
    if (fstat(*share, &ss) == 0 && fstat(*dest, &ds) == 0 && ss.st_dev == ds.st_dev) {
        set_errorf("%s is on the share; the files must leave it", dest_dir);
        close(*share);
        close(*dest);
        errno = EINVAL;
        return -1;
    }
    return 0;
dest_fail:
    e = errno;
    set_errorf("cannot open %s: %s", dest_dir, strerror(e));
    close(*share);
    errno = e;
    return -1;
}

long hylics_evict(const char *dest_dir, unsigned long long *bytes_moved)
{
    unsigned long long bytes = 0;
    char *rep, *buf;
    long total = 0, moved = 0;
    int share, dest, e;

    set_error("");
    if (bytes_moved)
        *bytes_moved = 0;
    if (!dest_dir || !*dest_dir) {
        errno = EINVAL;
        return -1;
    }
    rep = malloc(REPLY_MAX_BYTES + 2);
    buf = malloc(COPY_BUF_BYTES);
    if (!rep || !buf) {
        free(rep);
        free(buf);
        set_error("out of memory");
        errno = ENOMEM;
        return -1;
    }
    if (open_evict_dirs(dest_dir, &share, &dest) < 0) {
        total = -1;
        goto out;
    }
    for (int round = 0; round < EVICT_MAX_ROUNDS; round++) {
        moved = evict_round(share, dest, dest_dir, rep, buf, &bytes);
        if (moved <= 0)
            break;
        total += moved;
    }
    if (moved < 0)
        total = -1;
    close(share);
    close(dest);
out:
    e = errno;
    free(rep);
    free(buf);
    if (bytes_moved)
        *bytes_moved = bytes;
    errno = e;
    return total;
}
