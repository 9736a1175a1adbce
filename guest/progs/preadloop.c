/* preadloop FILE N: pread the first 4 KiB of FILE N times. Sky's worst case for interception
 * overhead (a cheap syscall served from the page cache, repeated). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: preadloop FILE N\n");
        return 2;
    }
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    long n = atol(argv[2]);
    static char buf[4096];
    for (long i = 0; i < n; i++)
        if (pread(fd, buf, sizeof buf, 0) < 0) {
            perror("pread");
            return 1;
        }
    return 0;
}
