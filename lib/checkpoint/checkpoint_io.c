#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "lib/base/failpoint.h"
#include "lib/checkpoint/checkpoint_io.h"

const char *em_save_step_name(em_save_step step)
{
    switch (step) {
#define EM_SAVE_STEP_NAME(ID, number, name)                                                   \
    case EM_SAVE_##ID:                                                                        \
        return name;
        EM_SAVE_STEPS(EM_SAVE_STEP_NAME)
#undef EM_SAVE_STEP_NAME
    }
    return "?";
}

/* The failpoints: a crash ends the process before the step; a failure is reported. */
static bool step_fails(em_save_step step)
{
    uint64_t value = 0;
    if (em_failpoint_hit(EM_FAILPOINT_CHECKPOINT_CRASH, &value) && value == (uint64_t)step)
        _exit(99);
    return em_failpoint_hit(EM_FAILPOINT_CHECKPOINT_FAIL, &value) && value == (uint64_t)step;
}

static em_status step_error(em_save_step step, const char *path, int error, em_error *err)
{
    return em_error_set(err, EM_INTERNAL, "%s (step %d) failed for %s: %s", em_save_step_name(step),
                        (int)step, path, strerror(error));
}

#ifdef EM_ADDRESS_SANITIZED /* from malloc (checkpoint_io.h) */
void *em_io_buffer_alloc(size_t bytes)
{
    size_t large = (size_t)2 << 20, align = bytes >= large ? large : EM_SAVE_DIRECT_ALIGN;
    void *memory = NULL;
    if (bytes > SIZE_MAX / 2) /* refused as in the build without the sanitizer */
        return NULL;
    return posix_memalign(&memory, align, bytes > 0 ? bytes : 1) == 0 ? memory : NULL;
}

void em_io_buffer_free(void *buffer)
{
    free(buffer);
}
#else
/* An io buffer is mapped on its own, one page before its data holding the mapping's
 * length, so that its free gives its pages back to the system at once. */
static size_t page_bytes(void)
{
    long page = sysconf(_SC_PAGESIZE);
    return page > 0 ? (size_t)page : EM_SAVE_DIRECT_ALIGN;
}

static size_t round_up(size_t bytes, size_t to)
{
    return (bytes + to - 1) / to * to;
}

void *em_io_buffer_alloc(size_t bytes)
{
    size_t large = (size_t)2 << 20, page = page_bytes();
    size_t align = bytes >= large ? large : EM_SAVE_DIRECT_ALIGN;
    align = align > page ? align : page;
    if (bytes > SIZE_MAX / 2) /* no such memory; and the sums below stay in range */
        return NULL;
    size_t data_bytes = round_up(bytes > 0 ? bytes : 1, page);
    size_t length = page + data_bytes + align;
    unsigned char *base = mmap(NULL, length, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
        return NULL;
    uintptr_t first = (uintptr_t)base + page;
    unsigned char *data = base + (round_up(first, align) - first) + page;
    unsigned char *start = data - page, *end = data + data_bytes;
    if (start > base) /* the slack the alignment left before and after */
        munmap(base, (size_t)(start - base));
    if (base + length > end)
        munmap(end, (size_t)(base + length - end));
    size_t kept = page + data_bytes;
    memcpy(start, &kept, sizeof(kept));
    if (align == large) /* advice only: without large pages the buffer works as well */
        (void)madvise(data, data_bytes, MADV_HUGEPAGE);
    return data;
}

void em_io_buffer_free(void *buffer)
{
    if (buffer == NULL)
        return;
    unsigned char *start = (unsigned char *)buffer - page_bytes();
    size_t length = 0;
    memcpy(&length, start, sizeof(length));
    munmap(start, length);
}
#endif

em_status em_save_write(int fd, const void *data, size_t bytes, em_save_step step,
                        const char *path, em_error *err)
{
    const char *p = data;
    bool fail = step_fails(step);
    int flags = fcntl(fd, F_GETFL);
    bool direct = flags != -1 && (flags & O_DIRECT) != 0;
    size_t limit = fail ? bytes / 2 : bytes;
    if (fail && direct) /* half, in the blocks a direct write takes */
        limit &= ~(EM_SAVE_DIRECT_ALIGN - 1);
    while (limit > 0) {
        ssize_t written = write(fd, p, limit);
        if (written < 0 && errno == EINTR)
            continue;
        if (written < 0 && errno == EINVAL && direct) {
            /* the file system wants other alignment: go on through the page cache */
            direct = false;
            if (fcntl(fd, F_SETFL, flags & ~O_DIRECT) == 0)
                continue;
            errno = EINVAL;
        }
        if (written < 0)
            return step_error(step, path, errno, err);
        p += written;
        limit -= (size_t)written;
    }
    return fail ? step_error(step, path, ENOSPC, err) : EM_OK;
}

em_status em_save_write_buffered(int fd, const void *data, size_t bytes, em_save_step step,
                                 const char *path, em_error *err)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags == -1 || ((flags & O_DIRECT) != 0 && fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0))
        return step_error(step, path, errno, err);
    return em_save_write(fd, data, bytes, step, path, err);
}

em_status em_save_fsync(int fd, em_save_step step, const char *path, em_error *err)
{
    if (step_fails(step))
        return step_error(step, path, EIO, err);
    if (fsync(fd) != 0)
        return step_error(step, path, errno, err);
    return EM_OK;
}

em_status em_save_fsync_dir(const char *path, em_save_step step, em_error *err)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return step_error(step, path, errno, err);
    em_status status = em_save_fsync(fd, step, path, err);
    close(fd);
    return status;
}

em_status em_save_rename(const char *from, const char *to, em_save_step step, em_error *err)
{
    if (step_fails(step))
        return step_error(step, to, EIO, err);
    if (rename(from, to) != 0)
        return step_error(step, to, errno, err);
    return EM_OK;
}
