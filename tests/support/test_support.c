#include "tests/support/test_support.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lib/checkpoint/npy.h"

#define DEFAULT_TEST_SEED UINT64_C(20261121)

int em_test_run(Suite *suite)
{
    SRunner *runner = srunner_create(suite);
    srunner_set_fork_status(runner, CK_FORK);
    srunner_run_all(runner, CK_ENV); /* CK_VERBOSITY=verbose lists every test */
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    if (failed != 0)
        fprintf(stderr, "seed: EMBER_TEST_SEED=%" PRIu64 "\n", em_test_seed());
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

uint64_t em_test_seed(void)
{
    const char *text = getenv("EMBER_TEST_SEED");
    if (text == NULL || *text == '\0')
        return DEFAULT_TEST_SEED;
    return strtoull(text, NULL, 0);
}

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

void em_test_rng_init(em_test_rng *rng, uint64_t seed)
{
    uint64_t state = seed;
    for (int i = 0; i < 4; i++)
        rng->state[i] = splitmix64(&state);
}

static uint64_t rotate_left(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t em_test_rng_next(em_test_rng *rng)
{
    uint64_t *s = rng->state;
    uint64_t result = rotate_left(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotate_left(s[3], 45);
    return result;
}

uint64_t em_test_rng_below(em_test_rng *rng, uint64_t bound)
{
    return (uint64_t)(((unsigned __int128)em_test_rng_next(rng) * bound) >> 64);
}

double em_test_rng_unit(em_test_rng *rng)
{
    return (double)(em_test_rng_next(rng) >> 11) * 0x1.0p-53;
}

double em_test_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

uint64_t em_test_parse_count(const char *program, const char *option, const char *text,
                             uint64_t most)
{
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    /* strtoull takes "-1" (after blanks too) as 2^64 - 1 */
    if (errno != 0 || end == text || *end != '\0' || strchr(text, '-') != NULL || value < 1 ||
        value > most) {
        fprintf(stderr, "%s: %s '%s': expected a whole number from 1 to %" PRIu64 "\n", program,
                option, text, most);
        exit(2);
    }
    return value;
}

void em_test_print_machine(const char *note)
{
    FILE *cpuinfo = fopen("/proc/cpuinfo", "r");
    char line[256], model[256] = "unknown";
    int cpus = 0;
    while (cpuinfo != NULL && fgets(line, sizeof(line), cpuinfo) != NULL) {
        if (strncmp(line, "model name", 10) == 0) {
            cpus++;
            snprintf(model, sizeof(model), "%s", strchr(line, ':') + 2);
            model[strcspn(model, "\n")] = '\0';
        }
    }
    if (cpuinfo != NULL)
        fclose(cpuinfo);
    printf("machine: %s, %d logical CPUs%s\n", model, cpus, note != NULL ? note : "");
}

void em_test_make_dir(const char *prefix, char *path, size_t capacity)
{
    const char *tmp = getenv("TMPDIR") != NULL ? getenv("TMPDIR") : "/tmp";
    snprintf(path, capacity, "%s/%s-XXXXXX", tmp, prefix);
    ck_assert_ptr_nonnull(mkdtemp(path));
}

void em_test_remove_tree(const char *path)
{
    DIR *dir = opendir(path);
    if (dir == NULL) {
        unlink(path);
        return;
    }
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0)
            continue;
        char child[4400];
        snprintf(child, sizeof(child), "%s/%s", path, entry->d_name);
        em_test_remove_tree(child);
    }
    closedir(dir);
    rmdir(path);
}

void em_test_flip_byte(const char *path, long offset)
{
    int fd = open(path, O_RDWR);
    ck_assert_int_ge(fd, 0);
    unsigned char byte = 0;
    ck_assert_int_eq(pread(fd, &byte, 1, offset), 1);
    byte ^= 0x10;
    ck_assert_int_eq(pwrite(fd, &byte, 1, offset), 1);
    close(fd);
}

void *em_test_read_array(const char *dir, const char *name, const char *descr, uint64_t rows,
                         uint64_t columns)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *file = fopen(path, "rb");
    ck_assert_msg(file != NULL, "%s is missing", path);
    em_npy_array shape;
    em_error err;
    ck_assert_msg(em_npy_read_header(file, path, &shape, &err) == EM_OK, "%s", err.message);
    ck_assert_str_eq(shape.descr, descr);
    ck_assert_uint_eq(shape.dimensions, columns == 0 ? 1 : 2);
    ck_assert_uint_eq(shape.rows, rows);
    ck_assert_uint_eq(shape.columns, columns == 0 ? 1 : columns);
    size_t bytes = rows * (columns == 0 ? 1 : columns) * em_npy_element_bytes(descr);
    void *data = malloc(bytes + 1);
    ck_assert_uint_eq(fread(data, 1, bytes, file), bytes);
    fclose(file);
    return data;
}
