/* libhylics: see hylics.h. The wire format is vmsight_proto::hylics: one JSON object per line
 * each way. Requests are built here with snprintf; replies are vmsight's own
 * ({"ok":true,...} or {"ok":false,"error":"..."}), read with a small lenient JSON scanner that
 * looks up the top-level keys it needs and ignores the others. A reply it cannot read is
 * EPROTO, "malformed reply from vmsight".
 *
 * hylics_send_file opens a connection per call (a send can take long). The task reports and
 * the advice requests of hylics_evict share one connection per process: a static descriptor
 * guarded by a mutex, reopened once when a write or read on it fails, and never shared with a
 * forked child (the child notices the changed pid and connects anew).
 *
 * hylics_sendfile (the socket scheme) hands an accepted TCP connection to vmsight with
 * TCP_REPAIR on a connection of its own: sock-hold, freeze and dump the socket, sock-send with
 * the dumped state, restore the socket from the state vmsight answers, sock-release, thaw. See
 * the section "The socket scheme" below. */
#define _GNU_SOURCE
#include "hylics.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
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

/* Testing aid: $HYLICS_SERVICE_UNIX names a Unix stream socket to use instead of vsock. */
static int connect_unix_service(const char *path)
{
    struct sockaddr_un addr;
    int fd;
    if (strlen(path) >= sizeof addr.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strcpy(addr.sun_path, path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int connect_service(void)
{
    struct sockaddr_vm addr;
    const char *unix_path = getenv("HYLICS_SERVICE_UNIX");
    int fd;
    if (unix_path && *unix_path)
        return connect_unix_service(unix_path);
    fd = socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0);
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
static int conn_domain;       /* its address family (AF_VSOCK; AF_UNIX when testing) */
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

/* Forgets the connection; after a fork the child only closes its copy if it still is a socket
 * of the same family (a program may have reused the descriptor's number meanwhile). */
static void conn_drop(void)
{
    if (conn_fd >= 0 && conn_pid != getpid()) {
        int domain = 0;
        socklen_t len = sizeof domain;
        if (getsockopt(conn_fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 &&
            domain == conn_domain)
            close(conn_fd);
    } else if (conn_fd >= 0) {
        close(conn_fd);
    }
    conn_fd = -1;
}

static int conn_open(void)
{
    struct timeval tv = { .tv_sec = IO_TIMEOUT_SECS, .tv_usec = 0 };
    socklen_t len = sizeof conn_domain;
    int fd = connect_service();
    if (fd < 0)
        return -1;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &conn_domain, &len) < 0)
        conn_domain = AF_VSOCK;
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

/* ---- The socket scheme: hand an accepted TCP connection to vmsight and back ---------------- */

/* TCP_REPAIR (Linux >= 3.5, TCP_REPAIR_WINDOW >= 4.8); glibc's netinet/tcp.h has most. */
#ifndef TCP_REPAIR
#define TCP_REPAIR 19
#endif
#ifndef TCP_REPAIR_QUEUE
#define TCP_REPAIR_QUEUE 20
#endif
#ifndef TCP_QUEUE_SEQ
#define TCP_QUEUE_SEQ 21
#endif
#ifndef TCP_REPAIR_OPTIONS
#define TCP_REPAIR_OPTIONS 22
#endif
#ifndef TCP_TIMESTAMP
#define TCP_TIMESTAMP 24
#endif
#ifndef TCP_REPAIR_WINDOW
#define TCP_REPAIR_WINDOW 29
#endif
#ifndef TCP_REPAIR_ON
#define TCP_REPAIR_ON 1
#endif
#ifndef TCP_REPAIR_OFF_NO_WP
#define TCP_REPAIR_OFF_NO_WP -1
#endif
#ifndef TCPOPT_MSS
#define TCPOPT_MSS 2
#endif
#ifndef TCPOPT_WINDOW
#define TCPOPT_WINDOW 3
#endif
#ifndef TCPOPT_SACK_PERMITTED
#define TCPOPT_SACK_PERMITTED 4
#endif
#ifndef TCPOPT_TIMESTAMP
#define TCPOPT_TIMESTAMP 8
#endif
#ifndef TCPI_OPT_TIMESTAMPS
#define TCPI_OPT_TIMESTAMPS 1
#endif
#ifndef TCPI_OPT_SACK
#define TCPI_OPT_SACK 2
#endif
#ifndef TCPI_OPT_WSCALE
#define TCPI_OPT_WSCALE 4
#endif
#ifndef SIOCINQ
#define SIOCINQ 0x541B
#endif
#ifndef SIOCOUTQ
#define SIOCOUTQ 0x5411
#endif
/* TCP_REPAIR_QUEUE's values (an enum in glibc, so no #ifndef): */
#define REPAIR_NO_QUEUE 0
#define REPAIR_RECV_QUEUE 1
#define REPAIR_SEND_QUEUE 2
#define TCP_STATE_ESTABLISHED 1   /* tcpi_state */

#define DRAIN_TIMEOUT_MS 10000    /* the app's sent bytes must be acknowledged within this */
#define HANDBACK_MAX_BYTES 16384  /* vmsight_proto::hylics::MAX_HANDBACK_BYTES */
#define ADDR_MAX 24               /* "255.255.255.255:65535" */

struct repair_opt {
    uint32_t code, val;
};

struct repair_window {
    uint32_t snd_wl1, snd_wnd, max_window, rcv_wnd, rcv_wup;
};

/* A frozen connection: vmsight_proto::hylics::TcpState without the hand-back data. */
struct tcp_state {
    struct sockaddr_in local, remote;
    uint32_t snd_seq, rcv_seq, mss, ts_val;
    int tstamp, sack, wscale;
    unsigned snd_wscale, rcv_wscale;
    struct repair_window win;
};

/* What the app may have set on its socket; put back after the hand-over. */
struct app_opts {
    int fl, keepalive, nodelay, reuseaddr;
    int keepidle, keepintvl, keepcnt, user_timeout;   /* -1: could not be read */
};

static int tcp_setopt(int fd, int opt, int val)
{
    return setsockopt(fd, IPPROTO_TCP, opt, &val, sizeof val);
}

static int tcp_getopt(int fd, int opt, int *val)
{
    socklen_t len = sizeof *val;
    return getsockopt(fd, IPPROTO_TCP, opt, val, &len);
}

static int fail_errno(const char *what)
{
    int e = errno;
    set_errorf("%s: %s", what, strerror(e));
    errno = e;
    return -1;
}

static void format_addr(const struct sockaddr_in *a, char *out)
{
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    snprintf(out, ADDR_MAX, "%s:%u", ip, (unsigned)ntohs(a->sin_port));
}

/* The connection's ends; EAFNOSUPPORT unless it is an IPv4 TCP socket, ENOTCONN unless it is
 * established. */
static int tcp_endpoints(int fd, struct sockaddr_in *local, struct sockaddr_in *remote)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    struct tcp_info ti;
    int type = 0, proto = 0;
    socklen_t il = sizeof type;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) < 0)
        return fail_errno("not a socket");
    if (ss.ss_family != AF_INET || getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &il) < 0 ||
        type != SOCK_STREAM || (il = sizeof proto,
                                getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &il) < 0) ||
        proto != IPPROTO_TCP) {
        set_error("the socket scheme takes IPv4 TCP connections only");
        errno = EAFNOSUPPORT;
        return -1;
    }
    memcpy(local, &ss, sizeof *local);
    len = sizeof *remote;
    if (getpeername(fd, (struct sockaddr *)remote, &len) < 0)
        return fail_errno("the socket is not connected");
    len = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0)
        return fail_errno("cannot read TCP_INFO");
    if (ti.tcpi_state != TCP_STATE_ESTABLISHED) {
        set_error("the connection is not established (closing?)");
        errno = ENOTCONN;
        return -1;
    }
    return 0;
}

