/* libhylics: see hylics.h. The wire format is vmsight_proto::hylics: one JSON object per line
 * each way; the replies are vmsight's own ({"ok":true,"bytes":N} or {"ok":false,"error":"..."}),
 * so a small reader for exactly those two shapes is enough here. */
#define _GNU_SOURCE
#include "hylics.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

#define LINE_MAX_BYTES 4096

static __thread char last_error[512];

const char *hylics_last_error(void)
{
    return last_error;
}

static void set_error(const char *msg)
{
    snprintf(last_error, sizeof last_error, "%s", msg);
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

/* The path relative to the share: strips the mount point if `path` is under it. */
static const char *share_relative(const char *path)
{
    const char *root = getenv("HYLICS_ROOT");
    size_t rl;
    if (!root || !*root)
        root = HYLICS_DEFAULT_ROOT;
    rl = strlen(root);
    while (rl > 1 && root[rl - 1] == '/')
        rl--;
    if (strncmp(path, root, rl) == 0 && (path[rl] == '/' || path[rl] == '\0'))
        return path[rl] ? path + rl : "/";
    return path;
}

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

static int write_all(int fd, const char *buf, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
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

/* Reads one reply line into buf (NUL-terminated, newline removed); 0 on success. */
static int read_line(int fd, char *buf, size_t cap)
{
    size_t n = 0;
    while (n + 1 < cap) {
        ssize_t r = read(fd, buf + n, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        if (buf[n] == '\n') {
            buf[n] = '\0';
            return 0;
        }
        n++;
    }
    return -1;
}

/* Decodes {"ok":true,"bytes":N} or {"ok":false,"error":"..."}. */
static long long parse_reply(const char *line)
{
    const char *p;
    if (strstr(line, "\"ok\":true")) {
        p = strstr(line, "\"bytes\":");
        if (!p) {
            set_error("malformed reply from vmsight");
            errno = EPROTO;
            return -1;
        }
        return strtoll(p + 8, NULL, 10);
    }
    p = strstr(line, "\"error\":\"");
    if (p) {
        char msg[sizeof last_error];
        size_t n = 0;
        for (p += 9; *p && *p != '"' && n + 1 < sizeof msg; p++) {
            if (*p == '\\' && p[1])
                p++;
            msg[n++] = *p;
        }
        msg[n] = '\0';
        set_error(msg);
    } else {
        set_error("malformed reply from vmsight");
    }
    errno = EPROTO;
    return -1;
}

long long hylics_send_file(const char *dest, const char *path, unsigned long long offset,
                           unsigned long long len)
{
    char req[LINE_MAX_BYTES], rep[LINE_MAX_BYTES];
    size_t n = 0;
    long long result;
    int fd;

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
        set_error("cannot reach vmsight's Hylics service over vsock (is the VM run with --shared-mem?)");
        return -1;
    }
    if (write_all(fd, req, n) || read_line(fd, rep, sizeof rep)) {
        int e = errno ? errno : EPROTO;
        close(fd);
        set_error("the Hylics service closed the connection");
        errno = e;
        return -1;
    }
    close(fd);
    result = parse_reply(rep);
    return result;

too_long:
    set_error("request too long");
    errno = ENAMETOOLONG;
    return -1;
}
