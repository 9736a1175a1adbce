/* A blocking read on a pipe is interrupted by a SA_RESTART signal whose handler itself calls
 * write; the kernel restarts the read, which then returns the byte a child writes later.
 * Exercises signal delivery during a pending syscall and restart (Sky §4.2). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void on_usr1(int sig)
{
    (void)sig;
    static const char msg[] = "handler\n";
    if (write(1, msg, sizeof msg - 1) < 0)
        _exit(3);
}

static void pause_ms(long ms)
{
    struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) != 0)
        ;
}

int main(void)
{
    int p[2];
    if (pipe(p) != 0)
        return 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, NULL) != 0)
        return 1;
    pid_t parent = getpid();
    pid_t child = fork();
    if (child < 0)
        return 1;
    if (child == 0) {
        close(p[0]);
        pause_ms(1500);           /* the parent is blocked in read by now */
        kill(parent, SIGUSR1);
        pause_ms(1500);
        if (write(p[1], "x", 1) != 1)
            _exit(1);
        _exit(0);
    }
    close(p[1]);
    char c = 0;
    ssize_t n = read(p[0], &c, 1);
    int status = 0;
    waitpid(child, &status, 0);
    printf("read %zd byte(s): %c\n", n, c);
    return n == 1 && c == 'x' && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
