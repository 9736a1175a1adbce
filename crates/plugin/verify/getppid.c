#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/mman.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall instruction */
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    const char hello[] = "vmsight-peek: hello from the guest\n";
    for (int i = 0; i < 3; i++)
        syscall(SYS_write, 1, hello, sizeof hello - 1);
    /* Peek edge cases: an unmapped buffer (EFAULT) and a buffer running off the end of a
       mapping into an unmapped page (the plugin must copy the 8 readable bytes). */
    syscall(SYS_write, 1, (void *)0x10, 5);
    char *pg = mmap(0, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    munmap(pg + 4096, 4096);
    memcpy(pg + 4088, "EDGE8by\n", 8);
    syscall(SYS_write, 1, pg + 4088, 20);
    long sum = 0;
    double t0 = now();
    for (long i = 0; i < n; i++)
        sum += syscall(SYS_getppid);
    double t1 = now();
    char line[200];
    int len = snprintf(line, sizeof line,
        "GETPPID n=%ld total=%.3f s per_syscall=%.3f us (ppid sum %ld)\n",
        n, t1 - t0, (t1 - t0) * 1e6 / n, sum);
    syscall(SYS_write, 1, line, len);
    return 0;
}
