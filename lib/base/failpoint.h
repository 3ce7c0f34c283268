/*
 * DESIGN: named failpoints, so tests can make one part fail on cue in a real daemon.
 *
 * EM_FAILPOINTS lists them, each with the place that consults it. A failpoint is armed
 * from the environment when a daemon is created (EMBER_FAILPOINTS, and the file
 * EMBER_FAILPOINTS_FILE names, read again on every reload so a test can arm one in a
 * running daemon), or by em_failpoints_arm in a test that runs a daemon in its own
 * process; the daemon logs a warning naming every armed failpoint. Disarmed, a
 * failpoint costs one relaxed atomic load where it is consulted.
 *
 *   EMBER_FAILPOINTS="pool_alloc*2,worker_stall=300*1,partial_write=7"
 *
 * Each item is name[=value][*count]: value is the failpoint's argument (milliseconds,
 * bytes), count how many hits trigger it (absent: every hit until disarmed).
 *
 * The armed set is process-wide on purpose, the one piece of global state in lib/: it
 * is a test facility reached from deep inside (the pool), like the environment that
 * arms it, and in service every failpoint stays disarmed.
 */
#ifndef EMBER_LIB_BASE_FAILPOINT_H
#define EMBER_LIB_BASE_FAILPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lib/base/status.h"

/* X(ID, name, help) */
#define EM_FAILPOINTS(X)                                                                      \
    X(POOL_ALLOC, pool_alloc, "a pool allocation fails with RESOURCE_EXHAUSTED")              \
    X(WORKER_STALL, worker_stall, "a worker sleeps value ms before it runs a request")        \
    X(PARTIAL_WRITE, partial_write, "answers go out value bytes per write (default 1)")       \
    X(ACCEPT_FAIL, accept_fail, "an accepted connection is dropped as if accept failed")      \
    X(CHECKPOINT_FAIL, checkpoint_fail,                                                       \
      "step value of a save fails with EIO (a write writes half, then ENOSPC)")              \
    X(CHECKPOINT_CRASH, checkpoint_crash, "the process exits at once before step value of a save") \
    X(CHECKPOINT_STALL, checkpoint_stall, "a save sleeps value ms once its snapshot is taken") \
    X(CHECKPOINT_READ_FAIL, checkpoint_read_fail,                                             \
      "a load's first read of rows.emb that reaches past byte value reads half, then EIO")    \
    X(GPU_FAULT, gpu_fault,                                                                   \
      "the emulated GPUs fail with a sticky kernel fault (tests/support/kernels_emulated.c)") \
    X(NCCL_INIT_FAIL, nccl_init_fail, "the emulated ncclCommInitAll fails")

typedef enum em_failpoint {
#define EM_FAILPOINT_ENUM(ID, name, help) EM_FAILPOINT_##ID,
    EM_FAILPOINTS(EM_FAILPOINT_ENUM)
#undef EM_FAILPOINT_ENUM
    EM_FAILPOINT_COUNT
} em_failpoint;

/* True when failpoint triggers on this hit (one of its count is used up); *value (may
 * be NULL) gets its argument. */
bool em_failpoint_hit(em_failpoint failpoint, uint64_t *value);

/* True while failpoint is armed (it would trigger), without using up a hit; *value (may
 * be NULL) gets its argument. */
bool em_failpoint_armed(em_failpoint failpoint, uint64_t *value);

/* Arms the failpoints of spec (the syntax above). Errors: INVALID_ARGUMENT naming the
 * item; nothing is armed then. */
em_status em_failpoints_arm(const char *spec, em_error *err);

/* Arms what EMBER_FAILPOINTS and the file EMBER_FAILPOINTS_FILE say (nothing when
 * they are unset or empty). */
em_status em_failpoints_arm_from_env(em_error *err);

void em_failpoints_disarm_all(void);

/* "pool_alloc*2, worker_stall=300" for the log; "" when none is armed. */
void em_failpoints_describe(char *out, size_t capacity);

const char *em_failpoint_name(em_failpoint failpoint);

#endif
