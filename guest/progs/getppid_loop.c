/* getppid_loop N: calls getppid(2) N times through syscall(2), so every call really enters the
 * kernel (no libc caching). A cheap, known syscall load for measuring syscall interception
 * overhead. Prints nothing unless there is an error. Built with gcc -O2 -static by
 * guest/build-image.sh into /usr/local/bin of the guest. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "countarg.h"

int main(int argc, char **argv)
{
    unsigned long long n;
    if (!count_arg(argc, argv, &n))
        return 2;
    for (unsigned long long i = 0; i < n; i++) {
        if (syscall(SYS_getppid) < 0) {
            perror("getppid");
            return 1;
        }
    }
    return 0;
}
