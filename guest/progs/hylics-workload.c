// build: dynamic -lhylics -lm
/* hylics-workload: a synthetic workload whose mean service time is a KNOWN function of the
 * share's size, so that vmsight's Hylics SLO controller can be tested against a known model.
 *
 *   hylics-workload --curve MIB:SECS[,MIB:SECS...] (--rate R | --alternate R1,R2,HALF_SECS)
 *                   --duration SECS [--seed N] [--dist det|exp] [--root DIR] [--no-report]
 *
 * The model: an M/G/1 processor-sharing queue, emulated in real time (CLOCK_MONOTONIC).
 * - m, the share's size, is its size limit from statvfs(root) (f_blocks * f_frsize, in MiB),
 *   re-read at every scheduling step (at least every 50 ms): vmsight resizes it meanwhile.
 * - X(m), the service time of one unit of work, interpolates the --curve points linearly
 *   (MIB strictly increasing, SECS > 0) and is clamped to the first/last value outside them.
 * - Tasks arrive as a Poisson process of rate R per second; with --alternate the rate is R1
 *   for HALF_SECS, then R2 for HALF_SECS, and so on (each inter-arrival time is drawn with the
 *   rate in force at the previous arrival). The pseudo-random numbers are splitmix64's,
 *   seeded by --seed (default 1): a run is reproducible.
 * - Each task needs 1 unit of work (--dist det) or an exponential amount of mean 1 (exp). The
 *   server does 1/X(m) units per second, shared equally by the n tasks in the system. A step
 *   sleeps until the next arrival, the next completion or a 50 ms tick, whichever is first,
 *   then serves dt / (n * X(m)) units to every task, with the m read at the step's start.
 *   Within a step, arrivals and completions happen at their exact model times, so a late
 *   wake-up (or a slow report) does not change the response times.
 * - Arrivals stop at --duration; tasks in the system then finish, for at most 60 s more.
 *
 * Each arrival and completion is reported to vmsight (hylics_task_arrived, hylics_task_done)
 * unless --no-report; a failed report warns once on stderr and the run goes on (failures are
 * counted). Stdout gets one line per completed task, and a summary at the end:
 *   task ID arrive=T done=T response=R m=MIB n=N
 *   summary tasks=N mean_response=S report_failures=F dropped=D unfinished=U
 * T in seconds since the start, MIB the share's size at completion, N the tasks in the system
 * just after the arrival (the task included). At most 100000 tasks are in the system; further
 * arrivals are dropped (not reported) and counted. Exit status 0, 1 on a failure (the share
 * cannot be read), 2 on a usage error. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <time.h>
#include <hylics.h>

#define PROG "hylics-workload"
#define MAX_POINTS 1024
#define MAX_IN_SYSTEM 100000
#define TICK_SECS 0.05
#define DRAIN_SECS 60.0
#define DONE_EPS 1e-9
#define MAX_RATE 1e5          /* arrivals per second */
#define MAX_SECS 31536000.0   /* a year: --duration, HALF_SECS */
#define MAX_MIB 1e9
#define MAX_SERVICE 86400.0   /* SECS of a curve point */

struct point {
    double mib, secs;
};

struct options {
    struct point curve[MAX_POINTS];
    size_t npoints;
    double rate[2], half;      /* half > 0: alternate between rate[0] and rate[1] */
    double duration;
    uint64_t seed;
    int exp_work;
    const char *root;
    int report;
};

struct task {
    double finish;             /* virtual time at which it is done */
    double arrive;
    unsigned long long id;
    unsigned n_at_arrival;
};

/* The emulation's state. Processor sharing serves every task in the system alike, so it keeps
 * the work served to each so far ("virtual time") and each task's virtual finish time in a
 * min-heap; a task's remaining work is finish - vtime. */
struct sim {
    const struct options *o;
    struct task *heap;
    size_t n;
    double vtime;
    double clock;              /* model time (s since start) up to which all is done */
    double next_arrival;
    double m_mib;              /* the share's size, read at the current step's start */
    uint64_t rng;
    unsigned long long next_id, done, dropped, failures;
    double sum_response;
    int warned;
};