static void app_opts_save(int fd, struct app_opts *o)
{
    socklen_t len = sizeof(int);
    o->fl = fcntl(fd, F_GETFL);
    o->keepalive = o->reuseaddr = -1;
    if (getsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &o->keepalive, &len) < 0)
        o->keepalive = -1;
    len = sizeof(int);
    if (getsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &o->reuseaddr, &len) < 0)
        o->reuseaddr = -1;
    if (tcp_getopt(fd, TCP_NODELAY, &o->nodelay) < 0)
        o->nodelay = -1;
    if (tcp_getopt(fd, TCP_KEEPIDLE, &o->keepidle) < 0)
        o->keepidle = -1;
    if (tcp_getopt(fd, TCP_KEEPINTVL, &o->keepintvl) < 0)
        o->keepintvl = -1;
    if (tcp_getopt(fd, TCP_KEEPCNT, &o->keepcnt) < 0)
        o->keepcnt = -1;
    if (tcp_getopt(fd, TCP_USER_TIMEOUT, &o->user_timeout) < 0)
        o->user_timeout = -1;
}

/* Best effort: the options a repair-mode reset may have cleared, and SO_REUSEADDR, which
 * TCP_REPAIR overrides (left at "force", a later TIME_WAIT would keep a new listener from
 * binding the port even with SO_REUSEADDR). */
