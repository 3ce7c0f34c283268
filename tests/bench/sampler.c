/*
 * DESIGN: two kinds of samples. Wall samples are taken on the thread that began the
 * phase, every INTERVAL_US of wall time (a CLOCK_MONOTONIC POSIX timer aimed at that
 * thread, with a signal of its own: a high-resolution timer), so that they say where
 * that thread spends its time, running or waiting for a device, the disk or other
 * threads. CPU samples (SIGPROF from setitimer ITIMER_PROF) come every INTERVAL_US of
 * the process's CPU time, rounded up to the kernel's tick, on whichever thread runs:
 * they say which threads' work the phase's CPUs do. Each is the interrupted instruction and the
 * return addresses above it (glibc's backtrace, whose unwinder steps through the
 * signal frame), written into a buffer taken before sampling starts. Nothing
 * is resolved here: at exit each address is written as an object of the process (the
 * program, a library) and an offset into it, read from dl_iterate_phdr, and
 * tests/bench/profile-report.py names them with addr2line where the binaries are.
 */
#include "tests/bench/sampler.h"

#include <errno.h>
#include <execinfo.h>
#include <link.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#define DEPTH 30          /* frames kept per sample */
#define MAX_SAMPLES 131072
#define MAX_LABELS 32
#define INTERVAL_US 1000
#define WALL_SIGNAL (SIGRTMIN + 5)

enum { WALL, CPU };

typedef struct sample {
    uint16_t label;
    uint8_t kind; /* WALL or CPU */
    uint8_t depth;
    void *pc[DEPTH]; /* pc[0] the interrupted instruction, then return addresses */
} sample;

static sample *samples;
static atomic_uint_fast64_t taken;
static atomic_uint_fast64_t dropped;
static _Atomic int current = -1; /* the label sampled now, -1 none */
static const char *labels[MAX_LABELS];
static int label_count;
static char directory[PATH_MAX];
static timer_t timer;

static void on_sample(int signal, siginfo_t *info, void *context)
{
    (void)info;
    int label = atomic_load_explicit(&current, memory_order_relaxed);
    if (label < 0)
        return;
    uint_fast64_t i = atomic_fetch_add_explicit(&taken, 1, memory_order_relaxed);
    if (i >= MAX_SAMPLES) {
        atomic_fetch_add_explicit(&dropped, 1, memory_order_relaxed);
        return;
    }
    sample *s = &samples[i];
    s->label = (uint16_t)label;
    s->kind = signal == SIGPROF ? CPU : WALL;
    s->pc[0] = (void *)((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP];
    s->depth = 1;
    /* the handler's own frames and the signal trampoline come first: the callers
     * start after the interrupted instruction */
    void *frames[DEPTH + 8];
    int n = backtrace(frames, DEPTH + 8);
    for (int f = 0; f < n; f++)
        if (frames[f] == s->pc[0]) {
            for (int c = f + 1; c < n && s->depth < DEPTH; c++)
                s->pc[s->depth++] = frames[c];
            break;
        }
}

/* ---- writing ---------------------------------------------------------------------------- */

typedef struct object {
    char path[PATH_MAX];
    uintptr_t base;             /* what the object's addresses are offset by */
    uintptr_t low[16], high[16]; /* its loaded segments */
    int segments;
    int used;                   /* its number in the file, 0 while none */
} object;

typedef struct object_list {
    object *items;
    int count, capacity;
} object_list;

static int add_object(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    object_list *list = data;
    if (list->count == list->capacity)
        return 1;
    object *o = &list->items[list->count++];
    memset(o, 0, sizeof(*o));
    if (info->dlpi_name == NULL || info->dlpi_name[0] == '\0') {
        ssize_t len = readlink("/proc/self/exe", o->path, sizeof(o->path) - 1);
        o->path[len > 0 ? len : 0] = '\0';
    } else {
        snprintf(o->path, sizeof(o->path), "%s", info->dlpi_name);
    }
    o->base = info->dlpi_addr;
    for (int p = 0; p < info->dlpi_phnum && o->segments < 16; p++)
        if (info->dlpi_phdr[p].p_type == PT_LOAD) {
            o->low[o->segments] = info->dlpi_addr + info->dlpi_phdr[p].p_vaddr;
            o->high[o->segments] = o->low[o->segments] + info->dlpi_phdr[p].p_memsz;
            o->segments++;
        }
    return 0;
}

static object *object_of(object_list *list, uintptr_t address)
{
    for (int i = 0; i < list->count; i++)
        for (int s = 0; s < list->items[i].segments; s++)
            if (address >= list->items[i].low[s] && address < list->items[i].high[s])
                return &list->items[i];
    return NULL;
}

static void write_profile(void)
{
    atomic_store(&current, -1);
    timer_delete(timer);
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_PROF, &off, NULL);
    object_list list = {calloc(512, sizeof(object)), 0, 512};
    if (list.items == NULL)
        return;
    dl_iterate_phdr(add_object, &list);
    char path[PATH_MAX + 64];
    snprintf(path, sizeof(path), "%s/%s-%ld.profile", directory, program_invocation_short_name,
             (long)getpid());
    FILE *out = fopen(path, "w");
    if (out == NULL) {
        fprintf(stderr, "bench profile: cannot write %s\n", path);
        free(list.items);
        return;
    }
    uint64_t count = atomic_load(&taken);
    count = count < MAX_SAMPLES ? count : MAX_SAMPLES;
    fprintf(out, "ember-bench-profile 1\nprogram %s\ninterval_us %d\ndropped %llu\n",
            program_invocation_short_name, INTERVAL_US,
            (unsigned long long)atomic_load(&dropped));
    for (int l = 0; l < label_count; l++)
        fprintf(out, "label %d %s\n", l, labels[l]);
    int used = 0;
    for (uint64_t i = 0; i < count; i++) {
        const sample *s = &samples[i];
        for (int f = 0; f < s->depth; f++) {
            object *o = object_of(&list, (uintptr_t)s->pc[f]);
            if (o != NULL && o->used == 0) {
                o->used = ++used;
                fprintf(out, "object %d %s\n", o->used, o->path);
            }
        }
    }
    /* a frame: object number and offset, 0 for an address in no object */
    for (uint64_t i = 0; i < count; i++) {
        const sample *s = &samples[i];
        fprintf(out, "sample %u %s", s->label, s->kind == CPU ? "cpu" : "wall");
        for (int f = 0; f < s->depth; f++) {
            object *o = object_of(&list, (uintptr_t)s->pc[f]);
            fprintf(out, " %d:%lx", o != NULL ? o->used : 0,
                    (unsigned long)((uintptr_t)s->pc[f] - (o != NULL ? o->base : 0)));
        }
        fputc('\n', out);
    }
    fclose(out);
    fprintf(stderr, "bench profile: %llu samples in %s\n", (unsigned long long)count, path);
    free(list.items);
}

