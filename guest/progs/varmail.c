/* varmail: a filebench-varmail-shaped mail-server workload that counts the file data it makes
 * the file system write, the ground truth for vmsight's data/metadata accuracy check (Sky §6.1,
 * Table 5).
 *
 *   varmail [-d DIR] [-n NFILES] [-o OPS] [-a MAXAPPEND] [-m MEANSIZE] [-s SEED] [-j]
 *
 * DIR (default /mnt/varmail, created if missing) holds NFILES slots (default 1000) named
 * fNNNNNN; 80% exist at the start (filebench's prealloc), each with 1..2*MEANSIZE random bytes
 * (default mean 16 KiB), written and then made durable with one syncfs(2). Leftover fNNNNNN
 * files of an earlier run are removed first. Then, until at least OPS operations (default
 * 20000) have run, one iteration does filebench's varmail flowops:
 *   delete a random existing file;
 *   create a file in a free slot, append 1..MAXAPPEND random bytes (default 16 KiB), fsync, close;
 *   open a random existing file, read it whole, append 1..MAXAPPEND bytes, fsync, close;
 *   open a random existing file, read it whole, close.
 * Every flowop counts as one operation (13 per iteration, like filebench). Data is pseudo-
 * random (xorshift64, SEED default 1), so no two 4 KiB chunks repeat.
 *
 * What is counted ("data_chunks"): for every write that is made durable (each append is
 * followed by its fsync; the initial files by the syncfs), the number of distinct
 * file-offset-aligned 4 KiB chunks the written bytes touch. That is the number of 4 KiB data
 * blocks the file system writes to the disk for this workload, because every dirty page cache
 * page is written back exactly once per fsync and no file is deleted or rewritten before its
 * fsync. A chunk only partly covered by the write (the file's tail, or the head of an append
 * that starts mid-chunk) is still written as a whole block and is counted; "partial_chunks" says
 * how many of the counted chunks were partial (vmsight must complete those from the page cache
 * to recognise them, Sky §3.4.4). Not counted: directory, inode, journal or other metadata
 * writes. Caveat: file systems that store small files or tails inside metadata (btrfs inline
 * extents, ext4 inline_data) write fewer data blocks than counted.
 *
 * Output: a summary line, then "data_chunks N" and "partial_chunks N"; with -j one JSON object
 * instead. Exit status 1 on any I/O error, 2 on bad usage. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 4096ULL
#define READ_IO (1u << 20)

static const char *dir = "/mnt/varmail";
static uint64_t rng = 1;
static unsigned long long data_chunks, partial_chunks, bytes_written, bytes_read;
static unsigned long long ops, created, deleted, fsyncs, appends;
static char *wbuf, *rbuf;

static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Uniform in 1..max. */
static unsigned long long rand_size(unsigned long long max)
{
    return 1 + next_rand() % max;
}

static void die(const char *what, const char *path)
{
    fprintf(stderr, "varmail: %s %s: %s\n", what, path, strerror(errno));
    exit(1);
}

static void slot_path(char *out, size_t size, unsigned slot)
{
    snprintf(out, size, "%s/f%06u", dir, slot);
}

/* Counts the chunks a durable write of [off, off+len) makes the file system write. */
static void count_chunks(unsigned long long off, unsigned long long len)
{
    unsigned long long first = off / CHUNK, last = (off + len - 1) / CHUNK;
    data_chunks += last - first + 1;
    if (off % CHUNK)
        partial_chunks++;
    unsigned long long end = off + len;
    if (end % CHUNK && (last != first || off % CHUNK == 0))
        partial_chunks++;
}

/* Appends len random bytes at the end of fd (whose size is off); returns the new size. */
static unsigned long long append(int fd, const char *path, unsigned long long off,
                                 unsigned long long len)
{
    for (unsigned long long i = 0; i < len; i += 8) {
        uint64_t x = next_rand();
        memcpy(wbuf + i, &x, len - i < 8 ? len - i : 8);
    }
    unsigned long long done = 0;
    while (done < len) {
        ssize_t r = write(fd, wbuf + done, len - done);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("write", path);
        }
        done += (unsigned long long)r;
    }
    bytes_written += len;
    appends++;
    count_chunks(off, len);
    return off + len;
}

static void read_whole(int fd, const char *path)
{
    for (;;) {
        ssize_t r = read(fd, rbuf, READ_IO);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("read", path);
        }
        if (r == 0)
            break;
        bytes_read += (unsigned long long)r;
    }
}

static unsigned pick(const unsigned char *exists, unsigned n, int want, unsigned count)
{
    /* count = number of slots in the wanted state (> 0); pick the k-th such slot. */
    unsigned k = (unsigned)(next_rand() % count);
    for (unsigned i = 0; i < n; i++)
        if (exists[i] == want && k-- == 0)
            return i;
    return 0; /* unreachable while count is right */
}

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-d DIR] [-n NFILES>=2] [-o OPS] [-a MAXAPPEND] [-m MEANSIZE] [-s SEED] [-j]\n",
            argv0);
    exit(2);
}

static unsigned long long num(const char *s, const char *argv0)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || end == s || s[0] == '-')
        usage(argv0);
    return v;
}

