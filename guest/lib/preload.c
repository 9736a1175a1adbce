/* libvmsight-preload.so: tags the I/O of unmodified programs with vmsight I/O classes by path,
 * and can declare them background processes for FoxyIdle.
 *
 *   VMSIGHT_HINTS='/srv/db/idx-*=1;/var/mail/box*=4' LD_PRELOAD=libvmsight-preload.so prog ...
 *   VMSIGHT_BACKGROUND=1 LD_PRELOAD=libvmsight-preload.so updatedb
 *
 * VMSIGHT_BACKGROUND=1 (or yes, on) makes the shim call vmsight_set_background(1) once when it
 * is loaded, with or without VMSIGHT_HINTS (see vmsight.h; vmsight then holds back the process's
 * disk reads, and those of its children, while foreground processes use the disk). Any other
 * non-empty value is reported once on stderr and ignored. Every exec'd program that inherits
 * the environment declares itself again, which is harmless. Programs that cannot be preloaded
 * (static, set-user/group-ID such as plocate's locate) can be run with `vmsight-background prog`.
 *
 * Rules are GLOB=CLASS separated by ';', tried in order, the first match wins. A GLOB is
 * matched with fnmatch(3) without flags (so '*' also matches '/') against the absolute path of
 * each opened file: the path as given, made absolute with the directory fd's path or getcwd(3),
 * and, if that does not match, the kernel's canonical path (/proc/self/fd, symlinks resolved).
 * read/write/pread/pwrite (and the 64-bit and fortified variants) on a matched fd issue the
 * hinted syscall of libvmsight (see vmsight.h for the register convention); everything else
 * is passed to libc untouched. Classes follow through dup/dup2/dup3/fcntl(F_DUPFD*), and fds
 * inherited across execve are re-matched at start-up (so `sh -c 'prog > /srv/db/x.idx'` works).
 *
 * Cost: with no rules the wrappers call libc directly; with rules, an unmatched fd costs one
 * relaxed atomic load per call; each open costs a fnmatch per rule (and a readlink when the
 * literal path does not match).
 *
 * Not covered: stdio (fwrite/fread go through glibc-internal calls that cannot be
 * interposed), readv/writev, mmap, io_uring/aio, statically linked programs, fds above
 * MAX_FD, and files opened through syscall(2) directly. A malformed rule is reported once on
 * stderr and skipped; hints never change what the calls do. */
#define _GNU_SOURCE
#include "vmsight.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>
#include <dirent.h>

#define MAX_RULES 64
#define MAX_FD 65536
#define EXPORT __attribute__((visibility("default")))

struct rule {
    char *glob;
    int ioclass;
};

static struct rule rules[MAX_RULES];
static int nrules;
/* Per fd: 0 = no hint, else class + 1. Relaxed atomics: an fd's class is set by the thread that
 * opened it before the fd number is visible to any other thread (it is returned by open). */
static _Atomic unsigned short fd_class[MAX_FD];
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
/* Set while init runs on this thread: dlsym may allocate, and an allocator that opens or
 * reads files (some do, e.g. to read /proc settings) would re-enter pthread_once and deadlock.
 * Such nested calls skip init and use the raw syscalls of NEED. */
static __thread int initializing;

static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static int (*real___open_2)(const char *, int);
static int (*real___open64_2)(const char *, int);
static int (*real___openat_2)(int, const char *, int);
static int (*real___openat64_2)(int, const char *, int);
static int (*real_creat)(const char *, mode_t);
static int (*real_creat64)(const char *, mode_t);
static int (*real_close)(int);
static int (*real_close_range)(unsigned int, unsigned int, int);
static int (*real_dup)(int);
static int (*real_dup2)(int, int);
static int (*real_dup3)(int, int, int);
static int (*real_fcntl)(int, int, ...);
static int (*real_fcntl64)(int, int, ...);
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_read)(int, void *, size_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pread)(int, void *, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off64_t);
static ssize_t (*real_pread64)(int, void *, size_t, off64_t);
static ssize_t (*real___read_chk)(int, void *, size_t, size_t);
static ssize_t (*real___pread_chk)(int, void *, size_t, off_t, size_t);
static ssize_t (*real___pread64_chk)(int, void *, size_t, off64_t, size_t);