static void app_opts_apply(int fd, const struct app_opts *o)
{
    int one = 1;
    if (o->fl >= 0 && fcntl(fd, F_GETFL) != o->fl)
        fcntl(fd, F_SETFL, o->fl);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, o->reuseaddr >= 0 ? &o->reuseaddr : &one,
               sizeof one);
    if (o->keepalive >= 0)
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &o->keepalive, sizeof o->keepalive);
    if (o->nodelay >= 0)
        tcp_setopt(fd, TCP_NODELAY, o->nodelay);
    if (o->keepidle > 0)
        tcp_setopt(fd, TCP_KEEPIDLE, o->keepidle);
    if (o->keepintvl > 0)
        tcp_setopt(fd, TCP_KEEPINTVL, o->keepintvl);
    if (o->keepcnt > 0)
        tcp_setopt(fd, TCP_KEEPCNT, o->keepcnt);
    if (o->user_timeout >= 0)
        tcp_setopt(fd, TCP_USER_TIMEOUT, o->user_timeout);
}

/* Repair mode needs CAP_NET_ADMIN: tried (on and off at once) before anything is asked. */
static int tcp_repair_allowed(int fd, const struct app_opts *o)
{
    if (tcp_setopt(fd, TCP_REPAIR, TCP_REPAIR_ON) < 0) {
        int e = errno;
        set_errorf("TCP_REPAIR: %s%s", strerror(e),
                   e == EPERM ? " (the socket scheme needs root or CAP_NET_ADMIN)" : "");
        errno = e;
        return -1;
    }
    tcp_setopt(fd, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP);
    app_opts_apply(fd, o);
    return 0;
}

static long long elapsed_ms(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0->tv_sec) * 1000LL + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

/* Waits until every byte the app wrote is acknowledged (the send queue is empty); EBUSY when
 * that takes longer than DRAIN_TIMEOUT_MS. */
static int tcp_wait_drained(int fd)
{
    struct timespec t0, ms = { 0, 1000000 };
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int outq = 0;
        if (ioctl(fd, SIOCOUTQ, &outq) < 0)
            return fail_errno("SIOCOUTQ");
        if (outq == 0)
            return 0;
        if (elapsed_ms(&t0) >= DRAIN_TIMEOUT_MS) {
            set_errorf("the send queue did not drain in %d s (%d bytes unacknowledged)",
                       DRAIN_TIMEOUT_MS / 1000, outq);
            errno = EBUSY;
            return -1;
        }
        nanosleep(&ms, NULL);
    }
}

/* Freeze and dump: repair mode on, then the state and the unread received bytes (*inq, malloc'd,
 * *inq_len bytes; they stay in the guest). The socket stays in repair mode, also on failure. */
