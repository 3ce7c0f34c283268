/*
 * DESIGN: moving whole rows in and out of a table: import (rows with their optimizer
 * state, checked to be finite and well-formed before anything is written) and export
 * (a cursor over every shard's rows, for checkpoints and rebalancing).
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/table/table_internal.h"

/* ---- import / export ------------------------------------------------------------- */

/* A row of a table of config, of floats floats (weights, then optimizer state). */
static em_status check_import_row(const em_table_config *config, uint32_t floats, uint64_t key,
                                  uint64_t index, const float *row, em_error *err)
{
    uint32_t dim = config->dim;
    em_optimizer_kind kind = config->optimizer.kind;
    for (uint32_t j = 0; j < floats; j++) {
        /* the usual row passes on these two tests alone; names only for a refusal */
        if (isfinite(row[j]) && (j < dim || row[j] >= 0))
            continue;
        bool weight = j < dim;
        uint32_t state_index = j - dim;
        const char *what = weight ? "weight" : em_optimizer_state_name(kind, dim, state_index);
        if (!isfinite(row[j]))
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "row %" PRIu64 " (key %" PRIu64 "): %s element %u is not finite",
                                index, key, what, weight ? j : state_index);
        if (em_optimizer_state_nonnegative(kind, dim, state_index))
            return em_error_set(err, EM_INVALID_ARGUMENT,
                                "row %" PRIu64 " (key %" PRIu64 "): %s element %u is %g, must "
                                "be >= 0", index, key, what, state_index, (double)row[j]);
    }
    return EM_OK;
}

static uint32_t nonnegative_run(const em_table_config *config, uint32_t floats)
{
    uint32_t dim = config->dim;
    em_optimizer_kind kind = config->optimizer.kind;
    uint32_t from = floats;
    for (uint32_t j = dim; j < floats && from == floats; j++)
        if (em_optimizer_state_nonnegative(kind, dim, j - dim))
            from = j;
    for (uint32_t j = from; j < floats; j++)
        if (!em_optimizer_state_nonnegative(kind, dim, j - dim))
            return UINT32_MAX;
    return from;
}

uint32_t em__nonnegative_run(const em_table *table)
{
    return nonnegative_run(&table->config, table->row_floats);
}

/* check_import_row's verdict for a row that passes it, without a branch per float (so
 * the compiler vectorises it): every float finite (exponent not all ones), and none of
 * those from nonnegative_from on below zero (-0.0 is not). */
static bool row_passes(const float *row, uint32_t floats, uint32_t nonnegative_from)
{
    uint32_t bad = 0;
    for (uint32_t j = 0; j < floats; j++) {
        uint32_t bits;
        memcpy(&bits, row + j, sizeof(bits));
        bad |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u);
    }
    for (uint32_t j = nonnegative_from; j < floats; j++)
        bad |= (uint32_t)(row[j] < 0.0f);
    return bad == 0;
}

static em_status check_import_size(uint64_t n, em_error *err)
{
    if (n > MAX_KEYS_PER_REQUEST)
        return em_error_set(err, EM_INVALID_ARGUMENT, "import of %" PRIu64 " rows exceeds %"
                            PRIu32 " rows per call", n, MAX_KEYS_PER_REQUEST);
    return EM_OK;
}

static em_status check_rows(const em_table_config *config, uint32_t floats,
                            uint32_t nonnegative_from, const uint64_t *keys, const float *values,
                            uint64_t n, em_error *err)
{
    for (uint64_t i = 0; i < n; i++) {
        const float *row = values + i * floats;
        if (nonnegative_from != UINT32_MAX && row_passes(row, floats, nonnegative_from))
            continue;
        /* the slow check names what is wrong (or passes a row the fast one doubted) */
        em_status status = check_import_row(config, floats, keys[i], i, row, err);
        if (status != EM_OK)
            return status;
    }
    return EM_OK;
}

