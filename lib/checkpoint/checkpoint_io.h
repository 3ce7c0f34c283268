/*
 * DESIGN: the file operations of a save, each a named step, so that a failure names
 * what failed and tests can make any step fail or crash (failpoints checkpoint_fail and
 * checkpoint_crash, whose value is the step's number below).
 */
#ifndef EMBER_LIB_CHECKPOINT_IO_H
#define EMBER_LIB_CHECKPOINT_IO_H

#include <stddef.h>

#include "lib/base/status.h"

/* X(ID, number, name) in the order a save takes them. */
#define EM_SAVE_STEPS(X)                                                                      \
    X(ROWS_WRITE, 1, "write rows.emb")                                                        \
    X(ROWS_FSYNC, 2, "fsync rows.emb")                                                        \
    X(INDEX_WRITE, 3, "write index.emb")                                                      \
    X(INDEX_FSYNC, 4, "fsync index.emb")                                                      \
    X(TOMBSTONES_WRITE, 5, "write tombstones.emb")                                            \
    X(TOMBSTONES_FSYNC, 6, "fsync tombstones.emb")                                            \
    X(MANIFEST_WRITE, 7, "write manifest.json")                                               \
    X(MANIFEST_FSYNC, 8, "fsync manifest.json")                                               \
    X(DIR_FSYNC, 9, "fsync the checkpoint's directory")                                       \
    X(RENAME, 10, "rename the checkpoint's directory to its id")                              \
    X(TABLE_DIR_FSYNC, 11, "fsync the table's directory")                                     \
    X(LATEST_WRITE, 12, "write LATEST.tmp")                                                   \
    X(LATEST_FSYNC, 13, "fsync LATEST.tmp")                                                   \
    X(LATEST_RENAME, 14, "rename LATEST.tmp to LATEST")                                       \
    X(LATEST_DIR_FSYNC, 15, "fsync the table's directory after LATEST")

/* The number of steps (the last one's). */
#define EM_SAVE_STEP_COUNT 15

typedef enum em_save_step {
#define EM_SAVE_STEP_ENUM(ID, number, name) EM_SAVE_##ID = number,
    EM_SAVE_STEPS(EM_SAVE_STEP_ENUM)
#undef EM_SAVE_STEP_ENUM
} em_save_step;

const char *em_save_step_name(em_save_step step);

/* Direct writes (O_DIRECT) start at and cover multiples of this many bytes, from memory
 * aligned to it. */
#define EM_SAVE_DIRECT_ALIGN ((size_t)4096)

/* Set in a build with AddressSanitizer (gcc's macro, clang's feature test): io buffers
 * then come from malloc, whose bounds the sanitizer checks to the byte. */
#if defined(__SANITIZE_ADDRESS__)
#define EM_ADDRESS_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EM_ADDRESS_SANITIZED 1
#endif
#endif

/* Memory for a buffer that large reads or writes go through (freed with
 * em_io_buffer_free), NULL when there is none: aligned to EM_SAVE_DIRECT_ALIGN, and from
 * 2 MiB up to 2 MiB with the advice to back it with large pages. It is mapped on its own
 * and unmapped when freed: from malloc, a save's buffers stayed in the allocator's arenas
 * after the save (one set an arena, the threads that saved), and a daemon saving small
 * tables every second grew from 22 to 35-58 MiB and stayed there. A direct write pins every page it sends, and the
 * disk takes each page as a segment: direct writes of a 1.5 GiB file in 4 MiB calls spent
 * 0.61-0.69 s in the kernel from 4 KiB pages and 0.35-0.38 s from large pages on a virtual
 * disk, where a save's writer thread went from 0.64-0.77 s to 0.35-0.39 s
 * (tests/bench/RESULTS.md). Copies into and out of such a buffer miss the TLB less. */
void *em_io_buffer_alloc(size_t bytes);
void em_io_buffer_free(void *buffer);

/* Writes all of data to fd (a short write and EINTR go on; a step made to fail writes
 * half, then fails with ENOSPC). An fd opened O_DIRECT gets data and bytes aligned to
 * EM_SAVE_DIRECT_ALIGN; where its file system refuses that (EINVAL), the fd goes on
 * through the page cache. Errors: INTERNAL naming the step and path. */
em_status em_save_write(int fd, const void *data, size_t bytes, em_save_step step,
                        const char *path, em_error *err);
/* em_save_write through the page cache, whatever fd was opened with (the last partial
 * block of a file written O_DIRECT). */
em_status em_save_write_buffered(int fd, const void *data, size_t bytes, em_save_step step,
                                 const char *path, em_error *err);
/* fsync; a failure is final (never retried). */
em_status em_save_fsync(int fd, em_save_step step, const char *path, em_error *err);
/* Opens a directory and fsyncs it. */
em_status em_save_fsync_dir(const char *path, em_save_step step, em_error *err);
em_status em_save_rename(const char *from, const char *to, em_save_step step, em_error *err);

#endif
