/* vmsight-background [--off] [--] CMD [ARGS...]: runs CMD as a background process for vmsight's
 * FoxyIdle (idle-time disk scheduling): declares this process background, then execvp's CMD,
 * which keeps the process (same TGID) and so the declaration. vmsight holds back the disk reads
 * of CMD and of everything it starts while foreground processes use the disk. With --off the
 * process is declared foreground again instead (e.g. for a command started by a background
 * shell). Without vmsight it just runs CMD.
 *
 * The declaration is the prctl of vmsight_set_background() (see vmsight.h), issued here directly:
 * helper programs are built static, without libvmsight; only the header's constants are used.
 * Works for programs LD_PRELOAD cannot reach (static or set-user/group-ID, e.g. locate).
 * Exit status: CMD's, 127 if CMD cannot be executed, 2 on a usage error. Built with gcc -O2
 * -static by guest/build-image.sh into /usr/local/bin of the guest. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vmsight.h>

static void declare(int on)
{
    /* prctl(VMSIGHT_PRCTL_OPTION, VMSIGHT_PRCTL_BACKGROUND, on, 0, 0): every argument a full
     * register (syscall(2) is variadic). The guest kernel answers EINVAL and does nothing; only
     * vmsight, watching the prctl entry from outside, acts on it. */
    (void)syscall(SYS_prctl, (unsigned long)VMSIGHT_PRCTL_OPTION,
                  (unsigned long)VMSIGHT_PRCTL_BACKGROUND, on ? 1UL : 0UL, 0UL, 0UL);
}

int main(int argc, char **argv)
{
    int on = 1;
    int i = 1;
    if (i < argc && strcmp(argv[i], "--off") == 0) {
        on = 0;
        i++;
    }
    if (i < argc && strcmp(argv[i], "--") == 0)
        i++;
    if (i >= argc) {
        fprintf(stderr, "usage: vmsight-background [--off] [--] CMD [ARGS...]\n"
                        "Runs CMD as a background process for vmsight (FoxyIdle); --off runs it "
                        "as a foreground process.\n");
        return 2;
    }
    declare(on);
    execvp(argv[i], argv + i);
    fprintf(stderr, "vmsight-background: cannot execute %s: %s\n", argv[i], strerror(errno));
    return 127;
}
