/*
 * DESIGN: kernels/ember_kernels.h implemented serially on the host, for tests.
 *
 * Linked instead of the real kernels, it lets the CUDA backend (lib/device/cuda_device.c,
 * lib/device/cuda_backend.c, lib/device/exchange_nccl.c, unchanged) run on any machine: every
 * launcher runs its kernel's per-item function from kernels/kernel_logic.h over all
 * items, one after the other; CUB's scan and radix sort are replaced by a serial scan
 * and a stable sort; NCCL transfers are memcpy.
 *
 * "Device memory" is real host memory, but it is kept inaccessible (PROT_NONE) except
 * while an emulated kernel or copy runs, so host code that touches a device pointer
 * directly (which would fault on a GPU) faults here too. One mutex serialises all
 * emulated device work for that reason.
 *
 * Copies between the GPU and pinned host memory (em_gpu_host_alloc) complete, as far as
 * the host can see, as late as CUDA allows: a copy into pinned memory writes it only
 * when the host waits for the copy's stream (em_gpu_stream_synchronize, or
 * em_gpu_event_synchronize of an event recorded after the copy), so host code that
 * reads such memory before waiting reads stale bytes, as it could on a GPU; and a copy
 * out of pinned memory must find its source unchanged when it is waited for (the DMA
 * reads it meanwhile): a change, or freeing it first, aborts the process naming the
 * copy. Copies to or from pageable memory are synchronous, as CUDA makes them.
 *
 * Kernels run one at a time, each as it is enqueued, or with EMBER_EMULATED_LATE=1 as
 * late as CUDA lets them (LATER_OP below): then a kernel on one stream that should wait
 * for another stream's work and does not runs before it. A launch's items run in index
 * order, or in an order of the launch's own (EMBER_EMULATED_ORDER, EACH_ITEM below).
 *
 * What this cannot show: kernels running beside each other, launch geometry, warp
 * primitives (the butterfly reduction of rowwise adagrad is emulated below in the same
 * order), the CUDA memory model, and CUB itself.
 *
 * Configuration (environment): EMBER_EMULATED_GPUS (default 2) devices of
 * EMBER_EMULATED_GPU_MEBIBYTES (default 512) each; EMBER_EMULATED_ORDER (forward, the
 * default, reverse or scattered): the order a launch's items run in; EMBER_EMULATED_LATE
 * (0, the default, or 1): whether kernels wait on their stream until something needs
 * them. Tests may set both (tests/support/kernels_emulated.h).
 *
 * Faults: when the failpoint gpu_fault triggers at the start of device work (a kernel,
 * a copy), the emulated GPUs fail as a kernel fault leaves a real one: that call and
 * every later call of the process return the sticky cudaErrorIllegalAddress (700,
 * fatal). The work itself still runs, as a faulting kernel's writes are undefined.
 * The failpoint nccl_init_fail makes ncclCommInitAll fail.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/kernel_logic.h"
#include "lib/base/failpoint.h"
#include "tests/support/kernels_emulated.h"

#define MAX_DEVICES 16
#define MAX_REGIONS 4096
#define DEFAULT_DEVICES 2
#define DEFAULT_MEBIBYTES 512

typedef struct later_call later_call;

struct em_gpu_stream {
    int ordinal;
    uint64_t issued; /* copies involving pinned memory enqueued so far */
    /* EMBER_EMULATED_LATE: the kernels enqueued and not yet run, oldest first, and how
     * many were enqueued and run (under later_lock); run_lock: held while they run */
    later_call *later_head, **later_tail;
    uint64_t later_queued, later_ran;
    pthread_mutex_t run_lock;
    em_gpu_stream *next_stream; /* every stream (later_lock) */
};

struct em_gpu_event {
    int ordinal;
    em_gpu_stream *stream; /* where it was last recorded (NULL: never) */
    uint64_t issued;       /* the stream's copies enqueued by then */
    uint64_t queued;       /* and its kernels enqueued by then */
};

struct em_gpu_comm {
    int rank;
};

typedef struct region {
    void *base;
    size_t bytes;
    int ordinal;
} region;

static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;
/* Changed by every launch (under device_lock): the scattered order's offset. */
static uint64_t launch_salt;
static region regions[MAX_REGIONS];
static size_t region_count;
static uint64_t allocated[MAX_DEVICES];

/* ---- configuration and status ------------------------------------------------------- */

static int emulated_devices(void)
{
    const char *text = getenv("EMBER_EMULATED_GPUS");
    int count = text != NULL ? atoi(text) : DEFAULT_DEVICES;
    return count < 0 ? 0 : count > MAX_DEVICES ? MAX_DEVICES : count;
}

static uint64_t emulated_bytes(void)
{
    const char *text = getenv("EMBER_EMULATED_GPU_MEBIBYTES");
    uint64_t mebibytes = text != NULL ? strtoull(text, NULL, 10) : DEFAULT_MEBIBYTES;
    return mebibytes << 20;
}

/* Set once gpu_fault triggered: every call fails from then on. */
static _Atomic bool faulted;

static em_gpu_status sticky_fault(void)
{
    return (em_gpu_status){700, 0, "cudaStreamSynchronize",
                           "an illegal memory access was encountered (emulated)", 1};
}

static em_gpu_status ok(void)
{
    if (atomic_load(&faulted))
        return sticky_fault();
    return (em_gpu_status){0, 0, NULL, NULL, 0};
}

static em_gpu_status failure(int code, int out_of_memory, const char *call, const char *message)
{
    if (atomic_load(&faulted))
        return sticky_fault();
    return (em_gpu_status){code, out_of_memory, call, message, 0};
}

static em_gpu_status check_ordinal(int ordinal, const char *call)
{
    if (ordinal < 0 || ordinal >= emulated_devices())
        return failure(101, 0, call, "invalid device ordinal (emulated)");
    return ok();
}

/* ---- device memory access ------------------------------------------------------------ */

static void protect_all(int protection)
{
    for (size_t r = 0; r < region_count; r++)
        if (mprotect(regions[r].base, regions[r].bytes, protection) != 0)
            abort();
}

/* What the host asked of the emulated GPUs (em_gpu_emulated_counts). */
static _Atomic uint64_t operations_issued, transfers_issued, host_waits, overlapped_waits,
    joint_waits;

void em_gpu_emulated_counts(uint64_t *operations, uint64_t *waits)
{
    *operations = atomic_load(&operations_issued);
    *waits = atomic_load(&host_waits);
}

uint64_t em_gpu_emulated_transfers(void)
{
    return atomic_load(&transfers_issued);
}

uint64_t em_gpu_emulated_overlapped_waits(void)
{
    return atomic_load(&overlapped_waits);
}

uint64_t em_gpu_emulated_joint_waits(void)
{
    return atomic_load(&joint_waits);
}

/* Device work runs between these two: regions readable and writable, one at a time. */
static void enter_device(void)
{
    atomic_fetch_add(&operations_issued, 1);
    if (em_failpoint_hit(EM_FAILPOINT_GPU_FAULT, NULL))
        atomic_store(&faulted, true);
    pthread_mutex_lock(&device_lock);
    launch_salt++;
    protect_all(PROT_READ | PROT_WRITE);
}

static void leave_device(void)
{
    protect_all(PROT_NONE);
    pthread_mutex_unlock(&device_lock);
}

/* ---- the order of a launch's items ---------------------------------------------------- */

/* A GPU runs a launch's threads in no fixed order. EMBER_EMULATED_ORDER sets the order
 * the emulated kernels visit their items in: "forward" (0, 1, 2, ...: the default),
 * "reverse", or "scattered" (item (k * m + c) mod n at step k, m prime to n, c new for
 * each launch), so that what holds in one order only (the slot an insert claims, the row
 * a new key is given, which of a key's repeats a dedupe sees first) shows here rather
 * than on a GPU. The serial scans and the sort that stand in for CUB's keep their order
 * (CUB's results do not depend on its threads'); so do a launch's parts (em_gpu_shard_part,
 * each on its own grid row) and the elements of one item. */
typedef enum item_order { ORDER_FORWARD, ORDER_REVERSE, ORDER_SCATTERED } item_order;

static _Atomic int chosen_order = -1; /* -1: from EMBER_EMULATED_ORDER, when first asked */

void em_gpu_emulated_set_order(const char *order)
{
    item_order chosen = ORDER_FORWARD;
    if (order == NULL || order[0] == '\0' || strcmp(order, "forward") == 0) {
        chosen = ORDER_FORWARD;
    } else if (strcmp(order, "reverse") == 0) {
        chosen = ORDER_REVERSE;
    } else if (strcmp(order, "scattered") == 0) {
        chosen = ORDER_SCATTERED;
    } else {
        fprintf(stderr, "EMBER_EMULATED_ORDER='%s': expected forward, reverse or scattered\n",
                order);
        abort();
    }
    atomic_store_explicit(&chosen_order, (int)chosen, memory_order_relaxed);
}

static item_order order_of_items(void)
{
    int known = atomic_load_explicit(&chosen_order, memory_order_relaxed);
    if (known < 0) {
        em_gpu_emulated_set_order(getenv("EMBER_EMULATED_ORDER"));
        known = atomic_load_explicit(&chosen_order, memory_order_relaxed);
    }
    return (item_order)known;
}