static void warn_rule(const char *rule, const char *why)
{
    /* Only at start-up and only for a malformed VMSIGHT_HINTS: worth one line on stderr. */
    char msg[512];
    int n = snprintf(msg, sizeof msg, "libvmsight-preload: ignoring rule '%s': %s\n", rule, why);
    if (n > 0 && real_write)
        (void)!real_write(2, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
}

static void parse_rules(const char *spec)
{
    char *copy = strdup(spec);
    if (!copy)
        return;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ";", &save); tok; tok = strtok_r(NULL, ";", &save)) {
        if (*tok == '\0')
            continue;
        /* The class follows the last '=', so globs may contain '='. */
        char *eq = strrchr(tok, '=');
        if (!eq || eq == tok) {
            warn_rule(tok, "expected GLOB=CLASS");
            continue;
        }
        *eq = '\0';
        char *end;
        errno = 0;
        long c = strtol(eq + 1, &end, 10);
        if (errno || end == eq + 1 || *end != '\0' || c < 0 || c > VMSIGHT_CLASS_MAX) {
            *eq = '=';
            warn_rule(tok, "CLASS must be an integer 0..255");
            continue;
        }
        if (nrules == MAX_RULES) {
            warn_rule(tok, "too many rules (64 at most)");
            break;
        }
        char *g = strdup(tok);
        if (!g)
            break;
        rules[nrules].glob = g;
        rules[nrules].ioclass = (int)c;
        nrules++;
    }
    free(copy);
}

/* VMSIGHT_BACKGROUND: declares the process background at start-up (see the top of the file). */
static void apply_background(void)
{
    const char *v = getenv("VMSIGHT_BACKGROUND");
    if (!v || *v == '\0')
        return;
    if (strcmp(v, "1") == 0 || strcmp(v, "yes") == 0 || strcmp(v, "on") == 0) {
        vmsight_set_background(1);
        return;
    }
    if (strcmp(v, "0") == 0 || strcmp(v, "no") == 0 || strcmp(v, "off") == 0)
        return; /* explicitly not background: nothing to declare */
    int saved = errno;
    char msg[512];
    int n = snprintf(msg, sizeof msg, "libvmsight-preload: ignoring VMSIGHT_BACKGROUND='%s': "
                     "expected 1, yes or on (or 0, no, off)\n", v);
    if (n > 0 && real_write)
        (void)!real_write(2, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    errno = saved;
}

static void *next(const char *name)
{
    return dlsym(RTLD_NEXT, name);
}

static int match_path(const char *abs)
{
    for (int i = 0; i < nrules; i++)
        if (fnmatch(rules[i].glob, abs, 0) == 0)
            return rules[i].ioclass;
    return -1;
}

/* The kernel's path of an open fd, or -1. */
static ssize_t fd_path(int fd, char *out, size_t size)
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, size - 1);
    if (n < 0 || (size_t)n >= size - 1)
        return -1;
    out[n] = '\0';
    return n;
}

static void set_class(int fd, int ioclass)
{
    if (fd >= 0 && fd < MAX_FD)
        atomic_store_explicit(&fd_class[fd], ioclass < 0 ? 0 : (unsigned short)(ioclass + 1),
                              memory_order_relaxed);
}

static int get_class(int fd)
{
    if (fd < 0 || fd >= MAX_FD)
        return -1;
    return (int)atomic_load_explicit(&fd_class[fd], memory_order_relaxed) - 1;
}

/* Matches a newly opened fd: the literal path made absolute first, then the canonical one. */
static void classify(int dirfd, const char *path, int fd)
{
    if (fd < 0 || fd >= MAX_FD)
        return;
    int c = -1;
    if (path) {
        char abs[PATH_MAX];
        if (path[0] == '/') {
            c = match_path(path);
        } else {
            ssize_t n;
            if (dirfd == AT_FDCWD) {
                n = getcwd(abs, sizeof abs) ? (ssize_t)strlen(abs) : -1;
            } else {
                n = fd_path(dirfd, abs, sizeof abs);
            }
            if (n > 0 && (size_t)n + 1 + strlen(path) < sizeof abs) {
                if (abs[n - 1] != '/')
                    abs[n++] = '/';
                strcpy(abs + n, path);
                c = match_path(abs);
            }
        }
        if (c < 0) {
            char canon[PATH_MAX];
            if (fd_path(fd, canon, sizeof canon) > 0)
                c = match_path(canon);
        }
    }
    set_class(fd, c);
}