em_status em_table_check_rows(const em_table *table, const uint64_t *keys, const float *values,
                              uint64_t n, em_error *err)
{
    return check_rows(&table->config, table->row_floats, table->nonnegative_from, keys, values,
                      n, err);
}

em_status em_table_config_check_rows(const em_table_config *config, const uint64_t *keys,
                                     const float *values, uint64_t n, em_error *err)
{
    uint32_t floats = config->dim + em_optimizer_state_floats(config->optimizer.kind, config->dim);
    return check_rows(config, floats, nonnegative_run(config, floats), keys, values, n, err);
}

/* Keys of an import are distinct; inverse[i] == i for all i exactly then (unique keeps
 * the order of first appearance). */
static em_status check_distinct(request_context *r, const uint64_t *keys, uint64_t n,
                                em_error *err)
{
    if (r->batch.unique_count == n)
        return EM_OK;
    const uint32_t *inverse = r->batch.inverse;
    uint32_t *host_inverse = NULL;
    if (!r->home->host_addressable) {
        host_inverse = malloc(n * sizeof(*host_inverse));
        if (host_inverse == NULL)
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of host memory");
        em_status status = r->home->ops->copy_to_host(r->home_lane, host_inverse, inverse,
                                                      n * sizeof(*host_inverse), err);
        if (status != EM_OK) {
            free(host_inverse);
            return status;
        }
        inverse = host_inverse;
    }
    uint64_t i = 0;
    while (i < n && inverse[i] == i)
        i++;
    em_status status = em_error_set(err, EM_INVALID_ARGUMENT,
                                    "key %" PRIu64 " appears twice (rows %u and %" PRIu64 ")",
                                    keys[i], inverse[i], i);
    free(host_inverse);
    return status;
}

/* Identity offsets (one key per row) so the gradient-sum operation places import rows
 * in partitioned order; sums start at -0.0, so single values are copied bit for bit. */
