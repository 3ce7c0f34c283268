#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lib/table/catalog.h"
#include "tests/support/test_support.h"

static em_backend *make_backend(void)
{
    em_cpu_backend_options options;
    em_cpu_backend_options_init(&options);
    options.pool_limit_bytes = 64u << 20;
    options.pool_initial_bytes = 8u << 20;
    em_backend *backend = NULL;
    em_error err;
    ck_assert_int_eq(em_backend_create_cpu(&options, &backend, &err), EM_OK);
    return backend;
}

static em_table_config config_named(const char *name)
{
    em_table_config config;
    em_table_config_init(&config, name, 4, 1000);
    return config;
}

/* The pool's bytes in use by tables: the scratch blocks the device keeps for requests
 * (em_device_scratch_take) are the device's, given back to the pool first. */
static uint64_t pool_in_use(em_backend *backend)
{
    em_device_scratch_drop(backend->devices[0]);
    em_pool_stats stats;
    em_pool_get_stats(backend->devices[0]->pool, &stats);
    return stats.bytes_in_use;
}

START_TEST(create_lookup_and_duplicates)
{
    em_backend *backend = make_backend();
    em_catalog *catalog = NULL;
    em_error err;
    ck_assert_int_eq(em_catalog_create(backend, &catalog, &err), EM_OK);
    em_table_config a = config_named("alpha"), b = config_named("beta");
    ck_assert_int_eq(em_catalog_create_table(catalog, &b, NULL, &err), EM_OK);
    ck_assert_int_eq(em_catalog_create_table(catalog, &a, NULL, &err), EM_OK);
    ck_assert_int_eq(em_catalog_create_table(catalog, &a, NULL, &err), EM_ALREADY_EXISTS);
    ck_assert_str_eq(err.message, "table 'alpha' already exists");
    ck_assert_uint_eq(em_catalog_count(catalog), 2);
    em_table *table = NULL;
    ck_assert_int_eq(em_catalog_acquire(catalog, "beta", &table, &err), EM_OK);
    ck_assert_str_eq(em_table_name(table), "beta");
    em_catalog_release(catalog, table);
    ck_assert_int_eq(em_catalog_acquire(catalog, "gamma", &table, &err), EM_NOT_FOUND);
    ck_assert_str_eq(err.message, "no table 'gamma' (tables: beta, alpha)");
    em_table **list = NULL;
    size_t count = 0;
    ck_assert_int_eq(em_catalog_list(catalog, &list, &count, &err), EM_OK);
    ck_assert_uint_eq(count, 2);
    ck_assert_str_eq(em_table_name(list[0]), "alpha");
    ck_assert_str_eq(em_table_name(list[1]), "beta");
    for (size_t i = 0; i < count; i++)
        em_catalog_release(catalog, list[i]);
    free(list);
    em_catalog_destroy(catalog);
    em_backend_destroy(backend);
}
END_TEST

START_TEST(drop_waits_for_the_last_reference)
{
    em_backend *backend = make_backend();
    em_catalog *catalog = NULL;
    em_error err;
    ck_assert_int_eq(em_catalog_create(backend, &catalog, &err), EM_OK);
    uint64_t baseline = pool_in_use(backend);
    em_table_config config = config_named("clicks");
    em_table *held = NULL;
    ck_assert_int_eq(em_catalog_create_table(catalog, &config, &held, &err), EM_OK);
    /* put rows in so the table owns pool memory */
    const uint32_t offsets[] = {0, 2};
    const uint64_t keys[] = {1, 2};
    float out[8];
    em_pull_request request = {{1, 2, offsets, keys}, EM_COMBINER_NONE, true, out, 8};
    em_pull_result result;
    ck_assert_int_eq(em_table_pull(held, &request, &result, &err), EM_OK);
    uint64_t with_table = pool_in_use(backend);
    ck_assert_uint_gt(with_table, baseline);

    ck_assert_int_eq(em_catalog_drop(catalog, "clicks", &err), EM_OK);
    ck_assert_uint_eq(em_catalog_count(catalog), 0);
    em_table *again = NULL;
    ck_assert_int_eq(em_catalog_acquire(catalog, "clicks", &again, &err), EM_NOT_FOUND);
    ck_assert_str_eq(err.message, "no table 'clicks' (tables: none)");
    /* the held reference still works, and its memory stays until released */
    ck_assert_int_eq(em_table_pull(held, &request, &result, &err), EM_OK);
    ck_assert_uint_eq(pool_in_use(backend), with_table);
    /* the name is free for a new table meanwhile */
    ck_assert_int_eq(em_catalog_create_table(catalog, &config, NULL, &err), EM_OK);
    ck_assert_int_eq(em_catalog_drop(catalog, "clicks", &err), EM_OK);
    em_catalog_release(catalog, held);
    ck_assert_uint_eq(pool_in_use(backend), baseline);
    ck_assert_int_eq(em_catalog_drop(catalog, "clicks", &err), EM_NOT_FOUND);
    em_catalog_destroy(catalog);
    em_backend_destroy(backend);
}
END_TEST

typedef struct racer {
    em_catalog *catalog;
    em_status status;
} racer;

static void *create_same_name(void *argument)
{
    racer *r = argument;
    em_table_config config = config_named("contested");
    em_error err;
    r->status = em_catalog_create_table(r->catalog, &config, NULL, &err);
    return NULL;
}

START_TEST(concurrent_creates_of_one_name_make_one_table)
{
    em_backend *backend = make_backend();
    em_catalog *catalog = NULL;
    em_error err;
    ck_assert_int_eq(em_catalog_create(backend, &catalog, &err), EM_OK);
    pthread_t threads[8];
    racer racers[8];
    for (int i = 0; i < 8; i++) {
        racers[i] = (racer){catalog, EM_UNKNOWN};
        pthread_create(&threads[i], NULL, create_same_name, &racers[i]);
    }
    int created = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(threads[i], NULL);
        ck_assert(racers[i].status == EM_OK || racers[i].status == EM_ALREADY_EXISTS);
        created += racers[i].status == EM_OK;
    }
    ck_assert_int_eq(created, 1);
    ck_assert_uint_eq(em_catalog_count(catalog), 1);
    em_catalog_destroy(catalog);
    em_backend_destroy(backend);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("catalog");
    TCase *tc = tcase_create("catalog");
    tcase_add_test(tc, create_lookup_and_duplicates);
    tcase_add_test(tc, drop_waits_for_the_last_reference);
    tcase_add_test(tc, concurrent_creates_of_one_name_make_one_table);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
