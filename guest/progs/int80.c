/* int80 N: makes N 32-bit system calls from this 64-bit program through `int $0x80` (the i386
 * gate the kernel keeps with CONFIG_IA32_EMULATION): getpid, i386 number 20. Prints
 * "int80 N PID" when every call returned this process's PID (the 64-bit getpid's answer).
 * vmsight traces only the 64-bit `syscall` instruction and counts these (compat_syscalls). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s N\n", argv[0]);
        return 2;
    }
    char *end;
    errno = 0;
    unsigned long n = strtoul(argv[1], &end, 10);
    if (errno != 0 || *end != '\0' || end == argv[1] || argv[1][0] == '-') {
        fprintf(stderr, "%s: N must be a non-negative integer, not '%s'\n", argv[0], argv[1]);
        return 2;
    }
    long want = getpid();
    for (unsigned long i = 0; i < n; i++) {
        long ret;
        __asm__ volatile("int $0x80" : "=a"(ret) : "a"(20L) : "memory");
        if (ret != want) {
            fprintf(stderr, "int80: call %lu returned %ld, want %ld\n", i, ret, want);
            return 1;
        }
    }
    printf("int80 %lu %ld\n", n, want);
    return 0;
}
