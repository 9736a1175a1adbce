// pageout-probe N: maps N anonymous pages, writes a pattern into each, asks the kernel to
// swap out the odd ones (MADV_PAGEOUT; needs active swap), leaves page N-1 never touched, and
// prints one line: "pageout-probe pid=P base=0xADDR pages=N". Then it waits for a line on stdin
// before exiting, so a test can inspect its pages (page_info symcalls against
// /proc/P/pagemap) while they stay as they are. With "check" as second argument it verifies the
// pattern of every touched page after the wait (swapped pages come back intact).
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 8;
    int check = argc > 2 && strcmp(argv[2], "check") == 0;
    long page = sysconf(_SC_PAGESIZE);
    if (n < 2 || n > 65536) {
        fprintf(stderr, "pageout-probe: N must be 2..65536\n");
        return 2;
    }
    uint8_t *base = mmap(NULL, (size_t)(n * page), PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        perror("pageout-probe: mmap");
        return 1;
    }
    for (long i = 0; i < n - 1; i++)
        memset(base + i * page, (int)(0x11 + i) & 0xff, (size_t)page);
    for (long i = 1; i < n - 1; i += 2)
        if (madvise(base + i * page, (size_t)page, MADV_PAGEOUT) != 0) {
            perror("pageout-probe: madvise(MADV_PAGEOUT)");
            return 1;
        }
    printf("pageout-probe pid=%d base=%p pages=%ld\n", getpid(), (void *)base, n);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) {
        /* EOF: exit all the same */
    }
    if (check)
        for (long i = 0; i < n - 1; i++)
            for (long j = 0; j < page; j++)
                if (base[i * page + j] != (uint8_t)((0x11 + i) & 0xff)) {
                    printf("pageout-probe: page %ld corrupt\n", i);
                    return 1;
                }
    printf("pageout-probe done\n");
    return 0;
}