static void usage(void)
{
    fprintf(stderr,
            "usage: " PROG " --curve MIB:SECS[,MIB:SECS...]"
            " (--rate R | --alternate R1,R2,HALF_SECS)\n"
            "       --duration SECS [--seed N] [--dist det|exp] [--root DIR] [--no-report]\n");
    exit(2);
}

static void bad(const char *what, const char *arg)
{
    fprintf(stderr, PROG ": bad %s: '%s'\n", what, arg);
    usage();
}

/* ---- Arguments ----------------------------------------------------------------------------- */

/* Parses a finite number in [lo, hi] (lo excluded when open) from s up to *end (or the end of
 * s when end is NULL); 0 on success. */
static int number(const char *s, char **end, double lo, double hi, int open, double *out)
{
    char *e;
    if (!*s || *s == ' ' || *s == '\t')
        return -1;
    errno = 0;
    *out = strtod(s, &e);
    if (errno || e == s || (!end && *e) || !isfinite(*out) || *out < lo || *out > hi ||
        (open && *out == lo))
        return -1;
    if (end)
        *end = e;
    return 0;
}

static void parse_curve(struct options *o, const char *arg)
{
    const char *s = arg;
    o->npoints = 0;
    for (;;) {
        struct point pt;
        char *e;
        if (o->npoints == MAX_POINTS || number(s, &e, 0, MAX_MIB, 0, &pt.mib) || *e != ':' ||
            number(e + 1, &e, 0, MAX_SERVICE, 1, &pt.secs) || (*e != ',' && *e != '\0'))
            bad("--curve (MIB:SECS[,...], at most 1024 points, 0 <= MIB <= 1e9, "
                "0 < SECS <= 86400)", arg);
        if (o->npoints > 0 && pt.mib <= o->curve[o->npoints - 1].mib)
            bad("--curve (MIB must be strictly increasing)", arg);
        o->curve[o->npoints++] = pt;
        if (*e == '\0')
            return;
        s = e + 1;
    }
}

static void parse_alternate(struct options *o, const char *arg)
{
    char *e;
    if (number(arg, &e, 0, MAX_RATE, 1, &o->rate[0]) || *e != ',' ||
        number(e + 1, &e, 0, MAX_RATE, 1, &o->rate[1]) || *e != ',' ||
        number(e + 1, NULL, 0, MAX_SECS, 1, &o->half))
        bad("--alternate (R1,R2,HALF_SECS: 0 < R <= 100000, 0 < HALF_SECS <= 31536000)", arg);
}

static void parse_args(int argc, char **argv, struct options *o)
{
    static const struct option longopts[] = {
        { "curve", required_argument, NULL, 'c' },
        { "rate", required_argument, NULL, 'r' },
        { "alternate", required_argument, NULL, 'a' },
        { "duration", required_argument, NULL, 'd' },
        { "seed", required_argument, NULL, 's' },
        { "dist", required_argument, NULL, 'D' },
        { "root", required_argument, NULL, 'R' },
        { "no-report", no_argument, NULL, 'n' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c, have_rate = 0, have_alt = 0;
    char *e;

    memset(o, 0, sizeof *o);
    o->seed = 1;
    o->report = 1;
    o->root = getenv("HYLICS_ROOT");
    if (!o->root || !*o->root)
        o->root = HYLICS_DEFAULT_ROOT;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case 'c':
            parse_curve(o, optarg);
            break;
        case 'r':
            if (number(optarg, NULL, 0, MAX_RATE, 1, &o->rate[0]))
                bad("--rate (arrivals per second, 0 < R <= 100000)", optarg);
            o->rate[1] = o->rate[0];
            have_rate = 1;
            break;
        case 'a':
            parse_alternate(o, optarg);
            have_alt = 1;
            break;
        case 'd':
            if (number(optarg, NULL, 0, MAX_SECS, 1, &o->duration))
                bad("--duration (seconds, 0 < SECS <= 31536000)", optarg);
            break;
        case 's':
            errno = 0;
            o->seed = strtoull(optarg, &e, 10);
            if (errno || !*optarg || *e || *optarg < '0' || *optarg > '9')
                bad("--seed (a non-negative integer)", optarg);
            break;
        case 'D':
            if (strcmp(optarg, "det") != 0 && strcmp(optarg, "exp") != 0)
                bad("--dist (det or exp)", optarg);
            o->exp_work = strcmp(optarg, "exp") == 0;
            break;
        case 'R':
            if (!*optarg)
                bad("--root", optarg);
            o->root = optarg;
            break;
        case 'n':
            o->report = 0;
            break;
        default:
            usage();
        }
    }
    if (optind != argc || o->npoints == 0 || have_rate + have_alt != 1 || o->duration == 0)
        usage();
    if (have_rate)
        o->half = 0;
}

