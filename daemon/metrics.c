#include "daemon/metrics.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_LENGTH 128

bool em_metrics_wants_openmetrics(const char *accept)
{
    return accept != NULL && strstr(accept, "application/openmetrics-text") != NULL;
}

/* ---- names ---------------------------------------------------------------------------- */

static bool ends_with(const char *text, const char *suffix)
{
    size_t length = strlen(text), suffix_length = strlen(suffix);
    return length >= suffix_length && strcmp(text + length - suffix_length, suffix) == 0;
}

/* The family name: ember_ + the stat's name in base units, without a counter's _total. */
static void family_name(const em_stat *stat, char *out, size_t capacity)
{
    char base[NAME_MAX_LENGTH];
    snprintf(base, sizeof(base), "%s", stat->name);
    size_t length = strlen(base);
    const char *unit = "";
    if (stat->unit == EM_STAT_MILLISECONDS) {
        if (ends_with(base, "_unix_ms")) {
            base[length - strlen("_unix_ms")] = '\0';
            unit = "_timestamp_seconds";
        } else {
            if (ends_with(base, "_ms"))
                base[length - strlen("_ms")] = '\0';
            unit = "_seconds";
        }
    }
    if (stat->kind != EM_STAT_COUNTER && ends_with(base, "_count")) /* region_count: regions */
        strcpy(base + strlen(base) - strlen("_count"), "s");
    if (stat->unit == EM_STAT_BYTES && strstr(base, "bytes") == NULL) /* largest_free_block */
        unit = "_bytes";
    if (stat->kind == EM_STAT_COUNTER && strncmp(base, "total_", 6) == 0) /* total_allocations */
        memmove(base, base + 6, strlen(base + 6) + 1);
    if (stat->kind == EM_STAT_COUNTER && ends_with(base, "_total"))
        base[strlen(base) - strlen("_total")] = '\0';
    if (stat->kind == EM_STAT_INFO)
        unit = "_info";
    if (stat->kind == EM_STAT_INFO && strcmp(stat->name, "version") == 0)
        snprintf(base, sizeof(base), "build");
    const char *scope = stat->scope == EM_STAT_TABLE ? "table_"
                        : stat->scope == EM_STAT_POOL ? "pool_"
                                                      : "";
    snprintf(out, capacity, "ember_%s%s%s", scope, base, unit);
}

static const char *label_name(em_stat_scope scope)
{
    switch (scope) {
    case EM_STAT_METHOD:
        return "method";
    case EM_STAT_TABLE:
        return "table";
    case EM_STAT_POOL:
        return "device";
    case EM_STAT_SERVER:
        break;
    }
    return NULL;
}

/* ---- writing -------------------------------------------------------------------------- */

static void write_escaped(FILE *out, const char *text, bool quotes)
{
    for (const char *c = text; *c != '\0'; c++) {
        if (*c == '\\')
            fputs("\\\\", out);
        else if (*c == '\n')
            fputs("\\n", out);
        else if (*c == '"' && quotes)
            fputs("\\\"", out);
        else
            fputc(*c, out);
    }
}

static void write_header(FILE *out, const char *family, const char *type, const char *help,
                         bool openmetrics)
{
    /* 0.0.4 names a counter's family by its sample name */
    const char *suffix = !openmetrics && strcmp(type, "counter") == 0 ? "_total" : "";
    fprintf(out, "# HELP %s%s ", family, suffix);
    write_escaped(out, help, false);
    fprintf(out, "\n# TYPE %s%s %s\n", family, suffix, type);
}

static void write_double(FILE *out, double value)
{
    if (isnan(value))
        fputs("NaN", out);
    else if (isinf(value))
        fputs(value > 0 ? "+Inf" : "-Inf", out);
    else
        fprintf(out, "%.17g", value);
}

/* One sample: name{label="value"} number. */
static void write_sample(FILE *out, const char *name, const char *label, const char *label_value,
                         const char *extra_label, const char *extra_value)
{
    fputs(name, out);
    if (label != NULL || extra_label != NULL) {
        fputc('{', out);
        if (label != NULL) {
            fprintf(out, "%s=\"", label);
            write_escaped(out, label_value, true);
            fputc('"', out);
        }
        if (extra_label != NULL)
            fprintf(out, "%s%s=\"%s\"", label != NULL ? "," : "", extra_label, extra_value);
        fputc('}', out);
    }
    fputc(' ', out);
}

/* ---- the schema's numbers -------------------------------------------------------------- */

typedef struct sample {
    const em_stat *stat;
    const char *label;
    em_stat_value value;
} sample;

typedef struct collected {
    sample *samples;
    size_t count, capacity;
    bool failed;
} collected;

static void collect(void *context, const em_stat *stat, size_t index, const char *label,
                    em_stat_value value)
{
    (void)index;
    collected *c = context;
    if (c->count == c->capacity) {
        size_t capacity = c->capacity == 0 ? 256 : 2 * c->capacity;
        sample *grown = realloc(c->samples, capacity * sizeof(*grown));
        if (grown == NULL) {
            c->failed = true;
            return;
        }
        c->samples = grown;
        c->capacity = capacity;
    }
    c->samples[c->count++] = (sample){stat, label, value};
}

