/* memperf: a memory access sweep over working sets up to bigger than the guest's memory, the
 * shape of ECT memperf (Stricker and Gross) as the SwapBypass evaluation ran it (SymCall paper
 * §7.2): time per access against working-set size and stride.
 *
 *   memperf MIB [--ws LIST] [--stride LIST] [--passes N] [--canonical] [--nohuge]
 *
 * Maps MIB MiB of anonymous memory and writes all of it once (every word a hash of its index:
 * data that does not compress, so compressing swap sees real data; with --canonical every word
 * its index, which compresses well, as gups --canonical). Then for every working
 * set W in LIST (MiB, default 16,64,128,192,256; values above MIB become MIB, repeats are
 * dropped) and every stride in the stride LIST (default 8,4096,rand), it makes N passes
 * (default 2) over the first W MiB, incrementing one 64-bit word (a read and a write) per step:
 * a stride in bytes (a multiple of 8: 8 is sequential, 4096 one word per page), or "rand": one
 * word per page, the pages in a random order (a new permutation per working set, drawn before
 * the clock starts; the same for its passes). At the end every word is checked against its
 * start value plus the increments it must have received, so a page that came back from swap
 * wrong, stale or zeroed makes valid=0 (the first bad word is named on stderr).
 *
 * Stdout:
 *   memperf ws_mib=W stride=S passes=N seconds=T ns_per_access=X     (one per pair)
 *   memperf total_seconds=T valid=1 init_seconds=I check_seconds=C  (T: the sum of the pairs)
 * Exit status: 0 valid, 1 invalid, 2 usage error, 3 allocation failure. */
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
#include <unistd.h>

#define PROG "memperf"
#define MAX_LIST 32
#define RAND_STRIDE 0 /* a stride of 0 bytes stands for "rand" */

static int canonical;

static uint64_t start_word(uint64_t i) {
    return canonical ? i : memwork_mix64(i * 0x9e3779b97f4a7c15ULL + 0x4d454d50ULL);
}

static void usage(void) {
    fprintf(stderr, "usage: " PROG " MIB [--ws LIST] [--stride LIST] [--passes N] [--canonical] "
                    "[--nohuge]\n"
                    "  LIST: comma-separated; working sets in MiB (default 16,64,128,192,256, "
                    "capped at MIB),\n  strides in bytes, multiples of 8, or rand (default "
                    "8,4096,rand)\n");
    exit(2);
}

static long parse_long(const char *s, size_t len, const char *what, long lo, long hi) {
    char buf[32], *end;
    if (len == 0 || len >= sizeof buf)
        goto bad;
    memcpy(buf, s, len);
    buf[len] = 0;
    errno = 0;
    long v = strtol(buf, &end, 10);
    if (errno || *end || v < lo || v > hi)
        goto bad;
    return v;
bad:
    fprintf(stderr, PROG ": %s must be an integer in %ld..%ld, not '%.*s'\n", what, lo, hi,
            (int)len, s);
    exit(2);
}