static uint64_t greatest_divisor(uint64_t a, uint64_t b)
{
    while (b != 0) {
        uint64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

/* A step prime to n, near n times the golden ratio's fraction, so that neighbouring
 * steps visit items far apart; the last one found is kept (under device_lock). */
static uint64_t scattered_step(uint64_t n)
{
    static uint64_t known_n, known_step;
    if (n == known_n)
        return known_step;
    uint64_t step = (uint64_t)((double)n * 0.6180339887498949) | 1u;
    while (greatest_divisor(n, step) != 1)
        step += 2;
    known_n = n;
    known_step = step % n;
    return known_step;
}

/* The item a launch over n items visits at its step k (k <= n; at k == n, a value the
 * loop does not use). */
static uint64_t item_at(uint64_t k, uint64_t n)
{
    if (k >= n)
        return n;
    switch (order_of_items()) {
    case ORDER_REVERSE:
        return n - 1 - k;
    case ORDER_SCATTERED: {
        uint64_t offset = (launch_salt * UINT64_C(0x9e3779b97f4a7c15)) % n;
        return (uint64_t)(((unsigned __int128)k * scattered_step(n) + offset) % n);
    }
    case ORDER_FORWARD:
        break;
    }
    return k;
}

bool em_gpu_emulated_order_fixed(void)
{
    return order_of_items() != ORDER_SCATTERED;
}

/* Every item i of [0, n) once, in the order EMBER_EMULATED_ORDER sets. */
#define EACH_ITEM(i, n)                                                                  \
    for (uint64_t i##_end = (n), i##_k = 0, i = item_at(0, i##_end); i##_k < i##_end;   \
         i = item_at(++i##_k, i##_end))

/* ---- kernels that run when their stream is waited for --------------------------------- */

/* With EMBER_EMULATED_LATE=1 a kernel (an operation defined with LATER_OP) does not run
 * when it is enqueued: its arguments are kept on its stream, and it runs, in the
 * stream's order, once something needs it done: the host waits for the stream (or for
 * an event recorded after it), another stream is made to wait for such an event, an
 * operation that runs at once (a copy, a scan, a sort) is enqueued behind it on the
 * stream, or device memory is freed (cudaFree waits for the whole device). That is as
 * late as CUDA lets it run: work on one stream that reads what a kernel of another
 * stream writes, with no event between them, reads it before it is written, as it may
 * on a GPU; and a kernel still to run on one lane finds memory that another lane gave
 * back to the pool already overwritten (em_gpu_fill_freed). Without it (the default)
 * every kernel runs as it is enqueued. */
struct later_call {
    later_call *next;
    void (*replay)(const void *call);
    _Alignas(max_align_t) unsigned char call[]; /* the operation's *_call struct */
};

static pthread_mutex_t later_lock = PTHREAD_MUTEX_INITIALIZER;
/* Held while every stream's kept kernels run (run_all_later) and while a stream is
 * added or removed; before run_lock, later_lock and device_lock. */
static pthread_mutex_t streams_lock = PTHREAD_MUTEX_INITIALIZER;
static em_gpu_stream *all_streams;

static void run_all_later(void);

static _Atomic int chosen_late = -1; /* -1: from EMBER_EMULATED_LATE, when first asked */

void em_gpu_emulated_set_late(bool late)
{
    if (!late)
        run_all_later(); /* the kept kernels before any that runs at once */
    atomic_store_explicit(&chosen_late, late ? 1 : 0, memory_order_relaxed);
}

static bool late_kernels(void)
{
    int known = atomic_load_explicit(&chosen_late, memory_order_relaxed);
    if (known >= 0)
        return known == 1;
    const char *text = getenv("EMBER_EMULATED_LATE");
    if (text != NULL && text[0] != '\0' && strcmp(text, "0") != 0 && strcmp(text, "1") != 0) {
        fprintf(stderr, "EMBER_EMULATED_LATE='%s': expected 0 or 1\n", text);
        abort();
    }
    em_gpu_emulated_set_late(text != NULL && strcmp(text, "1") == 0);
    return atomic_load_explicit(&chosen_late, memory_order_relaxed) == 1;
}

/* Runs the stream's kept kernels, in order, until `upto` of its kernels have run. */
static void run_later(em_gpu_stream *stream, uint64_t upto)
{
    if (stream == NULL)
        return;
    pthread_mutex_lock(&stream->run_lock);
    for (;;) {
        pthread_mutex_lock(&later_lock);
        later_call *call = stream->later_ran < upto ? stream->later_head : NULL;
        if (call != NULL) {
            stream->later_head = call->next;
            if (stream->later_head == NULL)
                stream->later_tail = &stream->later_head;
            stream->later_ran++;
        }
        pthread_mutex_unlock(&later_lock);
        if (call == NULL)
            break;
        call->replay(call->call);
        free(call);
    }
    pthread_mutex_unlock(&stream->run_lock);
}

/* An operation that runs at once: the stream's kernels before it first. */
static void catch_up(em_gpu_stream *stream)
{
    run_later(stream, UINT64_MAX);
}

/* What cudaFree and cudaFreeHost wait for: every stream's kernels. */
static void run_all_later(void)
{
    pthread_mutex_lock(&streams_lock);
    for (em_gpu_stream *stream = all_streams; stream != NULL; stream = stream->next_stream)
        catch_up(stream);
    pthread_mutex_unlock(&streams_lock);
}

static em_gpu_status keep_for_later(em_gpu_stream *stream, void (*replay)(const void *),
                                    const void *call, size_t bytes)
{
    later_call *kept = malloc(sizeof(*kept) + bytes);
    if (kept == NULL)
        abort();
    kept->next = NULL;
    kept->replay = replay;
    memcpy(kept->call, call, bytes);
    pthread_mutex_lock(&later_lock);
    *stream->later_tail = kept;
    stream->later_tail = &kept->next;
    stream->later_queued++;
    pthread_mutex_unlock(&later_lock);
    return ok();
}

/* A kernel run later has no caller to return its failure to: only a sticky fault (which
 * the next wait reports) may happen there. */
static void replayed(em_gpu_status status, const char *operation)
{
    if (status.code != 0 && !atomic_load(&faulted)) {
        fprintf(stderr, "emulated GPU: %s, run later, failed: %s (%s)\n", operation,
                status.message, status.call);
        abort();
    }
}

/* LATER_EACH(f, (type, name), ...): f(type, name) for each pair, up to 14. */
#define LATER_COUNT(...) LATER_COUNT_(__VA_ARGS__, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define LATER_COUNT_(a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, n, ...) n
#define LATER_JOIN(a, b) LATER_JOIN_(a, b)
#define LATER_JOIN_(a, b) a##b
#define LATER_EACH(f, ...) LATER_JOIN(LATER_EACH_, LATER_COUNT(__VA_ARGS__))(f, __VA_ARGS__)
#define LATER_EACH_1(f, x) f x
#define LATER_EACH_2(f, x, ...) f x LATER_EACH_1(f, __VA_ARGS__)
#define LATER_EACH_3(f, x, ...) f x LATER_EACH_2(f, __VA_ARGS__)
#define LATER_EACH_4(f, x, ...) f x LATER_EACH_3(f, __VA_ARGS__)
#define LATER_EACH_5(f, x, ...) f x LATER_EACH_4(f, __VA_ARGS__)
#define LATER_EACH_6(f, x, ...) f x LATER_EACH_5(f, __VA_ARGS__)
#define LATER_EACH_7(f, x, ...) f x LATER_EACH_6(f, __VA_ARGS__)
#define LATER_EACH_8(f, x, ...) f x LATER_EACH_7(f, __VA_ARGS__)
#define LATER_EACH_9(f, x, ...) f x LATER_EACH_8(f, __VA_ARGS__)
#define LATER_EACH_10(f, x, ...) f x LATER_EACH_9(f, __VA_ARGS__)
#define LATER_EACH_11(f, x, ...) f x LATER_EACH_10(f, __VA_ARGS__)
#define LATER_EACH_12(f, x, ...) f x LATER_EACH_11(f, __VA_ARGS__)
#define LATER_EACH_13(f, x, ...) f x LATER_EACH_12(f, __VA_ARGS__)
#define LATER_EACH_14(f, x, ...) f x LATER_EACH_13(f, __VA_ARGS__)
#define LATER_FIELD(type, name) type name;
#define LATER_PARAM(type, name) , type name
#define LATER_NAME(type, name) , name
#define LATER_ARG(type, name) , c->name

/* Defines the kernel operation fn(em_gpu_stream *stream, type name, ...), its
 * parameters after the stream given as (type, name) pairs; the body that follows runs
 * it, at once or, with EMBER_EMULATED_LATE=1, when its stream gets to it. Every
 * parameter is kept by value: pointers are to device memory, as a kernel's are. */
#define LATER_OP(fn, ...)                                                                  \
    typedef struct fn##_call {                                                             \
        em_gpu_stream *stream;                                                             \
        LATER_EACH(LATER_FIELD, __VA_ARGS__)                                               \
    } fn##_call;                                                                           \
    static em_gpu_status fn##_now(em_gpu_stream *stream                                    \
                                      LATER_EACH(LATER_PARAM, __VA_ARGS__));               \
    static void fn##_replay(const void *call)                                              \
    {                                                                                      \
        const fn##_call *c = call;                                                         \
        replayed(fn##_now(c->stream LATER_EACH(LATER_ARG, __VA_ARGS__)), #fn);             \
    }                                                                                      \
    em_gpu_status fn(em_gpu_stream *stream LATER_EACH(LATER_PARAM, __VA_ARGS__))           \
    {                                                                                      \
        if (stream == NULL || !late_kernels())                                             \
            return fn##_now(stream LATER_EACH(LATER_NAME, __VA_ARGS__));                   \
        fn##_call call = {stream LATER_EACH(LATER_NAME, __VA_ARGS__)};                     \
        return keep_for_later(stream, fn##_replay, &call, sizeof(call));                   \
    }                                                                                      \
    static em_gpu_status fn##_now(em_gpu_stream *stream LATER_EACH(LATER_PARAM, __VA_ARGS__))

/* ---- copies involving pinned host memory ----------------------------------------------- */

#define MAX_PINNED 4096

/* Pinned host blocks (em_gpu_host_alloc) and the copies the host has not yet waited
 * for, oldest first. */
typedef struct pinned_block {
    const uint8_t *base;
    size_t bytes;
} pinned_block;

typedef struct pending_copy {
    em_gpu_stream *stream;
    uint64_t number;   /* the stream's issued count with this copy */
    bool to_host;      /* into pinned memory (written when waited for); else out of it */
    uint8_t *host;     /* the pinned bytes */
    uint8_t *bytes;    /* to_host: what the GPU had; else the source as it was enqueued */
    size_t size;
    struct pending_copy *next;
} pending_copy;

static pthread_mutex_t pinned_lock = PTHREAD_MUTEX_INITIALIZER;
static pinned_block pinned[MAX_PINNED];
static size_t pinned_count;
static pending_copy *pending_head, **pending_tail = &pending_head;

static bool in_pinned_locked(const void *pointer, size_t bytes)
{
    const uint8_t *p = pointer;
    for (size_t i = 0; i < pinned_count; i++)
        if (p >= pinned[i].base && p < pinned[i].base + pinned[i].bytes)
            return bytes <= (size_t)(pinned[i].base + pinned[i].bytes - p);
    return false;
}

static bool in_device_region(const void *pointer)
{
    const uint8_t *p = pointer;
    pthread_mutex_lock(&device_lock);
    bool found = false;
    for (size_t r = 0; r < region_count && !found; r++)
        found = p >= (const uint8_t *)regions[r].base &&
                p < (const uint8_t *)regions[r].base + regions[r].bytes;
    pthread_mutex_unlock(&device_lock);
    return found;
}

static void pinned_misuse(const pending_copy *copy, const char *what)
{
    fprintf(stderr,
            "emulated GPU: a copy of %zu bytes %s pinned host memory at %p (stream of device "
            "%d): %s before the host waited for the copy\n",
            copy->size, copy->to_host ? "from the GPU into" : "to the GPU out of",
            (void *)copy->host, copy->stream->ordinal, what);
    abort();
}

/* Completes the pending copies of stream (every one, or those numbered up to `upto`):
 * what the host sees once it has waited for them. */
static void complete_copies(const em_gpu_stream *stream, uint64_t upto)
{
    pthread_mutex_lock(&pinned_lock);
    pending_copy **link = &pending_head;
    while (*link != NULL) {
        pending_copy *copy = *link;
        if (copy->stream != stream || copy->number > upto) {
            link = &copy->next;
            continue;
        }
        if (copy->to_host)
            memcpy(copy->host, copy->bytes, copy->size);
        else if (memcmp(copy->host, copy->bytes, copy->size) != 0)
            pinned_misuse(copy, "the source changed (the DMA reads it until then)");
        *link = copy->next;
        free(copy->bytes);
        free(copy);
    }
    pending_tail = &pending_head; /* the list's end may have gone */
    while (*pending_tail != NULL)
        pending_tail = &(*pending_tail)->next;
    pthread_mutex_unlock(&pinned_lock);
}

/* An asynchronous copy: device work like any other, but a copy into pinned memory
 * lands there only when waited for, and one out of it is checked then. */
static em_gpu_status async_copy(em_gpu_stream *stream, void *destination, const void *source,
                                size_t bytes)
{
    pthread_mutex_lock(&pinned_lock);
    bool into_pinned = bytes > 0 && in_pinned_locked(destination, bytes);
    bool out_of_pinned = bytes > 0 && in_pinned_locked(source, bytes);
    pthread_mutex_unlock(&pinned_lock);
    into_pinned = into_pinned && in_device_region(source);
    out_of_pinned = out_of_pinned && in_device_region(destination);
    pending_copy *copy = NULL;
    if (into_pinned || out_of_pinned) {
        copy = calloc(1, sizeof(*copy));
        if (copy == NULL || (copy->bytes = malloc(bytes)) == NULL)
            abort();
        copy->stream = stream;
        copy->to_host = into_pinned;
        copy->host = into_pinned ? destination : (uint8_t *)source;
        copy->size = bytes;
    }
    atomic_fetch_add(&transfers_issued, 1);
    enter_device();
    if (into_pinned)
        memcpy(copy->bytes, source, bytes);
    else
        memcpy(destination, source, bytes);
    leave_device();
    if (out_of_pinned)
        memcpy(copy->bytes, source, bytes);
    if (copy != NULL) {
        pthread_mutex_lock(&pinned_lock);
        copy->number = ++stream->issued;
        *pending_tail = copy;
        pending_tail = &copy->next;
        pthread_mutex_unlock(&pinned_lock);
    }
    return ok();
}

/* ---- runtime ----------------------------------------------------------------------------- */

em_gpu_status em_gpu_device_count(int *count)
{
    *count = emulated_devices();
    if (*count == 0)
        return failure(100, 0, "cudaGetDeviceCount",
                       "no CUDA-capable device is detected (emulated)");
    return ok();
}

em_gpu_status em_gpu_versions(int *driver, int *runtime)
{
    *driver = *runtime = 13000;
    return ok();
}

em_gpu_status em_gpu_device_info_get(int ordinal, em_gpu_device_info *out)
{
    em_gpu_status status = check_ordinal(ordinal, "cudaGetDeviceProperties");
    if (status.code != 0)
        return status;
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "emulated GPU %d", ordinal);
    out->total_bytes = emulated_bytes();
    out->multiprocessors = 1;
    out->compute_major = 9;
    return ok();
}

em_gpu_status em_gpu_kernels_supported(int ordinal)
{
    return check_ordinal(ordinal, "cudaFuncGetAttributes");
}

em_gpu_status em_gpu_memory_info(int ordinal, uint64_t *free_bytes, uint64_t *total_bytes)
{
    em_gpu_status status = check_ordinal(ordinal, "cudaMemGetInfo");
    if (status.code != 0)
        return status;
    pthread_mutex_lock(&device_lock);
    *total_bytes = emulated_bytes();
    *free_bytes = *total_bytes - allocated[ordinal];
    pthread_mutex_unlock(&device_lock);
    return ok();
}

em_gpu_status em_gpu_malloc(int ordinal, size_t bytes, void **out)
{
    *out = NULL;
    em_gpu_status status = check_ordinal(ordinal, "cudaMalloc");
    if (status.code != 0)
        return status;
    pthread_mutex_lock(&device_lock);
    bool fits = allocated[ordinal] + bytes <= emulated_bytes() && region_count < MAX_REGIONS;
    if (bytes == 0 || !fits) {
        pthread_mutex_unlock(&device_lock);
        return failure(2, 1, "cudaMalloc", "out of memory (emulated)");
    }
    void *base = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        pthread_mutex_unlock(&device_lock);
        return failure(2, 1, "cudaMalloc", "out of memory (emulated, mmap failed)");
    }
    regions[region_count++] = (region){base, bytes, ordinal};
    allocated[ordinal] += bytes;
    pthread_mutex_unlock(&device_lock);
    *out = base;
    return ok();
}

int em_gpu_fills_freed(void)
{
    return 1;
}

void em_gpu_fill_freed(void *pointer, size_t bytes)
{
    /* no GPU operation of the request's: neither counted nor a failpoint's */
    pthread_mutex_lock(&device_lock);
    protect_all(PROT_READ | PROT_WRITE);
    memset(pointer, 0xa5, bytes);
    leave_device();
}

void em_gpu_free(int ordinal, void *pointer)
{
    (void)ordinal;
    if (pointer == NULL)
        return;
    run_all_later(); /* cudaFree waits for the device */
    pthread_mutex_lock(&device_lock);
    for (size_t r = 0; r < region_count; r++) {
        if (regions[r].base != pointer)
            continue;
        munmap(regions[r].base, regions[r].bytes);
        allocated[regions[r].ordinal] -= regions[r].bytes;
        regions[r] = regions[--region_count];
        break;
    }
    pthread_mutex_unlock(&device_lock);
}

em_gpu_status em_gpu_host_alloc(size_t bytes, void **out)
{
    *out = malloc(bytes);
    if (*out == NULL)
        return failure(2, 1, "cudaHostAlloc", "out of memory (emulated)");
    pthread_mutex_lock(&pinned_lock);
    bool room = pinned_count < MAX_PINNED;
    if (room)
        pinned[pinned_count++] = (pinned_block){*out, bytes};
    pthread_mutex_unlock(&pinned_lock);
    if (!room) {
        free(*out);
        *out = NULL;
        return failure(2, 1, "cudaHostAlloc", "too many pinned blocks (emulated)");
    }
    return ok();
}

void em_gpu_host_free(void *pointer)
{
    if (pointer == NULL)
        return;
    run_all_later(); /* cudaFreeHost waits for the device */
    pthread_mutex_lock(&pinned_lock);
    for (size_t i = 0; i < pinned_count; i++) {
        if (pinned[i].base != pointer)
            continue;
        for (const pending_copy *c = pending_head; c != NULL; c = c->next)
            if (c->host >= pinned[i].base && c->host < pinned[i].base + pinned[i].bytes)
                pinned_misuse(c, "the memory was freed");
        pinned[i] = pinned[--pinned_count];
        break;
    }
    pthread_mutex_unlock(&pinned_lock);
    free(pointer);
}

em_gpu_status em_gpu_stream_create(int ordinal, em_gpu_stream **out)
{
    em_gpu_status status = check_ordinal(ordinal, "cudaStreamCreateWithFlags");
    if (status.code != 0)
        return status;
    *out = calloc(1, sizeof(**out));
    if (*out == NULL)
        return failure(2, 1, "calloc (stream handle)", "out of memory");
    em_gpu_stream *stream = *out;
    stream->ordinal = ordinal;
    stream->later_tail = &stream->later_head;
    pthread_mutex_init(&stream->run_lock, NULL);
    pthread_mutex_lock(&streams_lock);
    stream->next_stream = all_streams;
    all_streams = stream;
    pthread_mutex_unlock(&streams_lock);
    return ok();
}

void em_gpu_stream_destroy(em_gpu_stream *stream)
{
    pthread_mutex_lock(&streams_lock);
    catch_up(stream); /* a destroyed stream's work still completes */
    for (em_gpu_stream **link = &all_streams; *link != NULL; link = &(*link)->next_stream)
        if (*link == stream) {
            *link = stream->next_stream;
            break;
        }
    pthread_mutex_unlock(&streams_lock);
    complete_copies(stream, UINT64_MAX);
    pthread_mutex_destroy(&stream->run_lock);
    free(stream);
}

/* Counts a wait for a stream of device `ordinal` (em_gpu_emulated_overlapped_waits). */
static void count_wait(int ordinal)
{
    atomic_fetch_add(&host_waits, 1);
    bool overlapped = false;
    pthread_mutex_lock(&pinned_lock);
    for (const pending_copy *c = pending_head; c != NULL && !overlapped; c = c->next)
        overlapped = c->to_host && c->stream->ordinal != ordinal;
    pthread_mutex_unlock(&pinned_lock);
    if (overlapped)
        atomic_fetch_add(&overlapped_waits, 1);
}

em_gpu_status em_gpu_stream_synchronize(em_gpu_stream *stream)
{
    catch_up(stream);
    count_wait(stream->ordinal);
    complete_copies(stream, UINT64_MAX);
    return ok();
}

em_gpu_status em_gpu_streams_synchronize(em_gpu_stream *const *streams, int count,
                                         int *failed)
{
    *failed = -1;
    if (count < 0 || count > 64)
        return failure(1, 0, "em_gpu_streams_synchronize (count)", "invalid argument");
    bool devices_differ = false;
    for (int i = 1; i < count; i++)
        devices_differ = devices_differ || streams[i]->ordinal != streams[0]->ordinal;
    for (int i = 0; i < count; i++)
        catch_up(streams[i]);
    atomic_fetch_add(&host_waits, 1);
    if (devices_differ)
        atomic_fetch_add(&joint_waits, 1);
    for (int i = 0; i < count; i++)
        complete_copies(streams[i], UINT64_MAX);
    em_gpu_status status = ok();
    if (status.code != 0)
        *failed = 0;
    return status;
}

em_gpu_status em_gpu_event_create(int ordinal, int timing, em_gpu_event **out)
{
    (void)timing;
    em_gpu_status status = check_ordinal(ordinal, "cudaEventCreateWithFlags");
    if (status.code != 0)
        return status;
    *out = calloc(1, sizeof(**out));
    if (*out == NULL)
        return failure(2, 1, "calloc (event handle)", "out of memory");
    (*out)->ordinal = ordinal;
    return ok();
}

void em_gpu_event_destroy(em_gpu_event *event)
{
    free(event);
}

em_gpu_status em_gpu_event_record(em_gpu_event *event, em_gpu_stream *stream)
{
    /* A CUDA event records only on a stream of its own device. */
    if (event->ordinal != stream->ordinal)
        return failure(400, 0, "cudaEventRecord",
                       "event and stream on different devices (emulated)");
    pthread_mutex_lock(&pinned_lock);
    event->stream = stream;
    event->issued = stream->issued;
    pthread_mutex_unlock(&pinned_lock);
    pthread_mutex_lock(&later_lock);
    event->queued = stream->later_queued;
    pthread_mutex_unlock(&later_lock);
    return ok();
}

/* The stream's later work waits for the event: here the kernels before the event run
 * now, which is as late as they may (the stream's next kernel may run at once). */
em_gpu_status em_gpu_stream_wait(em_gpu_stream *stream, em_gpu_event *event)
{
    (void)stream;
    pthread_mutex_lock(&pinned_lock);
    em_gpu_stream *recorded = event->stream;
    pthread_mutex_unlock(&pinned_lock);
    pthread_mutex_lock(&later_lock);
    uint64_t upto = event->queued;
    pthread_mutex_unlock(&later_lock);
    run_later(recorded, upto);
    return ok();
}

em_gpu_status em_gpu_event_synchronize(em_gpu_event *event)
{
    pthread_mutex_lock(&pinned_lock);
    em_gpu_stream *stream = event->stream;
    uint64_t upto = event->issued;
    pthread_mutex_unlock(&pinned_lock);
    pthread_mutex_lock(&later_lock);
    uint64_t kernels = event->queued;
    pthread_mutex_unlock(&later_lock);
    run_later(stream, kernels);
    count_wait(event->ordinal);
    if (stream != NULL)
        complete_copies(stream, upto);
    return ok();
}

em_gpu_status em_gpu_event_elapsed_ms(em_gpu_event *start, em_gpu_event *end, float *ms)
{
    (void)start;
    (void)end;
    *ms = 0.0f;
    return ok();
}

em_gpu_status em_gpu_memcpy_async(em_gpu_stream *stream, void *destination, const void *source,
                                  size_t bytes)
{
    catch_up(stream);
    return async_copy(stream, destination, source, bytes);
}

LATER_OP(em_gpu_memset_async, (void *, destination), (int, value), (size_t, bytes))
{
    (void)stream;
    atomic_fetch_add(&transfers_issued, 1);
    enter_device();
    memset(destination, value, bytes);
    leave_device();
    return ok();
}

em_gpu_status em_gpu_comm_init_all(const int *ordinals, int count, em_gpu_comm **comms)
{
    if (em_failpoint_hit(EM_FAILPOINT_NCCL_INIT_FAIL, NULL))
        return failure(2, 0, "ncclCommInitAll", "unhandled system error (emulated)");
    for (int i = 0; i < count; i++) {
        em_gpu_status status = check_ordinal(ordinals[i], "ncclCommInitAll");
        if (status.code != 0)
            return status;
    }
    for (int i = 0; i < count; i++) {
        comms[i] = calloc(1, sizeof(**comms));
        if (comms[i] == NULL)
            return failure(2, 1, "calloc (communicator)", "out of memory");
        comms[i]->rank = i;
    }
    return ok();
}

em_gpu_status em_gpu_comm_warm(em_gpu_comm *const *comms, const int *ordinals, int count)
{
    (void)comms;
    for (int i = 0; i < count; i++) {
        em_gpu_status status = check_ordinal(ordinals[i], "ncclSend");
        if (status.code != 0)
            return status;
    }
    return ok();
}

void em_gpu_comm_destroy(em_gpu_comm *comm)
{
    free(comm);
}

em_gpu_status em_gpu_comm_exchange(em_gpu_comm *const *comms, const em_gpu_send_recv *transfers,
                                   size_t count)
{
    for (size_t i = 0; i < count; i++) {
        const em_gpu_send_recv *t = &transfers[i];
        if (comms[t->source_rank]->rank != t->source_rank ||
            comms[t->destination_rank]->rank != t->destination_rank ||
            t->source_rank == t->destination_rank ||
            t->source_stream->ordinal == t->destination_stream->ordinal)
            return failure(4, 0, "ncclSend", "invalid usage (emulated): ranks or streams");
    }
    for (size_t i = 0; i < count; i++) {
        catch_up(transfers[i].source_stream);
        catch_up(transfers[i].destination_stream);
    }
    enter_device();
    for (size_t i = 0; i < count; i++)
        memcpy(transfers[i].destination, transfers[i].source, transfers[i].bytes);
    leave_device();
    return ok();
}

/* ---- primitives ------------------------------------------------------------------------- */

LATER_OP(em_gpu_iota_u32, (uint32_t *, out), (uint64_t, n))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        out[i] = (uint32_t)i;
    leave_device();
    return ok();
}

/* Temporary storage is not needed here; ask for some anyway so pool use resembles
 * the GPU's. */
static size_t emulated_temp_bytes(uint64_t n)
{
    return 256 + n * sizeof(uint32_t) / 4;
}

em_gpu_status em_gpu_scan_temp_bytes(em_gpu_stream *stream, uint64_t n, size_t *bytes)
{
    (void)stream;
    *bytes = emulated_temp_bytes(n);
    return ok();
}

em_gpu_status em_gpu_exclusive_scan_u32(em_gpu_stream *stream, void *temp, size_t temp_bytes,
                                        const uint32_t *in, uint32_t *out, uint64_t n)
{
    catch_up(stream); /* runs at once, after the kernels before it */
    if (n > 0 && temp_bytes < emulated_temp_bytes(n))
        return failure(1, 0, "cub::DeviceScan::ExclusiveSum", "temporary storage too small");
    (void)temp;
    enter_device();
    uint32_t sum = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t value = in[i];
        out[i] = sum;
        sum += value;
    }
    leave_device();
    return ok();
}