static int tcp_freeze(int fd, struct tcp_state *st, unsigned char **inq, size_t *inq_len)
{
    struct tcp_info ti;
    socklen_t len;
    int outq = 0, n = 0, v;

    *inq = NULL;
    *inq_len = 0;
    if (tcp_setopt(fd, TCP_REPAIR, TCP_REPAIR_ON) < 0)
        return fail_errno("TCP_REPAIR on");
    if (ioctl(fd, SIOCOUTQ, &outq) < 0)
        return fail_errno("SIOCOUTQ");
    if (outq != 0) {
        set_errorf("the app wrote again: %d bytes unacknowledged", outq);
        errno = EBUSY;
        return -1;
    }
    if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_SEND_QUEUE) < 0 ||
        tcp_getopt(fd, TCP_QUEUE_SEQ, &v) < 0)
        return fail_errno("cannot read the send sequence");
    st->snd_seq = (uint32_t)v;
    if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_RECV_QUEUE) < 0 ||
        tcp_getopt(fd, TCP_QUEUE_SEQ, &v) < 0)
        return fail_errno("cannot read the receive sequence");
    st->rcv_seq = (uint32_t)v;
    if (ioctl(fd, SIOCINQ, &n) < 0)
        return fail_errno("SIOCINQ");
    if (n > 0) {
        ssize_t r;
        *inq = malloc((size_t)n);
        if (!*inq) {
            errno = ENOMEM;
            return fail_errno("the receive queue");
        }
        r = recv(fd, *inq, (size_t)n, MSG_PEEK | MSG_DONTWAIT);
        if (r != n) {
            if (r >= 0)
                errno = EIO;
            return fail_errno("cannot peek at the receive queue");
        }
        *inq_len = (size_t)n;
    }
    if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_NO_QUEUE) < 0)
        return fail_errno("TCP_REPAIR_QUEUE");
    if (tcp_getopt(fd, TCP_MAXSEG, &v) < 0) /* in repair mode: the peer's MSS (mss_clamp) */
        return fail_errno("TCP_MAXSEG");
    st->mss = (uint32_t)v;
    len = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0)
        return fail_errno("TCP_INFO");
    st->tstamp = !!(ti.tcpi_options & TCPI_OPT_TIMESTAMPS);
    st->sack = !!(ti.tcpi_options & TCPI_OPT_SACK);
    st->wscale = !!(ti.tcpi_options & TCPI_OPT_WSCALE);
    st->snd_wscale = ti.tcpi_snd_wscale;
    st->rcv_wscale = ti.tcpi_rcv_wscale;
    if (tcp_getopt(fd, TCP_TIMESTAMP, &v) < 0)
        return fail_errno("TCP_TIMESTAMP");
    st->ts_val = (uint32_t)v;
    len = sizeof st->win;
    if (getsockopt(fd, IPPROTO_TCP, TCP_REPAIR_WINDOW, &st->win, &len) < 0)
        return fail_errno("TCP_REPAIR_WINDOW");
    return 0;
}

/* Resets the frozen socket silently (connect(AF_UNSPEC) in repair mode: no FIN, no RST, timers
 * stopped, queues dropped, the 4-tuple freed); it stays in repair mode, in TCP_CLOSE, ready for
 * tcp_restore. */
static int tcp_reset_silently(int fd)
{
    struct sockaddr sa;
    int err;
    socklen_t len = sizeof err;
    memset(&sa, 0, sizeof sa);
    sa.sa_family = AF_UNSPEC;
    if (connect(fd, &sa, sizeof sa) < 0)
        return fail_errno("cannot reset the socket for its restore");
    /* The reset leaves ECONNABORTED pending; read it so the app does not get it. */
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    return 0;
}

/* Queues data[0..n) on the receive queue (repair mode, TCP_REPAIR_QUEUE = RECV selected). */
static int queue_received(int fd, const unsigned char *data, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            if (w == 0)
                errno = EIO;
            return -1;
        }
        data += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Restores the connection `st` on the reset socket fd (repair mode, TCP_CLOSE): its receive
 * queue gets q1[0..n1) then q2[0..n2), which end at st->rcv_seq. Stays in repair mode. */
