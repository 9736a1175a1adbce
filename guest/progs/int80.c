/* int80 N: makes N 32-bit system calls from this 64-bit program through `int $0x80` (the i386
 * gate the kernel keeps with CONFIG_IA32_EMULATION): getpid, i386 number 20. Prints
 * "int80 N PID" when every call returned this process's PID (the 64-bit getpid's answer).
 * vmsight traces only the 64-bit `syscall` instruction and counts these (compat_syscalls). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "countarg.h"

int main(int argc, char **argv)
{
    unsigned long long n;
    if (!count_arg(argc, argv, &n))
        return 2;
    long want = getpid();
    for (unsigned long long i = 0; i < n; i++) {
        long ret;
        __asm__ volatile("int $0x80" : "=a"(ret) : "a"(20L) : "memory");
        if (ret != want) {
            fprintf(stderr, "int80: call %llu returned %ld, want %ld\n", i, ret, want);
            return 1;
        }
    }
    printf("int80 %llu %ld\n", n, want);
    return 0;
}
