// build: dynamic -lhylics
/* hylics-evict DEST_DIR: moves the files vmsight's Hylics controller advises out of the share
 * (/hylics, or $HYLICS_ROOT) into DEST_DIR under the same relative paths, through libhylics
 * (hylics_evict in hylics.h), and prints `moved N files (B bytes)`. Exit status 0 on success,
 * 1 when the service refused or a move failed (the sentence on stderr), 2 on a usage error. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <hylics.h>

int main(int argc, char **argv)
{
    unsigned long long bytes = 0;
    long moved;
    if (argc != 2 || !*argv[1] || argv[1][0] == '-') {
        fprintf(stderr, "usage: hylics-evict DEST_DIR\n");
        return 2;
    }
    moved = hylics_evict(argv[1], &bytes);
    if (moved < 0) {
        const char *why = hylics_last_error();
        fprintf(stderr, "hylics-evict: %s\n", *why ? why : strerror(errno));
        if (bytes)
            fprintf(stderr, "hylics-evict: %llu bytes were moved before\n", bytes);
        return 1;
    }
    printf("moved %ld files (%llu bytes)\n", moved, bytes);
    return 0;
}
