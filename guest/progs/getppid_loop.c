/* getppid_loop N: calls getppid(2) N times through syscall(2), so every call really enters the
 * kernel (no libc caching). A cheap, known syscall load for measuring syscall interception
 * overhead. Prints nothing unless there is an error. Built with gcc -O2 -static by
 * guest/build-image.sh into /usr/local/bin of the guest. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s N\n", argv[0]);
        return 2;
    }
    char *end;
    errno = 0;
    unsigned long long n = strtoull(argv[1], &end, 10);
    if (errno != 0 || *end != '\0' || end == argv[1] || argv[1][0] == '-') {
        fprintf(stderr, "%s: N must be a non-negative integer, not '%s'\n", argv[0], argv[1]);
        return 2;
    }
    for (unsigned long long i = 0; i < n; i++) {
        if (syscall(SYS_getppid) < 0) {
            perror("getppid");
            return 1;
        }
    }
    return 0;
}
