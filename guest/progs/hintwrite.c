/* hintwrite MODE PATH CLASS BYTES [CHUNK]: I/O with libvmsight class hints (docs/insights.md).
 *   write  — creates PATH and writes BYTES bytes with vmsight_write(CLASS), CHUNK bytes per call
 *   pwrite — the same with vmsight_pwrite at increasing offsets
 *   read   — reads PATH whole with vmsight_read(CLASS), CHUNK bytes per call
 *   pread  — the same with vmsight_pread
 * Writers fsync at the end. The data is a deterministic pseudo-random stream (so no two 4 KiB
 * chunks are equal). CHUNK defaults to 65536. Prints nothing unless there is an error.
 * Linked dynamically against /usr/local/lib/libvmsight.so, so it also checks the installed
 * library. */
// build: dynamic -lvmsight
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <vmsight.h>

static int parse_u64(const char *s, unsigned long long *out)
{
    char *end;
    errno = 0;
    *out = strtoull(s, &end, 10);
    return !(errno || *end || end == s || s[0] == '-');
}

int main(int argc, char **argv)
{
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "usage: %s write|pwrite|read|pread PATH CLASS BYTES [CHUNK]\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1], *path = argv[2];
    unsigned long long cls, bytes, chunk = 65536;
    if (!parse_u64(argv[3], &cls) || cls > 1000 || !parse_u64(argv[4], &bytes) ||
        (argc == 6 && (!parse_u64(argv[5], &chunk) || chunk == 0 || chunk > (64u << 20)))) {
        fprintf(stderr, "%s: CLASS, BYTES and CHUNK must be non-negative integers (CHUNK 1..64Mi)\n",
                argv[0]);
        return 2;
    }
    int writing = !strcmp(mode, "write") || !strcmp(mode, "pwrite");
    int positional = !strcmp(mode, "pwrite") || !strcmp(mode, "pread");
    if (!writing && strcmp(mode, "read") && strcmp(mode, "pread")) {
        fprintf(stderr, "%s: unknown mode '%s'\n", argv[0], mode);
        return 2;
    }
    char *buf = malloc(chunk);
    if (!buf) {
        perror("malloc");
        return 1;
    }
    int fd = writing ? open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644) : open(path, O_RDONLY);
    if (fd < 0) {
        fprintf(stderr, "%s: cannot open %s: %s\n", argv[0], path, strerror(errno));
        return 1;
    }
    uint64_t x = 0x9e3779b97f4a7c15ULL ^ cls;
    unsigned long long off = 0;
    for (;;) {
        size_t n = chunk;
        if (writing) {
            if (off >= bytes)
                break;
            if (bytes - off < n)
                n = (size_t)(bytes - off);
            for (size_t i = 0; i < n; i++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                buf[i] = (char)x;
            }
        }
        ssize_t r;
        if (writing)
            r = positional ? vmsight_pwrite(fd, buf, n, (off_t)off, (int)cls)
                           : vmsight_write(fd, buf, n, (int)cls);
        else
            r = positional ? vmsight_pread(fd, buf, n, (off_t)off, (int)cls)
                           : vmsight_read(fd, buf, n, (int)cls);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            fprintf(stderr, "%s: %s %s: %s\n", argv[0], mode, path, strerror(errno));
            return 1;
        }
        if (r == 0)
            break; /* end of file (readers), or a device that takes nothing (writers) */
        off += (unsigned long long)r;
    }
    if (writing && fsync(fd) != 0) {
        fprintf(stderr, "%s: fsync %s: %s\n", argv[0], path, strerror(errno));
        return 1;
    }
    if (close(fd) != 0) {
        fprintf(stderr, "%s: close %s: %s\n", argv[0], path, strerror(errno));
        return 1;
    }
    free(buf);
    return 0;
}