em_gpu_status em_gpu_sort_temp_bytes(em_gpu_stream *stream, uint64_t n, uint32_t end_bit,
                                     size_t *bytes)
{
    (void)stream;
    *bytes = end_bit == 0 ? 0 : emulated_temp_bytes(n);
    return ok();
}

typedef struct sort_entry {
    uint32_t key, value;
    uint64_t position;
} sort_entry;

static int compare_entries(const void *a, const void *b)
{
    const sort_entry *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->position < y->position ? -1 : x->position > y->position;
}

em_gpu_status em_gpu_sort_pairs_u32(em_gpu_stream *stream, void *temp, size_t temp_bytes,
                                    const uint32_t *keys_in, uint32_t *keys_out,
                                    const uint32_t *values_in, uint32_t *values_out, uint64_t n,
                                    uint32_t end_bit)
{
    catch_up(stream); /* runs at once, after the kernels before it */
    (void)temp;
    if (n > 0 && end_bit > 0 && temp_bytes < emulated_temp_bytes(n))
        return failure(1, 0, "cub::DeviceRadixSort::SortPairs", "temporary storage too small");
    sort_entry *entries = malloc((n + 1) * sizeof(*entries));
    if (entries == NULL)
        return failure(2, 1, "malloc (emulated sort)", "out of memory");
    uint32_t mask = end_bit >= 32 ? UINT32_MAX : (UINT32_C(1) << end_bit) - 1;
    enter_device();
    for (uint64_t i = 0; i < n; i++)
        entries[i] = (sort_entry){keys_in[i] & mask, values_in[i], i};
    /* (key, position) order: stable, as the radix sort is. */
    qsort(entries, n, sizeof(*entries), compare_entries);
    for (uint64_t i = 0; i < n; i++) {
        keys_out[i] = keys_in[entries[i].position];
        values_out[i] = entries[i].value;
    }
    leave_device();
    free(entries);
    return ok();
}