static int tcp_restore(int fd, const struct tcp_state *st, const unsigned char *q1, size_t n1,
                       const unsigned char *q2, size_t n2)
{
    struct repair_opt opts[4];
    size_t nopts = 0;
    struct sockaddr_in bound;
    socklen_t len = sizeof bound;

    if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_SEND_QUEUE) < 0 ||
        tcp_setopt(fd, TCP_QUEUE_SEQ, (int)st->snd_seq) < 0)
        return fail_errno("cannot set the send sequence");
    if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_RECV_QUEUE) < 0 ||
        tcp_setopt(fd, TCP_QUEUE_SEQ, (int)(st->rcv_seq - (uint32_t)(n1 + n2))) < 0)
        return fail_errno("cannot set the receive sequence");
    if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_NO_QUEUE) < 0)
        return fail_errno("TCP_REPAIR_QUEUE");
    /* Before connect: full-sized segments at once (else 536-byte ones for a while). */
    if (tcp_setopt(fd, TCP_MAXSEG, (int)st->mss) < 0)
        return fail_errno("TCP_MAXSEG");
    /* Repair mode forces address reuse, so the listener's port does not stand in the way. (The
     * reset unbinds the socket; should it still be bound to the address, that is fine too.) */
    if (bind(fd, (const struct sockaddr *)&st->local, sizeof st->local) < 0 &&
        !(errno == EINVAL && getsockname(fd, (struct sockaddr *)&bound, &len) == 0 &&
          bound.sin_port == st->local.sin_port &&
          bound.sin_addr.s_addr == st->local.sin_addr.s_addr))
        return fail_errno("cannot bind the restored socket");
    if (connect(fd, (const struct sockaddr *)&st->remote, sizeof st->remote) < 0)
        return fail_errno("cannot connect the restored socket (repair mode: no SYN)");
    opts[nopts++] = (struct repair_opt){ TCPOPT_MSS, st->mss };
    if (st->wscale)
        opts[nopts++] = (struct repair_opt){ TCPOPT_WINDOW,
                                             st->snd_wscale | (st->rcv_wscale << 16) };
    if (st->sack)
        opts[nopts++] = (struct repair_opt){ TCPOPT_SACK_PERMITTED, 0 };
    if (st->tstamp)
        opts[nopts++] = (struct repair_opt){ TCPOPT_TIMESTAMP, 0 };
    if (setsockopt(fd, IPPROTO_TCP, TCP_REPAIR_OPTIONS, opts, (socklen_t)(nopts * sizeof *opts)) < 0)
        return fail_errno("TCP_REPAIR_OPTIONS");
    if (st->tstamp && tcp_setopt(fd, TCP_TIMESTAMP, (int)st->ts_val) < 0)
        return fail_errno("TCP_TIMESTAMP");
    if (n1 + n2 > 0) {
        if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_RECV_QUEUE) < 0 ||
            queue_received(fd, q1, n1) < 0 || queue_received(fd, q2, n2) < 0)
            return fail_errno("cannot refill the receive queue");
        if (tcp_setopt(fd, TCP_REPAIR_QUEUE, REPAIR_NO_QUEUE) < 0)
            return fail_errno("TCP_REPAIR_QUEUE");
    }
    /* After the receive queue: the kernel wants rcv_wup <= rcv_nxt. */
    if (setsockopt(fd, IPPROTO_TCP, TCP_REPAIR_WINDOW, &st->win, sizeof st->win) < 0)
        return fail_errno("TCP_REPAIR_WINDOW");
    return 0;
}

/* Thaw: repair mode off without a window probe, the app's options back. */
static int tcp_thaw(int fd, const struct app_opts *o)
{
    int rc = tcp_setopt(fd, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP);
    int e = errno;
    app_opts_apply(fd, o);
    errno = e;
    return rc;
}

