/* vmsight.h: application-supplied I/O class hints for vmsight (Sky §3.6), and the background
 * declaration for FoxyIdle (idle-time disk scheduling).
 *
 * Each call issues the ordinary system call with two extra arguments in registers the kernel
 * ignores for that call: a magic number and the I/O class. vmsight sees them when it
 * intercepts the syscall from outside the VM and uses the class for the block requests that
 * carry this data; without vmsight (or on any kernel) the calls behave exactly like
 * write(2), read(2), pwrite(2) and pread(2), including errno.
 *
 * Register convention (x86-64 syscall arguments args[0..5] = rdi rsi rdx r10 r8 r9):
 *   write / read:       args[3] = VMSIGHT_HINT_MAGIC, args[4] = class
 *   pwrite64 / pread64: args[4] = VMSIGHT_HINT_MAGIC, args[5] = class
 *
 * Classes: 0 (lowest priority) .. 31, and 32 "payload is unique, skip dedup" (Sky Table 6;
 * 5 is what vmsight gives file-system metadata; larger values up to 255 are passed through).
 * A class outside 0..VMSIGHT_CLASS_MAX is not an error: the call is made without a hint,
 * because a wrong hint may cost performance but must never cost data.
 *
 * Background declaration: vmsight_set_background(1) issues
 *   prctl(VMSIGHT_PRCTL_OPTION, VMSIGHT_PRCTL_BACKGROUND, 1, 0, 0)   (0 instead of 1: foreground)
 * i.e. args[0..2] = rdi rsi rdx = option, VMSIGHT_PRCTL_BACKGROUND, on; args[3..4] = 0. No kernel
 * knows the option, so the call fails with EINVAL and changes nothing in the guest; vmsight sees
 * it at the kernel's prctl entry. It applies to the whole calling process (thread group) and
 * survives execve; vmsight also treats the process's descendants as background. The
 * command-line form is `vmsight-background CMD...`, the unmodified-program form is
 * VMSIGHT_BACKGROUND=1 with libvmsight-preload.so.
 *
 * Link with -lvmsight. See docs/insights.md, "Application hints". */
#ifndef VMSIGHT_H
#define VMSIGHT_H

#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* "vmsight1" in ASCII; the same value as vmsight_insight::VMSIGHT_HINT_MAGIC. */
#define VMSIGHT_HINT_MAGIC 0x766d736967687431ULL

/* Highest class passed on (vmsight ignores larger values, so they are not sent). */
#define VMSIGHT_CLASS_MAX 255
#define VMSIGHT_CLASS_METADATA 5
#define VMSIGHT_CLASS_SKIP_DEDUP 32

/* prctl(2) option and sub-command of the background declaration: "vmsi" and "bgnd" in ASCII. */
#define VMSIGHT_PRCTL_OPTION 0x766d7369UL
#define VMSIGHT_PRCTL_BACKGROUND 0x62676e64UL

ssize_t vmsight_write(int fd, const void *buf, size_t len, int ioclass);
ssize_t vmsight_read(int fd, void *buf, size_t len, int ioclass);
ssize_t vmsight_pwrite(int fd, const void *buf, size_t len, off_t offset, int ioclass);
ssize_t vmsight_pread(int fd, void *buf, size_t len, off_t offset, int ioclass);

/* Declares the calling process a background process for FoxyIdle (on != 0): vmsight then holds
 * back its disk reads, and those of its descendants, while foreground processes use the disk.
 * on == 0 declares it foreground again. Always returns 0: the declaration is fire-and-forget,
 * the guest cannot tell whether vmsight saw it; with vmsight it takes effect for block requests
 * submitted after the call. errno is preserved (the prctl itself fails with EINVAL). */
int vmsight_set_background(int on);

#ifdef __cplusplus
}
#endif

#endif /* VMSIGHT_H */
