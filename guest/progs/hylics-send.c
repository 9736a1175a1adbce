// build: dynamic -lhylics
/* hylics-send DEST PATH [OFFSET [LEN]]: asks vmsight to send the share's file PATH (under
 * /hylics, or relative to the share) to the TCP server DEST ("IP:PORT") from the host, through
 * libhylics (hylics.h). Prints the bytes sent. Exit status 0 on success, 1 when the service
 * refused or failed (its sentence on stderr), 2 on a usage error. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <hylics.h>

static int number(const char *s, unsigned long long *out)
{
    char *end;
    errno = 0;
    *out = strtoull(s, &end, 10);
    return errno || *end || !*s || *s == '-';
}

int main(int argc, char **argv)
{
    unsigned long long offset = 0, len = 0;
    long long sent;
    if (argc < 3 || argc > 5 || (argc > 3 && number(argv[3], &offset)) ||
        (argc > 4 && number(argv[4], &len))) {
        fprintf(stderr, "usage: hylics-send DEST PATH [OFFSET [LEN]]\n");
        return 2;
    }
    sent = hylics_send_file(argv[1], argv[2], offset, len);
    if (sent < 0) {
        const char *why = hylics_last_error();
        fprintf(stderr, "hylics-send: %s\n", *why ? why : strerror(errno));
        return 1;
    }
    printf("%lld\n", sent);
    return 0;
}