int main(int argc, char **argv)
{
    unsigned long long nfiles = 1000, want_ops = 20000, max_append = 16384, mean = 16384;
    int json = 0, opt;
    while ((opt = getopt(argc, argv, "d:n:o:a:m:s:j")) != -1) {
        switch (opt) {
        case 'd': dir = optarg; break;
        case 'n': nfiles = num(optarg, argv[0]); break;
        case 'o': want_ops = num(optarg, argv[0]); break;
        case 'a': max_append = num(optarg, argv[0]); break;
        case 'm': mean = num(optarg, argv[0]); break;
        case 's': rng = num(optarg, argv[0]); break;
        case 'j': json = 1; break;
        default: usage(argv[0]);
        }
    }
    if (optind != argc || nfiles < 2 || nfiles > 999999 || max_append == 0 ||
        max_append > (64u << 20) || mean == 0 || mean > (32u << 20))
        usage(argv[0]);
    if (rng == 0)
        rng = 1; /* xorshift needs a non-zero state */
    unsigned long long seed = rng;
    unsigned long long bufsize = max_append > 2 * mean ? max_append : 2 * mean;
    wbuf = malloc(bufsize + 8);
    rbuf = malloc(READ_IO);
    unsigned char *exists = calloc(nfiles, 1);
    unsigned long long *size = calloc(nfiles, sizeof *size);
    if (!wbuf || !rbuf || !exists || !size) {
        fprintf(stderr, "varmail: out of memory\n");
        return 1;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        die("mkdir", dir);
    char path[4096];
    DIR *d = opendir(dir);
    if (!d)
        die("opendir", dir);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        unsigned slot;
        char tail;
        if (sscanf(e->d_name, "f%6u%c", &slot, &tail) == 1 && strlen(e->d_name) == 7) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (unlink(path) != 0)
                die("unlink", path);
        }
    }
    closedir(d);

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    unsigned nexist = 0;
    for (unsigned i = 0; i < nfiles * 8 / 10; i++) {
        slot_path(path, sizeof path, i);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd < 0)
            die("create", path);
        size[i] = append(fd, path, 0, rand_size(2 * mean));
        appends--; /* preallocation, not a flowop */
        if (close(fd) != 0)
            die("close", path);
        exists[i] = 1;
        nexist++;
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd < 0)
        die("open", dir);
    if (syncfs(dfd) != 0)
        die("syncfs", dir);
    close(dfd);
    unsigned long long prealloc_chunks = data_chunks;

    unsigned long long iterations = 0;
    while (ops < want_ops) {
        iterations++;
        unsigned s;
        int fd;
        if (nexist > 0) { /* deletefile */
            s = pick(exists, (unsigned)nfiles, 1, nexist);
            slot_path(path, sizeof path, s);
            if (unlink(path) != 0)
                die("unlink", path);
            exists[s] = 0;
            nexist--;
            deleted++;
            ops++;
        }
        /* createfile, appendfilerand, fsync, closefile */
        s = pick(exists, (unsigned)nfiles, 0, (unsigned)nfiles - nexist);
        slot_path(path, sizeof path, s);
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND, 0644);
        if (fd < 0)
            die("create", path);
        exists[s] = 1;
        nexist++;
        created++;
        size[s] = append(fd, path, 0, rand_size(max_append));
        if (fsync(fd) != 0)
            die("fsync", path);
        fsyncs++;
        if (close(fd) != 0)
            die("close", path);
        ops += 4;
        /* openfile, readwholefile, appendfilerand, fsync, closefile */
        s = pick(exists, (unsigned)nfiles, 1, nexist);
        slot_path(path, sizeof path, s);
        fd = open(path, O_RDWR | O_APPEND);
        if (fd < 0)
            die("open", path);
        read_whole(fd, path);
        size[s] = append(fd, path, size[s], rand_size(max_append));
        if (fsync(fd) != 0)
            die("fsync", path);
        fsyncs++;
        if (close(fd) != 0)
            die("close", path);
        ops += 5;
        /* openfile, readwholefile, closefile */
        s = pick(exists, (unsigned)nfiles, 1, nexist);
        slot_path(path, sizeof path, s);
        fd = open(path, O_RDONLY);
        if (fd < 0)
            die("open", path);
        read_whole(fd, path);
        if (close(fd) != 0)
            die("close", path);
        ops += 3;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    if (json) {
        printf("{\"ops\":%llu,\"iterations\":%llu,\"dir\":\"%s\",\"nfiles\":%llu,\"seed\":%llu,"
               "\"created\":%llu,\"deleted\":%llu,\"appends\":%llu,\"fsyncs\":%llu,"
               "\"bytes_written\":%llu,\"bytes_read\":%llu,\"data_chunks\":%llu,"
               "\"prealloc_chunks\":%llu,\"partial_chunks\":%llu,\"seconds\":%.3f}\n",
               ops, iterations, dir, nfiles, seed, created, deleted, appends, fsyncs,
               bytes_written, bytes_read, data_chunks, prealloc_chunks, partial_chunks, secs);
    } else {
        printf("varmail: %llu ops (%llu iterations) in %s in %.1f s: %llu created, %llu deleted, "
               "%llu fsyncs, %llu bytes written, %llu bytes read\n",
               ops, iterations, dir, secs, created, deleted, fsyncs, bytes_written, bytes_read);
        printf("data_chunks %llu\npartial_chunks %llu\n", data_chunks, partial_chunks);
    }
    return fflush(stdout) == 0 ? 0 : 1;
}
