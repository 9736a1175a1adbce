/* stream: the STREAM benchmark's kernels over arrays bigger than the guest's memory, the shape
 * of the SwapBypass evaluation's "Stream configured to use 300 MB" (SymCall paper §7.2).
 *
 *   stream MIB [--iters N] [--triad-only] [--canonical] [--nohuge]
 *
 * Three arrays of doubles a, b, c of MIB/3 MiB each, in one anonymous mapping. Each of the N
 * iterations (default 4) runs STREAM's four kernels in STREAM's order, c = a (copy),
 * b = q*c (scale), c = a + b (add), a = b + q*c (triad), with q = 3; --triad-only runs only the
 * triad. Unlike STREAM's constant arrays, a starts with a different value per element, b and c
 * with noise (overwritten before they are read): pages of identical words would be free for
 * compressing swap (zram stores them as one word), and the point here is moving real data.
 * Every element follows the same recurrence from its own start value, so the validation
 * replays it element by element and checks all of a, b and c (relative error 1e-13, as
 * STREAM): a page that came back from swap wrong, stale or zeroed makes valid=0.
 * --canonical starts from STREAM's own constants (a = 1, b = 2, c = 0): every page of an array
 * then holds one value repeated, which zram stores as a single word (compressing swap's best
 * case), and a page swapped with another of the same array goes unnoticed.
 *
 * Stdout, one line:
 *   stream mib=300 iters=N seconds=S MBps=X valid=1 init_seconds=I check_seconds=C errors=E
 * seconds covers the N iterations only (CLOCK_MONOTONIC; fills and the check are timed apart),
 * MBps counts bytes as STREAM does (copy and scale move 2 arrays, add and triad 3).
 * Exit status: 0 valid, 1 invalid, 2 usage error, 3 allocation failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "memwork.h"

#define PROG "stream"

static const double q = 3.0;
static int canonical;

/* A double in [1, 2) with a random 52-bit mantissa. */
static double start_value(uint64_t salt, size_t i) {
    if (canonical)
        return salt == 1 ? 1.0 : salt == 2 ? 2.0 : 0.0;
    return 1.0 + (double)(memwork_mix64(salt ^ (i * 0x9e3779b97f4a7c15ULL)) >> 12) * 0x1p-52;
}

static void usage(void) {
    fprintf(stderr, "usage: " PROG " MIB [--iters N] [--triad-only] [--canonical] [--nohuge]\n"
                    "  three double arrays of MIB/3 MiB each; N iterations (default 4) of "
                    "copy, scale, add, triad\n");
    exit(2);
}

static long parse_int(const char *s, const char *what, long lo, long hi) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, PROG ": %s must be an integer in %ld..%ld, not '%s'\n", what, lo, hi, s);
        exit(2);
    }
    return v;
}

static int close_enough(double got, double want) {
    return fabs(got - want) <= 1e-13 * fabs(want);
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"iters", required_argument, 0, 'i'},
        {"triad-only", no_argument, 0, 't'},
        {"nohuge", no_argument, 0, 'n'},
        {"canonical", no_argument, 0, 'c'},
        {0, 0, 0, 0},
    };
    long iters = 4;
    int triad_only = 0, nohuge = 0, c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'i': iters = parse_int(optarg, "--iters", 1, 100000); break;
        case 't': triad_only = 1; break;
        case 'n': nohuge = 1; break;
        case 'c': canonical = 1; break;
        default: usage();
        }
    }
    if (optind != argc - 1)
        usage();
    long mib = parse_int(argv[optind], "MIB", 3, 1 << 20);
    size_t n = ((size_t)mib << 20) / 3 / sizeof(double);
    size_t bytes = 3 * n * sizeof(double);
    double *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        fprintf(stderr, PROG ": cannot allocate %ld MiB: %s\n", mib, strerror(errno));
        return 3;
    }
    if (nohuge && madvise(mem, bytes, MADV_NOHUGEPAGE) != 0)
        fprintf(stderr, PROG ": madvise(MADV_NOHUGEPAGE): %s (going on)\n", strerror(errno));
    double *a = mem, *b = mem + n, *cc = mem + 2 * n;

    double t0 = memwork_now();
    for (size_t i = 0; i < n; i++) {
        a[i] = start_value(1, i);
        b[i] = start_value(2, i);
        cc[i] = start_value(3, i);
    }
    double t1 = memwork_now();
    for (long k = 0; k < iters; k++) {
        if (!triad_only) {
            for (size_t i = 0; i < n; i++)
                cc[i] = a[i];
            for (size_t i = 0; i < n; i++)
                b[i] = q * cc[i];
            for (size_t i = 0; i < n; i++)
                cc[i] = a[i] + b[i];
        }
        for (size_t i = 0; i < n; i++)
            a[i] = b[i] + q * cc[i];
    }
    double t2 = memwork_now();

    /* Replays each element's recurrence from its start value (the same operations in the same
     * order, so normally bit for bit the same). */
    size_t errors = 0, first_bad = 0;
    for (size_t i = 0; i < n; i++) {
        double ea = start_value(1, i), eb = start_value(2, i), ec = start_value(3, i);
        for (long k = 0; k < iters; k++) {
            if (!triad_only) {
                ec = ea;
                eb = q * ec;
                ec = ea + eb;
            }
            ea = eb + q * ec;
        }
        if (!close_enough(a[i], ea) || !close_enough(b[i], eb) || !close_enough(cc[i], ec)) {
            if (!errors)
                first_bad = i;
            errors++;
        }
    }
    double t3 = memwork_now();
    if (errors)
        fprintf(stderr,
                PROG ": %zu elements wrong, the first at index %zu (array byte offset %zu, "
                     "page %zu of each array)\n",
                errors, first_bad, first_bad * sizeof(double), first_bad * sizeof(double) / 4096);

    double moved = (double)iters * (double)n * sizeof(double) * (triad_only ? 3.0 : 10.0);
    double secs = t2 - t1;
    printf(PROG " mib=%ld iters=%ld seconds=%.6f MBps=%.1f valid=%d init_seconds=%.6f "
                "check_seconds=%.6f errors=%zu\n",
           mib, iters, secs, secs > 0 ? moved / secs / 1e6 : 0.0, errors == 0, t1 - t0, t3 - t2,
           errors);
    return errors ? 1 : 0;
}
