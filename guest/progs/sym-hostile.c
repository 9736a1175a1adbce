/*
 * sym-hostile: a hostile guest process against the symbiotic interface (docs/symbiotic.md).
 * Finds vmsight's ivshmem device (1af4:1110 whose shared region starts with the VMM magic),
 * maps its shared region (resource2) and registers (resource0) through sysfs, and:
 *
 *   sym-hostile garbage SECONDS   writes random bytes over the guest page (0x1000..0x3000) and
 *                                 the call page (0x3000..0x4000) for SECONDS
 *   sym-hostile flood COUNT       writes the Doorbell register COUNT times for each of
 *                                 vmsight's two vectors (peer = the VMM page's vmm_peer)
 *   sym-hostile info              prints the device, both magics and the states
 *   sym-hostile swaplock MS [PID] takes the swap region's lock (the second ivshmem device,
 *                                 docs/swapbypass.md) as the guest side does, kills PID (if
 *                                 given) and holds the lock for MS milliseconds: the module's
 *                                 operations (the freeing of PID's swap) find it busy
 *
 * Needs root. Prints what it did.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define REGION_SIZE 65536
#define VMM_MAGIC 0x4d4d564d59534d56ULL /* "VMSYMVMM" */
#define GUEST_OFF 0x1000
#define CALL_OFF 0x3000
#define CALL_END 0x4000
#define VMM_STATE 16
#define VMM_PEER 24
#define GUEST_MAGIC_OFF (GUEST_OFF + 0)
#define GUEST_STATE (GUEST_OFF + 12)
#define CALL_STATE (CALL_OFF + 8)
#define REG_IVPOSITION 0x08
#define REG_DOORBELL 0x0c
#define SWAPR_MAGIC 0x4752504157534d56ULL /* "VMSWAPRG" */
#define SWAPR_LOCK 28
#define SWAPR_LOCK_FREE 0
#define SWAPR_LOCK_GUEST 1

static int read_sysfs(const char *dir, const char *name, char *buf, size_t len)
{
    char path[512];
    ssize_t n;
    int fd;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    n = read(fd, buf, len - 1);
    close(fd);
    if (n < 0)
        return -1;
    buf[n] = 0;
    buf[strcspn(buf, "\n")] = 0;
    return 0;
}

