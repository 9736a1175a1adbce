/* swap-check: an integrity checker for swap (SwapBypass, docs/symbiotic.md): every page that
 * goes out to swap and comes back must come back with exactly the contents it left with.
 *
 *   swap-check MIB [--rounds N] [--seed S] [--touch-frac F] [--pause-file PATH] [--hold]
 *                  [--nohuge]
 *
 * Maps MIB MiB of anonymous memory and fills it page by page: every 8-byte word of page i in
 * version v is a hash of (seed, i, v, word index), so a page that comes back misplaced (another
 * page's data), stale (an older version of itself) or zeroed fails the check in every word, and
 * the data does not compress (zram and any compressing cache see it as real data). Then N
 * rounds (default 3): each visits the pages in a new random order (all of them, or the first
 * F of the permutation with --touch-frac F, 0 < F <= 1), verifies each visited page against
 * its current version and rewrites about half of them with the next version (one byte of
 * version per page is all the state kept outside the mapping, so almost all memory is the
 * checked data). A final pass verifies every page in address order.
 *
 * Stdout, line-buffered:
 *   swap-check: pages=N seed=S rounds=R touch_frac=F
 *   swap-check: round R verified P pages            (after each round)
 *   swap-check OK pages=N verified=M rewritten=K    (M and K count every page visit, fill
 *                                                    excluded, final pass included)
 * or, at the first bad page, instead of the OK line:
 *   swap-check BAD page=I expected_version=V word=W got=0x... want=0x...
 * plus, on stderr, what the bad page holds instead (zeros, an older or newer version of the
 * same page, another page's data, or something else; and how many of its words are wrong).
 *
 * --pause-file PATH: after the fill and after every round (so also before the final pass), if
 * PATH exists, print "swap-check: paused" once and wait (polling every 100 ms) until it is
 * removed, then print "swap-check: resumed". A test creates PATH before starting swap-check to
 * change the swap configuration (e.g. resize the host's swap cache) while all data is written.
 * --hold: after the result line, wait for a line on stdin (or EOF) before exiting, so the
 * memory stays allocated for inspection. --nohuge: madvise(MADV_NOHUGEPAGE), so the kernel
 * swaps 4 KiB pages one by one instead of whole transparent huge pages.
 * --self-test-corrupt[=KIND] (for tests): damage page pages/2 after the fill, which must be
 * reported as BAD: KIND bit (the default) flips one bit of word 7, zero zeroes the page, stale
 * leaves the page's version 0 data where version 1 is expected, swap exchanges it with the
 * next page (misplaced data; needs MIB*256 >= 2 pages).
 *
 * Exit status: 0 all pages intact, 1 corruption found, 2 usage error, 3 allocation failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>

#include "memwork.h"
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PROG "swap-check"

/* splitmix64's finalizer: a bijective 64-bit mix, good enough that two different inputs never
 * give the same word in practice. */
/* The per-(page, version) key; word w of that page is word_of(key, w). */
static uint64_t page_key(uint64_t seed, uint64_t page, unsigned version) {
    return memwork_mix64(seed ^ memwork_mix64((page << 16) ^ version ^ 0x5357415043484b31ULL));
}

static inline uint64_t word_of(uint64_t key, uint64_t w) {
    return memwork_mix64(key + (w + 1) * 0x9e3779b97f4a7c15ULL);
}

static uint64_t rng_state;

static uint64_t rng_next(void) {
    rng_state += 0x9e3779b97f4a7c15ULL;
    return memwork_mix64(rng_state);
}

/* Uniform in [0, n) (n small against 2^64: the modulo bias is negligible here). */
static uint64_t rng_below(uint64_t n) { return rng_next() % n; }

static uint64_t *mem;
static uint8_t *version;
static size_t npages, words_per_page;
static uint64_t seed = 1;
static long long verified, rewritten;
static unsigned max_version;

static void fill_page(size_t i) {
    uint64_t *p = mem + i * words_per_page;
    uint64_t key = page_key(seed, i, version[i]);
    for (size_t w = 0; w < words_per_page; w++)
        p[w] = word_of(key, w);
}

