/* The one-argument command line of the syscall-loop programs (guest/progs: getppid_loop,
 * int80): `PROG N`, N a non-negative decimal count. Header-only, built with -I guest/lib. */
#ifndef VMSIGHT_COUNTARG_H
#define VMSIGHT_COUNTARG_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

/* Parses argv[1] into *n; prints the usage or the error and returns 0 when it is not a count. */
static inline int count_arg(int argc, char **argv, unsigned long long *n)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s N\n", argv[0]);
        return 0;
    }
    char *end;
    errno = 0;
    *n = strtoull(argv[1], &end, 10);
    if (errno != 0 || *end != '\0' || end == argv[1] || argv[1][0] == '-') {
        fprintf(stderr, "%s: N must be a non-negative integer, not '%s'\n", argv[0], argv[1]);
        return 0;
    }
    return 1;
}

#endif