/* ---- phases ----------------------------------------------------------------------------- */

static int start_sampling(void)
{
    const char *dir = getenv("EMBER_BENCH_PROFILE");
    if (dir == NULL || dir[0] == '\0')
        return -1;
    snprintf(directory, sizeof(directory), "%s", dir);
    samples = malloc(MAX_SAMPLES * sizeof(sample));
    if (samples == NULL) {
        fprintf(stderr, "bench profile: no memory for the samples\n");
        return -1;
    }
    void *prime[4];
    backtrace(prime, 4); /* loads the unwinder now, not in the handler */
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_sample;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&action.sa_mask); /* neither kind lands inside the other's handler */
    sigaddset(&action.sa_mask, WALL_SIGNAL);
    sigaddset(&action.sa_mask, SIGPROF);
    sigaction(WALL_SIGNAL, &action, NULL);
    sigaction(SIGPROF, &action, NULL);
    atexit(write_profile);
    return 0;
}

/* Starts (on) or stops both kinds of samples: between phases no signal arrives, so the
 * program's sleeps, waits and system calls between phases run as without a profile. */
static void arm(bool on)
{
    long interval = on ? INTERVAL_US : 0;
    struct itimerval cpu = {{0, interval}, {0, interval}};
    setitimer(ITIMER_PROF, &cpu, NULL);
    struct itimerspec wall = {{0, interval * 1000}, {0, interval * 1000}};
    timer_settime(timer, 0, &wall, NULL);
}

/* Aims the timer at the calling thread. */
static int aim_timer(void)
{
    static bool created;
    if (created)
        timer_delete(timer);
    struct sigevent event;
    memset(&event, 0, sizeof(event));
    event.sigev_notify = SIGEV_THREAD_ID;
    event.sigev_signo = WALL_SIGNAL;
    event._sigev_un._tid = (pid_t)syscall(SYS_gettid);
    created = timer_create(CLOCK_MONOTONIC, &event, &timer) == 0;
    if (!created) {
        fprintf(stderr, "bench profile: no timer for the samples\n");
        return -1;
    }
    return 0;
}

void bench_profile_begin(const char *label)
{
    static int state;  /* 0 not yet asked, 1 sampling, -1 off */
    static pid_t aimed; /* the thread the timer samples */
    if (state == 0)
        state = start_sampling() == 0 ? 1 : -1;
    pid_t self = (pid_t)syscall(SYS_gettid);
    if (state > 0 && aimed != self)
        state = aim_timer() == 0 ? 1 : -1;
    if (state < 0)
        return;
    aimed = self;
    int l = 0;
    while (l < label_count && strcmp(labels[l], label) != 0)
        l++;
    if (l == label_count) {
        if (label_count == MAX_LABELS)
            return;
        labels[label_count++] = strdup(label);
    }
    atomic_store(&current, l);
    arm(true);
}

void bench_profile_end(void)
{
    atomic_store(&current, -1);
    if (label_count > 0)
        arm(false);
}