/* Splits a comma-separated list; "rand" (when allowed) becomes RAND_STRIDE. */
static int parse_list(const char *s, long *out, const char *what, long lo, long hi, int rand_ok) {
    int n = 0;
    for (;;) {
        size_t len = strcspn(s, ",");
        if (n == MAX_LIST) {
            fprintf(stderr, PROG ": %s: at most %d values\n", what, MAX_LIST);
            exit(2);
        }
        if (rand_ok && len == 4 && !strncmp(s, "rand", 4))
            out[n++] = RAND_STRIDE;
        else
            out[n++] = parse_long(s, len, what, lo, hi);
        if (!s[len])
            return n;
        s += len + 1;
    }
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"ws", required_argument, 0, 'w'},     {"stride", required_argument, 0, 's'},
        {"passes", required_argument, 0, 'p'}, {"nohuge", no_argument, 0, 'n'},
        {"canonical", no_argument, 0, 'c'},    {0, 0, 0, 0},
    };
    long ws_list[MAX_LIST] = {16, 64, 128, 192, 256}, strides[MAX_LIST] = {8, 4096, RAND_STRIDE};
    int nws = 5, nstrides = 3, nohuge = 0, c;
    long passes = 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'w': nws = parse_list(optarg, ws_list, "--ws", 1, 1 << 20, 0); break;
        case 's': nstrides = parse_list(optarg, strides, "--stride", 8, 1 << 30, 1); break;
        case 'p': passes = parse_long(optarg, strlen(optarg), "--passes", 1, 1000000); break;
        case 'n': nohuge = 1; break;
        case 'c': canonical = 1; break;
        default: usage();
        }
    }
    if (optind != argc - 1)
        usage();
    long mib = parse_long(argv[optind], strlen(argv[optind]), "MIB", 1, 1 << 20);
    for (int i = 0; i < nstrides; i++)
        if (strides[i] % 8) {
            fprintf(stderr, PROG ": a stride must be a multiple of 8 bytes, not %ld\n",
                    strides[i]);
            exit(2);
        }
    /* Cap the working sets at MIB and drop repeats (16,64,...,256 with MIB 100: 16,64,100). */
    int m = 0;
    for (int i = 0; i < nws; i++) {
        long w = ws_list[i] < mib ? ws_list[i] : mib;
        int dup = 0;
        for (int j = 0; j < m; j++)
            dup |= ws_list[j] == w;
        if (!dup)
            ws_list[m++] = w;
    }
    nws = m;

    size_t page = (size_t)sysconf(_SC_PAGESIZE), wpp = page / sizeof(uint64_t);
    size_t bytes = (size_t)mib << 20, words = bytes / sizeof(uint64_t), pages = bytes / page;
    uint64_t *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint32_t *perm = malloc(pages * sizeof *perm);
    uint64_t *inc = malloc(wpp * sizeof *inc);
    if (mem == MAP_FAILED || !perm || !inc) {
        fprintf(stderr, PROG ": cannot allocate %ld MiB: %s\n", mib, strerror(errno));
        return 3;
    }
    if (nohuge && madvise(mem, bytes, MADV_NOHUGEPAGE) != 0)
        fprintf(stderr, PROG ": madvise(MADV_NOHUGEPAGE): %s (going on)\n", strerror(errno));

    double t0 = memwork_now();
    for (size_t i = 0; i < words; i++)
        mem[i] = start_word(i);
    double init = memwork_now() - t0, total = 0;
    uint64_t rng = 0x6d656d70ULL;

    for (int a = 0; a < nws; a++) {
        size_t ws_pages = ((size_t)ws_list[a] << 20) / page, ws_words = ws_pages * wpp;
        for (int b = 0; b < nstrides; b++) {
            size_t accesses;
            double t1, t2;
            if (strides[b] == RAND_STRIDE) {
                for (size_t i = 0; i < ws_pages; i++)
                    perm[i] = (uint32_t)i;
                for (size_t i = ws_pages - 1; i > 0; i--) {
                    rng += 0x9e3779b97f4a7c15ULL;
                    size_t j = (size_t)(memwork_mix64(rng) % (i + 1));
                    uint32_t t = perm[i];
                    perm[i] = perm[j];
                    perm[j] = t;
                }
                accesses = ws_pages;
                t1 = memwork_now();
                for (long p = 0; p < passes; p++)
                    for (size_t i = 0; i < ws_pages; i++) {
                        size_t pg = perm[i];
                        mem[pg * wpp + ((pg * 67) & (wpp - 1))]++;
                    }
                t2 = memwork_now();
            } else {
                size_t step = (size_t)strides[b] / sizeof(uint64_t);
                accesses = (ws_words + step - 1) / step;
                t1 = memwork_now();
                for (long p = 0; p < passes; p++)
                    for (size_t w = 0; w < ws_words; w += step)
                        mem[w]++;
                t2 = memwork_now();
            }
            total += t2 - t1;
            char sname[24];
            if (strides[b] == RAND_STRIDE)
                snprintf(sname, sizeof sname, "rand");
            else
                snprintf(sname, sizeof sname, "%ld", strides[b]);
            printf(PROG " ws_mib=%ld stride=%s passes=%ld seconds=%.6f ns_per_access=%.2f\n",
                   ws_list[a], sname, passes, t2 - t1,
                   (t2 - t1) * 1e9 / ((double)accesses * (double)passes));
        }
    }

    /* Every word must be its start value plus one per access it received: page by page, the
     * increments each (working set, stride) pair gave the page's words. */
    double t3 = memwork_now();
    int valid = 1;
    for (size_t pg = 0; valid && pg < pages; pg++) {
        size_t base = pg * wpp;
        memset(inc, 0, wpp * sizeof *inc);
        for (int a = 0; a < nws; a++) {
            if (pg >= ((size_t)ws_list[a] << 20) / page)
                continue;
            for (int b = 0; b < nstrides; b++) {
                if (strides[b] == RAND_STRIDE) {
                    inc[(pg * 67) & (wpp - 1)] += (uint64_t)passes;
                } else {
                    size_t step = (size_t)strides[b] / sizeof(uint64_t);
                    for (size_t w = (base + step - 1) / step * step; w < base + wpp; w += step)
                        inc[w - base] += (uint64_t)passes;
                }
            }
        }
        for (size_t w = 0; w < wpp; w++)
            if (mem[base + w] != start_word(base + w) + inc[w]) {
                fprintf(stderr,
                        PROG ": page %zu word %zu is 0x%016llx, want 0x%016llx (start value "
                             "+ %llu)\n",
                        pg, w, (unsigned long long)mem[base + w],
                        (unsigned long long)(start_word(base + w) + inc[w]),
                        (unsigned long long)inc[w]);
                valid = 0;
                break;
            }
    }
    printf(PROG " total_seconds=%.6f valid=%d init_seconds=%.6f check_seconds=%.6f\n", total,
           valid, init, memwork_now() - t3);
    return valid ? 0 : 1;
}