/* What the bad page holds instead, on stderr (best effort: it looks at the bad word only, and
 * at versions up to the highest one written). */
static void diagnose(size_t i, size_t bad_w) {
    const uint64_t *p = mem + i * words_per_page;
    uint64_t key = page_key(seed, i, version[i]);
    size_t wrong = 0, zero = 0;
    for (size_t w = 0; w < words_per_page; w++) {
        wrong += p[w] != word_of(key, w);
        zero += p[w] == 0;
    }
    fprintf(stderr, PROG ": diagnosis: page %zu has %zu of %zu words wrong, %zu zero words\n", i,
            wrong, words_per_page, zero);
    uint64_t got = p[bad_w];
    if (got == 0) {
        fprintf(stderr, PROG ": diagnosis: word %zu is zero (a page that came back zeroed?)\n",
                bad_w);
        return;
    }
    for (unsigned v = 0; v <= max_version; v++)
        if (word_of(page_key(seed, i, v), bad_w) == got) {
            fprintf(stderr, PROG ": diagnosis: word %zu holds version %u of the same page (%s)\n",
                    bad_w, v, v < version[i] ? "stale" : "newer than expected");
            return;
        }
    for (size_t j = 0; j < npages; j++)
        for (unsigned v = 0; v <= max_version; v++)
            if (j != i && word_of(page_key(seed, j, v), bad_w) == got) {
                fprintf(stderr,
                        PROG ": diagnosis: word %zu holds page %zu's data (version %u; that "
                             "page's current version is %u): misplaced\n",
                        bad_w, j, v, version[j]);
                return;
            }
    fprintf(stderr, PROG ": diagnosis: word %zu matches no page and version (foreign data)\n",
            bad_w);
}

/* Verifies page i; on a bad word prints the BAD line and returns 0. */
static int check_page(size_t i) {
    const uint64_t *p = mem + i * words_per_page;
    uint64_t key = page_key(seed, i, version[i]);
    for (size_t w = 0; w < words_per_page; w++) {
        uint64_t want = word_of(key, w);
        if (p[w] != want) {
            printf(PROG " BAD page=%zu expected_version=%u word=%zu got=0x%016" PRIx64
                        " want=0x%016" PRIx64 "\n",
                   i, version[i], w, p[w], want);
            fflush(stdout);
            diagnose(i, w);
            return 0;
        }
    }
    verified++;
    return 1;
}

static void maybe_pause(const char *path) {
    if (!path || access(path, F_OK) != 0)
        return;
    printf(PROG ": paused\n");
    while (access(path, F_OK) == 0)
        usleep(100 * 1000);
    printf(PROG ": resumed\n");
}

static void hold(void) {
    char line[64];
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) {
        /* EOF: exit all the same */
    }
}

static void usage(void) {
    fprintf(stderr, "usage: " PROG " MIB [--rounds N] [--seed S] [--touch-frac F] "
                    "[--pause-file PATH] [--hold] [--nohuge]\n");
    exit(2);
}

