/*
 * Pull throughput of the C client, for tests/bench/bench_python.py to set beside the
 * same workload from Python: pulls of ROWS rows of KEYS_PER_ROW keys drawn from KEY_SPACE
 * (a fixed seed, so both sides send the same batches), pooled with SUM, WINDOW in flight.
 *
 *   bench_client_pull SERVER TABLE ROWS KEYS_PER_ROW KEY_SPACE PULLS WINDOW
 *
 * Prints one line: "<keys per second> <seconds>".
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "clients/ember_client.h"

static double now_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

/* The batches bench_python.py draws too: key i of pull p is a splitmix64 mix of
 * (p * nnz + i), modulo the key space. */
static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

int main(int argc, char **argv)
{
    if (argc != 8) {
        fprintf(stderr, "usage: %s SERVER TABLE ROWS KEYS_PER_ROW KEY_SPACE PULLS WINDOW\n",
                argv[0]);
        return 2;
    }
    uint32_t rows = (uint32_t)atoi(argv[3]), per_row = (uint32_t)atoi(argv[4]);
    uint64_t key_space = strtoull(argv[5], NULL, 10);
    uint32_t pulls = (uint32_t)atoi(argv[6]), window = (uint32_t)atoi(argv[7]);
    uint64_t nnz = (uint64_t)rows * per_row;
    uint32_t batches = 16; /* distinct batches, cycled */
    uint32_t *offsets = malloc((rows + 1) * sizeof(uint32_t));
    uint64_t *keys = malloc(batches * nnz * sizeof(uint64_t));
    em_client_options options;
    em_client_options_init(&options);
    options.servers = argv[1];
    options.window = window;
    em_client *client;
    em_error err = {0};
    if (offsets == NULL || keys == NULL || em_client_create(&options, &client, &err) != EM_OK) {
        fprintf(stderr, "bench_client_pull: %s\n", err.message);
        return 1;
    }
    for (uint32_t r = 0; r <= rows; r++)
        offsets[r] = r * per_row;
    for (uint64_t i = 0; i < batches * nnz; i++)
        keys[i] = mix(i) % key_space;
    /* the answers of the calls in flight: window buffers of rows x 64 floats at most */
    uint64_t out_floats = (uint64_t)rows * 64;
    float *out = malloc(window * out_floats * sizeof(float));
    em_client_call **calls = calloc(window, sizeof(*calls));
    if (out == NULL || calls == NULL)
        return 1;
    double started = now_seconds();
    for (uint32_t p = 0; p < pulls + window; p++) {
        uint32_t slot = p % window;
        if (calls[slot] != NULL) {
            em_client_pull_result result;
            if (em_client_finish(client, calls[slot], &result, &err) != EM_OK) {
                fprintf(stderr, "bench_client_pull: %s\n", err.message);
                return 1;
            }
            calls[slot] = NULL;
        }
        if (p >= pulls)
            continue;
        em_client_pull_args args = {argv[2], {rows, nnz, offsets, keys + (p % batches) * nnz},
                                    EM_COMBINER_SUM, true, out + slot * out_floats, out_floats};
        if (em_client_pull_start(client, &args, &calls[slot], &err) != EM_OK) {
            fprintf(stderr, "bench_client_pull: %s\n", err.message);
            return 1;
        }
    }
    double seconds = now_seconds() - started;
    printf("%.0f %.4f\n", (double)pulls * (double)nnz / seconds, seconds);
    em_client_destroy(client);
    free(calls);
    free(out);
    free(keys);
    free(offsets);
    return 0;
}