static void write_value(FILE *out, const em_stat *stat, em_stat_value value)
{
    if (stat->kind == EM_STAT_INFO)
        fputs("1", out);
    else if (stat->unit == EM_STAT_MILLISECONDS)
        write_double(out, (value.type == EM_STAT_VALUE_DOUBLE ? value.f64 : (double)value.u64) /
                              1000.0);
    else if (value.type == EM_STAT_VALUE_DOUBLE)
        write_double(out, value.f64);
    else
        fprintf(out, "%" PRIu64, value.u64);
    fputc('\n', out);
}

/* Every sample of one stat, under one header (families must not interleave). */
static void write_family(FILE *out, const em_stat *stat, const collected *c, bool openmetrics)
{
    char family[NAME_MAX_LENGTH], name[NAME_MAX_LENGTH + 8];
    family_name(stat, family, sizeof(family));
    snprintf(name, sizeof(name), "%s%s", family, stat->kind == EM_STAT_COUNTER ? "_total" : "");
    bool header = false;
    for (size_t i = 0; i < c->count; i++) {
        const sample *s = &c->samples[i];
        if (s->stat != stat)
            continue;
        if (!header) {
            write_header(out, family, stat->kind == EM_STAT_COUNTER ? "counter" : "gauge",
                         stat->help, openmetrics);
            header = true;
        }
        if (stat->kind == EM_STAT_INFO)
            write_sample(out, name, stat->name, s->value.text, NULL, NULL);
        else
            write_sample(out, name, label_name(stat->scope), s->label, NULL, NULL);
        write_value(out, stat, s->value);
    }
}

/* ---- per method: answers by status, durations ------------------------------------------ */

static uint64_t method_total(const em_method_snapshot *method)
{
    uint64_t total = 0;
    for (size_t b = 0; b <= EM_DURATION_BUCKETS; b++)
        total += method->duration_buckets[b];
    return total;
}

static void write_answers(FILE *out, const em_stats_snapshot *snapshot, bool openmetrics)
{
    write_header(out, "ember_responses", "counter", "requests answered, by method and status",
                 openmetrics);
    for (size_t m = 0; m < snapshot->method_count; m++) {
        const em_method_snapshot *method = &snapshot->methods[m];
        for (size_t s = 0; s < EM_STATUS_COUNT; s++) {
            if (method->answers[s] == 0)
                continue;
            write_sample(out, "ember_responses_total", "method", method->name, "status",
                         em_status_name((em_status)s));
            fprintf(out, "%" PRIu64 "\n", method->answers[s]);
        }
    }
}

static void write_durations(FILE *out, const em_stats_snapshot *snapshot, bool openmetrics)
{
    write_header(out, "ember_request_duration_seconds", "histogram",
                 "time from a request's arrival to its answer, by method", openmetrics);
    for (size_t m = 0; m < snapshot->method_count; m++) {
        const em_method_snapshot *method = &snapshot->methods[m];
        uint64_t total = method_total(method), cumulative = 0;
        if (total == 0)
            continue;
        char bound[32];
        for (size_t b = 0; b < EM_DURATION_BUCKETS; b++) {
            cumulative += method->duration_buckets[b];
            snprintf(bound, sizeof(bound), "%g", (double)em_duration_bounds_ns[b] / 1e9);
            write_sample(out, "ember_request_duration_seconds_bucket", "method", method->name,
                         "le", bound);
            fprintf(out, "%" PRIu64 "\n", cumulative);
        }
        write_sample(out, "ember_request_duration_seconds_bucket", "method", method->name, "le",
                     "+Inf");
        fprintf(out, "%" PRIu64 "\n", total);
        write_sample(out, "ember_request_duration_seconds_sum", "method", method->name, NULL,
                     NULL);
        write_double(out, (double)method->duration_sum_ns / 1e9);
        fputc('\n', out);
        write_sample(out, "ember_request_duration_seconds_count", "method", method->name, NULL,
                     NULL);
        fprintf(out, "%" PRIu64 "\n", total);
    }
}

em_status em_metrics_render(const em_stats_snapshot *snapshot, bool openmetrics, char **out,
                            size_t *length, em_error *err)
{
    collected c = {0};
    em_stats_visit(snapshot, collect, &c);
    char *text = NULL;
    size_t size = 0;
    FILE *stream = c.failed ? NULL : open_memstream(&text, &size);
    if (stream == NULL) {
        free(c.samples);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "metrics: out of memory");
    }
    size_t schema_count;
    const em_stat *schema = em_stats_schema(&schema_count);
    for (size_t i = 0; i < schema_count; i++)
        write_family(stream, &schema[i], &c, openmetrics);
    write_answers(stream, snapshot, openmetrics);
    write_durations(stream, snapshot, openmetrics);
    if (openmetrics)
        fputs("# EOF\n", stream);
    bool failed = ferror(stream) != 0;
    if (fclose(stream) != 0 || failed) {
        free(text);
        free(c.samples);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "metrics: out of memory");
    }
    free(c.samples);
    *out = text;
    *length = size;
    return EM_OK;
}