static long long parse_int(const char *s, const char *what, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 0);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, PROG ": %s must be an integer in %lld..%lld, not '%s'\n", what, lo, hi, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"rounds", required_argument, 0, 'r'},     {"seed", required_argument, 0, 's'},
        {"touch-frac", required_argument, 0, 'f'}, {"pause-file", required_argument, 0, 'p'},
        {"hold", no_argument, 0, 'h'},             {"nohuge", no_argument, 0, 'n'},
        {"self-test-corrupt", optional_argument, 0, 'c'}, {0, 0, 0, 0},
    };
    long rounds = 3;
    double frac = 1.0;
    const char *pause_file = NULL;
    const char *corrupt = NULL;
    int do_hold = 0, nohuge = 0, c;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'r': rounds = (long)parse_int(optarg, "--rounds", 0, 200); break;
        case 's': seed = (uint64_t)parse_int(optarg, "--seed", 0, INT64_MAX); break;
        case 'f': {
            char *end;
            frac = strtod(optarg, &end);
            if (end == optarg || *end || !(frac > 0.0 && frac <= 1.0)) {
                fprintf(stderr, PROG ": --touch-frac must be in (0, 1], not '%s'\n", optarg);
                exit(2);
            }
            break;
        }
        case 'p': pause_file = optarg; break;
        case 'h': do_hold = 1; break;
        case 'n': nohuge = 1; break;
        case 'c':
            corrupt = optarg ? optarg : "bit";
            if (strcmp(corrupt, "bit") && strcmp(corrupt, "zero") && strcmp(corrupt, "stale") &&
                strcmp(corrupt, "swap")) {
                fprintf(stderr, PROG ": --self-test-corrupt takes bit, zero, stale or swap\n");
                exit(2);
            }
            break;
        default: usage();
        }
    }
    if (optind != argc - 1)
        usage();
    long long mib = parse_int(argv[optind], "MIB", 1, 1 << 20);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t bytes = (size_t)mib << 20;
    words_per_page = page / sizeof(uint64_t);
    npages = bytes / page;
    /* A page gains at most one version per round: with --rounds <= 200 a byte never wraps. */
    max_version = (unsigned)rounds;

    mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    version = calloc(npages, 1);
    uint32_t *perm = malloc(npages * sizeof *perm);
    if (mem == MAP_FAILED || !version || !perm) {
        fprintf(stderr, PROG ": cannot allocate %lld MiB: %s\n", mib, strerror(errno));
        return 3;
    }
    if (nohuge && madvise(mem, bytes, MADV_NOHUGEPAGE) != 0)
        fprintf(stderr, PROG ": madvise(MADV_NOHUGEPAGE): %s (going on)\n", strerror(errno));
    rng_state = seed ^ 0x726e6721ULL;
    printf(PROG ": pages=%zu seed=%" PRIu64 " rounds=%ld touch_frac=%g\n", npages, seed, rounds,
           frac);

    for (size_t i = 0; i < npages; i++)
        fill_page(i);
    if (corrupt) {
        size_t i = npages / 2;
        uint64_t *p = mem + i * words_per_page;
        if (!strcmp(corrupt, "bit")) {
            p[7] ^= 1;
        } else if (!strcmp(corrupt, "zero")) {
            memset(p, 0, page);
        } else if (!strcmp(corrupt, "stale")) {
            version[i] = 1;
            if (max_version < 1)
                max_version = 1;
        } else if (i + 1 < npages) {
            for (size_t w = 0; w < words_per_page; w++) {
                uint64_t t = p[w];
                p[w] = p[w + words_per_page];
                p[w + words_per_page] = t;
            }
        }
    }

    int ok = 1;
    size_t visit = (size_t)(frac * (double)npages + 0.5);
    if (visit < 1)
        visit = 1;
    if (visit > npages)
        visit = npages;
    for (size_t i = 0; i < npages; i++)
        perm[i] = (uint32_t)i;
    for (long r = 1; ok && r <= rounds; r++) {
        maybe_pause(pause_file);
        /* Fisher-Yates, only as far as the pages visited. */
        for (size_t k = 0; k < visit; k++) {
            size_t j = k + (size_t)rng_below(npages - k);
            uint32_t t = perm[k];
            perm[k] = perm[j];
            perm[j] = t;
        }
        long long before = verified;
        for (size_t k = 0; k < visit; k++) {
            size_t i = perm[k];
            if (!check_page(i)) {
                ok = 0;
                break;
            }
            if (rng_next() & 1) {
                version[i]++;
                fill_page(i);
                rewritten++;
            }
        }
        if (ok)
            printf(PROG ": round %ld verified %lld pages\n", r, verified - before);
    }
    if (ok) {
        maybe_pause(pause_file);
        for (size_t i = 0; ok && i < npages; i++)
            ok = check_page(i);
    }
    if (ok)
        printf(PROG " OK pages=%zu verified=%lld rewritten=%lld\n", npages, verified, rewritten);
    if (do_hold)
        hold();
    return ok ? 0 : 1;
}
