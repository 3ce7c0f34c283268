/*
 * Shared helpers for the Check suites and the benchmarks: a runner that executes each
 * test in its own process with a timeout, and a small seeded random generator so
 * every randomised test is reproducible (EMBER_TEST_SEED=<n> overrides the seed and
 * every failure message prints the seed in use).
 */
#ifndef EMBER_TESTS_TEST_SUPPORT_H
#define EMBER_TESTS_TEST_SUPPORT_H

#include <check.h>
#include <stdint.h>

/* Runs suite (each test forked; output as CK_VERBOSITY says, normal by default) and
 * returns the process exit code. */
int em_test_run(Suite *suite);

/* Seed for randomised tests: EMBER_TEST_SEED when set, else a fixed default. */
uint64_t em_test_seed(void);

/* xoshiro256** seeded through splitmix64. */
typedef struct em_test_rng {
    uint64_t state[4];
} em_test_rng;

void em_test_rng_init(em_test_rng *rng, uint64_t seed);
uint64_t em_test_rng_next(em_test_rng *rng);
/* Uniform in [0, bound), bound > 0. */
uint64_t em_test_rng_below(em_test_rng *rng, uint64_t bound);
/* Uniform in [0, 1). */
double em_test_rng_unit(em_test_rng *rng);

/* Monotonic clock in seconds, for benchmarks. */
double em_test_now(void);

/* Prints "machine: <CPU model>, <n> logical CPUs<note>" for benchmark tables. */
void em_test_print_machine(const char *note);

/* A benchmark's option: text as a whole number from 1 to most, else the program ends
 * (exit status 2) with "<program>: <option> '<text>': expected a whole number from 1 to
 * <most>". */
uint64_t em_test_parse_count(const char *program, const char *option, const char *text,
                             uint64_t most);

/* A new empty directory named <TMPDIR or /tmp>/<prefix>-XXXXXX, written to path. */
void em_test_make_dir(const char *prefix, char *path, size_t capacity);

/* Removes a directory tree (or a file), best effort. */
void em_test_remove_tree(const char *path);

/* Flips one bit (mask 0x10) of the byte at offset of the file at path: damage. */
void em_test_flip_byte(const char *path, long offset);

/* The elements of the NumPy array file dir/name (malloc'ed), checked to be of descr with
 * shape (rows,) when columns is 0, else (rows, columns). */
void *em_test_read_array(const char *dir, const char *name, const char *descr, uint64_t rows,
                         uint64_t columns);

#endif