/* fds inherited across execve: match them by their canonical path. */
static void scan_inherited(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return;
    int self = dirfd(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char *end;
        long fd = strtol(e->d_name, &end, 10);
        if (*end != '\0' || end == e->d_name || fd == self || fd < 0 || fd >= MAX_FD)
            continue;
        char canon[PATH_MAX];
        if (fd_path((int)fd, canon, sizeof canon) > 0 && canon[0] == '/')
            set_class((int)fd, match_path(canon));
    }
    closedir(d);
}

static void init(void)
{
    initializing = 1;
    real_open = next("open");
    real_open64 = next("open64");
    real_openat = next("openat");
    real_openat64 = next("openat64");
    real___open_2 = next("__open_2");
    real___open64_2 = next("__open64_2");
    real___openat_2 = next("__openat_2");
    real___openat64_2 = next("__openat64_2");
    real_creat = next("creat");
    real_creat64 = next("creat64");
    real_close = next("close");
    real_close_range = next("close_range");
    real_dup = next("dup");
    real_dup2 = next("dup2");
    real_dup3 = next("dup3");
    real_fcntl = next("fcntl");
    real_fcntl64 = next("fcntl64");
    real_write = next("write");
    real_read = next("read");
    real_pwrite = next("pwrite");
    real_pread = next("pread");
    real_pwrite64 = next("pwrite64");
    real_pread64 = next("pread64");
    real___read_chk = next("__read_chk");
    real___pread_chk = next("__pread_chk");
    real___pread64_chk = next("__pread64_chk");
    const char *spec = getenv("VMSIGHT_HINTS");
    if (spec && *spec)
        parse_rules(spec);
    if (nrules > 0)
        scan_inherited();
    /* init runs once per process, from the constructor at the latest (earlier only if another
     * library's constructor opens or reads a file first), so this is at start-up. */
    apply_background();
    initializing = 0;
}

static inline void ensure_init(void)
{
    if (!initializing)
        pthread_once(&init_once, init);
}

__attribute__((constructor)) static void preload_ctor(void)
{
    ensure_init();
}

/* When the libc function is not known (during init on this thread, or a symbol this libc
 * lacks), the call is made as the raw syscall: a hint must never make I/O fail. */
#define NEED(fn, raw)           \
    do {                        \
        ensure_init();          \
        if (!(fn))              \
            return raw;         \
    } while (0)

/* open(2)'s mode argument is read only when the flags need it, like libc does. */
static int needs_mode(int flags)
{
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE;
}

#define OPEN_WRAPPER(name, real)                                   \
    EXPORT int name(const char *path, int flags, ...)              \
    {                                                              \
        mode_t mode = 0;                                           \
        if (needs_mode(flags)) {                                   \
            va_list ap;                                            \
            va_start(ap, flags);                                   \
            mode = (mode_t)va_arg(ap, int);                        \
            va_end(ap);                                            \
        }                                                          \
        NEED(real, (int)syscall(SYS_open, path, flags, mode));     \
        int fd = real(path, flags, mode);                          \
        if (fd >= 0 && nrules > 0)                                 \
            classify(AT_FDCWD, path, fd);                          \
        else if (fd >= 0)                                          \
            set_class(fd, -1);                                     \
        return fd;                                                 \
    }

#define OPENAT_WRAPPER(name, real)                                 \
    EXPORT int name(int dirfd, const char *path, int flags, ...)   \
    {                                                              \
        mode_t mode = 0;                                           \
        if (needs_mode(flags)) {                                   \
            va_list ap;                                            \
            va_start(ap, flags);                                   \
            mode = (mode_t)va_arg(ap, int);                        \
            va_end(ap);                                            \
        }                                                          \
        NEED(real, (int)syscall(SYS_openat, dirfd, path, flags, mode)); \
        int fd = real(dirfd, path, flags, mode);                   \
        if (fd >= 0 && nrules > 0)                                 \
            classify(dirfd, path, fd);                             \
        else if (fd >= 0)                                          \
            set_class(fd, -1);                                     \
        return fd;                                                 \
    }

