/*
 * What tests can ask of the emulated kernels (tests/support/kernels_emulated.c) beyond
 * kernels/ember_kernels.h.
 */
#ifndef EMBER_TESTS_SUPPORT_KERNELS_EMULATED_H
#define EMBER_TESTS_SUPPORT_KERNELS_EMULATED_H

#include <stdbool.h>
#include <stdint.h>

/* Since the process started: *operations, the copies, fills and kernels the host
 * enqueued on the emulated GPUs; *waits, the times it waited for them (stream or event
 * synchronisations). */
void em_gpu_emulated_counts(uint64_t *operations, uint64_t *waits);

/* Of the operations, the copies and fills (cudaMemcpyAsync, cudaMemsetAsync): the rest
 * are kernel launches. */
uint64_t em_gpu_emulated_transfers(void);

/* Of the waits, those during which another device also had a copy into pinned host
 * memory still in flight: the host waits for one GPU while another works on for the
 * same host (their work overlaps on real GPUs). */
uint64_t em_gpu_emulated_overlapped_waits(void);

/* Of the waits, those for the streams of several devices at once
 * (em_gpu_streams_synchronize): one round trip for GPUs that worked at once. */
uint64_t em_gpu_emulated_joint_waits(void);

/* Whether a launch's items run in one order, the same for every launch over the same
 * items (EMBER_EMULATED_ORDER forward or reverse): two tables fed the same requests then
 * hold their keys at the same slots. Not so in the scattered order, nor on a GPU. */
bool em_gpu_emulated_order_fixed(void);

/* What EMBER_EMULATED_ORDER (forward, reverse or scattered; NULL: forward) and
 * EMBER_EMULATED_LATE (kernels run when their stream is waited for, not when enqueued)
 * set, for the rest of the process. */
void em_gpu_emulated_set_order(const char *order);
void em_gpu_emulated_set_late(bool late);

#endif
