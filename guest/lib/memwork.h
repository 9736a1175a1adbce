/* Small helpers shared by the memory workloads of SwapBypass (guest/progs: swap-check,
 * stream, gups, memperf). Header-only: the programs are single files built with -I guest/lib. */
#ifndef VMSIGHT_MEMWORK_H
#define VMSIGHT_MEMWORK_H

#include <stdint.h>
#include <time.h>

/* Monotonic seconds. */
static inline double memwork_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* splitmix64's finalizer: a bijective 64-bit mix, good enough that two different inputs never
 * give the same word in practice. */
static inline uint64_t memwork_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

#endif
