/* libvmsight: write/read/pwrite/pread with an I/O class hint for vmsight, and the FoxyIdle
 * background declaration (see vmsight.h).
 * Built by guest/build-image.sh as /usr/local/lib/libvmsight.so.1 and libvmsight.a. */
#define _GNU_SOURCE
#include "vmsight.h"

#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The syscall is issued by hand rather than through syscall(3) because the kernel preserves
 * r8-r10 across a syscall, and libc's plain read/write do not touch them: the magic would stay
 * in r10 and make the program's next plain write() look hinted to vmsight. So r8, r9 and r10
 * are zeroed right after the syscall instruction. */
static long hinted6(long nr, long a0, long a1, long a2, long a3, long a4, long a5)
{
    register long r10 __asm__("r10") = a3;
    register long r8 __asm__("r8") = a4;
    register long r9 __asm__("r9") = a5;
    long ret;
    __asm__ volatile("syscall\n\t"
                     "xor %%r8d, %%r8d\n\t"
                     "xor %%r9d, %%r9d\n\t"
                     "xor %%r10d, %%r10d"
                     : "=a"(ret), "+r"(r10), "+r"(r8), "+r"(r9)
                     : "0"(nr), "D"(a0), "S"(a1), "d"(a2)
                     : "rcx", "r11", "memory");
    if (ret < 0 && ret > -4096) {
        errno = (int)-ret;
        return -1;
    }
    return ret;
}

static int valid_class(int ioclass)
{
    return ioclass >= 0 && ioclass <= VMSIGHT_CLASS_MAX;
}

#define MAGIC ((long)VMSIGHT_HINT_MAGIC)

ssize_t vmsight_write(int fd, const void *buf, size_t len, int ioclass)
{
    if (!valid_class(ioclass))
        return write(fd, buf, len);
    return hinted6(SYS_write, fd, (long)buf, (long)len, MAGIC, ioclass, 0);
}

ssize_t vmsight_read(int fd, void *buf, size_t len, int ioclass)
{
    if (!valid_class(ioclass))
        return read(fd, buf, len);
    return hinted6(SYS_read, fd, (long)buf, (long)len, MAGIC, ioclass, 0);
}

ssize_t vmsight_pwrite(int fd, const void *buf, size_t len, off_t offset, int ioclass)
{
    if (!valid_class(ioclass))
        return pwrite(fd, buf, len, offset);
    return hinted6(SYS_pwrite64, fd, (long)buf, (long)len, (long)offset, MAGIC, ioclass);
}

ssize_t vmsight_pread(int fd, void *buf, size_t len, off_t offset, int ioclass)
{
    if (!valid_class(ioclass))
        return pread(fd, buf, len, offset);
    return hinted6(SYS_pread64, fd, (long)buf, (long)len, (long)offset, MAGIC, ioclass);
}

int vmsight_set_background(int on)
{
    int saved = errno;
    /* Every argument as a full register: syscall(2) is variadic, and an int would leave the upper
     * half of its register undefined. The kernel rejects the unknown option with EINVAL. */
    (void)syscall(SYS_prctl, (unsigned long)VMSIGHT_PRCTL_OPTION,
                  (unsigned long)VMSIGHT_PRCTL_BACKGROUND, on ? 1UL : 0UL, 0UL, 0UL);
    errno = saved;
    return 0;
}