LATER_OP(em_gpu_segment_starts, (const uint32_t *, sorted_keys), (uint64_t, n),
         (uint32_t, segments), (uint32_t *, starts))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n + 1)
        em_gpu_segment_start_item(sorted_keys, n, segments, i, starts);
    leave_device();
    return ok();
}

/* ---- home-side operations ---------------------------------------------------------------- */

LATER_OP(em_gpu_unique_claim, (const uint64_t *, keys), (uint64_t, n), (uint32_t *, table),
         (uint64_t, slot_count), (uint32_t *, slot_of))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_unique_claim_item(keys, i, table, slot_count, slot_of);
    leave_device();
    return ok();
}

em_gpu_status em_gpu_unique_rank_temp_bytes(em_gpu_stream *stream, uint64_t n, size_t *bytes)
{
    (void)stream;
    *bytes = emulated_temp_bytes(n + 1);
    return ok();
}

/* The scan of CUB with the flags computed as it reads them (kernels/home_ops.cu). */
em_gpu_status em_gpu_unique_rank(em_gpu_stream *stream, void *temp, size_t temp_bytes,
                                 const uint32_t *table, const uint32_t *slot_of, uint64_t n,
                                 uint32_t *rank)
{
    catch_up(stream); /* runs at once, after the kernels before it */
    (void)temp;
    if (temp_bytes < emulated_temp_bytes(n + 1))
        return failure(1, 0, "cub::DeviceScan::ExclusiveSum", "temporary storage too small");
    enter_device();
    uint32_t sum = 0;
    for (uint64_t i = 0; i <= n; i++) {
        uint32_t flag = em_gpu_unique_first(table, slot_of, n, i);
        rank[i] = sum;
        sum += flag;
    }
    leave_device();
    return ok();
}