static em_status stage_identity_offsets(request_context *r, uint64_t n, em_error *err)
{
    uint32_t *offsets = malloc((n + 1) * sizeof(*offsets));
    if (offsets == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of host memory");
    for (uint64_t i = 0; i <= n; i++)
        offsets[i] = (uint32_t)i;
    em_csr identity = {.rows = (uint32_t)n, .nnz = n, .offsets = offsets};
    em_status status = EM_OK;
    if (r->home->host_addressable) {
        /* Aliased staging would outlive this buffer: copy into scratch instead. */
        void *copy = NULL;
        status = em__request_alloc(r, r->home, (n + 1) * sizeof(uint32_t), "import offsets", &copy,
                                   err);
        if (status == EM_OK)
            memcpy(copy, offsets, (n + 1) * sizeof(uint32_t));
        r->batch.rows = (uint32_t)n;
        r->batch.offsets = copy;
    } else {
        status = em__stage_offsets(r, &identity, err);
    }
    free(offsets);
    return status;
}

static em_status send_import_rows(request_context *r, const float *values, uint64_t n,
                                  em_error *err)
{
    em_device *home = r->home;
    uint32_t width = r->table->row_floats;
    const float *staged = NULL;
    float *ordered = NULL;
    if (r->row_sources != NULL) /* written from where they are (import_locked) */
        return EM_OK;
    if (r->targets != NULL) { /* em__shards_at_home: rows written from staged by target */
        em_status status = em__stage_input(r, values, n * width * sizeof(float),
                                           "import values", (const void **)&staged, err);
        for (uint32_t d = 0; status == EM_OK && d < r->table->backend->device_count; d++)
            r->segments[d].payload = (void *)staged;
        return status;
    }
    em_status status = stage_identity_offsets(r, n, err);
    if (status == EM_OK)
        status = em__stage_input(r, values, n * width * sizeof(float), "import values",
                                 (const void **)&staged, err);
    if (status == EM_OK)
        status = em__request_alloc(r, home, n * width * sizeof(float), "ordered import values",
                                   (void **)&ordered, err);
    if (status == EM_OK)
        status = home->ops->sum_gradients(r->home_lane, &r->batch, EM_COMBINER_NONE, width,
                                          staged, ordered, err);
    if (status == EM_OK)
        status = em__scatter_to_segments(r, ordered, width * sizeof(float), "segment import values",
                                         em__segment_payload, err);
    return status;
}

/* Whether an import's shards can write its rows from pointers (row_sources). */
static bool writes_rows_from(const request_context *r)
{
    return em__shards_at_home(r) && r->home->host_addressable &&
           r->home->ops->shard_write_rows_from != NULL;
}

/* absent: em_table_import_new's promise that the table holds none of the keys; the rows
 * are values[i], or where row_sources[i] points (em_table_import_new_from) */
static em_status import_locked(em_table *table, const uint64_t *keys, const float *values,
                               const float *const *row_sources, uint64_t n, bool absent,
                               em_error *err)
{
    request_context r;
    em__snapshot_wait_room(table); /* before a lane: the save's reader needs one too */
    em_status status = em__request_begin(table, &r, err);
    r.keys_absent = absent;
    uint64_t rows_before = absent ? em__stored_rows(table) : 0;
    float *gathered = NULL; /* row_sources' rows in one array, where shards need them so */
    if (status == EM_OK && row_sources != NULL && !writes_rows_from(&r)) {
        size_t row_bytes = table->row_floats * sizeof(float);
        gathered = malloc(n * row_bytes);
        if (n > 0 && gathered == NULL)
            status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "import: out of host memory");
        for (uint64_t i = 0; status == EM_OK && i < n; i++)
            memcpy(gathered + i * table->row_floats, row_sources[i], row_bytes);
        values = gathered;
        row_sources = NULL;
    }
    r.row_sources = row_sources;
    if (status == EM_OK && row_sources != NULL) /* before anything is created */
        status = em__request_alloc(&r, r.home, n * sizeof(*r.row_scratch), "import row sources",
                                   (void **)&r.row_scratch, err);
    if (status == EM_OK)
        status = em__plan_and_find(&r, keys, n, em__shards_at_home(&r), err);
    if (status == EM_OK)
        status = check_distinct(&r, keys, n, err);
    if (status == EM_OK)
        status = send_import_rows(&r, values, n, err);
    /* the present rows a snapshot has not read yet go aside before anything is created
     * (created rows are not the snapshot's), so that between creating the missing rows
     * and writing them nothing can fail: they need no initial values, the exclusive
     * table lock keeps every reader out, and the write below fills them all */
    if (status == EM_OK)
        status = em__preserve_for_snapshot(&r, true, err);
    r.rows_written_next = r.home->host_addressable;
    if (status == EM_OK)
        status = em__create_missing(&r, false, err);
    if (status == EM_OK && absent) { /* each key was created: none was there already */
        uint64_t created = em__stored_rows(table) - rows_before;
        if (created != r.missing)
            status = em_error_set(err, EM_INVALID_ARGUMENT,
                                  "%" PRIu64 " of its %" PRIu64 " keys are in the table "
                                  "already", r.missing - created, r.missing);
    }
    if (status == EM_OK)
        status = em__run_on_shards(&r, WORK_WRITE, table->row_floats, err);
    if (status == EM_OK)
        status = em__synchronize_devices(&r, err);
    em__request_end(&r);
    free(gathered);
    return status;
}

static em_status import_rows(em_table *table, const uint64_t *keys, const float *values,
                             const float *const *row_sources, uint64_t n, bool checked,
                             bool absent, em_error *err)
{
    em_status status = check_import_size(n, err);
    if (status == EM_OK && !checked)
        status = em_table_check_rows(table, keys, values, n, err);
    if (status == EM_OK) {
        em_spread_lock_write(&table->lock);
        status = import_locked(table, keys, values, row_sources, n, absent, err);
        em_spread_unlock_write(&table->lock);
    }
    if (status != EM_OK)
        return em_error_prefix(err, "import into table '%s': ", table->config.name);
    atomic_fetch_add_explicit(&table->imports, 1, memory_order_relaxed);
    return EM_OK;
}