OPEN_WRAPPER(open, real_open)
OPEN_WRAPPER(open64, real_open64)
OPENAT_WRAPPER(openat, real_openat)
OPENAT_WRAPPER(openat64, real_openat64)

/* _FORTIFY_SOURCE builds (all of Debian) call these when the flags are not constant. */
#define OPEN2_WRAPPER(name, real)                                  \
    EXPORT int name(const char *path, int flags)                   \
    {                                                              \
        NEED(real, (int)syscall(SYS_open, path, flags, 0));        \
        int fd = real(path, flags);                                \
        if (fd >= 0 && nrules > 0)                                 \
            classify(AT_FDCWD, path, fd);                          \
        else if (fd >= 0)                                          \
            set_class(fd, -1);                                     \
        return fd;                                                 \
    }
#define OPENAT2_WRAPPER(name, real)                                \
    EXPORT int name(int dirfd, const char *path, int flags)        \
    {                                                              \
        NEED(real, (int)syscall(SYS_openat, dirfd, path, flags, 0)); \
        int fd = real(dirfd, path, flags);                         \
        if (fd >= 0 && nrules > 0)                                 \
            classify(dirfd, path, fd);                             \
        else if (fd >= 0)                                          \
            set_class(fd, -1);                                     \
        return fd;                                                 \
    }
OPEN2_WRAPPER(__open_2, real___open_2)
OPEN2_WRAPPER(__open64_2, real___open64_2)
OPENAT2_WRAPPER(__openat_2, real___openat_2)
OPENAT2_WRAPPER(__openat64_2, real___openat64_2)

#define CREAT_WRAPPER(name, real)                                  \
    EXPORT int name(const char *path, mode_t mode)                 \
    {                                                              \
        NEED(real, (int)syscall(SYS_creat, path, mode));          \
        int fd = real(path, mode);                                 \
        if (fd >= 0 && nrules > 0)                                 \
            classify(AT_FDCWD, path, fd);                          \
        else if (fd >= 0)                                          \
            set_class(fd, -1);                                     \
        return fd;                                                 \
    }
CREAT_WRAPPER(creat, real_creat)
CREAT_WRAPPER(creat64, real_creat64)

EXPORT int close(int fd)
{
    NEED(real_close, (int)syscall(SYS_close, fd));
    /* Cleared first: once close returns, another thread may get the same number. */
    set_class(fd, -1);
    return real_close(fd);
}

EXPORT int close_range(unsigned int first, unsigned int last, int flags)
{
    NEED(real_close_range, (int)syscall(SYS_close_range, first, last, flags));
    int r = real_close_range(first, last, flags);
    /* CLOSE_RANGE_CLOEXEC (4) only marks the fds; they stay open with their class. */
    if (r == 0 && !(flags & 4)) {
        for (unsigned int fd = first; fd <= last && fd < MAX_FD; fd++)
            set_class((int)fd, -1);
    }
    return r;
}

EXPORT int dup(int oldfd)
{
    NEED(real_dup, (int)syscall(SYS_dup, oldfd));
    int fd = real_dup(oldfd);
    if (fd >= 0)
        set_class(fd, get_class(oldfd));
    return fd;
}

EXPORT int dup2(int oldfd, int newfd)
{
    NEED(real_dup2, (int)syscall(SYS_dup2, oldfd, newfd));
    int fd = real_dup2(oldfd, newfd);
    if (fd >= 0)
        set_class(fd, get_class(oldfd));
    return fd;
}

EXPORT int dup3(int oldfd, int newfd, int flags)
{
    NEED(real_dup3, (int)syscall(SYS_dup3, oldfd, newfd, flags));
    int fd = real_dup3(oldfd, newfd, flags);
    if (fd >= 0)
        set_class(fd, get_class(oldfd));
    return fd;
}