LATER_OP(em_gpu_unique_scatter, (const uint64_t *, keys), (uint64_t, n), (const uint32_t *, table),
         (const uint32_t *, slot_of), (const uint32_t *, rank), (uint64_t *, unique),
         (uint32_t *, inverse), (uint32_t *, first_positions))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_unique_scatter_item(keys, i, table, slot_of, rank, unique, inverse,
                                   first_positions);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_partition_owners, (const uint64_t *, unique), (uint64_t, n),
         (uint32_t, shard_count), (uint32_t *, owner), (uint32_t *, index))
{
    (void)stream;
    enter_device();
    EACH_ITEM(u, n)
        em_gpu_partition_owner_item(unique, u, shard_count, owner, index);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_partition_owners_counted, (const uint64_t *, unique), (uint64_t, n),
         (const uint32_t *, count), (uint32_t, shard_count), (uint32_t *, owner),
         (uint32_t *, index))
{
    (void)stream;
    enter_device();
    EACH_ITEM(u, n)
        em_gpu_partition_owner_counted_item(unique, count, u, shard_count, owner, index);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_partition_scatter, (const uint64_t *, unique), (const uint32_t *, sorted_index),
         (const uint32_t *, first_positions), (uint64_t, n), (uint64_t *, partitioned),
         (uint32_t *, position), (uint32_t *, targets))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_partition_scatter_item(unique, sorted_index, first_positions, i, partitioned,
                                      position, targets);
    leave_device();
    return ok();
}

em_gpu_status em_gpu_spread_keys(em_gpu_stream *stream, const uint64_t *partitioned, uint64_t n,
                                 const uint32_t *starts, uint32_t shard_count,
                                 const em_gpu_spread *spread, uint64_t *buckets,
                                 uint32_t *bucket_counts, uint32_t *position)
{
    catch_up(stream); /* runs at once, after the kernels before it */
    uint64_t items = n > spread->count ? n : spread->count;
    enter_device();
    EACH_ITEM(t, items)
        em_gpu_spread_item(spread, partitioned, n, starts, shard_count, t, buckets, bucket_counts,
                           position);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_key_rows, (const uint32_t *, offsets), (uint32_t, rows), (uint64_t, nnz),
         (uint32_t *, key_row))
{
    (void)stream;
    enter_device();
    EACH_ITEM(k, nnz)
        key_row[k] = em_gpu_row_of_key(offsets, rows, k);
    leave_device();
    return ok();
}

em_gpu_status em_gpu_sum_gradients(em_gpu_stream *stream, const em_gpu_batch *batch,
                                   const uint32_t *sorted_inverse,
                                   const uint32_t *sorted_positions, const uint32_t *key_row,
                                   const float *gradients, float *partials, float *out)
{
    catch_up(stream); /* runs at once, after the kernels before it */
    if (batch->nnz == 0 || batch->unique_count == 0 || batch->dim == 0)
        return ok();
    enter_device();
    uint64_t slots =
        em_gpu_sum_partials_floats(batch->nnz, batch->dim) != 0 ? em_gpu_sum_slots(batch->nnz) : 0;
    EACH_ITEM(p, batch->nnz)
        for (uint32_t j = 0; j < batch->dim; j++)
            em_gpu_sum_run_element(batch, sorted_inverse, sorted_positions, key_row, gradients,
                                   out, p, j);
    EACH_ITEM(slot, slots)
        for (uint32_t j = 0; j < batch->dim; j++)
            em_gpu_sum_chunk_element(batch, sorted_inverse, sorted_positions, key_row, gradients,
                                     partials, slot, j);
    EACH_ITEM(p, slots > 0 ? batch->nnz : 0)
        for (uint32_t j = 0; j < batch->dim; j++)
            em_gpu_sum_hot_element(batch, sorted_inverse, partials, out, p, j);
    leave_device();
    return ok();
}

em_gpu_status em_gpu_combine(em_gpu_stream *stream, const em_gpu_batch *batch,
                             const float *vectors, float *out)
{
    catch_up(stream); /* runs at once, after the kernels before it */
    enter_device();
    if (batch->combiner == EM_COMBINER_NONE) {
        EACH_ITEM(k, batch->nnz)
            for (uint32_t j = 0; j < batch->dim; j++)
                em_gpu_combine_copy_element(batch, vectors, out, k, j);
    } else {
        EACH_ITEM(r, batch->rows)
            for (uint32_t j = 0; j < batch->dim; j++)
                em_gpu_combine_pool_element(batch, vectors, out, r, j);
    }
    leave_device();
    return ok();
}