static em_status import(em_table *table, const uint64_t *keys, const float *values,
                        const float *const *row_sources, uint64_t n, bool checked, bool absent,
                        em_error *err)
{
    em__change_begin(table);
    return em__change_end(table, import_rows(table, keys, values, row_sources, n, checked,
                                             absent, err));
}

em_status em_table_import(em_table *table, const uint64_t *keys, const float *values, uint64_t n,
                          em_error *err)
{
    return import(table, keys, values, NULL, n, false, false, err);
}

em_status em_table_import_checked(em_table *table, const uint64_t *keys, const float *values,
                                  uint64_t n, em_error *err)
{
    return import(table, keys, values, NULL, n, true, false, err);
}

em_status em_table_import_new(em_table *table, const uint64_t *keys, const float *values,
                              uint64_t n, em_error *err)
{
    return import(table, keys, values, NULL, n, true, true, err);
}

em_status em_table_import_new_from(em_table *table, const uint64_t *keys,
                                   const float *const *rows, uint64_t n, em_error *err)
{
    return import(table, keys, NULL, rows, n, true, true, err);
}

em_status em_table_reserve(em_table *table, uint64_t rows, em_error *err)
{
    /* a shard's keys are a binomial share of the rows: its mean less three standard
     * deviations is below what nearly every shard gets, so a reservation of it never
     * grows a map past the size the imports would have grown it to */
    double mean = (double)rows / table->shard_count;
    double low = mean - 3.0 * sqrt(mean);
    uint64_t per_shard = table->shard_count == 1 ? rows : low > 0.0 ? (uint64_t)low : 0;
    em_status status = EM_OK;
    em_spread_lock_write(&table->lock);
    for (uint32_t s = 0; status == EM_OK && per_shard > 0 && s < table->shard_count; s++) {
        em_shard *shard = table->shards[s];
        const em_device_ops *ops = shard->device->ops;
        em_lane *lane = NULL;
        if (ops->shard_reserve == NULL)
            break;
        status = ops->lane_acquire(shard->device, &lane, err);
        if (status != EM_OK)
            break;
        em__shard_write_lock(table, s);
        status = ops->shard_reserve(shard, lane, per_shard, 0, err);
        em__shard_unlock(table, s);
        ops->lane_release(lane);
    }
    em_spread_unlock_write(&table->lock);
    if (status != EM_OK)
        return em_error_prefix(err, "reserving %" PRIu64 " rows in table '%s': ", rows,
                               table->config.name);
    return EM_OK;
}

em_status em_table_export(em_table *table, em_table_cursor *cursor, uint64_t max, uint64_t *keys,
                          float *values, uint64_t *count, em_error *err)
{
    *count = 0;
    em_status status = EM_OK;
    em_spread_lock_read(&table->lock);
    while (status == EM_OK && *count == 0 && cursor->shard < table->shard_count && max > 0) {
        em_shard *shard = table->shards[cursor->shard];
        const em_device_ops *ops = shard->device->ops;
        em_lane *lane = NULL;
        status = ops->lane_acquire(shard->device, &lane, err);
        if (status != EM_OK)
            break;
        em__shard_read_lock(table, cursor->shard);
        status = ops->shard_export(shard, lane, &cursor->position, keys, values, NULL, max, count,
                                   err);
        em__shard_unlock(table, cursor->shard);
        ops->lane_release(lane);
        if (status == EM_OK && *count == 0) {
            cursor->shard++;
            cursor->position = 0;
        }
    }
    em_spread_unlock_read(&table->lock);
    if (status != EM_OK)
        return em_error_prefix(err, "export of table '%s' shard %u: ", table->config.name,
                               cursor->shard);
    return EM_OK;
}

