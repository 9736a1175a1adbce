/* vmsight.h: application-supplied I/O class hints for vmsight (Sky §3.6).
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

ssize_t vmsight_write(int fd, const void *buf, size_t len, int ioclass);
ssize_t vmsight_read(int fd, void *buf, size_t len, int ioclass);
ssize_t vmsight_pwrite(int fd, const void *buf, size_t len, off_t offset, int ioclass);
ssize_t vmsight_pread(int fd, void *buf, size_t len, off_t offset, int ioclass);

#ifdef __cplusplus
}
#endif

#endif /* VMSIGHT_H */
