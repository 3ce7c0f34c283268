/*
 * Host buffers (lib/device/host_buffers.h) over a provider of ordinary host memory
 * standing in for pinned memory: buffers come from the pool while it has room and from
 * malloc after, the range check tells the two apart, and every buffer frees through the
 * same call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lib/device/host_buffers.h"
#include "tests/support/test_support.h"

#define KIBIBYTE ((size_t)1024)

typedef struct provider_log {
    int reserved, released;
} provider_log;

static em_status reserve(void *context, size_t bytes, uintptr_t *base, em_error *err)
{
    void *region = aligned_alloc(EM_POOL_ALIGNMENT, bytes);
    if (region == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "test region");
    ((provider_log *)context)->reserved++;
    *base = (uintptr_t)region;
    return EM_OK;
}

static void release(void *context, uintptr_t base, size_t bytes)
{
    (void)bytes;
    ((provider_log *)context)->released++;
    free((void *)base);
}

static em_host_buffers *make_buffers(provider_log *log, size_t limit, size_t region)
{
    em_host_buffers_options options = {
        .name = "test",
        .limit_bytes = limit,
        .region_bytes = region,
        .provider = {.reserve = reserve, .release = release, .context = log},
    };
    em_host_buffers *buffers = NULL;
    em_error err;
    ck_assert_msg(em_host_buffers_create(&options, &buffers, &err) == EM_OK, "%s", err.message);
    return buffers;
}

START_TEST(buffers_are_pinned_until_the_limit_then_malloced)
{
    provider_log log = {0, 0};
    em_host_buffers *buffers = make_buffers(&log, 512 * KIBIBYTE, 64 * KIBIBYTE);
    ck_assert_int_eq(log.reserved, 0); /* regions come as buffers need them */
    uint8_t *small = em_host_buffer_alloc(buffers, 1000);
    uint8_t *empty = em_host_buffer_alloc(buffers, 0);
    uint8_t *big = em_host_buffer_alloc(buffers, 200 * KIBIBYTE);
    uint8_t *too_big = em_host_buffer_alloc(buffers, 300 * KIBIBYTE); /* 64 + 200 + 300 > 512 */
    ck_assert_ptr_nonnull(small);
    ck_assert_ptr_nonnull(empty);
    ck_assert_ptr_nonnull(big);
    ck_assert_ptr_nonnull(too_big);
    ck_assert_uint_eq((uintptr_t)small % EM_HOST_BUFFER_ALIGNMENT, 0);
    ck_assert_uint_eq((uintptr_t)too_big % EM_HOST_BUFFER_ALIGNMENT, 0);
    ck_assert(em_host_buffer_pinned(buffers, small, 1000));
    ck_assert(em_host_buffer_pinned(buffers, small + 10, 990));
    ck_assert(em_host_buffer_pinned(buffers, big, 200 * KIBIBYTE));
    ck_assert(!em_host_buffer_pinned(buffers, too_big, 1));
    ck_assert(!em_host_buffer_pinned(buffers, &log, sizeof(log)));
    ck_assert(!em_host_buffer_pinned(NULL, small, 1));
    memset(small, 1, 1000);
    memset(big, 2, 200 * KIBIBYTE);
    memset(too_big, 3, 300 * KIBIBYTE);
    em_host_buffers_stats stats;
    em_host_buffers_get_stats(buffers, &stats);
    ck_assert_uint_eq(stats.pinned_allocations, 3);
    ck_assert_uint_eq(stats.unpinned_allocations, 1);
    ck_assert_uint_eq(stats.pinned_bytes_limit, 512 * KIBIBYTE);
    ck_assert_uint_le(stats.pinned_bytes_reserved, 512 * KIBIBYTE);
    ck_assert_uint_ge(stats.pinned_bytes_in_use, 201 * KIBIBYTE);
    em_host_buffers_count_copy(buffers, true, 100);
    em_host_buffers_count_copy(buffers, false, 7);
    em_host_buffers_count_copy(NULL, true, 5);
    em_host_buffer_free(buffers, small);
    em_host_buffer_free(buffers, empty);
    em_host_buffer_free(buffers, big);
    em_host_buffer_free(buffers, too_big);
    em_host_buffer_free(buffers, NULL);
    em_host_buffer_free(buffers, malloc(10)); /* any malloc'ed pointer */
    em_host_buffers_get_stats(buffers, &stats);
    ck_assert_uint_eq(stats.pinned_bytes_in_use, 0);
    ck_assert_uint_eq(stats.bytes_copied_directly, 100);
    ck_assert_uint_eq(stats.bytes_copied_staged, 7);
    /* the freed room serves again */
    uint8_t *again = em_host_buffer_alloc(buffers, 200 * KIBIBYTE);
    ck_assert(em_host_buffer_pinned(buffers, again, 200 * KIBIBYTE));
    em_host_buffer_free(buffers, again);
    int reserved = log.reserved;
    ck_assert_int_ge(reserved, 1);
    em_host_buffers_destroy(buffers);
    ck_assert_int_eq(log.released, reserved);
}
END_TEST

START_TEST(without_a_pool_every_buffer_is_malloced)
{
    uint8_t *buffer = em_host_buffer_alloc(NULL, 3 * KIBIBYTE);
    ck_assert_ptr_nonnull(buffer);
    ck_assert_uint_eq((uintptr_t)buffer % EM_HOST_BUFFER_ALIGNMENT, 0);
    memset(buffer, 0, 3 * KIBIBYTE);
    ck_assert(!em_host_buffer_pinned(NULL, buffer, 1));
    em_host_buffer_free(NULL, buffer);
    em_host_buffers_stats stats;
    em_host_buffers_get_stats(NULL, &stats);
    ck_assert_uint_eq(stats.pinned_allocations + stats.unpinned_allocations, 0);
}
END_TEST

START_TEST(bad_options_are_refused)
{
    provider_log log = {0, 0};
    em_host_buffers_options options = {
        .limit_bytes = 0,
        .provider = {.reserve = reserve, .release = release, .context = &log},
    };
    em_host_buffers *buffers = NULL;
    em_error err;
    ck_assert_int_eq(em_host_buffers_create(&options, &buffers, &err), EM_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(err.message, "limit"));
    ck_assert_ptr_null(buffers);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("host_buffers");
    TCase *tc = tcase_create("host_buffers");
    tcase_add_test(tc, buffers_are_pinned_until_the_limit_then_malloced);
    tcase_add_test(tc, without_a_pool_every_buffer_is_malloced);
    tcase_add_test(tc, bad_options_are_refused);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
