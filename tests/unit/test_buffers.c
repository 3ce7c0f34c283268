/* Zeroed buffers (lib/base/zeroed.h) and zeroed cache-line aligned ones
 * (lib/base/aligned.h). */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lib/base/aligned.h"
#include "lib/base/zeroed.h"

static size_t nonzero_bytes(const unsigned char *bytes, size_t n)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += bytes[i] != 0;
    return count;
}

/* A buffer of a size just freed full of ones (which malloc likely hands out again, as
 * it keeps freed chunks per size) comes back zeroed, for sizes from a byte to past
 * malloc's per-thread cache; a count of 0 still gets a buffer; an overflowing count x
 * size gets NULL. */
START_TEST(zeroed_buffers_are_zero_whatever_was_freed_before)
{
    static const size_t sizes[] = {1, 8, 40, 128, 856, 1024, 5000, 70000};
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        for (int round = 0; round < 4; round++) {
            unsigned char *dirty = malloc(sizes[s]);
            ck_assert_ptr_nonnull(dirty);
            memset(dirty, 0xff, sizes[s]);
            free(dirty);
            unsigned char *clean = em_zeroed(sizes[s], 1);
            ck_assert_ptr_nonnull(clean);
            ck_assert_msg(nonzero_bytes(clean, sizes[s]) == 0, "%zu bytes: some not zero",
                          sizes[s]);
            free(clean);
        }
    }
    void *empty = em_zeroed(0, 16);
    ck_assert_ptr_nonnull(empty);
    free(empty);
    ck_assert_ptr_null(em_zeroed(SIZE_MAX / 8 + 1, 8));
    ck_assert_ptr_null(em_zeroed(2, SIZE_MAX / 2 + 1));
}
END_TEST

/* Aligned buffers start on a cache line and come back zeroed; 0 or an overflowing count
 * x size gets NULL. */
START_TEST(aligned_buffers_are_zero_and_on_a_line)
{
    for (size_t size = 1; size <= 4096; size *= 3) {
        unsigned char *dirty = malloc(size);
        ck_assert_ptr_nonnull(dirty);
        memset(dirty, 0xff, size);
        free(dirty);
        unsigned char *clean = em_aligned_calloc(size, 1);
        ck_assert_ptr_nonnull(clean);
        ck_assert_uint_eq((uintptr_t)clean % EM_CACHE_LINE, 0);
        ck_assert_uint_eq(nonzero_bytes(clean, size), 0);
        free(clean);
    }
    ck_assert_ptr_null(em_aligned_calloc(0, 8));
    ck_assert_ptr_null(em_aligned_calloc(SIZE_MAX / 8 + 1, 8));
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("buffers");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, zeroed_buffers_are_zero_whatever_was_freed_before);
    tcase_add_test(tc, aligned_buffers_are_zero_and_on_a_line);
    suite_add_tcase(suite, tc);
    SRunner *runner = srunner_create(suite);
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