LATER_OP(em_gpu_copy_repeats, (const uint32_t *, inverse), (uint64_t, nnz),
         (const uint32_t *, first_positions), (uint32_t, dim), (float *, out))
{
    (void)stream;
    enter_device();
    EACH_ITEM(k, nnz)
        for (uint32_t j = 0; j < dim; j++)
            em_gpu_copy_repeats_element(inverse, first_positions, dim, out, k, j);
    leave_device();
    return ok();
}

/* ---- hash map ------------------------------------------------------------------------------ */

em_gpu_status em_gpu_map_clear(em_gpu_stream *stream, em_gpu_slot *slots, uint64_t slot_count)
{
    return em_gpu_memset_async(stream, slots, 0xff, slot_count * sizeof(em_gpu_slot));
}

LATER_OP(em_gpu_map_find, (em_gpu_map, map), (const uint64_t *, keys), (uint64_t, n),
         (uint64_t *, rows), (uint64_t *, missing))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        *missing += (uint64_t)em_gpu_map_find_item(map, keys, i, rows);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_maps_find, (const em_gpu_map_part *, parts), (uint32_t, count),
         (uint64_t, most_keys), (uint64_t, all_keys))
{
    (void)stream;
    (void)all_keys;
    if (count == 0 || most_keys == 0)
        return ok();
    enter_device();
    for (uint32_t p = 0; p < count; p++)
        EACH_ITEM(i, parts[p].n)
            *parts[p].missing += (uint64_t)em_gpu_map_find_item(parts[p].map, parts[p].keys, i,
                                                                parts[p].rows);
    leave_device();
    return ok();
}

/* Both forms search as em_gpu_map_find_item: on the host the group's search reads the
 * same slots in the same order. */
em_gpu_status em_gpu_map_find_as(em_gpu_stream *stream, em_gpu_map map, const uint64_t *keys,
                                 uint64_t n, uint64_t *rows, uint64_t *missing,
                                 em_gpu_find_form form)
{
    (void)form;
    return em_gpu_map_find(stream, map, keys, n, rows, missing);
}

LATER_OP(em_gpu_map_find_counted, (em_gpu_map, map), (const uint64_t *, keys), (uint64_t, n),
         (const uint32_t *, count), (uint64_t *, rows), (uint64_t *, missing))
{
    (void)stream;
    enter_device();
    uint64_t end = *count < n ? *count : n;
    EACH_ITEM(i, end)
        *missing += (uint64_t)em_gpu_map_find_item(map, keys, i, rows);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_shards_find_local, (em_gpu_shards, shards), (const uint64_t *, keys), (uint64_t, n),
         (const uint32_t *, count), (uint64_t *, rows), (uint64_t *, missing))
{
    (void)stream;
    if (n == 0)
        return ok();
    enter_device();
    uint64_t end = *count < n ? *count : n;
    EACH_ITEM(i, end) {
        uint32_t s = 0;
        int absent = em_gpu_shards_find_local_item(shards, keys, i, rows, &s);
        missing[s] += (uint64_t)absent;
    }
    leave_device();
    return ok();
}

LATER_OP(em_gpu_shards_find_counted, (em_gpu_shards, shards), (const uint64_t *, keys),
         (uint64_t, n), (const uint32_t *, count), (uint64_t *, rows), (uint64_t *, missing))
{
    (void)stream;
    enter_device();
    uint64_t end = *count < n ? *count : n;
    EACH_ITEM(i, end)
        *missing += (uint64_t)em_gpu_shards_find_item(shards, keys, i, rows);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_map_insert, (em_gpu_map, map), (const uint64_t *, keys), (uint64_t, n),
         (uint64_t *, rows), (uint8_t *, inserted))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_map_insert_item(map, keys, i, rows, inserted);
    leave_device();
    return ok();
}

/* ---- launches over several shards' parts (em_gpu_shard_part) ----------------------- */

/* item(part, i, context) for every key i of every part, as one launch. */
typedef void part_item(const em_gpu_shard_part *part, uint64_t i, const void *context);

static em_gpu_status each_part_item(const em_gpu_shard_part *parts, uint32_t count,
                                    uint64_t most_keys, part_item *item, const void *context)
{
    if (count == 0 || most_keys == 0)
        return ok();
    enter_device();
    for (uint32_t p = 0; p < count; p++)
        EACH_ITEM(i, parts[p].n)
            item(&parts[p], i, context);
    leave_device();
    return ok();
}

static void insert_part_item(const em_gpu_shard_part *part, uint64_t i, const void *context)
{
    (void)context;
    em_gpu_map_insert_item(part->map, part->keys, i, part->rows, part->inserted);
}

LATER_OP(em_gpu_parts_insert, (const em_gpu_shard_part *, parts), (uint32_t, count),
         (uint64_t, most_keys))
{
    (void)stream;
    return each_part_item(parts, count, most_keys, insert_part_item, NULL);
}

static void erase_part_item(const em_gpu_shard_part *part, uint64_t i, const void *context)
{
    (void)context;
    em_gpu_map_erase_item(part->map, part->keys, part->rows, i);
}

LATER_OP(em_gpu_parts_erase, (const em_gpu_shard_part *, parts), (uint32_t, count),
         (uint64_t, most_keys))
{
    (void)stream;
    return each_part_item(parts, count, most_keys, erase_part_item, NULL);
}

typedef struct gather_form {
    uint32_t dim;
    int quads;
} gather_form;

static void gather_part_item(const em_gpu_shard_part *part, uint64_t i, const void *context)
{
    const gather_form *form = context;
    if (form->quads)
        for (uint32_t q = 0; q < form->dim / 4; q++)
            em_gpu_rows_gather_quad(part->storage, part->rows, part->targets, part->vectors, i,
                                    q);
    else
        for (uint32_t j = 0; j < form->dim; j++)
            em_gpu_rows_gather_element(part->storage, part->rows, part->targets, part->vectors,
                                       i, j);
}

LATER_OP(em_gpu_parts_gather, (const em_gpu_shard_part *, parts), (uint32_t, count),
         (uint64_t, most_keys), (uint32_t, dim), (int, quads))
{
    (void)stream;
    gather_form form = {dim, quads};
    return each_part_item(parts, count, dim == 0 ? 0 : most_keys, gather_part_item, &form);
}

typedef struct touch_stamps {
    uint64_t accessed;
    uint32_t updated;
    int pushed;
} touch_stamps;

static void touch_part_item(const em_gpu_shard_part *part, uint64_t i, const void *context)
{
    const touch_stamps *t = context;
    em_gpu_rows_touch_item(part->storage, part->rows, i, t->accessed, t->updated, t->pushed);
}

LATER_OP(em_gpu_parts_touch, (const em_gpu_shard_part *, parts), (uint32_t, count),
         (uint64_t, most_keys), (uint64_t, accessed), (uint32_t, updated), (int, pushed))
{
    (void)stream;
    touch_stamps stamps = {accessed, updated, pushed};
    return each_part_item(parts, count, most_keys, touch_part_item, &stamps);
}

LATER_OP(em_gpu_map_insert_counted, (em_gpu_map, map), (const uint64_t *, keys), (uint64_t, n),
         (em_gpu_gate, gate), (uint64_t *, rows), (uint8_t *, inserted))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, em_gpu_gate_end(gate, n))
        em_gpu_map_insert_item(map, keys, i, rows, inserted);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_shards_insert_counted, (em_gpu_shards, shards), (const uint64_t *, keys),
         (uint64_t, n), (em_gpu_gate, gate), (uint64_t *, rows), (uint8_t *, inserted))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, em_gpu_gate_end(gate, n))
        em_gpu_shards_insert_item(shards, keys, i, rows, inserted);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_map_erase, (em_gpu_map, map), (const uint64_t *, keys), (const uint64_t *, rows),
         (uint64_t, n))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_map_erase_item(map, keys, rows, i);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_map_rehash, (const em_gpu_slot *, old_slots), (uint64_t, old_slot_count),
         (em_gpu_map, map))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, old_slot_count)
        em_gpu_map_rehash_item(old_slots, i, map);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_map_export_flags, (em_gpu_map, map), (uint64_t, begin), (uint64_t, count),
         (uint32_t *, flags))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, count + 1)
        em_gpu_map_export_flag_item(map, begin, count, i, flags);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_map_export_compact, (em_gpu_map, map), (uint64_t, begin), (uint64_t, count),
         (const uint32_t *, flags), (const uint32_t *, rank), (uint64_t, take), (uint64_t, offset),
         (uint64_t *, keys), (uint64_t *, rows), (uint64_t *, next_slot))
{
    (void)stream;
    if (take == 0)
        return ok();
    enter_device();
    EACH_ITEM(i, count)
        em_gpu_map_export_compact_item(map, begin, i, flags, rank, take, offset, keys, rows,
                                       next_slot);
    leave_device();
    return ok();
}

