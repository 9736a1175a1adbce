// build: dynamic -lhylics
/* hylics-report: reports task arrivals and completions to vmsight's Hylics controller for a
 * workload that is not written in C (a script, a pipeline of tools), through libhylics
 * (hylics_task_arrived, hylics_task_done in hylics.h), over one kept-open connection.
 *
 * Reads lines from stdin until EOF:
 *   arrive          one task arrived now
 *   done SECS       one task completed SECS seconds after it arrived (finite, >= 0)
 * Blank lines are ignored. A line that is neither is a usage error: its number goes to stderr
 * and the line is skipped. A report the service refuses or cannot take (no controller, no
 * vsock, overloaded) is counted; the first failure's sentence goes to stderr, later ones only
 * to the count, and reading goes on: a workload never stops because its reports failed.
 * At EOF prints `reports N failed F bad B`. Exit status 0 when every line was a valid report
 * (whether or not the service took it), 1 when some lines were bad, 2 on a usage error. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <hylics.h>

#define LINE_MAX_BYTES 256

struct counts {
    unsigned long reports, failed, bad;
};

/* Parses "done SECS"; 0 and *secs set, -1 when the number is not a finite value >= 0. */
static int parse_done(const char *arg, double *secs)
{
    char *end;
    errno = 0;
    *secs = strtod(arg, &end);
    while (*end == ' ' || *end == '\t')
        end++;
    if (errno || end == arg || *end || !isfinite(*secs) || *secs < 0)
        return -1;
    return 0;
}

static void note_failure(struct counts *c)
{
    const char *why = hylics_last_error();
    if (c->failed++ == 0)
        fprintf(stderr, "hylics-report: a report failed (later failures are only counted): %s\n",
                *why ? why : strerror(errno));
}

/* One line without its newline. */
static void handle(char *line, unsigned long lineno, struct counts *c)
{
    double secs;
    int rc;
    while (*line == ' ' || *line == '\t')
        line++;
    if (!*line)
        return;
    if (strcmp(line, "arrive") == 0) {
        rc = hylics_task_arrived();
    } else if (strncmp(line, "done ", 5) == 0 && parse_done(line + 5, &secs) == 0) {
        rc = hylics_task_done(secs);
    } else {
        fprintf(stderr, "hylics-report: line %lu: expected `arrive` or `done SECS`\n", lineno);
        c->bad++;
        return;
    }
    c->reports++;
    if (rc < 0)
        note_failure(c);
}

int main(int argc, char **argv)
{
    char line[LINE_MAX_BYTES];
    unsigned long lineno = 0;
    struct counts c = {0, 0, 0};
    (void)argv;
    if (argc != 1) {
        fprintf(stderr, "usage: hylics-report < LINES  (`arrive` or `done SECS` per line)\n");
        return 2;
    }
    while (fgets(line, sizeof line, stdin)) {
        size_t n = strlen(line);
        lineno++;
        if (n && line[n - 1] == '\n') {
            line[n - 1] = '\0';
        } else if (!feof(stdin)) {
            int ch;
            while ((ch = getchar()) != EOF && ch != '\n')
                ;
            fprintf(stderr, "hylics-report: line %lu: longer than %d bytes\n", lineno,
                    LINE_MAX_BYTES - 2);
            c.bad++;
            continue;
        }
        handle(line, lineno, &c);
    }
    printf("reports %lu failed %lu bad %lu\n", c.reports, c.failed, c.bad);
    return c.bad ? 1 : 0;
}
