/* forktree LEVEL MAX: each level writes a line, forks a child that execs forktree LEVEL+1,
 * and waits for it; MAX levels deep (default 3). A fork/exec tree for the interception tests. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int level = argc > 1 ? atoi(argv[1]) : 0;
    int max = argc > 2 ? atoi(argv[2]) : 3;
    char line[64];
    int len = snprintf(line, sizeof line, "level %d pid %d\n", level, (int)getpid());
    if (write(1, line, (size_t)len) != len)
        return 1;
    if (level + 1 >= max)
        return 0;
    pid_t c = fork();
    if (c < 0)
        return 1;
    if (c == 0) {
        char next[16];
        snprintf(next, sizeof next, "%d", level + 1);
        execl("/usr/local/bin/forktree", "forktree", next, argv[2] ? argv[2] : "3", (char *)NULL);
        _exit(127);
    }
    int st = 0;
    if (waitpid(c, &st, 0) != c)
        return 1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}