/* Appends the TcpState JSON object of st (without rcv_data) to buf[*n..cap); 0 if it fits. */
static int put_tcp_state(char *buf, size_t cap, size_t *n, const struct tcp_state *st)
{
    char local[ADDR_MAX], remote[ADDR_MAX];
    int w;
    format_addr(&st->local, local);
    format_addr(&st->remote, remote);
    w = snprintf(buf + *n, cap - *n,
                 "{\"local\":\"%s\",\"remote\":\"%s\",\"snd_seq\":%u,\"rcv_seq\":%u,\"mss\":%u,"
                 "\"tstamp\":%s,\"sack\":%s,\"wscale\":%s,\"snd_wscale\":%u,\"rcv_wscale\":%u,"
                 "\"ts_val\":%u,\"snd_wl1\":%u,\"snd_wnd\":%u,\"max_window\":%u,\"rcv_wnd\":%u,"
                 "\"rcv_wup\":%u}",
                 local, remote, st->snd_seq, st->rcv_seq, st->mss,
                 st->tstamp ? "true" : "false", st->sack ? "true" : "false",
                 st->wscale ? "true" : "false", st->snd_wscale, st->rcv_wscale, st->ts_val,
                 st->win.snd_wl1, st->win.snd_wnd, st->win.max_window, st->win.rcv_wnd,
                 st->win.rcv_wup);
    if (w < 0 || (size_t)w >= cap - *n)
        return -1;
    *n += (size_t)w;
    return 0;
}

