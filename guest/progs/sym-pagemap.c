/*
 * sym-pagemap PID VADDR: one page's entry of /proc/PID/pagemap, the oracle of the page_info
 * symcall (docs/symbiotic.md). Prints
 *   present=0|1 swapped=0|1 pfn=N swap_type=N swap_offset=N
 * Bits (Documentation/admin-guide/mm/pagemap.rst): 63 present, 62 swapped, 0-54 the PFN when
 * present (0 unless root), 0-4 the swap type and 5-54 the swap offset when swapped.
 * PID may be "self". VADDR is decimal or 0x-hex.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    char path[64], *end;
    uint64_t vaddr, e;
    long page = sysconf(_SC_PAGESIZE);
    int fd;

    if (argc != 3) {
        fprintf(stderr, "usage: sym-pagemap PID VADDR\n");
        return 2;
    }
    errno = 0;
    vaddr = strtoull(argv[2], &end, 0);
    if (errno || *end || end == argv[2]) {
        fprintf(stderr, "sym-pagemap: bad address '%s'\n", argv[2]);
        return 2;
    }
    snprintf(path, sizeof(path), "/proc/%s/pagemap", argv[1]);
    fd = open(path, O_RDONLY);
    if (fd < 0) {
        fprintf(stderr, "sym-pagemap: %s: %s\n", path, strerror(errno));
        return 1;
    }
    if (pread(fd, &e, sizeof(e), (off_t)(vaddr / (uint64_t)page) * sizeof(e)) != sizeof(e)) {
        fprintf(stderr, "sym-pagemap: reading %s at 0x%" PRIx64 ": %s\n", path, vaddr,
                strerror(errno));
        return 1;
    }
    close(fd);
    {
        int present = (int)(e >> 63 & 1), swapped = (int)(e >> 62 & 1);
        uint64_t low = e & ((1ULL << 55) - 1);

        printf("present=%d swapped=%d pfn=%" PRIu64 " swap_type=%" PRIu64 " swap_offset=%" PRIu64
               "\n",
               present, swapped, present ? low : 0, swapped ? (low & 0x1f) : 0,
               swapped ? (low >> 5) : 0);
    }
    return 0;
}
