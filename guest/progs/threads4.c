/* Four threads, each creating, writing and closing its own file; then the main thread reads
 * them back. Used by the interception tests (per-thread syscall sequences vs strace). */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *worker(void *arg)
{
    long n = (long)arg;
    char path[64], buf[64];
    snprintf(path, sizeof path, "/tmp/thread-%ld.txt", n);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return (void *)1;
    int len = snprintf(buf, sizeof buf, "thread %ld\n", n);
    if (write(fd, buf, (size_t)len) != len)
        return (void *)1;
    close(fd);
    return NULL;
}

int main(void)
{
    pthread_t t[4];
    for (long i = 0; i < 4; i++)
        if (pthread_create(&t[i], NULL, worker, (void *)i) != 0)
            return 1;
    int bad = 0;
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(t[i], &r);
        bad |= r != NULL;
    }
    for (int i = 0; i < 4; i++) {
        char path[64], buf[64];
        snprintf(path, sizeof path, "/tmp/thread-%d.txt", i);
        int fd = open(path, O_RDONLY);
        ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf) : -1;
        if (n > 0 && write(1, buf, (size_t)n) != n)
            bad = 1;
        if (fd >= 0)
            close(fd);
    }
    return bad;
}