static int json_u32(const char *obj, const char *key, uint32_t *out)
{
    unsigned long long v;
    if (json_u64(json_member(obj, key), &v) || v > UINT32_MAX)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static int json_bool(const char *obj, const char *key, int *out)
{
    const char *v = json_member(obj, key);
    if (json_is(v, "true"))
        *out = 1;
    else if (json_is(v, "false"))
        *out = 0;
    else
        return -1;
    return 0;
}

/* The string member `key` of obj must be the address `want` (the same connection). */
static int json_same_addr(const char *obj, const char *key, const struct sockaddr_in *want)
{
    char got[64], exp[ADDR_MAX];
    const char *v = json_member(obj, key);
    int bad;
    if (!v || *v != '"' || !json_string(v, got, sizeof got, &bad) || bad)
        return -1;
    format_addr(want, exp);
    return strcmp(got, exp) == 0 ? 0 : -1;
}

/* Decodes the optional hex string rcv_data of obj into out (HANDBACK_MAX_BYTES); its length,
 * or -1 when malformed or too long. */
static long json_handback(const char *obj, unsigned char *out)
{
    static const size_t cap = 2 * HANDBACK_MAX_BYTES + 2;
    const char *v = json_member(obj, "rcv_data");
    char *hex;
    size_t n;
    long len = -1;
    int bad;
    if (!v)
        return 0;
    hex = malloc(cap);
    if (!hex)
        return -1;
    if (*v == '"' && json_string(v, hex, cap, &bad) && !bad && (n = strlen(hex)) % 2 == 0 &&
        n / 2 <= HANDBACK_MAX_BYTES) {
        len = (long)(n / 2);
        for (size_t i = 0; i < n / 2; i++) {
            int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
            if (hi < 0 || lo < 0) {
                len = -1;
                break;
            }
            out[i] = (unsigned char)(hi << 4 | lo);
        }
    }
    free(hex);
    return len;
}

/* Decodes {"ok":true,"bytes":N,"tcp":{TcpState}} into *bytes, *st (the addresses must be the
 * connection's own, which st holds on entry) and the hand-back data; -1 with EPROTO and
 * last_error otherwise. */
static int parse_sock_sent(const char *line, unsigned long long *bytes, struct tcp_state *st,
                           unsigned char *handback, size_t *handback_len)
{
    const char *tcp;
    uint32_t snd_wscale, rcv_wscale;
    long hb;
    if (check_ok(line))
        return -1;
    tcp = json_member(line, "tcp");
    if (json_u64(json_member(line, "bytes"), bytes) || *bytes > (unsigned long long)LLONG_MAX ||
        !tcp || *tcp != '{' || json_same_addr(tcp, "local", &st->local) ||
        json_same_addr(tcp, "remote", &st->remote) ||
        json_u32(tcp, "snd_seq", &st->snd_seq) || json_u32(tcp, "rcv_seq", &st->rcv_seq) ||
        json_u32(tcp, "mss", &st->mss) || json_bool(tcp, "tstamp", &st->tstamp) ||
        json_bool(tcp, "sack", &st->sack) || json_bool(tcp, "wscale", &st->wscale) ||
        json_u32(tcp, "snd_wscale", &snd_wscale) || json_u32(tcp, "rcv_wscale", &rcv_wscale) ||
        snd_wscale > 14 || rcv_wscale > 14 || json_u32(tcp, "ts_val", &st->ts_val) ||
        json_u32(tcp, "snd_wl1", &st->win.snd_wl1) || json_u32(tcp, "snd_wnd", &st->win.snd_wnd) ||
        json_u32(tcp, "max_window", &st->win.max_window) ||
        json_u32(tcp, "rcv_wnd", &st->win.rcv_wnd) || json_u32(tcp, "rcv_wup", &st->win.rcv_wup) ||
        (hb = json_handback(tcp, handback)) < 0) {
        set_error(MALFORMED);
        errno = EPROTO;
        return -1;
    }
    st->snd_wscale = snd_wscale;
    st->rcv_wscale = rcv_wscale;
    *handback_len = (size_t)hb;
    return 0;
}

/* One request on the hand-over's own connection; the reply line in rep (REPLY_MAX_BYTES + 2).
 * timeout_secs 0: wait as long as it takes. 0, or -1 with errno and last_error. */
static int handover_request(int fd, const char *req, size_t n, char *rep, int timeout_secs)
{
    struct timeval tv = { .tv_sec = timeout_secs, .tv_usec = 0 };
    int extra, r = -1;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (write_all(fd, req, n) == 0 && (r = read_line(fd, rep, REPLY_MAX_BYTES + 2, &extra)) == 0)
        return 0;
    if (r == -2 || errno == 0) {
        set_error(MALFORMED);
        errno = EPROTO;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        set_error("vmsight's Hylics service did not answer in time");
        errno = ETIMEDOUT;
    } else {
        fail_errno("the Hylics service closed the connection");
    }
    return -1;
}

/* sock-hold or sock-release of the connection `st`: 0 on {"ok":true}, else -1. */
static int handover_simple(int fd, const char *op, const struct tcp_state *st, char *rep)
{
    char req[256], local[ADDR_MAX], remote[ADDR_MAX];
    int n;
    format_addr(&st->local, local);
    format_addr(&st->remote, remote);
    n = snprintf(req, sizeof req, "{\"op\":\"%s\",\"local\":\"%s\",\"remote\":\"%s\"}\n", op,
                 local, remote);
    if (handover_request(fd, req, (size_t)n, rep, IO_TIMEOUT_SECS))
        return -1;
    return check_ok(rep);
}

/* The hand-over's progress, for the clean-up of a failure. */
enum handover_stage { HELD, FROZEN, RESET, RESTORED };

long long hylics_sendfile(int sockfd, const char *path, unsigned long long offset,
                          unsigned long long len)
{
    struct tcp_state own, now;
    struct app_opts opts;
    unsigned char *inq = NULL, *handback = NULL;
    size_t inq_len = 0, handback_len = 0, n = 0, prefix;
    char *req = NULL, *rep = NULL;
    unsigned long long bytes = 0;
    enum handover_stage stage = HELD;
    long long result = -1;
    int svc = -1, e;

    set_error("");
    if (sockfd < 0 || !path) {
        errno = EINVAL;
        return -1;
    }
    if (tcp_endpoints(sockfd, &own.local, &own.remote))
        return -1;
    req = malloc(LINE_MAX_BYTES);
    rep = malloc(REPLY_MAX_BYTES + 2);
    handback = malloc(HANDBACK_MAX_BYTES);
    if (!req || !rep || !handback) {
        set_error("out of memory");
        errno = ENOMEM;
        goto out;
    }
    /* The sock-send request up to its state, which is appended once frozen. */
    n = (size_t)snprintf(req, LINE_MAX_BYTES, "{\"op\":\"sock-send\",\"path\":");
    if (put_json_string(req, LINE_MAX_BYTES, &n, share_relative(path)))
        goto too_long;
    n += (size_t)snprintf(req + n, LINE_MAX_BYTES - n, ",\"offset\":%llu,\"len\":%llu,\"tcp\":",
                          offset, len);
    /* The state takes at most ~400 bytes. */
    if (n + 450 >= LINE_MAX_BYTES)
        goto too_long;
    prefix = n;

    app_opts_save(sockfd, &opts);
    if (tcp_repair_allowed(sockfd, &opts) || tcp_wait_drained(sockfd))
        goto out;
    svc = connect_service();
    if (svc < 0) {
        e = errno;
        set_error(UNREACHABLE);
        errno = e;
        goto out;
    }
    {
        struct timeval tv = { .tv_sec = IO_TIMEOUT_SECS, .tv_usec = 0 };
        setsockopt(svc, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }

    /* 1. vmsight drops the connection's frames from now on. */
    if (handover_simple(svc, "sock-hold", &own, rep))
        goto release;
    /* 2. Freeze, dump, reset: the guest's kernel lets go of the connection. */
    stage = FROZEN;
    if (tcp_freeze(sockfd, &own, &inq, &inq_len))
        goto release;
    if (tcp_reset_silently(sockfd))
        goto release;
    stage = RESET;
    /* 3. vmsight sends on the connection and answers with its state now. */
    n = prefix;
    if (put_tcp_state(req, LINE_MAX_BYTES - 2, &n, &own)) {
        set_error("request too long");
        errno = ENAMETOOLONG;
        goto release;
    }
    memcpy(req + n, "}\n", 2);
    n += 2;
    now = own;
    if (handover_request(svc, req, n, rep, 0) ||
        parse_sock_sent(rep, &bytes, &now, handback, &handback_len))
        goto release; /* as if nothing was sent: the guest's own state goes back */
    /* 4. The connection as vmsight left it, with the bytes the peer sent meanwhile after the
     * guest's own unread ones. */
    if (tcp_restore(sockfd, &now, inq, inq_len, handback, handback_len)) {
        e = errno;
        char why[sizeof last_error];
        snprintf(why, sizeof why, "%s", last_error);
        /* Back to the reset state: at least a socket the app can close. */
        if (tcp_reset_silently(sockfd) == 0 &&
            tcp_restore(sockfd, &own, inq, inq_len, NULL, 0) == 0)
            stage = RESTORED;
        set_errorf("sent %llu bytes, but cannot restore the socket: %s", bytes, why);
        errno = e;
        goto release;
    }
    stage = RESTORED;
    result = (long long)bytes;

release:
    e = errno;
    if (stage == RESET) {
        /* Failed after the reset: the guest's own state goes back. */
        char why[sizeof last_error];
        snprintf(why, sizeof why, "%s", last_error);
        if (tcp_restore(sockfd, &own, inq, inq_len, NULL, 0) == 0) {
            stage = RESTORED;
            set_error(why);
        } else {
            char again[sizeof last_error];
            snprintf(again, sizeof again, "%s", last_error);
            set_errorf("%.250s; and %.250s", why, again);
        }
    }
    /* 5. Always released, so the connection is never left held. A broken service connection is
     * reopened once for it. */
    {
        char why[sizeof last_error];
        int rc, ee;
        snprintf(why, sizeof why, "%s", last_error);
        rc = handover_simple(svc, "sock-release", &own, rep);
        if (rc && errno != EPROTO) {
            close(svc);
            svc = connect_service();
            if (svc >= 0)
                rc = handover_simple(svc, "sock-release", &own, rep);
        }
        ee = errno;
        if (result >= 0 && rc) {
            char msg[sizeof last_error];
            snprintf(msg, sizeof msg, "%s", last_error);
            set_errorf("sent %llu bytes, but vmsight did not release the connection: %s",
                       bytes, msg);
            result = -1;
            e = ee;
        } else {
            set_error(why);
        }
    }
    /* 6. Thaw: the socket is the app's again. */
    if (stage != HELD && tcp_thaw(sockfd, &opts) && result >= 0) {
        e = errno;
        fail_errno("TCP_REPAIR off");
        result = -1;
    }
    if (result >= 0)
        set_error("");
    errno = e;
    goto out;

too_long:
    set_error("request too long");
    errno = ENAMETOOLONG;
out:
    e = errno;
    if (svc >= 0)
        close(svc);
    free(inq);
    free(handback);
    free(req);
    free(rep);
    errno = e;
    return result;
}