/* ---- row storage ---------------------------------------------------------------------------- */

/* The settle asked of a launch that writes new rows (em_gpu_settle). */
static void settle_maps(em_gpu_settle settle)
{
    if (settle.map.header != NULL)
        em_gpu_map_settle_item(settle.map);
    for (uint32_t s = 0; s < settle.shards.count; s++) {
        em_gpu_map_settle_item(settle.shards.maps[s]);
        settle.headers[s] = *settle.shards.maps[s].header;
    }
}

LATER_OP(em_gpu_rows_init, (em_gpu_storage, storage), (const uint64_t *, keys),
         (const uint64_t *, rows), (const uint8_t *, inserted), (uint64_t, n),
         (em_initializer_config, initializer), (em_optimizer_config, optimizer),
         (em_gpu_settle, settle))
{
    (void)stream;
    if (n == 0 && settle.map.header == NULL && settle.shards.count == 0)
        return ok();
    enter_device();
    EACH_ITEM(i, n)
        for (uint32_t j = 0; j < storage.row_floats; j++)
            em_gpu_rows_init_element(storage, keys, rows, inserted, &initializer, &optimizer, i, j);
    settle_maps(settle);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_parts_init, (const em_gpu_shard_part *, parts), (uint32_t, count),
         (uint64_t, most_keys), (uint32_t, row_floats), (em_initializer_config, initializer),
         (em_optimizer_config, optimizer))
{
    (void)stream;
    (void)most_keys;
    (void)row_floats;
    if (count == 0)
        return ok();
    enter_device();
    for (uint32_t p = 0; p < count; p++) {
        const em_gpu_shard_part *part = &parts[p];
        EACH_ITEM(i, part->n)
            for (uint32_t j = 0; j < part->storage.row_floats; j++)
                em_gpu_rows_init_element(part->storage, part->keys, part->rows, part->inserted,
                                         &initializer, &optimizer, i, j);
        em_gpu_map_settle_item(part->map);
        *part->header = *part->map.header;
    }
    leave_device();
    return ok();
}

LATER_OP(em_gpu_rows_gather, (em_gpu_storage, storage), (const uint64_t *, rows), (uint64_t, n),
         (const uint32_t *, targets), (float *, vectors))
{
    (void)stream;
    enter_device();
    /* The same choice as the kernel: quads when dim % 4 == 0 and the output is aligned. */
    if (storage.dim % 4 == 0 && ((uintptr_t)vectors & 15u) == 0) {
        EACH_ITEM(i, n)
            for (uint32_t q = 0; q < storage.dim / 4; q++)
                em_gpu_rows_gather_quad(storage, rows, targets, vectors, i, q);
    } else {
        EACH_ITEM(i, n)
            for (uint32_t j = 0; j < storage.dim; j++)
                em_gpu_rows_gather_element(storage, rows, targets, vectors, i, j);
    }
    leave_device();
    return ok();
}

em_gpu_status em_gpu_rows_pull(em_gpu_stream *stream, em_gpu_storage storage,
                               const em_gpu_batch *batch, const uint64_t *rows, float *out)
{
    catch_up(stream); /* runs at once, after the kernels before it */
    uint64_t outputs = batch->combiner == EM_COMBINER_NONE ? batch->nnz : batch->rows;
    enter_device();
    EACH_ITEM(k, outputs)
        for (uint32_t j = 0; j < batch->dim; j++)
            em_gpu_rows_pull_element(storage, batch, rows, out, k, j);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_rows_touch_gated, (em_gpu_storage, storage), (const uint64_t *, rows),
         (uint64_t, n), (em_gpu_gate, gate), (uint64_t, accessed), (uint32_t, updated),
         (int, pushed))
{
    (void)stream;
    enter_device();
    uint64_t end = em_gpu_gate_end(gate, n);
    EACH_ITEM(i, end)
        em_gpu_rows_touch_item(storage, rows, i, accessed, updated, pushed);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_rows_fill_initial, (em_gpu_storage, storage), (em_initializer_config, initializer),
         (const uint64_t *, keys), (const uint64_t *, rows), (uint64_t, n),
         (const uint32_t *, targets), (float *, vectors))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        for (uint32_t j = 0; j < storage.dim; j++)
            em_gpu_rows_fill_initial_element(storage, &initializer, keys, rows, targets, vectors,
                                             i, j);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_rows_touch, (em_gpu_storage, storage), (const uint64_t *, rows), (uint64_t, n),
         (uint64_t, accessed), (uint32_t, updated), (int, pushed))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_rows_touch_item(storage, rows, i, accessed, updated, pushed);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_choice_mark_kept, (em_gpu_choice *, choices), (uint32_t, walks),
         (uint64_t, most_kept))
{
    (void)stream;
    (void)most_kept;
    enter_device();
    for (uint32_t w = 0; w < walks; w++)
        EACH_ITEM(j, choices[w].kept_count)
            em_gpu_choice_mark_kept_item(&choices[w], j);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_choice_count, (em_gpu_choice *, choices), (uint32_t, walks), (uint64_t, most_held),
         (uint32_t, digit))
{
    (void)stream;
    (void)most_held;
    enter_device();
    for (uint32_t w = 0; w < walks; w++) {
        em_gpu_choice *c = &choices[w];
        if (c->state != EM_GPU_CHOICE_OPEN || digit < c->digits)
            continue;
        uint64_t held = em_gpu_choice_held(c);
        EACH_ITEM(i, held) {
            uint32_t bin = em_gpu_choice_bin(c, i, digit);
            if (bin < EM_GPU_CHOICE_BINS)
                c->bins[bin]++;
        }
        em_gpu_choice_fix_item(c, c->bins, digit);
        memset(c->bins, 0, sizeof(c->bins));
    }
    leave_device();
    return ok();
}

LATER_OP(em_gpu_choice_flags, (em_gpu_choice *, choices), (uint32_t, walks), (uint64_t, most_want),
         (uint32_t *, flags))
{
    (void)stream;
    (void)most_want;
    enter_device();
    for (uint32_t w = 0; w < walks; w++)
        EACH_ITEM(i, choices[w].want)
            flags[choices[w].first_flag + i] = em_gpu_choice_flag(&choices[w], i);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_choice_write, (em_gpu_choice *, choices), (uint32_t, walks), (uint64_t, most_want),
         (const uint32_t *, flags), (const uint32_t *, rank))
{
    (void)stream;
    (void)most_want;
    enter_device();
    for (uint32_t w = 0; w < walks; w++)
        EACH_ITEM(i, choices[w].want)
            em_gpu_choice_write_item(&choices[w], i, flags, rank);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_walks_flags, (const em_gpu_walk_piece *, pieces), (uint32_t, count),
         (uint64_t, most_slots), (uint32_t *, flags))
{
    (void)stream;
    if (count == 0)
        return ok();
    enter_device();
    for (uint32_t p = 0; p < count; p++)
        EACH_ITEM(i, most_slots)
            em_gpu_walks_flag_item(pieces, count, p, i, flags);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_walks_compact, (const em_gpu_walk_piece *, pieces), (uint32_t, count),
         (uint64_t, most_slots), (const uint32_t *, flags), (const uint32_t *, rank))
{
    (void)stream;
    if (count == 0 || most_slots == 0)
        return ok();
    enter_device();
    for (uint32_t p = 0; p < count; p++)
        EACH_ITEM(i, pieces[p].count)
            em_gpu_walks_compact_item(&pieces[p], i, flags, rank);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_walks_advance, (const em_gpu_walk_piece *, pieces), (uint32_t, count),
         (const uint32_t *, rank))
{
    (void)stream;
    if (count == 0)
        return ok();
    enter_device();
    em_gpu_walks_advance_all(pieces, count, rank);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_access_read, (em_gpu_storage, storage), (const uint64_t *, rows), (uint64_t, n),
         (em_gpu_row_access *, out))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_access_read_item(storage, rows, i, out);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_access_write, (em_gpu_storage, storage), (const uint64_t *, rows), (uint64_t, n),
         (const em_gpu_row_access *, in))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        em_gpu_access_write_item(storage, rows, i, in);
    leave_device();
    return ok();
}

/* The warp butterfly of kernels/shard_ops.cu: lane l adds lane l ^ offset's value for
 * offset 16, 8, 4, 2, 1; every lane ends with the same sum. */
static float butterfly_sum(float partial[EM_GPU_ROW_LANES])
{
    for (uint32_t offset = EM_GPU_ROW_LANES / 2; offset > 0; offset /= 2) {
        float next[EM_GPU_ROW_LANES];
        for (uint32_t lane = 0; lane < EM_GPU_ROW_LANES; lane++)
            next[lane] = partial[lane] + partial[lane ^ offset];
        memcpy(partial, next, sizeof(next));
    }
    return partial[0];
}

static void rowwise_adagrad_row(em_gpu_storage storage, const em_optimizer_config *optimizer,
                                float *weights, const float *gradient)
{
    uint32_t dim = storage.dim;
    float partial[EM_GPU_ROW_LANES];
    for (uint32_t lane = 0; lane < EM_GPU_ROW_LANES; lane++)
        partial[lane] = em_gpu_rowwise_partial(gradient, dim, lane, EM_GPU_ROW_LANES);
    float squares = butterfly_sum(partial);
    float updated = 0.0f;
    float denominator =
        em_gpu_rowwise_denominator(weights[dim], squares, dim, optimizer->eps, &updated);
    for (uint32_t j = 0; j < dim; j++)
        em_rowwise_adagrad_element(&weights[j], gradient[j], optimizer->learning_rate, denominator);
    weights[dim] = updated;
}

