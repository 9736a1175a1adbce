// build: dynamic -lhylics
/* hylics-sockserve PORT PATH [HEADER [TRAILER]]: a one-connection server for Hylics' socket
 * scheme (hylics_sendfile in hylics.h). Listens on 0.0.0.0:PORT, prints LISTENING, accepts one
 * connection, writes HEADER (default "HEADER\n") itself, has vmsight send the share's file PATH
 * on that connection (prints SENT N, and SEQ before=B after=A advanced=N: the connection's next
 * send sequence number before and after the hand-over), writes TRAILER (default "TRAILER\n") itself, reads what the
 * client sends until its end of stream (at most 10 s; prints READ N), shuts down its side,
 * closes (prints CLOSED). Needs root or CAP_NET_ADMIN. Exit status 0 on success, 1 on a failure
 * (the sentence on stderr), 2 on a usage error. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <linux/tcp.h>
#include <sys/socket.h>
#include <hylics.h>

static int fail(const char *what)
{
    fprintf(stderr, "hylics-sockserve: %s: %s\n", what, strerror(errno));
    return 1;
}

static int write_all(int fd, const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -1;
        s += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The connection's next send sequence number (TCP_QUEUE_SEQ of the send queue: needs a
 * moment in repair mode, which this program may enter anyway), or -1 when unknown. */
static long long send_seq(int fd)
{
    int on = TCP_REPAIR_ON, off = TCP_REPAIR_OFF_NO_WP, q = TCP_SEND_QUEUE, one = 1, seq;
    socklen_t len = sizeof seq;
    long long rc = -1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_REPAIR, &on, sizeof on) < 0)
        return -1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_REPAIR_QUEUE, &q, sizeof q) == 0 &&
        getsockopt(fd, IPPROTO_TCP, TCP_QUEUE_SEQ, &seq, &len) == 0)
        rc = (unsigned)seq;
    setsockopt(fd, IPPROTO_TCP, TCP_REPAIR, &off, sizeof off);
    /* Repair mode forced address reuse; the accepted socket had the listener's setting. */
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    return rc;
}

/* Reads until the peer's end of stream, at most 10 s in all; the bytes read, or -1. */
static long long read_to_eof(int fd)
{
    struct timespec t0, t;
    long long total = 0;
    char buf[4096];
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        long left;
        ssize_t r;
        clock_gettime(CLOCK_MONOTONIC, &t);
        left = 10000 - ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000);
        if (left <= 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        r = poll(&p, 1, (int)left);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            continue;
        r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            return total;
        total += r;
    }
}

int main(int argc, char **argv)
{
    const char *header = argc > 3 ? argv[3] : "HEADER\n";
    const char *trailer = argc > 4 ? argv[4] : "TRAILER\n";
    struct sockaddr_in addr;
    long long before, after;
    long long sent, got;
    char *end;
    long port;
    int ls, fd, one = 1;

    if (argc < 3 || argc > 5 || (port = strtol(argv[1], &end, 10), *end || port < 1 ||
                                 port > 65535)) {
        fprintf(stderr, "usage: hylics-sockserve PORT PATH [HEADER [TRAILER]]\n");
        return 2;
    }
    ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0)
        return fail("socket");
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((unsigned short)port);
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(ls, (struct sockaddr *)&addr, sizeof addr) < 0)
        return fail("bind");
    if (listen(ls, 1) < 0)
        return fail("listen");
    printf("LISTENING\n");
    fflush(stdout);
    fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
        return fail("accept");
    if (write_all(fd, header, strlen(header)) < 0)
        return fail("writing the header");

    before = send_seq(fd);
    sent = hylics_sendfile(fd, argv[2], 0, 0);
    if (sent < 0) {
        const char *why = hylics_last_error();
        fprintf(stderr, "hylics-sockserve: hylics_sendfile: %s\n", *why ? why : strerror(errno));
        return 1;
    }
    after = send_seq(fd);
    printf("SENT %lld\n", sent);
    /* after - before (mod 2^32) is what vmsight sent on the connection. */
    printf("SEQ before=%lld after=%lld advanced=%lld\n", before, after,
           before < 0 || after < 0 ? -1LL : (long long)(((unsigned long long)after -
                                                          (unsigned long long)before) & 0xffffffffULL));
    fflush(stdout);

    if (write_all(fd, trailer, strlen(trailer)) < 0)
        return fail("writing the trailer");
    got = read_to_eof(fd);
    if (got < 0)
        return fail("reading from the client");
    printf("READ %lld\n", got);
    fflush(stdout);
    if (shutdown(fd, SHUT_WR) < 0)
        return fail("shutdown");
    if (close(fd) < 0)
        return fail("close");
    close(ls);
    printf("CLOSED\n");
    return 0;
}