/* ---- Model --------------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* An exponential draw of mean `mean`. */
static double draw_exp(uint64_t *state, double mean)
{
    double u = (double)((splitmix64(state) >> 11) + 1) * 0x1p-53; /* (0, 1] */
    return -log(u) * mean;
}

/* X(m): seconds per unit of work with a share of m MiB. */
static double service_time(const struct options *o, double m)
{
    const struct point *p = o->curve;
    size_t i;
    if (m <= p[0].mib)
        return p[0].secs;
    if (m >= p[o->npoints - 1].mib)
        return p[o->npoints - 1].secs;
    for (i = 1; m > p[i].mib; i++)
        ;
    return p[i - 1].secs +
           (p[i].secs - p[i - 1].secs) * (m - p[i - 1].mib) / (p[i].mib - p[i - 1].mib);
}

static double rate_at(const struct options *o, double t)
{
    if (o->half <= 0)
        return o->rate[0];
    return o->rate[(unsigned long long)(t / o->half) % 2];
}

/* The share's size limit in MiB; -1 with errno when statvfs fails. */
static double share_mib(const char *root)
{
    struct statvfs sv;
    if (statvfs(root, &sv) < 0)
        return -1;
    return (double)sv.f_blocks * (double)sv.f_frsize / (1024.0 * 1024.0);
}

/* ---- The task heap (by virtual finish time) ------------------------------------------------ */

static void heap_push(struct sim *s, struct task t)
{
    size_t i = s->n++;
    while (i > 0 && s->heap[(i - 1) / 2].finish > t.finish) {
        s->heap[i] = s->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    s->heap[i] = t;
}

static struct task heap_pop(struct sim *s)
{
    struct task top = s->heap[0], last = s->heap[--s->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= s->n)
            break;
        if (c + 1 < s->n && s->heap[c + 1].finish < s->heap[c].finish)
            c++;
        if (s->heap[c].finish >= last.finish)
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (s->n > 0)
        s->heap[i] = last;
    return top;
}

/* ---- Events -------------------------------------------------------------------------------- */

static void report_result(struct sim *s, int rc)
{
    if (rc == 0)
        return;
    s->failures++;
    if (!s->warned) {
        const char *why = hylics_last_error();
        fprintf(stderr,
                PROG ": cannot report tasks to vmsight: %s (going on; failures are counted)\n",
                *why ? why : strerror(errno));
        s->warned = 1;
    }
}

/* Serves the tasks in the system from s->clock to model time t with X = x. */
static void serve_until(struct sim *s, double t, double x)
{
    if (s->n > 0 && t > s->clock)
        s->vtime += (t - s->clock) / ((double)s->n * x);
    if (t > s->clock)
        s->clock = t;
}

/* Completes the tasks with no work left (and, when `force`, the first one in any case: it is
 * due by the model, rounding aside). */
static void complete(struct sim *s, int force)
{
    while (s->n > 0 && (force || s->heap[0].finish - s->vtime <= DONE_EPS)) {
        struct task t = heap_pop(s);
        double response = s->clock - t.arrive;
        force = 0;
        s->done++;
        s->sum_response += response;
        printf("task %llu arrive=%.6f done=%.6f response=%.6f m=%.3f n=%u\n", t.id, t.arrive,
               s->clock, response, s->m_mib, t.n_at_arrival);
        fflush(stdout);
        if (s->o->report)
            report_result(s, hylics_task_done(response));
    }
    if (s->n == 0)
        s->vtime = 0; /* empty: restart virtual time, keeping it small and exact */
}

static void arrive(struct sim *s)
{
    double work = s->o->exp_work ? draw_exp(&s->rng, 1.0) : 1.0;
    if (s->n >= MAX_IN_SYSTEM) {
        s->dropped++;
    } else {
        struct task t = { s->vtime + work, s->clock, ++s->next_id, (unsigned)s->n + 1 };
        heap_push(s, t);
        if (s->o->report)
            report_result(s, hylics_task_arrived());
    }
    s->next_arrival = s->clock + draw_exp(&s->rng, 1.0 / rate_at(s->o, s->clock));
}

/* The model time of the next completion with X = x (INFINITY when the system is empty). */
static double next_completion(const struct sim *s, double x)
{
    if (s->n == 0)
        return INFINITY;
    return s->clock + fmax(0.0, s->heap[0].finish - s->vtime) * (double)s->n * x;
}

static double next_admitted_arrival(const struct sim *s)
{
    return s->next_arrival < s->o->duration ? s->next_arrival : INFINITY;
}

/* Runs the model from s->clock to time `to` with X = x, event by event. */
static void advance(struct sim *s, double to, double x)
{
    for (;;) {
        double tc = next_completion(s, x), ta = next_admitted_arrival(s);
        if (fmin(tc, ta) > to)
            break;
        if (tc <= ta) {
            serve_until(s, tc, x);
            complete(s, 1);
        } else {
            serve_until(s, ta, x);
            arrive(s);
        }
    }
    serve_until(s, to, x);
    complete(s, 0);
}

/* ---- Real time ----------------------------------------------------------------------------- */

static struct timespec start;

static double elapsed(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - start.tv_sec) + (double)(now.tv_nsec - start.tv_nsec) / 1e9;
}