static void adam_row(em_gpu_storage storage, const em_optimizer_config *optimizer, float *weights,
                     const float *gradient)
{
    uint32_t dim = storage.dim;
    float *step = weights + 3 * (size_t)dim;
    float next = em_adam_next_step(*step);
    em_adam_constants constants = em_adam_row_setup(optimizer, next);
    for (uint32_t j = 0; j < dim; j++)
        em_adam_element(&weights[j], &weights[dim + j], &weights[2 * dim + j], gradient[j],
                        constants);
    *step = next;
}

em_gpu_status em_gpu_rows_apply(em_gpu_stream *stream, em_gpu_storage storage,
                                em_optimizer_config optimizer, const uint64_t *rows, uint64_t n,
                                const float *gradients)
{
    return em_gpu_rows_apply_gated(stream, storage, optimizer, rows, n, gradients,
                                   (em_gpu_gate){0}, (em_gpu_fresh_rows){0});
}

/* The steps of rows[0..end) (in the device: the caller entered it); false for an
 * optimizer kind outside EM_OPTIMIZERS. */
static bool apply_rows(em_gpu_storage storage, const em_optimizer_config *optimizer,
                       const uint64_t *rows, uint64_t end, const float *gradients,
                       const em_gpu_fresh_rows *fresh)
{
    EACH_ITEM(i, end) {
        if (rows[i] == EM_GPU_ROW_PENDING)
            continue; /* a refused key */
        em_gpu_fresh_row_floats(storage, optimizer, rows, fresh, i, 0, 1);
        float *weights = em_gpu_row_address(storage, rows[i]);
        const float *gradient = gradients + i * storage.dim;
        switch (optimizer->kind) {
        case EM_OPTIMIZER_ADAGRAD:
            for (uint32_t j = 0; j < storage.dim; j++)
                em_gpu_adagrad_element(storage, optimizer, rows, gradients, i, j);
            break;
        case EM_OPTIMIZER_ROWWISE_ADAGRAD:
            rowwise_adagrad_row(storage, optimizer, weights, gradient);
            break;
        case EM_OPTIMIZER_ADAM:
            adam_row(storage, optimizer, weights, gradient);
            break;
        case EM_OPTIMIZER_SGD:
            for (uint32_t j = 0; j < storage.dim; j++)
                em_gpu_sgd_element(storage, optimizer, rows, gradients, i, j);
            break;
        case EM_OPTIMIZER_COUNT:
            return false;
        }
    }
    return true;
}

static em_gpu_status invalid_optimizer(void)
{
    return (em_gpu_status){.code = 1, .call = "em_gpu_rows_apply",
                           .message = "optimizer kind outside EM_OPTIMIZERS"};
}

LATER_OP(em_gpu_rows_apply_gated, (em_gpu_storage, storage), (em_optimizer_config, optimizer),
         (const uint64_t *, rows), (uint64_t, n), (const float *, gradients), (em_gpu_gate, gate),
         (em_gpu_fresh_rows, fresh))
{
    (void)stream;
    if (n == 0 && fresh.settle.map.header == NULL && fresh.settle.shards.count == 0)
        return ok();
    enter_device();
    bool applied = apply_rows(storage, &optimizer, rows, em_gpu_gate_end(gate, n), gradients,
                              &fresh);
    if (applied)
        settle_maps(fresh.settle);
    leave_device();
    return applied ? ok() : invalid_optimizer();
}

LATER_OP(em_gpu_parts_apply, (const em_gpu_shard_part *, parts), (uint32_t, count),
         (uint64_t, most_keys), (uint32_t, dim), (em_optimizer_config, optimizer))
{
    (void)stream;
    (void)dim;
    if (count == 0 || most_keys == 0)
        return ok();
    enter_device();
    em_gpu_fresh_rows none = {0};
    bool applied = true;
    for (uint32_t p = 0; applied && p < count; p++)
        applied = apply_rows(parts[p].storage, &optimizer, parts[p].rows, parts[p].n,
                             parts[p].gradients, &none);
    leave_device();
    return applied ? ok() : invalid_optimizer();
}

em_gpu_status em_gpu_rows_check(em_gpu_stream *stream, em_gpu_storage storage,
                                em_optimizer_config optimizer, em_initializer_config initializer,
                                const uint64_t *keys, const uint64_t *rows, uint64_t n,
                                const float *gradients, uint64_t *first)
{
    return em_gpu_rows_check_counted(stream, storage, optimizer, initializer, keys, rows, n, NULL,
                                     gradients, first);
}

LATER_OP(em_gpu_rows_check_parts, (const em_gpu_check_part *, parts), (uint32_t, count),
         (uint64_t, most_keys))
{
    (void)stream;
    if (count == 0 || most_keys == 0)
        return ok();
    enter_device();
    for (uint32_t p = 0; p < count; p++) {
        const em_gpu_check_part *part = &parts[p];
        EACH_ITEM(i, part->n) {
            uint32_t code = em_gpu_rows_check_item(part->storage, &part->optimizer,
                                                   &part->initializer, part->keys, part->rows,
                                                   part->gradients, i);
            uint64_t result = em_gpu_rows_check_result(i, code);
            if (code != EM_ROW_CHECK_OK && result < *part->first)
                *part->first = result;
        }
    }
    leave_device();
    return ok();
}

LATER_OP(em_gpu_rows_check_counted, (em_gpu_storage, storage), (em_optimizer_config, optimizer),
         (em_initializer_config, initializer), (const uint64_t *, keys), (const uint64_t *, rows),
         (uint64_t, n), (const uint32_t *, count), (const float *, gradients), (uint64_t *, first))
{
    (void)stream;
    enter_device();
    uint64_t end = count != NULL && *count < n ? *count : n;
    EACH_ITEM(i, end) {
        uint32_t code = em_gpu_rows_check_item(storage, &optimizer, &initializer, keys, rows,
                                               gradients, i);
        uint64_t result = em_gpu_rows_check_result(i, code);
        if (code != EM_ROW_CHECK_OK && result < *first)
            *first = result;
    }
    leave_device();
    return ok();
}

/* The find of keys[i], then the check of its row, item by item (one kernel). */
static void find_check_item(int found_absent, em_gpu_storage storage,
                            const em_optimizer_config *optimizer,
                            const em_initializer_config *initializer, const uint64_t *keys,
                            const float *gradients, uint64_t *rows, uint64_t i,
                            uint64_t *missing, uint64_t *first)
{
    *missing += (uint64_t)found_absent;
    uint32_t code = em_gpu_rows_check_item(storage, optimizer, initializer, keys, rows,
                                           gradients, i);
    uint64_t result = em_gpu_rows_check_result(i, code);
    if (code != EM_ROW_CHECK_OK && result < *first)
        *first = result;
}

LATER_OP(em_gpu_map_find_check_counted, (em_gpu_map, map), (em_gpu_storage, storage),
         (em_optimizer_config, optimizer), (em_initializer_config, initializer),
         (const uint64_t *, keys), (uint64_t, n), (const uint32_t *, count),
         (const float *, gradients), (uint64_t *, rows), (uint64_t *, missing), (uint64_t *, first))
{
    (void)stream;
    enter_device();
    uint64_t end = *count < n ? *count : n;
    EACH_ITEM(i, end)
        find_check_item(em_gpu_map_find_item(map, keys, i, rows), storage, &optimizer,
                        &initializer, keys, gradients, rows, i, missing, first);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_shards_find_check_counted, (em_gpu_shards, shards), (em_gpu_storage, storage),
         (em_optimizer_config, optimizer), (em_initializer_config, initializer),
         (const uint64_t *, keys), (uint64_t, n), (const uint32_t *, count),
         (const float *, gradients), (uint64_t *, rows), (uint64_t *, missing), (uint64_t *, first))
{
    (void)stream;
    enter_device();
    uint64_t end = *count < n ? *count : n;
    EACH_ITEM(i, end)
        find_check_item(em_gpu_shards_find_item(shards, keys, i, rows), storage, &optimizer,
                        &initializer, keys, gradients, rows, i, missing, first);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_rows_read, (em_gpu_storage, storage), (const uint64_t *, rows), (uint64_t, n),
         (float *, values))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        for (uint32_t j = 0; j < storage.row_floats; j++)
            em_gpu_rows_read_element(storage, rows, values, i, j);
    leave_device();
    return ok();
}

LATER_OP(em_gpu_rows_write, (em_gpu_storage, storage), (const uint64_t *, rows), (uint64_t, n),
         (const uint32_t *, sources), (const float *, values))
{
    (void)stream;
    enter_device();
    EACH_ITEM(i, n)
        for (uint32_t j = 0; j < storage.row_floats; j++)
            em_gpu_rows_write_element(storage, rows, sources, values, i, j);
    leave_device();
    return ok();
}