/* fcntl's third argument is an int or a pointer; on x86-64 both travel in the same register,
 * so it is passed on as a pointer-sized value. */
#define FCNTL_WRAPPER(name, real)                                  \
    EXPORT int name(int fd, int cmd, ...)                          \
    {                                                              \
        va_list ap;                                                \
        va_start(ap, cmd);                                         \
        void *arg = va_arg(ap, void *);                            \
        va_end(ap);                                                \
        NEED(real, (int)syscall(SYS_fcntl, fd, cmd, arg));        \
        int r = real(fd, cmd, arg);                                \
        if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC))  \
            set_class(r, get_class(fd));                           \
        return r;                                                  \
    }
FCNTL_WRAPPER(fcntl, real_fcntl)
FCNTL_WRAPPER(fcntl64, real_fcntl64)

EXPORT ssize_t write(int fd, const void *buf, size_t len)
{
    NEED(real_write, syscall(SYS_write, fd, buf, len));
    int c = get_class(fd);
    if (c < 0)
        return real_write(fd, buf, len);
    return vmsight_write(fd, buf, len, c);
}

EXPORT ssize_t read(int fd, void *buf, size_t len)
{
    NEED(real_read, syscall(SYS_read, fd, buf, len));
    int c = get_class(fd);
    if (c < 0)
        return real_read(fd, buf, len);
    return vmsight_read(fd, buf, len, c);
}

EXPORT ssize_t pwrite(int fd, const void *buf, size_t len, off_t off)
{
    NEED(real_pwrite, syscall(SYS_pwrite64, fd, buf, len, off));
    int c = get_class(fd);
    if (c < 0)
        return real_pwrite(fd, buf, len, off);
    return vmsight_pwrite(fd, buf, len, off, c);
}

EXPORT ssize_t pread(int fd, void *buf, size_t len, off_t off)
{
    NEED(real_pread, syscall(SYS_pread64, fd, buf, len, off));
    int c = get_class(fd);
    if (c < 0)
        return real_pread(fd, buf, len, off);
    return vmsight_pread(fd, buf, len, off, c);
}

EXPORT ssize_t pwrite64(int fd, const void *buf, size_t len, off64_t off)
{
    NEED(real_pwrite64, syscall(SYS_pwrite64, fd, buf, len, off));
    int c = get_class(fd);
    if (c < 0)
        return real_pwrite64(fd, buf, len, off);
    return vmsight_pwrite(fd, buf, len, (off_t)off, c);
}

EXPORT ssize_t pread64(int fd, void *buf, size_t len, off64_t off)
{
    NEED(real_pread64, syscall(SYS_pread64, fd, buf, len, off));
    int c = get_class(fd);
    if (c < 0)
        return real_pread64(fd, buf, len, off);
    return vmsight_pread(fd, buf, len, (off_t)off, c);
}

/* Fortified reads: keep libc's buffer-size check, then read with the hint. */
EXPORT ssize_t __read_chk(int fd, void *buf, size_t len, size_t buflen)
{
    NEED(real___read_chk, syscall(SYS_read, fd, buf, len));
    int c = get_class(fd);
    if (c < 0 || len > buflen)
        return real___read_chk(fd, buf, len, buflen);
    return vmsight_read(fd, buf, len, c);
}

EXPORT ssize_t __pread_chk(int fd, void *buf, size_t len, off_t off, size_t buflen)
{
    NEED(real___pread_chk, syscall(SYS_pread64, fd, buf, len, off));
    int c = get_class(fd);
    if (c < 0 || len > buflen)
        return real___pread_chk(fd, buf, len, off, buflen);
    return vmsight_pread(fd, buf, len, off, c);
}

EXPORT ssize_t __pread64_chk(int fd, void *buf, size_t len, off64_t off, size_t buflen)
{
    NEED(real___pread64_chk, syscall(SYS_pread64, fd, buf, len, off));
    int c = get_class(fd);
    if (c < 0 || len > buflen)
        return real___pread64_chk(fd, buf, len, off, buflen);
    return vmsight_pread(fd, buf, len, (off_t)off, c);
}