static void sleep_until(double t)
{
    struct timespec ts;
    double whole = floor(t);
    long long ns = start.tv_nsec + (long long)((t - whole) * 1e9);
    ts.tv_sec = start.tv_sec + (time_t)whole + (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* Reads the share's size into s->m_mib (keeping the last one, with a warning, on a failure). */
static double current_x(struct sim *s)
{
    static int warned;
    double m = share_mib(s->o->root);
    if (m >= 0) {
        s->m_mib = m;
    } else if (!warned) {
        fprintf(stderr, PROG ": cannot read the size of %s: %s (keeping %.3f MiB)\n", s->o->root,
                strerror(errno), s->m_mib);
        warned = 1;
    }
    return service_time(s->o, s->m_mib);
}

static void run(struct sim *s)
{
    const double end = s->o->duration + DRAIN_SECS;
    double x;

    clock_gettime(CLOCK_MONOTONIC, &start);
    s->clock = 0;
    s->next_arrival = draw_exp(&s->rng, 1.0 / rate_at(s->o, 0));
    x = current_x(s);
    for (;;) {
        double target;
        advance(s, fmin(elapsed(), end), x);
        if (s->clock >= end ||
            (s->clock >= s->o->duration && s->n == 0 && next_admitted_arrival(s) == INFINITY))
            break;
        x = current_x(s);
        target = fmin(fmin(next_completion(s, x), next_admitted_arrival(s)),
                      fmin(s->clock + TICK_SECS, end));
        if (s->clock < s->o->duration)
            target = fmin(target, s->o->duration);
        if (target > elapsed())
            sleep_until(target);
    }
}

int main(int argc, char **argv)
{
    static struct options o;
    struct sim s;

    parse_args(argc, argv, &o);
    memset(&s, 0, sizeof s);
    s.o = &o;
    s.rng = o.seed;
    s.m_mib = share_mib(o.root);
    if (s.m_mib < 0) {
        fprintf(stderr, PROG ": cannot read the size of %s: %s\n", o.root, strerror(errno));
        return 1;
    }
    s.heap = malloc(sizeof *s.heap * MAX_IN_SYSTEM);
    if (!s.heap) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    run(&s);
    printf("summary tasks=%llu mean_response=%.6f report_failures=%llu dropped=%llu"
           " unfinished=%zu\n",
           s.done, s.done ? s.sum_response / (double)s.done : 0.0, s.failures, s.dropped, s.n);
    fflush(stdout);
    free(s.heap);
    return 0;
}