static void *map_resource(const char *dir, const char *name, size_t len)
{
    char path[512];
    void *p;
    int fd;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    fd = open(path, O_RDWR | O_SYNC);
    if (fd < 0) {
        fprintf(stderr, "sym-hostile: open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        fprintf(stderr, "sym-hostile: mmap %s: %s\n", path, strerror(errno));
        return NULL;
    }
    return p;
}

static DIR *open_pci_devices(void)
{
    DIR *d = opendir("/sys/bus/pci/devices");

    if (!d)
        perror("sym-hostile: /sys/bus/pci/devices");
    return d;
}

/* The next ivshmem device (1af4:1110) in D: its sysfs directory into PATH. 0, or -1 at the
 * end. */
static int next_ivshmem(DIR *d, char *path, size_t len)
{
    struct dirent *e;

    while ((e = readdir(d)) != NULL) {
        char vendor[16], device[16];

        if (e->d_name[0] == '.')
            continue;
        snprintf(path, len, "/sys/bus/pci/devices/%s", e->d_name);
        if (!read_sysfs(path, "vendor", vendor, sizeof(vendor)) &&
            !read_sysfs(path, "device", device, sizeof(device)) && !strcmp(vendor, "0x1af4") &&
            !strcmp(device, "0x1110"))
            return 0;
    }
    return -1;
}

/* Finds vmsight's device; maps its region and registers. */
static int find_device(char *dir, size_t dirlen, volatile uint8_t **region,
                       volatile uint32_t **regs)
{
    DIR *d = open_pci_devices();
    char path[512];
    int found = 0;

    if (!d)
        return -1;
    while (!found && !next_ivshmem(d, path, sizeof(path))) {
        void *r = map_resource(path, "resource2", REGION_SIZE);

        if (!r)
            continue;
        if (*(volatile uint64_t *)r != VMM_MAGIC) {
            printf("%s: ivshmem without vmsight's magic, skipped\n", path);
            munmap(r, REGION_SIZE);
            continue;
        }
        *regs = map_resource(path, "resource0", 4096);
        if (!*regs) {
            munmap(r, REGION_SIZE);
            continue;
        }
        *region = r;
        snprintf(dir, dirlen, "%s", path);
        found = 1;
    }
    closedir(d);
    if (!found) {
        fprintf(stderr, "sym-hostile: no vmsight ivshmem device (1af4:1110 with the VMM magic)\n");
        return -1;
    }
    return 0;
}

/* Maps the swap region's header page (an ivshmem device whose BAR2 starts with its magic). */
static volatile uint8_t *find_swap_region(void)
{
    DIR *d = open_pci_devices();
    volatile uint8_t *hdr = NULL;
    char path[512];

    if (!d)
        return NULL;
    while (!hdr && !next_ivshmem(d, path, sizeof(path))) {
        void *r = map_resource(path, "resource2", 4096);

        if (r && *(volatile uint64_t *)r == SWAPR_MAGIC)
            hdr = r;
        else if (r)
            munmap(r, 4096);
    }
    closedir(d);
    if (!hdr)
        fprintf(stderr, "sym-hostile: no swap region (1af4:1110 with the VMSWAPRG magic)\n");
    return hdr;
}

static double now(void);

/* Takes the swap region's lock (waiting at most 10 s), kills VICTIM (if > 0), holds the lock
 * MS ms, lets it go. */
static int swaplock(long ms, pid_t victim)
{
    volatile uint8_t *hdr = find_swap_region();
    uint32_t *lock;
    double start, held;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};

    if (!hdr)
        return 1;
    lock = (uint32_t *)(hdr + SWAPR_LOCK);
    start = now();
    for (;;) {
        uint32_t free = SWAPR_LOCK_FREE;

        if (__atomic_compare_exchange_n(lock, &free, SWAPR_LOCK_GUEST, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            break;
        if (now() - start > 10) {
            fprintf(stderr, "sym-hostile: the swap region's lock stayed taken for 10 s\n");
            return 1;
        }
    }
    held = now();
    if (victim > 0 && kill(victim, SIGKILL))
        fprintf(stderr, "sym-hostile: kill %d: %s\n", (int)victim, strerror(errno));
    printf("swaplock: holding\n");
    fflush(stdout);
    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
    __atomic_store_n(lock, SWAPR_LOCK_FREE, __ATOMIC_RELEASE);
    printf("swaplock: held the swap region's lock for %.0f ms\n", (now() - held) * 1000);
    return 0;
}

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;

    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void info(const char *dir, volatile uint8_t *region, volatile uint32_t *regs)
{
    printf("device %s: our peer %u, vmsight peer %u, vmm state %u, guest magic 0x%016" PRIx64
           " guest state %u, call state %u\n",
           dir, regs[REG_IVPOSITION / 4], *(volatile uint32_t *)(region + VMM_PEER),
           *(volatile uint32_t *)(region + VMM_STATE),
           *(volatile uint64_t *)(region + GUEST_MAGIC_OFF),
           *(volatile uint32_t *)(region + GUEST_STATE),
           *(volatile uint32_t *)(region + CALL_STATE));
}

int main(int argc, char **argv)
{
    volatile uint8_t *region = NULL;
    volatile uint32_t *regs = NULL;
    char dir[512];

    int swaplock_cmd = argc >= 2 && !strcmp(argv[1], "swaplock");

    if (argc < 2 || (strcmp(argv[1], "info") && argc != 3 && !(swaplock_cmd && argc == 4))) {
        fprintf(stderr, "usage: sym-hostile garbage SECONDS | flood COUNT | info | swaplock MS [PID]\n");
        return 2;
    }
    if (swaplock_cmd)
        return swaplock(atol(argv[2]), argc == 4 ? (pid_t)atol(argv[3]) : 0);
    if (find_device(dir, sizeof(dir), &region, &regs))
        return 1;
    if (!strcmp(argv[1], "info")) {
        info(dir, region, regs);
    } else if (!strcmp(argv[1], "garbage")) {
        double secs = atof(argv[2]), start = now();
        uint64_t seed = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ULL ^ (uint64_t)getpid();
        unsigned long passes = 0;
        size_t off;

        if (!seed)
            seed = 1;
        do {
            for (off = GUEST_OFF; off < CALL_END; off += 8)
                *(volatile uint64_t *)(region + off) = xorshift(&seed);
            passes++;
        } while (now() - start < secs);
        printf("garbage: %lu passes of random bytes over 0x%x..0x%x (guest and call pages) in %.1f s\n",
               passes, GUEST_OFF, CALL_END, now() - start);
    } else if (!strcmp(argv[1], "flood")) {
        long count = atol(argv[2]), i;
        uint32_t peer = *(volatile uint32_t *)(region + VMM_PEER) & 0xffff;
        double start = now();

        for (i = 0; i < count; i++) {
            regs[REG_DOORBELL / 4] = peer << 16 | 0;
            regs[REG_DOORBELL / 4] = peer << 16 | 1;
        }
        printf("flood: %ld doorbells on each of vectors 0 and 1 of peer %u in %.2f s\n", count,
               peer, now() - start);
    } else {
        fprintf(stderr, "sym-hostile: unknown command '%s'\n", argv[1]);
        return 2;
    }
    return 0;
}
