/* gups: HPCC RandomAccess (GUPS) over a table bigger than the guest's memory, the shape of the
 * SwapBypass evaluation's GUPS run (SymCall paper §7.2).
 *
 *   gups MIB [--updates-per-word K] [--canonical] [--nohuge]
 *
 * The table is the largest power of two of 64-bit words that fits in MIB MiB (one anonymous
 * mapping). The updates are HPCC's: the LCG stream ran = (ran << 1) ^ (ran < 0 ? POLY : 0)
 * with POLY 7, table[ran & (words - 1)] ^= ran, split into 128 interleaved streams started with
 * HPCC_starts (as HPCC's single-CPU core does, so that updates are independent of each
 * other). The total is K * table words rounded down to a multiple of 128. HPCC's own K is 4;
 * here the default is 1/16 (2M updates for 256 MiB: 32 per page on average, so every page is
 * touched many times), because under TCG with the table partly swapped out every update that
 * misses costs a page fault and a swap-in, and K = 4 would take hours.
 * Unlike HPCC (table[i] = i), word i starts as a hash of i: a table of small integers
 * compresses well, which would flatter compressing swap (zram); --canonical starts as HPCC.
 * Verification as HPCC's: the same updates again (from one stream; XOR undoes them in any
 * order), then every word must be back at its start value. HPCC accepts up to 1% wrong words
 * (its parallel versions race); this one is single-threaded, so any error is corrupted memory
 * and is reported on stderr too.
 *
 * Stdout, one line:
 *   gups mib=256 updates=U seconds=S gups=G errors=E init_seconds=I check_seconds=C table_mib=T
 * seconds covers the timed updates only (CLOCK_MONOTONIC); G = U / seconds / 1e9.
 * Exit status: 0 passed (errors <= 1% of the table, HPCC's rule), 1 failed, 2 usage error,
 * 3 allocation failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "memwork.h"

#define PROG "gups"
#define POLY 0x0000000000000007ULL
#define PERIOD 1317624576693539401LL
#define STREAMS 128

static inline uint64_t step(uint64_t ran) {
    return (ran << 1) ^ ((int64_t)ran < 0 ? POLY : 0);
}

/* HPCC_starts: the n-th element of the stream, by squaring (HPCC's RandomAccess/utility.c). */
static uint64_t hpcc_starts(int64_t n) {
    uint64_t m2[64], temp, ran;
    int i;
    while (n < 0)
        n += PERIOD;
    while (n > PERIOD)
        n -= PERIOD;
    if (n == 0)
        return 0x1;
    temp = 0x1;
    for (i = 0; i < 64; i++) {
        m2[i] = temp;
        temp = step(step(temp));
    }
    for (i = 62; i >= 0; i--)
        if ((n >> i) & 1)
            break;
    ran = 0x2;
    while (i > 0) {
        temp = 0;
        for (int j = 0; j < 64; j++)
            if ((ran >> j) & 1)
                temp ^= m2[j];
        ran = temp;
        i -= 1;
        if ((n >> i) & 1)
            ran = step(ran);
    }
    return ran;
}

static int canonical;

static uint64_t start_word(uint64_t i) {
    if (canonical)
        return i;
    return memwork_mix64(i * 0x9e3779b97f4a7c15ULL + 0x47555053ULL);
}

static void usage(void) {
    fprintf(stderr,
            "usage: " PROG " MIB [--updates-per-word K] [--canonical] [--nohuge]\n"
            "  table: the largest power of two of 64-bit words in MIB MiB; updates: K * words "
            "(default K = 0.0625; HPCC's is 4)\n");
    exit(2);
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"updates-per-word", required_argument, 0, 'k'},
        {"nohuge", no_argument, 0, 'n'},
        {"canonical", no_argument, 0, 'c'},
        {0, 0, 0, 0},
    };
    double k = 1.0 / 16;
    int nohuge = 0, c;
    char *end;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'k':
            k = strtod(optarg, &end);
            if (end == optarg || *end || !(k > 0 && k <= 1024)) {
                fprintf(stderr, PROG ": --updates-per-word must be in (0, 1024], not '%s'\n",
                        optarg);
                exit(2);
            }
            break;
        case 'n': nohuge = 1; break;
        case 'c': canonical = 1; break;
        default: usage();
        }
    }
    if (optind != argc - 1)
        usage();
    errno = 0;
    long mib = strtol(argv[optind], &end, 10);
    if (errno || end == argv[optind] || *end || mib < 1 || mib > (1 << 20)) {
        fprintf(stderr, PROG ": MIB must be an integer in 1..1048576, not '%s'\n", argv[optind]);
        exit(2);
    }
    uint64_t words = 1;
    while (words * 2 * sizeof(uint64_t) <= ((uint64_t)mib << 20))
        words *= 2;
    uint64_t updates = (uint64_t)(k * (double)words) / STREAMS * STREAMS;
    if (updates < STREAMS)
        updates = STREAMS;
    size_t bytes = words * sizeof(uint64_t);
    uint64_t *table =
        mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (table == MAP_FAILED) {
        fprintf(stderr, PROG ": cannot allocate %zu bytes: %s\n", bytes, strerror(errno));
        return 3;
    }
    if (nohuge && madvise(table, bytes, MADV_NOHUGEPAGE) != 0)
        fprintf(stderr, PROG ": madvise(MADV_NOHUGEPAGE): %s (going on)\n", strerror(errno));
    uint64_t mask = words - 1;

    double t0 = memwork_now();
    for (uint64_t i = 0; i < words; i++)
        table[i] = start_word(i);
    double t1 = memwork_now();
    uint64_t ran[STREAMS];
    for (int j = 0; j < STREAMS; j++)
        ran[j] = hpcc_starts((int64_t)(updates / STREAMS * (uint64_t)j));
    for (uint64_t i = 0; i < updates / STREAMS; i++)
        for (int j = 0; j < STREAMS; j++) {
            ran[j] = step(ran[j]);
            table[ran[j] & mask] ^= ran[j];
        }
    double t2 = memwork_now();

    uint64_t temp = 0x1, errors = 0;
    for (uint64_t i = 0; i < updates; i++) {
        temp = step(temp);
        table[temp & mask] ^= temp;
    }
    for (uint64_t i = 0; i < words; i++)
        errors += table[i] != start_word(i);
    double t3 = memwork_now();

    if (errors)
        fprintf(stderr, PROG ": %llu of %llu words wrong after undoing the updates (corrupted "
                             "memory: this run is single-threaded)\n",
                (unsigned long long)errors, (unsigned long long)words);
    double secs = t2 - t1;
    printf(PROG " mib=%ld updates=%llu seconds=%.6f gups=%.6f errors=%llu init_seconds=%.6f "
                "check_seconds=%.6f table_mib=%zu\n",
           mib, (unsigned long long)updates, secs,
           secs > 0 ? (double)updates / secs / 1e9 : 0.0, (unsigned long long)errors, t1 - t0,
           t3 - t2, bytes >> 20);
    return errors * 100 <= words ? 0 : 1;
}
