/*
 * DESIGN: emberctl, the operator's command line for emberd.
 *
 * A thin shell over libember-client: parse the command line, make one client to the
 * admin listener, run one command, print the answer. Every command gets its data as
 * JSON from the library (the same objects --json prints), and the human output is
 * rendered from that JSON, so the two views cannot disagree.
 *
 * Exit status tells scripts what happened: 0 ok, 1 the server answered with an error
 * (or health answered "not ready"), 2 the command line was wrong, 3 no answer at all
 * (cannot connect, or the deadline passed before the server replied). An error from
 * the server is recognised by the library's message form "server HOST:PORT: STATUS:".
 */
#include <cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>

#include "lib/checkpoint/checkpoint_cluster.h"
#include "clients/client_top.h"
#include "clients/ember_client.h"
#include "lib/checkpoint/checkpoint.h"
#include "ember_config.h"

#define DEFAULT_ADMIN_SERVER "127.0.0.1:7071"
/* The admin token of the development config (configs/default.json). */
#define DEVELOPMENT_ADMIN_TOKEN "ember-dev-admin-token"
#define DEFAULT_TIMEOUT_MS 10000
#define TOKEN_MAX 4096

enum exit_code { EXIT_OK = 0, EXIT_SERVER_ERROR = 1, EXIT_USAGE = 2, EXIT_NO_ANSWER = 3 };

typedef struct cli {
    const char *server;
    const char *token;
    const char *token_file;
    char token_buffer[TOKEN_MAX];
    bool json;
    uint32_t timeout_ms;
    const char *tls_ca, *tls_cert, *tls_key; /* TLS to the admin listener */
    em_client *client;
} cli;

/* ---- messages ---------------------------------------------------------------------- */

static int usage_error(const char *format, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fputs("emberctl: ", stderr);
    vfprintf(stderr, format, args);
    fputs("\nRun 'emberctl --help' for usage.\n", stderr);
    va_end(args);
    return EXIT_USAGE;
}

/* True when the error is an answer from the server (see ember_client.h). */
static bool answered_by_server(const em_error *err)
{
    if (strncmp(err->message, "server ", 7) != 0)
        return false;
    char marker[64];
    snprintf(marker, sizeof(marker), ": %s: ", em_status_name(err->status));
    return strstr(err->message, marker) != NULL;
}

static int call_failed(const em_error *err)
{
    if (answered_by_server(err)) {
        /* "server H:P: STATUS: message" already names the status */
        fprintf(stderr, "emberctl: %s\n", err->message);
        return EXIT_SERVER_ERROR;
    }
    fprintf(stderr, "emberctl: %s: %s\n", em_status_name(err->status), err->message);
    if (err->status == EM_UNAVAILABLE || err->status == EM_DEADLINE_EXCEEDED)
        return EXIT_NO_ANSWER;
    return err->status == EM_INVALID_ARGUMENT ? EXIT_USAGE : EXIT_SERVER_ERROR;
}

static void print_help(FILE *out)
{
    fputs("Usage: emberctl [OPTIONS] COMMAND\n"
          "\n"
          "Operate an emberd server through its admin listener.\n"
          "\n"
          "Commands:\n"
          "  ping                       round trip, server version and uptime\n"
          "  health                     readiness (exit 1 when the server is not ready)\n"
          "  tables list                tables with their size and optimizer\n"
          "  tables create --json-config '{...}'\n"
          "  tables create --name N --dim D --capacity C [--shards S]\n"
          "                [--optimizer TYPE] [--lr X] [--initializer TYPE] [--seed N]\n"
          "                [--eviction none|lru|lfu|age] [--candidates N] [--ring N]\n"
          "                [--max-age-steps N] [--max-age-seconds S] [--headroom F]\n"
          "                [--admission always|counter|probability] [--threshold N]\n"
          "                [--probability P]\n"
          "                             TYPE: sgd, adagrad, rowwise_adagrad, adam;\n"
          "                             initializers: zeros, uniform, normal\n"
          "  tables drop NAME\n"
          "  stats [TABLE]              server, request, table and memory pool statistics\n"
          "  top [TABLE] [--interval SECONDS] [--count N] [--once]\n"
          "                             live view, refreshed every --interval (1 s): request\n"
          "                             rates and p50/p90/p99 latency by method, table\n"
          "                             rates, pool use, connections; --once prints one\n"
          "                             view after one interval (with --json: a JSON line\n"
          "                             per view)\n"
          "  erase TABLE KEY... | erase TABLE --file PATH\n"
          "                             remove keys (PATH: one per line, - for stdin)\n"
          "  erase TABLE --not-pushed-for N | --not-pushed-since UNIX_SECONDS\n"
          "                             remove rows not pushed (nor created) in the\n"
          "                             table's last N pushes, or since that time\n"
          "  evicted TABLE [--after SEQUENCE] [--max N]\n"
          "                             keys the eviction policy removed, oldest first,\n"
          "                             numbered; --after the last sequence seen\n"
          "  save [TABLE] [--delta]     save every table (or one) as a checkpoint now;\n"
          "                             --delta only what changed since its last one\n"
          "  save [TABLE] --cluster DIR save every server of --server's list into one\n"
          "                             cluster checkpoint at DIR (an absolute path the\n"
          "                             servers and emberctl share)\n"
          "  load TABLE [--from PATH] [--weights-only]\n"
          "                             load a checkpoint (the table's latest, or the\n"
          "                             directory PATH on the server) as TABLE, replacing\n"
          "                             it; --weights-only keeps TABLE's optimizer\n"
          "  load [TABLE] --cluster DIR [--shards N]\n"
          "                             restore a cluster checkpoint onto the servers of\n"
          "                             --server's list, however many: each loads only\n"
          "                             the buckets it now owns\n"
          "  drain [--wait SECONDS]     take the server out of service (data requests and\n"
          "                             connections refused, HEALTH not ready); --wait\n"
          "                             until its running requests finish (exit 1 if not)\n"
          "  undrain                    put the server back in service\n"
          "  slowlog [--max N] [--reset]\n"
          "                             requests slower than slowlog_threshold_ms, newest\n"
          "                             first; --reset empties the log after reading it\n"
          "  reload                     read the configuration file again (as SIGHUP) and\n"
          "                             say what changed and what needs a restart\n"
          "  checkpoints list [TABLE]   the server's complete checkpoints (under its\n"
          "                             checkpoint.dir), from their manifests\n"
          "  checkpoints list DIR [TABLE]\n"
          "                             the same from a checkpoint dir on this host, no\n"
          "                             server (verify reads the data)\n"
          "  checkpoints verify PATH    check every checksum and value of a checkpoint\n"
          "                             as a load does, and of its chain for a delta,\n"
          "                             or of every part of a cluster checkpoint (no\n"
          "                             server)\n"
          "  checkpoints export PATH --out DIR [--weights-only] [--table TABLE]\n"
          "                             write the table of a checkpoint (checked as a\n"
          "                             load checks it), or of a cluster checkpoint's\n"
          "                             parts together, as NumPy arrays in DIR: keys.npy,\n"
          "                             weights.npy and the optimizer state, by key, and\n"
          "                             export.json (no server)\n"
          "  checkpoints import DIR --to CHECKPOINT_DIR [--name TABLE]\n"
          "                     [--json-config '{...}'] [--weights-only]\n"
          "                             write the arrays of DIR (an export's layout) as a\n"
          "                             new checkpoint of the table under CHECKPOINT_DIR,\n"
          "                             for a server to load (no server)\n"
          "\n"
          "Options:\n"
          "  --server HOST:PORT   admin listener (default " DEFAULT_ADMIN_SERVER "); a list\n"
          "                       (HOST:PORT,...) for --cluster, in the order the\n"
          "                       trainers list the servers' data listeners\n"
          "  --token TOKEN        admin token\n"
          "  --token-file FILE    read the admin token from FILE\n"
          "  --json               print JSON instead of tables\n"
          "  --timeout MS         per-call timeout in milliseconds (default 10000)\n"
          "  --tls-ca FILE        speak TLS; the server's certificate must chain to FILE\n"
          "  --tls-cert FILE      with --tls-key: present this client certificate\n"
          "  --tls-key FILE       the client certificate's private key\n"
          "  -h, --help           print this help\n"
          "  --version            print the version\n"
          "\n"
          "The admin token is --token, else the contents of --token-file, else\n"
          "$EMBER_ADMIN_TOKEN, else \"" DEVELOPMENT_ADMIN_TOKEN "\": the development default\n"
          "of configs/default.json, which a production config must replace.\n"
          "\n"
          "Exit status: 0 ok, 1 error from the server, 2 usage error, 3 no answer\n"
          "(connection failed or timed out).\n",
          out);
}

/* ---- formatting -------------------------------------------------------------------- */

/* "512 B", "1.5 MiB" */
static void format_bytes(double bytes, char *out, size_t capacity)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int unit = 0;
    while (bytes >= 1024.0 && unit < 5) {
        bytes /= 1024.0;
        unit++;
    }
    if (unit == 0)
        snprintf(out, capacity, "%.0f B", bytes);
    else
        snprintf(out, capacity, "%.1f %s", bytes, units[unit]);
}

/* "3d 04h 05m", "1h 02m 03s", "2m 03s", "4.2s" */
static void format_duration(double ms, char *out, size_t capacity)
{
    uint64_t seconds = (uint64_t)(ms / 1000.0);
    unsigned s = (unsigned)(seconds % 60), m = (unsigned)(seconds / 60 % 60);
    unsigned h = (unsigned)(seconds / 3600 % 24);
    uint64_t d = seconds / 86400;
    if (d > 0)
        snprintf(out, capacity, "%" PRIu64 "d %02uh %02um", d, h, m);
    else if (h > 0)
        snprintf(out, capacity, "%uh %02um %02us", h, m, s);
    else if (m > 0)
        snprintf(out, capacity, "%um %02us", m, s);
    else
        snprintf(out, capacity, "%.1fs", ms / 1000.0);
}

static double json_number(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(object, name);
    return cJSON_IsNumber(item) ? item->valuedouble : 0.0;
}

static const char *json_string(const cJSON *object, const char *name)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(object, name);
    return cJSON_IsString(item) ? item->valuestring : "";
}

static void print_json(const cJSON *json)
{
    char *text = cJSON_Print(json);
    if (text != NULL)
        puts(text);
    free(text);
}

/* ---- aligned tables ---------------------------------------------------------------- */

#define COLUMNS_MAX 8
#define CELL_MAX 64

/* Columns of text; a header starting with '>' is right-aligned (numbers). */
typedef struct text_table {
    int columns;
    const char *headers[COLUMNS_MAX];
    int rows;
    char (*cells)[COLUMNS_MAX][CELL_MAX];
} text_table;

static void text_table_init(text_table *table, int columns, const char *const *headers,
                            int rows)
{
    table->columns = columns;
    for (int c = 0; c < columns; c++)
        table->headers[c] = headers[c];
    table->rows = 0;
    table->cells = calloc((size_t)rows + 1, sizeof(*table->cells));
}

static void text_table_cell(text_table *table, int column, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

static void text_table_cell(text_table *table, int column, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    vsnprintf(table->cells[table->rows][column], CELL_MAX, format, args);
    va_end(args);
}

static const char *header_text(const char *header)
{
    return header[0] == '>' ? header + 1 : header;
}

static void print_row(const text_table *table, const int *widths, const char *const *texts)
{
    for (int c = 0; c < table->columns; c++) {
        bool right = table->headers[c][0] == '>';
        bool last = c == table->columns - 1;
        printf("%s%*s", c > 0 ? "  " : "", right ? widths[c] : -(last ? 0 : widths[c]),
               texts[c]);
    }
    putchar('\n');
}

static void text_table_print(text_table *table)
{
    int widths[COLUMNS_MAX];
    const char *texts[COLUMNS_MAX];
    for (int c = 0; c < table->columns; c++) {
        widths[c] = (int)strlen(header_text(table->headers[c]));
        for (int r = 0; r < table->rows; r++) {
            int length = (int)strlen(table->cells[r][c]);
            widths[c] = length > widths[c] ? length : widths[c];
        }
        texts[c] = header_text(table->headers[c]);
    }
    print_row(table, widths, texts);
    for (int r = 0; r < table->rows; r++) {
        for (int c = 0; c < table->columns; c++)
            texts[c] = table->cells[r][c];
        print_row(table, widths, texts);
    }
    free(table->cells);
    table->cells = NULL;
}

/* ---- the client -------------------------------------------------------------------- */

static int read_token_file(cli *c)
{
    FILE *file = fopen(c->token_file, "r");
    if (file == NULL)
        return usage_error("cannot read token file '%s': %s", c->token_file, strerror(errno));
    if (fgets(c->token_buffer, sizeof(c->token_buffer), file) == NULL)
        c->token_buffer[0] = '\0';
    fclose(file);
    c->token_buffer[strcspn(c->token_buffer, "\r\n")] = '\0';
    if (c->token_buffer[0] == '\0')
        return usage_error("token file '%s' is empty", c->token_file);
    c->token = c->token_buffer;
    return EXIT_OK;
}

/* --token, else --token-file, else $EMBER_ADMIN_TOKEN, else the development token. */
static int resolve_token(cli *c)
{
    if (c->token != NULL)
        return EXIT_OK;
    if (c->token_file != NULL)
        return read_token_file(c);
    const char *from_environment = getenv("EMBER_ADMIN_TOKEN");
    c->token = from_environment != NULL && from_environment[0] != '\0'
                   ? from_environment
                   : DEVELOPMENT_ADMIN_TOKEN;
    return EXIT_OK;
}

/* Connects on first use, after a command has checked its arguments. */
static int connected(cli *c)
{
    if (c->client != NULL)
        return EXIT_OK;
    int code = resolve_token(c);
    if (code != EXIT_OK)
        return code;
    em_client_options options;
    em_client_options_init(&options);
    options.servers = c->server;
    options.token = c->token;
    options.window = 1;
    options.timeout_ms = c->timeout_ms;
    options.connect_timeout_ms = c->timeout_ms;
    options.reconnect_attempts = 1; /* a command line fails fast */
    options.tls_ca_file = c->tls_ca;
    options.tls_cert_file = c->tls_cert;
    options.tls_key_file = c->tls_key;
    em_error err;
    if (em_client_create(&options, &c->client, &err) != EM_OK)
        return call_failed(&err);
    return EXIT_OK;
}

/* ---- commands ---------------------------------------------------------------------- */

static double monotonic_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec * 1e3 + (double)now.tv_nsec / 1e6;
}

static int command_ping(cli *c, int argc, char **argv)
{
    (void)argv;
    if (argc > 1)
        return usage_error("ping takes no arguments");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    char version[64];
    uint64_t uptime_ms;
    em_error err;
    double start = monotonic_ms();
    if (em_client_ping(c->client, version, sizeof(version), &uptime_ms, &err) != EM_OK)
        return call_failed(&err);
    double round_trip = monotonic_ms() - start;
    if (c->json) {
        cJSON *json = cJSON_CreateObject();
        cJSON_AddStringToObject(json, "server", c->server);
        cJSON_AddStringToObject(json, "version", version);
        cJSON_AddNumberToObject(json, "uptime_ms", (double)uptime_ms);
        cJSON_AddNumberToObject(json, "round_trip_ms", round_trip);
        print_json(json);
        cJSON_Delete(json);
        return EXIT_OK;
    }
    char uptime[32];
    format_duration((double)uptime_ms, uptime, sizeof(uptime));
    printf("pong from %s: version %s, up %s, %.2f ms\n", c->server, version, uptime, round_trip);
    return EXIT_OK;
}

static int command_health(cli *c, int argc, char **argv)
{
    (void)argv;
    if (argc > 1)
        return usage_error("health takes no arguments");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    em_client_health health;
    em_error err;
    if (em_client_health_check(c->client, &health, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        cJSON *json = cJSON_CreateObject();
        cJSON_AddBoolToObject(json, "ready", health.ready);
        cJSON_AddStringToObject(json, "state", health.state);
        cJSON_AddStringToObject(json, "backend", health.backend);
        cJSON_AddNumberToObject(json, "devices", health.devices);
        cJSON_AddNumberToObject(json, "tables", health.tables);
        print_json(json);
        cJSON_Delete(json);
    } else {
        printf("server   %s\nready    %s\nstate    %s\nbackend  %s\ndevices  %u\ntables   %u\n",
               c->server, health.ready ? "yes" : "no", health.state, health.backend,
               health.devices, health.tables);
    }
    return health.ready ? EXIT_OK : EXIT_SERVER_ERROR;
}

static void print_table_list(const cJSON *tables)
{
    static const char *const headers[] = {"NAME",   ">DIM",      ">CAPACITY",
                                          ">SHARDS", "OPTIMIZER", ">ROWS"};
    if (cJSON_GetArraySize(tables) == 0) {
        puts("no tables");
        return;
    }
    text_table table;
    text_table_init(&table, 6, headers, cJSON_GetArraySize(tables));
    const cJSON *t;
    cJSON_ArrayForEach(t, tables)
    {
        text_table_cell(&table, 0, "%s", json_string(t, "name"));
        text_table_cell(&table, 1, "%.0f", json_number(t, "dim"));
        text_table_cell(&table, 2, "%.0f", json_number(t, "capacity"));
        text_table_cell(&table, 3, "%.0f", json_number(t, "shards"));
        text_table_cell(&table, 4, "%s", json_string(t, "optimizer"));
        text_table_cell(&table, 5, "%.0f", json_number(t, "rows"));
        table.rows++;
    }
    text_table_print(&table);
}

static int tables_list(cli *c, int argc)
{
    if (argc > 2)
        return usage_error("tables list takes no arguments");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    cJSON *tables;
    em_error err;
    if (em_client_list_tables(c->client, &tables, &err) != EM_OK)
        return call_failed(&err);
    if (c->json)
        print_json(tables);
    else
        print_table_list(tables);
    cJSON_Delete(tables);
    return EXIT_OK;
}

/* The flags of tables create, as given. */
typedef struct create_flags {
    const char *json_config, *name, *dim, *capacity, *shards, *optimizer, *lr, *initializer,
        *seed, *eviction, *candidates, *ring, *max_age_steps, *max_age_seconds, *headroom,
        *admission, *threshold, *probability;
} create_flags;

static const struct create_flag {
    const char *name;
    size_t offset;
} create_flag_table[] = {
    {"json-config", offsetof(create_flags, json_config)},
    {"name", offsetof(create_flags, name)},
    {"dim", offsetof(create_flags, dim)},
    {"capacity", offsetof(create_flags, capacity)},
    {"shards", offsetof(create_flags, shards)},
    {"optimizer", offsetof(create_flags, optimizer)},
    {"lr", offsetof(create_flags, lr)},
    {"initializer", offsetof(create_flags, initializer)},
    {"seed", offsetof(create_flags, seed)},
    {"eviction", offsetof(create_flags, eviction)},
    {"candidates", offsetof(create_flags, candidates)},
    {"ring", offsetof(create_flags, ring)},
    {"max-age-steps", offsetof(create_flags, max_age_steps)},
    {"max-age-seconds", offsetof(create_flags, max_age_seconds)},
    {"headroom", offsetof(create_flags, headroom)},
    {"admission", offsetof(create_flags, admission)},
    {"threshold", offsetof(create_flags, threshold)},
    {"probability", offsetof(create_flags, probability)},
};

#define CREATE_FLAG_COUNT (sizeof(create_flag_table) / sizeof(create_flag_table[0]))

static int parse_create_flags(int argc, char **argv, create_flags *flags)
{
    struct option options[CREATE_FLAG_COUNT + 1] = {{0}};
    for (size_t i = 0; i < CREATE_FLAG_COUNT; i++)
        options[i] = (struct option){create_flag_table[i].name, required_argument, NULL,
                                     (int)i + 1};
    optind = 0;
    opterr = 0;
    int option;
    while ((option = getopt_long(argc, argv, "+", options, NULL)) != -1) {
        if (option < 1 || option > (int)CREATE_FLAG_COUNT)
            return usage_error("tables create: unknown or incomplete option '%s'",
                               argv[optind - 1]);
        *(const char **)((char *)flags + create_flag_table[option - 1].offset) = optarg;
    }
    if (optind < argc)
        return usage_error("tables create: unexpected argument '%s'", argv[optind]);
    return EXIT_OK;
}

/* A whole number of 0..2^64-1 in decimal, nothing else. */
static bool parse_key(const char *text, uint64_t *key)
{
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (text[0] < '0' || text[0] > '9' || *end != '\0' || errno != 0)
        return false;
    *key = value;
    return true;
}

/* Whole numbers from this on may lose digits as doubles (2^53). */
#define EXACT_DOUBLE_MAX 9007199254740992.0

static bool parse_whole(const char *text, double *out)
{
    uint64_t value;
    if (!parse_key(text, &value))
        return false;
    *out = (double)value;
    return true;
}

static bool parse_real(const char *text, double *out)
{
    char *end = NULL;
    errno = 0;
    *out = strtod(text, &end);
    return end != text && *end == '\0' && errno == 0;
}

/* Adds a whole-number flag to object; usage error when it is not one. */
static int add_whole(cJSON *object, const char *key, const char *flag, const char *text)
{
    double value;
    if (text == NULL)
        return EXIT_OK;
    if (!parse_whole(text, &value))
        return usage_error("--%s '%s' is not a whole number", flag, text);
    if (value >= EXACT_DOUBLE_MAX) /* a JSON number would round it: digits, as configs allow */
        cJSON_AddStringToObject(object, key, text);
    else
        cJSON_AddNumberToObject(object, key, value);
    return EXIT_OK;
}

static int add_optimizer(cJSON *config, const create_flags *flags)
{
    if (flags->optimizer == NULL && flags->lr == NULL)
        return EXIT_OK;
    cJSON *optimizer = cJSON_AddObjectToObject(config, "optimizer");
    cJSON_AddStringToObject(optimizer, "type", flags->optimizer != NULL ? flags->optimizer : "sgd");
    double lr;
    if (flags->lr != NULL && !parse_real(flags->lr, &lr))
        return usage_error("--lr '%s' is not a number", flags->lr);
    if (flags->lr != NULL)
        cJSON_AddNumberToObject(optimizer, "lr", lr);
    return EXIT_OK;
}

static int add_initializer(cJSON *config, const create_flags *flags)
{
    if (flags->initializer == NULL && flags->seed == NULL)
        return EXIT_OK;
    cJSON *initializer = cJSON_AddObjectToObject(config, "initializer");
    if (flags->initializer != NULL)
        cJSON_AddStringToObject(initializer, "type", flags->initializer);
    return add_whole(initializer, "seed", "seed", flags->seed);
}

static int add_eviction(cJSON *config, const create_flags *flags)
{
    if (flags->eviction == NULL && flags->candidates == NULL && flags->ring == NULL &&
        flags->max_age_steps == NULL && flags->max_age_seconds == NULL &&
        flags->headroom == NULL)
        return EXIT_OK;
    cJSON *eviction = cJSON_AddObjectToObject(config, "eviction");
    if (flags->eviction != NULL)
        cJSON_AddStringToObject(eviction, "policy", flags->eviction);
    double headroom;
    if (flags->headroom != NULL && !parse_real(flags->headroom, &headroom))
        return usage_error("--headroom '%s' is not a number", flags->headroom);
    if (flags->headroom != NULL)
        cJSON_AddNumberToObject(eviction, "headroom", headroom);
    int code = add_whole(eviction, "candidates", "candidates", flags->candidates);
    if (code == EXIT_OK)
        code = add_whole(eviction, "ring", "ring", flags->ring);
    if (code == EXIT_OK)
        code = add_whole(eviction, "max_age_steps", "max-age-steps", flags->max_age_steps);
    return code == EXIT_OK ? add_whole(eviction, "max_age_seconds", "max-age-seconds",
                                       flags->max_age_seconds)
                           : code;
}

static int add_admission(cJSON *config, const create_flags *flags)
{
    if (flags->admission == NULL && flags->threshold == NULL && flags->probability == NULL)
        return EXIT_OK;
    cJSON *admission = cJSON_AddObjectToObject(config, "admission");
    if (flags->admission != NULL)
        cJSON_AddStringToObject(admission, "policy", flags->admission);
    double probability;
    if (flags->probability != NULL && !parse_real(flags->probability, &probability))
        return usage_error("--probability '%s' is not a number", flags->probability);
    if (flags->probability != NULL)
        cJSON_AddNumberToObject(admission, "probability", probability);
    return add_whole(admission, "threshold", "threshold", flags->threshold);
}

/* The table config JSON text (malloc'ed) from the flags; NULL after a usage error. */
static char *config_from_flags(const create_flags *flags, int *code)
{
    if (flags->json_config != NULL) {
        cJSON *parsed = cJSON_Parse(flags->json_config);
        *code = parsed == NULL ? usage_error("--json-config is not valid JSON: '%s'",
                                             flags->json_config)
                               : EXIT_OK;
        cJSON_Delete(parsed);
        return *code == EXIT_OK ? strdup(flags->json_config) : NULL;
    }
    if (flags->name == NULL || flags->dim == NULL || flags->capacity == NULL) {
        *code = usage_error("tables create needs --name, --dim and --capacity, or "
                            "--json-config");
        return NULL;
    }
    cJSON *config = cJSON_CreateObject();
    cJSON_AddStringToObject(config, "name", flags->name);
    *code = add_whole(config, "dim", "dim", flags->dim);
    if (*code == EXIT_OK)
        *code = add_whole(config, "capacity", "capacity", flags->capacity);
    if (*code == EXIT_OK)
        *code = add_whole(config, "shards", "shards", flags->shards);
    if (*code == EXIT_OK)
        *code = add_optimizer(config, flags);
    if (*code == EXIT_OK)
        *code = add_initializer(config, flags);
    if (*code == EXIT_OK)
        *code = add_eviction(config, flags);
    if (*code == EXIT_OK)
        *code = add_admission(config, flags);
    char *text = *code == EXIT_OK ? cJSON_PrintUnformatted(config) : NULL;
    cJSON_Delete(config);
    return text;
}

static int tables_create(cli *c, int argc, char **argv)
{
    create_flags flags = {0};
    int code = parse_create_flags(argc - 1, argv + 1, &flags);
    if (code != EXIT_OK)
        return code;
    char *config = config_from_flags(&flags, &code);
    if (config == NULL)
        return code;
    code = connected(c);
    if (code != EXIT_OK) {
        free(config);
        return code;
    }
    cJSON *info = NULL;
    em_error err;
    em_status status = em_client_create_table(c->client, config, &info, &err);
    free(config);
    if (status != EM_OK)
        return call_failed(&err);
    if (c->json)
        print_json(info);
    else
        printf("created table '%s': dim %.0f, capacity %.0f, %.0f shard%s, %s\n",
               json_string(info, "name"), json_number(info, "dim"),
               json_number(info, "capacity"), json_number(info, "shards"),
               json_number(info, "shards") == 1 ? "" : "s", json_string(info, "optimizer"));
    cJSON_Delete(info);
    return EXIT_OK;
}

static int tables_drop(cli *c, int argc, char **argv)
{
    if (argc != 3)
        return usage_error("tables drop needs exactly one table name");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    em_error err;
    if (em_client_drop_table(c->client, argv[2], &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        cJSON *json = cJSON_CreateObject();
        cJSON_AddStringToObject(json, "dropped", argv[2]);
        print_json(json);
        cJSON_Delete(json);
    } else {
        printf("dropped table '%s'\n", argv[2]);
    }
    return EXIT_OK;
}

static int command_tables(cli *c, int argc, char **argv)
{
    if (argc < 2)
        return usage_error("tables needs a subcommand: list, create or drop");
    if (strcmp(argv[1], "list") == 0)
        return tables_list(c, argc);
    if (strcmp(argv[1], "create") == 0)
        return tables_create(c, argc, argv);
    if (strcmp(argv[1], "drop") == 0)
        return tables_drop(c, argc, argv);
    return usage_error("unknown tables subcommand '%s' (list, create, drop)", argv[1]);
}

/* ---- stats ------------------------------------------------------------------------- */

static void print_server_stats(const cJSON *server)
{
    char uptime[32], bytes_in[32], bytes_out[32];
    format_duration(json_number(server, "uptime_ms"), uptime, sizeof(uptime));
    format_bytes(json_number(server, "bytes_in"), bytes_in, sizeof(bytes_in));
    format_bytes(json_number(server, "bytes_out"), bytes_out, sizeof(bytes_out));
    printf("server\n"
           "  version      %s\n"
           "  state        %s\n"
           "  backend      %s\n"
           "  uptime       %s\n"
           "  connections  %.0f open, %.0f total, %.0f rejected\n"
           "  traffic      %s in, %s out\n"
           "  bad frames   %.0f\n",
           json_string(server, "version"), json_string(server, "state"),
           json_string(server, "backend"), uptime, json_number(server, "connections_current"),
           json_number(server, "connections_total"), json_number(server, "connections_rejected"),
           bytes_in, bytes_out, json_number(server, "frames_rejected"));
    if (json_number(server, "pinned_buffer_bytes_limit") > 0) {
        char in_use[32], limit[32], direct[32], staged[32];
        format_bytes(json_number(server, "pinned_buffer_bytes_in_use"), in_use, sizeof(in_use));
        format_bytes(json_number(server, "pinned_buffer_bytes_limit"), limit, sizeof(limit));
        format_bytes(json_number(server, "bytes_copied_directly"), direct, sizeof(direct));
        format_bytes(json_number(server, "bytes_copied_staged"), staged, sizeof(staged));
        printf("  pinned       %s of %s in use, %.0f buffers found it full; GPU copies %s "
               "direct, %s staged\n",
               in_use, limit, json_number(server, "pinned_buffers_full"), direct, staged);
    }
    double waits = json_number(server, "device_waits");
    if (waits > 0)
        printf("  gpu waits    %.0f, %.3f s in all\n", waits,
               json_number(server, "device_wait_ms") / 1000.0);
    double saves = json_number(server, "checkpoint_saves");
    double failures = json_number(server, "checkpoint_save_failures");
    double restored = json_number(server, "checkpoint_tables_restored");
    double running = json_number(server, "checkpoint_saves_running");
    double unchanged = json_number(server, "checkpoint_saves_unchanged");
    double passed_over = json_number(server, "checkpoint_saves_passed_over");
    if (saves + failures + restored + running + unchanged + passed_over == 0)
        return;
    char last_bytes[32];
    format_bytes(json_number(server, "checkpoint_last_save_bytes"), last_bytes,
                 sizeof(last_bytes));
    printf("  checkpoints  %.0f saved (%.0f deltas), %.0f unchanged, %.0f passed over, %.0f "
           "failed, %.0f running (%.0f of %.0f rows read); last save %s in %.0f ms; %.0f tables "
           "(%.0f rows) restored at start\n",
           saves, json_number(server, "checkpoint_deltas"), unchanged, passed_over, failures,
           running,
           json_number(server, "checkpoint_save_rows_read"),
           json_number(server, "checkpoint_save_rows"), last_bytes,
           json_number(server, "checkpoint_last_save_ms"), restored,
           json_number(server, "checkpoint_rows_restored"));
}

static void print_method_stats(const cJSON *methods)
{
    static const char *const headers[] = {"METHOD", ">REQUESTS", ">ERRORS"};
    text_table table;
    text_table_init(&table, 3, headers, cJSON_GetArraySize(methods));
    const cJSON *m;
    cJSON_ArrayForEach(m, methods)
    {
        text_table_cell(&table, 0, "%s", json_string(m, "method"));
        text_table_cell(&table, 1, "%.0f", json_number(m, "requests"));
        text_table_cell(&table, 2, "%.0f", json_number(m, "errors"));
        table.rows++;
    }
    putchar('\n');
    text_table_print(&table);
}

static void print_table_stats(const cJSON *tables)
{
    static const char *const headers[] = {"TABLE", ">ROWS", ">CAPACITY", ">DIM",
                                          ">SHARDS", ">MEMORY", ">PULLS", ">PUSHES"};
    text_table table;
    text_table_init(&table, 8, headers, cJSON_GetArraySize(tables));
    const cJSON *t;
    cJSON_ArrayForEach(t, tables)
    {
        char memory[32];
        format_bytes(json_number(t, "row_bytes") + json_number(t, "index_bytes"), memory,
                     sizeof(memory));
        text_table_cell(&table, 0, "%s", json_string(t, "name"));
        text_table_cell(&table, 1, "%.0f", json_number(t, "rows"));
        text_table_cell(&table, 2, "%.0f", json_number(t, "capacity"));
        text_table_cell(&table, 3, "%.0f", json_number(t, "dim"));
        text_table_cell(&table, 4, "%.0f", json_number(t, "shards"));
        text_table_cell(&table, 5, "%s", memory);
        text_table_cell(&table, 6, "%.0f", json_number(t, "pulls"));
        text_table_cell(&table, 7, "%.0f", json_number(t, "pushes"));
        table.rows++;
    }
    putchar('\n');
    text_table_print(&table);
}

static void print_pool_stats(const cJSON *pools)
{
    static const char *const headers[] = {"POOL",  ">IN USE",       ">RESERVED",
                                          ">LIMIT", ">PEAK",         ">LARGEST FREE",
                                          ">FRAGMENTATION"};
    static const char *const sizes[] = {"bytes_in_use", "bytes_reserved", "bytes_limit",
                                        "peak_bytes_in_use", "largest_free_block"};
    text_table table;
    text_table_init(&table, 7, headers, cJSON_GetArraySize(pools));
    const cJSON *p;
    cJSON_ArrayForEach(p, pools)
    {
        text_table_cell(&table, 0, "%s", json_string(p, "device"));
        for (int i = 0; i < 5; i++)
            format_bytes(json_number(p, sizes[i]), table.cells[table.rows][i + 1], CELL_MAX);
        text_table_cell(&table, 6, "%.1f%%", 100.0 * json_number(p, "fragmentation"));
        table.rows++;
    }
    putchar('\n');
    text_table_print(&table);
}

static int command_stats(cli *c, int argc, char **argv)
{
    if (argc > 2)
        return usage_error("stats takes at most one table name");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    cJSON *stats;
    em_error err;
    if (em_client_stats(c->client, argc == 2 ? argv[1] : NULL, &stats, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(stats);
    } else {
        const cJSON *server = cJSON_GetObjectItemCaseSensitive(stats, "server");
        print_server_stats(server);
        print_method_stats(cJSON_GetObjectItemCaseSensitive(server, "methods"));
        print_table_stats(cJSON_GetObjectItemCaseSensitive(stats, "tables"));
        print_pool_stats(cJSON_GetObjectItemCaseSensitive(stats, "pools"));
    }
    cJSON_Delete(stats);
    return EXIT_OK;
}

/* ---- top --------------------------------------------------------------------------- */

/* "850 us", "12.5 ms", "1.20 s" */
static void format_seconds(double seconds, char *out, size_t capacity)
{
    if (seconds < 1e-3)
        snprintf(out, capacity, "%.0f us", seconds * 1e6);
    else if (seconds < 1.0)
        snprintf(out, capacity, "%.1f ms", seconds * 1e3);
    else
        snprintf(out, capacity, "%.2f s", seconds);
}

/* "12.5", "3.4k", "1.25M" */
static void format_rate(double rate, char *out, size_t capacity)
{
    if (rate < 1e3)
        snprintf(out, capacity, "%.1f", rate);
    else if (rate < 1e6)
        snprintf(out, capacity, "%.1fk", rate / 1e3);
    else
        snprintf(out, capacity, "%.2fM", rate / 1e6);
}

static void print_top_server(const cJSON *view)
{
    const cJSON *server = cJSON_GetObjectItemCaseSensitive(view, "server");
    char uptime[32], bytes_in[32], bytes_out[32], used[32], limit[32];
    format_duration(json_number(server, "uptime_ms"), uptime, sizeof(uptime));
    format_bytes(json_number(server, "bytes_in_per_second"), bytes_in, sizeof(bytes_in));
    format_bytes(json_number(server, "bytes_out_per_second"), bytes_out, sizeof(bytes_out));
    format_bytes(json_number(server, "memory_used_bytes"), used, sizeof(used));
    format_bytes(json_number(server, "memory_limit_bytes"), limit, sizeof(limit));
    printf("emberd %s, %s backend, %s, up %s; rates over the last %.1fs\n"
           "connections  %.0f open, %.1f/s accepted, %.1f/s rejected\n"
           "traffic      %s/s in, %s/s out\n"
           "work         %.0f queued or running; request memory %s of %s\n",
           json_string(server, "version"), json_string(server, "backend"),
           json_string(server, "state"), uptime, json_number(view, "seconds"),
           json_number(server, "connections_current"),
           json_number(server, "connections_per_second"),
           json_number(server, "rejected_per_second"), bytes_in, bytes_out,
           json_number(server, "work_queued"), used, limit);
}

static void print_top_methods(const cJSON *methods)
{
    putchar('\n');
    if (cJSON_GetArraySize(methods) == 0) {
        puts("no requests in the interval");
        return;
    }
    static const char *const headers[] = {"METHOD", ">REQ/S", ">ERR/S", ">P50", ">P90", ">P99"};
    static const char *const quantiles[] = {"p50_seconds", "p90_seconds", "p99_seconds"};
    text_table table;
    text_table_init(&table, 6, headers, cJSON_GetArraySize(methods));
    const cJSON *m;
    cJSON_ArrayForEach(m, methods)
    {
        text_table_cell(&table, 0, "%s", json_string(m, "method"));
        format_rate(json_number(m, "requests_per_second"), table.cells[table.rows][1], CELL_MAX);
        format_rate(json_number(m, "errors_per_second"), table.cells[table.rows][2], CELL_MAX);
        for (int q = 0; q < 3; q++)
            format_seconds(json_number(m, quantiles[q]), table.cells[table.rows][3 + q],
                           CELL_MAX);
        table.rows++;
    }
    text_table_print(&table);
}

static void print_top_tables(const cJSON *tables)
{
    if (cJSON_GetArraySize(tables) == 0)
        return;
    static const char *const headers[] = {"TABLE",     ">ROWS",          ">FILL",
                                          ">PULLS/S",  ">PUSHES/S",      ">KEYS PULLED/S",
                                          ">KEYS PUSHED/S", ">CREATED/S"};
    static const char *const rates[] = {"pulls_per_second", "pushes_per_second",
                                        "keys_pulled_per_second", "keys_pushed_per_second",
                                        "rows_created_per_second"};
    text_table table;
    text_table_init(&table, 8, headers, cJSON_GetArraySize(tables));
    const cJSON *t;
    cJSON_ArrayForEach(t, tables)
    {
        double capacity = json_number(t, "capacity");
        text_table_cell(&table, 0, "%s", json_string(t, "name"));
        text_table_cell(&table, 1, "%.0f", json_number(t, "rows"));
        text_table_cell(&table, 2, "%.1f%%",
                        capacity > 0 ? 100.0 * json_number(t, "rows") / capacity : 0.0);
        for (int r = 0; r < 5; r++)
            format_rate(json_number(t, rates[r]), table.cells[table.rows][3 + r], CELL_MAX);
        table.rows++;
    }
    putchar('\n');
    text_table_print(&table);
}

static void print_top_pools(const cJSON *pools)
{
    static const char *const headers[] = {"POOL", ">IN USE", ">LIMIT", ">USE",
                                          ">PEAK", ">LARGEST FREE", ">FRAGMENTATION"};
    text_table table;
    text_table_init(&table, 7, headers, cJSON_GetArraySize(pools));
    const cJSON *p;
    cJSON_ArrayForEach(p, pools)
    {
        double in_use = json_number(p, "bytes_in_use"), limit = json_number(p, "bytes_limit");
        text_table_cell(&table, 0, "%s", json_string(p, "device"));
        format_bytes(in_use, table.cells[table.rows][1], CELL_MAX);
        format_bytes(limit, table.cells[table.rows][2], CELL_MAX);
        text_table_cell(&table, 3, "%.1f%%", limit > 0 ? 100.0 * in_use / limit : 0.0);
        format_bytes(json_number(p, "peak_bytes_in_use"), table.cells[table.rows][4], CELL_MAX);
        format_bytes(json_number(p, "largest_free_block"), table.cells[table.rows][5], CELL_MAX);
        text_table_cell(&table, 6, "%.1f%%", 100.0 * json_number(p, "fragmentation"));
        table.rows++;
    }
    putchar('\n');
    text_table_print(&table);
}

static void print_top(const cJSON *view)
{
    print_top_server(view);
    print_top_methods(cJSON_GetObjectItemCaseSensitive(view, "methods"));
    print_top_tables(cJSON_GetObjectItemCaseSensitive(view, "tables"));
    print_top_pools(cJSON_GetObjectItemCaseSensitive(view, "pools"));
}

static void sleep_seconds(double seconds)
{
    struct timespec wait = {.tv_sec = (time_t)seconds,
                            .tv_nsec = (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {
    }
}

static int command_top(cli *c, int argc, char **argv)
{
    double interval = 1.0, count = 0;
    const char *table_name = NULL;
    bool once = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--once") == 0) {
            once = true;
        } else if (strcmp(argv[i], "--interval") == 0 && i + 1 < argc) {
            if (!parse_real(argv[++i], &interval) || interval < 0.05 || interval > 3600)
                return usage_error("--interval '%s' is not a number of seconds in 0.05..3600",
                                   argv[i]);
        } else if (strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
            if (!parse_whole(argv[++i], &count) || count < 1)
                return usage_error("--count '%s' is not a whole number of at least 1", argv[i]);
        } else if (argv[i][0] != '-' && table_name == NULL) {
            table_name = argv[i];
        } else {
            return usage_error("top takes [TABLE] [--interval SECONDS] [--count N] [--once]");
        }
    }
    if (once)
        count = 1;
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    /* redraw in place only for a person watching a terminal */
    bool redraw = !once && !c->json && isatty(STDOUT_FILENO);
    em_error err;
    cJSON *before = NULL;
    if (em_client_stats(c->client, table_name, &before, &err) != EM_OK)
        return call_failed(&err);
    for (double shown = 0; count == 0 || shown < count; shown++) {
        double started = monotonic_ms();
        sleep_seconds(interval);
        cJSON *after = NULL;
        if (em_client_stats(c->client, table_name, &after, &err) != EM_OK) {
            cJSON_Delete(before);
            return call_failed(&err);
        }
        cJSON *view = em_top_view(before, after, (monotonic_ms() - started) / 1000.0);
        cJSON_Delete(before);
        before = after;
        if (view == NULL) {
            cJSON_Delete(before);
            fputs("emberctl: out of memory\n", stderr);
            return EXIT_NO_ANSWER;
        }
        if (c->json) {
            char *line = cJSON_PrintUnformatted(view);
            if (line != NULL)
                puts(line);
            free(line);
        } else {
            if (redraw)
                fputs("\033[H\033[2J", stdout);
            else if (shown > 0)
                putchar('\n');
            print_top(view);
        }
        fflush(stdout);
        cJSON_Delete(view);
    }
    cJSON_Delete(before);
    return EXIT_OK;
}

/* ---- erase and evicted keys --------------------------------------------------------- */

/* Keys from a file (or "-": standard input), one decimal key per line; blank lines and
 * lines starting with '#' are skipped. */
static int read_key_file(const char *path, uint64_t **keys, uint64_t *count, uint64_t *capacity)
{
    FILE *file = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");
    if (file == NULL)
        return usage_error("cannot read key file '%s': %s", path, strerror(errno));
    char line[256];
    int code = EXIT_OK;
    for (uint64_t number = 1; code == EXIT_OK && fgets(line, sizeof(line), file) != NULL;
         number++) {
        line[strcspn(line, "\r\n")] = '\0';
        if (line[0] == '\0' || line[0] == '#')
            continue;
        if (*count == *capacity) {
            uint64_t grown = *capacity == 0 ? 1024 : *capacity * 2;
            uint64_t *more = realloc(*keys, grown * sizeof(uint64_t));
            if (more == NULL) {
                code = usage_error("key file '%s': out of memory", path);
                break;
            }
            *keys = more;
            *capacity = grown;
        }
        if (!parse_key(line, &(*keys)[*count]))
            code = usage_error("key file '%s' line %" PRIu64 ": '%s' is not a key (a whole "
                               "number 0..18446744073709551615)", path, number, line);
        else
            (*count)++;
    }
    if (file != stdin)
        fclose(file);
    return code;
}

/* erase TABLE --not-pushed-for N (pushes) | --not-pushed-since UNIX_SECONDS */
static int erase_by_age(cli *c, const char *table, int argc, char **argv)
{
    bool by_time = strcmp(argv[2], "--not-pushed-since") == 0;
    double value = 0;
    if (argc != 4 || !parse_whole(argv[3], &value) ||
        value > (by_time ? 18446744073709551.0 : 2147483647.0) || (!by_time && value < 1))
        return usage_error(by_time ? "erase TABLE --not-pushed-since T takes one time in "
                                     "seconds since 1970"
                                   : "erase TABLE --not-pushed-for N takes one number of "
                                     "pushes in 1..2147483647");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    uint64_t erased = 0;
    em_error err;
    em_status status =
        by_time ? em_client_erase_before(c->client, table, (uint64_t)value * 1000u, &erased, &err)
                : em_client_erase_older(c->client, table, (uint32_t)value, &erased, &err);
    if (status != EM_OK)
        return call_failed(&err);
    if (c->json)
        printf("{\"table\": \"%s\", \"%s\": %.0f, \"erased\": %" PRIu64 "}\n", table,
               by_time ? "not_pushed_since" : "not_pushed_for", value, erased);
    else if (by_time)
        printf("erased %" PRIu64 " row(s) of table '%s' not pushed since %.0f\n", erased, table,
               value);
    else
        printf("erased %" PRIu64 " row(s) of table '%s' not pushed in its last %.0f pushes\n",
               erased, table, value);
    return EXIT_OK;
}

static int command_erase(cli *c, int argc, char **argv)
{
    if (argc < 2)
        return usage_error("erase needs a table name, then keys or --file PATH");
    const char *table = argv[1];
    if (argc >= 3 && (strcmp(argv[2], "--not-pushed-for") == 0 ||
                      strcmp(argv[2], "--not-pushed-since") == 0))
        return erase_by_age(c, table, argc, argv);
    uint64_t *keys = NULL, count = 0, capacity = 0;
    int code = EXIT_OK;
    for (int i = 2; code == EXIT_OK && i < argc; i++) {
        if (strcmp(argv[i], "--file") == 0 && i + 1 < argc) {
            code = read_key_file(argv[++i], &keys, &count, &capacity);
            continue;
        }
        if (count == capacity) {
            capacity = capacity == 0 ? 64 : capacity * 2;
            uint64_t *more = realloc(keys, capacity * sizeof(uint64_t));
            if (more == NULL) {
                code = usage_error("erase: out of memory");
                break;
            }
            keys = more;
        }
        if (!parse_key(argv[i], &keys[count]))
            code = usage_error("erase: '%s' is not a key (a whole number "
                               "0..18446744073709551615) or --file PATH", argv[i]);
        else
            count++;
    }
    if (code == EXIT_OK && count == 0)
        code = usage_error("erase: no keys given (list them, or --file PATH)");
    if (code == EXIT_OK)
        code = connected(c);
    uint64_t erased = 0;
    em_error err;
    if (code == EXIT_OK && em_client_erase(c->client, table, keys, count, &erased, &err) != EM_OK)
        code = call_failed(&err);
    free(keys);
    if (code != EXIT_OK)
        return code;
    if (c->json)
        printf("{\"table\": \"%s\", \"listed\": %" PRIu64 ", \"erased\": %" PRIu64 "}\n",
               table, count, erased);
    else
        printf("erased %" PRIu64 " of %" PRIu64 " listed key(s) from table '%s'\n", erased, count,
               table);
    return EXIT_OK;
}

static int command_evicted(cli *c, int argc, char **argv)
{
    if (argc < 2)
        return usage_error("evicted needs a table name");
    double after = 0, max = 0;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--after") == 0 && i + 1 < argc) {
            if (!parse_whole(argv[++i], &after))
                return usage_error("--after '%s' is not a sequence number", argv[i]);
        } else if (strcmp(argv[i], "--max") == 0 && i + 1 < argc) {
            if (!parse_whole(argv[++i], &max) || max > 1048576)
                return usage_error("--max '%s' is not a number in 0..1048576", argv[i]);
        } else {
            return usage_error("evicted takes TABLE [--after SEQUENCE] [--max N]");
        }
    }
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    cJSON *evicted = NULL;
    em_error err;
    if (em_client_evicted(c->client, argv[1], (uint64_t)after, (uint32_t)max, &evicted, &err) !=
        EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(evicted);
        cJSON_Delete(evicted);
        return EXIT_OK;
    }
    const cJSON *keys = cJSON_GetObjectItemCaseSensitive(evicted, "keys");
    int shown = cJSON_GetArraySize(keys);
    double first = json_number(evicted, "first");
    printf("table '%s': %.0f key(s) evicted or expired in all", argv[1],
           json_number(evicted, "total"));
    if (shown > 0)
        printf("; sequence %.0f to %.0f below", first, first + shown - 1);
    if (json_number(evicted, "missed") > 0)
        printf("; %.0f after %.0f no longer kept", json_number(evicted, "missed"), after);
    if (after > json_number(evicted, "total")) /* a poller's sequence from before a restore */
        printf("; --after %.0f is past them all: the table went back to a checkpoint (or "
               "this is another server)", after);
    putchar('\n');
    const cJSON *key;
    cJSON_ArrayForEach(key, keys)
    {
        puts(key->valuestring);
    }
    cJSON_Delete(evicted);
    return EXIT_OK;
}

/* ---- checkpoints -------------------------------------------------------------------- */

static void print_drain(cli *c, const em_client_drain_state *state)
{
    if (c->json) {
        cJSON *json = cJSON_CreateObject();
        cJSON_AddBoolToObject(json, "was_drained", state->was_drained);
        cJSON_AddNumberToObject(json, "requests_running", (double)state->requests_running);
        cJSON_AddNumberToObject(json, "data_connections", state->data_connections);
        print_json(json);
        cJSON_Delete(json);
        return;
    }
    printf("%s: drained%s; %" PRIu64 " request(s) running, %u data connection(s) open\n",
           c->server, state->was_drained ? " (already)" : "", state->requests_running,
           state->data_connections);
}

static int command_drain(cli *c, int argc, char **argv)
{
    double wait_s = 0;
    if (argc == 3 && strcmp(argv[1], "--wait") == 0) {
        if (!parse_whole(argv[2], &wait_s) || wait_s > 86400)
            return usage_error("--wait '%s' is not a number of seconds in 0..86400", argv[2]);
    } else if (argc != 1) {
        return usage_error("drain takes only --wait SECONDS");
    }
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    em_client_drain_state state;
    em_error err;
    if (em_client_drain(c->client, &state, &err) != EM_OK)
        return call_failed(&err);
    /* DRAIN again only reports: poll until nothing runs or the wait is over */
    for (double waited = 0; state.requests_running > 0 && waited < wait_s; waited += 0.1) {
        usleep(100000);
        if (em_client_drain(c->client, &state, &err) != EM_OK)
            return call_failed(&err);
        state.was_drained = false;
    }
    print_drain(c, &state);
    return wait_s > 0 && state.requests_running > 0 ? EXIT_SERVER_ERROR : EXIT_OK;
}

static int command_undrain(cli *c, int argc, char **argv)
{
    (void)argv;
    if (argc != 1)
        return usage_error("undrain takes no arguments");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    bool was_drained = false;
    em_error err;
    if (em_client_undrain(c->client, &was_drained, &err) != EM_OK)
        return call_failed(&err);
    if (c->json)
        printf("{\"was_drained\": %s}\n", was_drained ? "true" : "false");
    else
        printf("%s: in service%s\n", c->server, was_drained ? "" : " (was not drained)");
    return EXIT_OK;
}

static void print_keys(const char *label, const cJSON *keys)
{
    printf("%s:", label);
    const cJSON *key = NULL;
    int count = 0;
    cJSON_ArrayForEach(key, keys)
    {
        printf(" %s", key->valuestring);
        count++;
    }
    printf("%s\n", count == 0 ? " none" : "");
}

static int command_reload(cli *c, int argc, char **argv)
{
    (void)argv;
    if (argc != 1)
        return usage_error("reload takes no arguments");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    cJSON *report = NULL;
    em_error err;
    if (em_client_reload(c->client, &report, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(report);
    } else {
        printf("reloaded %s\n", cJSON_GetStringValue(cJSON_GetObjectItem(report, "path")));
        print_keys("changed", cJSON_GetObjectItem(report, "changed"));
        print_keys("needs a restart", cJSON_GetObjectItem(report, "needs_restart"));
    }
    cJSON_Delete(report);
    return EXIT_OK;
}

static int command_slowlog(cli *c, int argc, char **argv)
{
    double max = 0;
    bool reset = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reset") == 0)
            reset = true;
        else if (strcmp(argv[i], "--max") == 0 && i + 1 < argc) {
            if (!parse_whole(argv[++i], &max) || max > 100000)
                return usage_error("--max '%s' is not a number in 0..100000", argv[i]);
        } else
            return usage_error("slowlog takes --max N and --reset");
    }
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    cJSON *log = NULL;
    em_error err;
    if (em_client_slowlog(c->client, (uint32_t)max, reset, &log, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(log);
        cJSON_Delete(log);
        return EXIT_OK;
    }
    printf("%.0f slow request(s) (at least %.0f ms) recorded, %.0f dropped%s\n",
           cJSON_GetObjectItem(log, "recorded")->valuedouble,
           cJSON_GetObjectItem(log, "threshold_ms")->valuedouble,
           cJSON_GetObjectItem(log, "dropped")->valuedouble, reset ? "; the log is now empty" : "");
    printf("%6s %-13s %10s %10s %10s %-9s %-16s %9s %11s %-18s %s\n", "id", "answered (ms)",
           "total us", "queued us", "run us", "method", "table", "keys", "bytes", "status",
           "peer");
    const cJSON *e = NULL;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(log, "entries"))
    {
        printf("%6.0f %-13.0f %10.0f %10.0f %10.0f %-9s %-16s %9.0f %11.0f %-18s %s\n",
               cJSON_GetObjectItem(e, "id")->valuedouble,
               cJSON_GetObjectItem(e, "unix_ms")->valuedouble,
               cJSON_GetObjectItem(e, "duration_us")->valuedouble,
               cJSON_GetObjectItem(e, "queue_us")->valuedouble,
               cJSON_GetObjectItem(e, "run_us")->valuedouble,
               cJSON_GetObjectItem(e, "method")->valuestring,
               cJSON_GetObjectItem(e, "table")->valuestring,
               cJSON_GetObjectItem(e, "keys")->valuedouble,
               cJSON_GetObjectItem(e, "bytes")->valuedouble,
               cJSON_GetObjectItem(e, "status")->valuestring,
               cJSON_GetObjectItem(e, "peer")->valuestring);
    }
    cJSON_Delete(log);
    return EXIT_OK;
}

static int cluster_save(cli *c, const char *table, const char *dir)
{
    cJSON *record = NULL;
    em_error err;
    if (em_client_cluster_save(c->client, table, dir, &record, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(record);
    } else {
        const cJSON *tables = cJSON_GetObjectItem(record, "tables"), *entry = NULL;
        cJSON_ArrayForEach(entry, tables)
        {
            const cJSON *part = NULL;
            cJSON_ArrayForEach(part, cJSON_GetObjectItem(entry, "parts"))
            {
                printf("%s: server %.0f (%s): checkpoint %s, %.0f rows, %.0f bytes, %s/%s\n",
                       cJSON_GetObjectItem(entry, "name")->valuestring,
                       cJSON_GetObjectItem(part, "server")->valuedouble,
                       cJSON_GetObjectItem(part, "address")->valuestring,
                       cJSON_GetObjectItem(part, "id")->valuestring,
                       cJSON_GetObjectItem(part, "rows")->valuedouble,
                       cJSON_GetObjectItem(part, "bytes")->valuedouble, dir,
                       cJSON_GetObjectItem(part, "path")->valuestring);
            }
        }
        printf("cluster checkpoint %s: %d tables from %d servers\n", dir,
               cJSON_GetArraySize(tables),
               cJSON_GetArraySize(cJSON_GetObjectItem(record, "servers")));
    }
    cJSON_Delete(record);
    return EXIT_OK;
}

static int command_save(cli *c, int argc, char **argv)
{
    const char *table = NULL, *cluster = NULL;
    bool delta = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--delta") == 0)
            delta = true;
        else if (strcmp(argv[i], "--cluster") == 0 && i + 1 < argc)
            cluster = argv[++i];
        else if (argv[i][0] != '-' && table == NULL)
            table = argv[i];
        else
            return usage_error("save: unexpected argument '%s' (save [TABLE] [--delta] or "
                               "save [TABLE] --cluster DIR)", argv[i]);
    }
    if (cluster != NULL && delta)
        return usage_error("save: a cluster checkpoint is full: --delta is not for it");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    if (cluster != NULL)
        return cluster_save(c, table, cluster);
    cJSON *saved;
    em_error err;
    if (em_client_save(c->client, table, delta, &saved, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(saved);
    } else {
        const cJSON *item = NULL;
        cJSON_ArrayForEach(item, saved)
        {
            printf("%s: %s checkpoint %s, %.0f rows, %.0f tombstones, %.0f bytes, %.3f s, %s\n",
                   cJSON_GetObjectItem(item, "table")->valuestring,
                   cJSON_GetObjectItem(item, "kind")->valuestring,
                   cJSON_GetObjectItem(item, "id")->valuestring,
                   cJSON_GetObjectItem(item, "rows")->valuedouble,
                   cJSON_GetObjectItem(item, "tombstones")->valuedouble,
                   cJSON_GetObjectItem(item, "bytes")->valuedouble,
                   cJSON_GetObjectItem(item, "seconds")->valuedouble,
                   cJSON_GetObjectItem(item, "path")->valuestring);
        }
    }
    cJSON_Delete(saved);
    return EXIT_OK;
}

static int cluster_load(cli *c, const char *table, const char *dir, uint32_t shards)
{
    cJSON *loaded = NULL;
    em_error err;
    if (em_client_cluster_load(c->client, dir, table, shards, &loaded, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(loaded);
    } else {
        const cJSON *item = NULL;
        cJSON_ArrayForEach(item, loaded)
        {
            printf("%s: server %.0f (%s) loaded %.0f rows from %.0f parts, %.3f s\n",
                   cJSON_GetObjectItem(item, "table")->valuestring,
                   cJSON_GetObjectItem(item, "server")->valuedouble,
                   cJSON_GetObjectItem(item, "address")->valuestring,
                   cJSON_GetObjectItem(item, "table_rows")->valuedouble,
                   cJSON_GetObjectItem(item, "sources")->valuedouble,
                   cJSON_GetObjectItem(item, "seconds")->valuedouble);
        }
    }
    cJSON_Delete(loaded);
    return EXIT_OK;
}

static int command_load(cli *c, int argc, char **argv)
{
    const char *table = NULL, *path = NULL, *cluster = NULL;
    bool weights_only = false;
    uint64_t shards = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--from") == 0 && i + 1 < argc)
            path = argv[++i];
        else if (strcmp(argv[i], "--cluster") == 0 && i + 1 < argc)
            cluster = argv[++i];
        else if (strcmp(argv[i], "--shards") == 0 && i + 1 < argc) {
            if (!parse_key(argv[++i], &shards) || shards == 0 || shards > 1024)
                return usage_error("load: --shards takes a count from 1 to 1024, not '%s'",
                                   argv[i]);
        } else if (strcmp(argv[i], "--weights-only") == 0)
            weights_only = true;
        else if (argv[i][0] != '-' && table == NULL)
            table = argv[i];
        else
            return usage_error("load: unexpected argument '%s'", argv[i]);
    }
    if (cluster != NULL && (path != NULL || weights_only))
        return usage_error("load: --cluster restores whole tables; not with --from or "
                           "--weights-only");
    if (cluster == NULL && shards > 0)
        return usage_error("load: --shards is for --cluster");
    if (table == NULL && cluster == NULL)
        return usage_error("load needs a table name");
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    if (cluster != NULL)
        return cluster_load(c, table, cluster, (uint32_t)shards);
    cJSON *loaded = NULL;
    em_error err;
    if (em_client_load(c->client, table, path, weights_only, &loaded, &err) != EM_OK)
        return call_failed(&err);
    if (c->json) {
        print_json(loaded);
    } else {
        /* table_rows: the rows of the loaded table; rows: those the checkpoint's own
         * files hold (a delta's changed rows only) */
        const char *kind = cJSON_GetObjectItem(loaded, "kind")->valuestring;
        printf("%s: loaded %s checkpoint %s", table, kind,
               cJSON_GetObjectItem(loaded, "id")->valuestring);
        if (strcmp(kind, "delta") == 0)
            printf(" (depth %.0f)", cJSON_GetObjectItem(loaded, "depth")->valuedouble);
        printf(", %.0f rows, %.3f s, from %s%s\n",
               cJSON_GetObjectItem(loaded, "table_rows")->valuedouble,
               cJSON_GetObjectItem(loaded, "seconds")->valuedouble,
               cJSON_GetObjectItem(loaded, "path")->valuestring,
               weights_only ? " (weights only)" : "");
    }
    cJSON_Delete(loaded);
    return EXIT_OK;
}

/* Offline: a checkpoint's files are read here, not by a server. */
static int checkpoint_failed(const em_error *err)
{
    fprintf(stderr, "emberctl: %s: %s\n", em_status_name(err->status), err->message);
    return EXIT_SERVER_ERROR;
}

static void print_checkpoint(const cli *c, const em_checkpoint_info *info, const char *verdict)
{
    if (c->json) {
        printf("{\"table\": \"%s\", \"id\": \"%s\", \"path\": \"%s\", \"kind\": \"%s\", "
               "\"parent\": \"%s\", \"depth\": %u, \"rows\": %" PRIu64 ", \"tombstones\": %"
               PRIu64 ", \"table_rows\": %" PRIu64 ", \"bytes\": %" PRIu64
               ", \"created_unix_ms\": %" PRIu64 "}\n",
               info->table, info->id, info->path, info->kind, info->parent, info->depth,
               info->rows, info->tombstones, info->table_rows, info->bytes,
               info->created_unix_ms);
        return;
    }
    if (strcmp(info->kind, "delta") == 0)
        printf("%s %s: table %s, delta on %s (depth %u), %" PRIu64 " rows changed, %" PRIu64
               " tombstones, %" PRIu64 " rows restored, %" PRIu64 " bytes, %" PRIu64
               " chunks%s\n", info->id, info->path, info->table, info->parent, info->depth,
               info->rows, info->tombstones, info->table_rows, info->bytes, info->chunks,
               verdict);
    else
        printf("%s %s: table %s, full, %" PRIu64 " rows, %" PRIu64 " bytes, %" PRIu64
               " chunks%s\n", info->id, info->path, info->table, info->rows, info->bytes,
               info->chunks, verdict);
}

/* A text field of a listed checkpoint into fixed room. */
static void copy_field(char *to, size_t room, const cJSON *item, const char *name)
{
    const cJSON *field = cJSON_GetObjectItem(item, name);
    snprintf(to, room, "%s", cJSON_IsString(field) ? field->valuestring : "");
}

static uint64_t number_field(const cJSON *item, const char *name)
{
    const cJSON *field = cJSON_GetObjectItem(item, name);
    return cJSON_IsNumber(field) ? (uint64_t)field->valuedouble : 0;
}

/* checkpoints list [TABLE]: the server's, under its checkpoint.dir (CHECKPOINTS). */
static int checkpoints_list_server(cli *c, const char *table)
{
    int code = connected(c);
    if (code != EXIT_OK)
        return code;
    cJSON *listed = NULL;
    em_error err;
    if (em_client_checkpoints(c->client, table, &listed, &err) != EM_OK)
        return call_failed(&err);
    if (cJSON_GetArraySize(listed) == 0 && !c->json)
        printf("no checkpoints under the server's checkpoint dir\n");
    const cJSON *item = NULL;
    cJSON_ArrayForEach(item, listed)
    {
        em_checkpoint_info info;
        memset(&info, 0, sizeof(info));
        copy_field(info.table, sizeof(info.table), item, "table");
        copy_field(info.id, sizeof(info.id), item, "id");
        copy_field(info.path, sizeof(info.path), item, "path");
        copy_field(info.kind, sizeof(info.kind), item, "kind");
        copy_field(info.parent, sizeof(info.parent), item, "parent");
        info.rows = number_field(item, "rows");
        info.bytes = number_field(item, "bytes");
        info.depth = (uint32_t)number_field(item, "depth");
        info.tombstones = number_field(item, "tombstones");
        info.table_rows = number_field(item, "table_rows");
        info.chunks = number_field(item, "chunks");
        info.created_unix_ms = number_field(item, "created_unix_ms");
        const cJSON *next = item->next; /* each table's latest comes last among its own */
        char next_table[sizeof(info.table)] = "";
        if (next != NULL)
            copy_field(next_table, sizeof(next_table), next, "table");
        const char *verdict = strcmp(next_table, info.table) != 0 ? " (latest)" : "";
        if (strcmp(info.kind, "?") == 0 && !c->json)
            printf("%s %s: DAMAGED: its manifest does not read (checkpoints verify on the "
                   "server's host says why)%s\n", info.id, info.path, verdict);
        else
            print_checkpoint(c, &info, verdict);
    }
    cJSON_Delete(listed);
    return EXIT_OK;
}

/* checkpoints list [TABLE] asks the server; checkpoints list DIR [TABLE] reads a
 * checkpoint dir here, without a server (an existing directory is a DIR). */
static int checkpoints_list(cli *c, int argc, char **argv)
{
    if (argc > 4)
        return usage_error("checkpoints list takes at most a checkpoint dir and a table");
    struct stat st;
    bool here = argc >= 3 && stat(argv[2], &st) == 0 && S_ISDIR(st.st_mode);
    if (!here && argc == 4) {
        fprintf(stderr, "emberctl: NOT_FOUND: checkpoints list: '%s' is not a directory "
                "(checkpoints list DIR TABLE reads a checkpoint dir on this host; "
                "checkpoints list TABLE asks the server)\n", argv[2]);
        return EXIT_SERVER_ERROR;
    }
    if (!here)
        return checkpoints_list_server(c, argc == 3 ? argv[2] : NULL);
    char **names = NULL;
    size_t count = 0;
    em_error err;
    if (argc == 4) {
        names = malloc(sizeof(char *));
        names[0] = strdup(argv[3]);
        count = 1;
    } else if (em_checkpoint_tables(argv[2], &names, &count, &err) != EM_OK) {
        return checkpoint_failed(&err);
    } else if (count == 0 && !c->json) {
        printf("no checkpoints under %s\n", argv[2]);
    }
    int code = EXIT_OK;
    for (size_t t = 0; t < count && code == EXIT_OK; t++) {
        em_checkpoint_info *infos = NULL;
        size_t n = 0;
        if (em_checkpoint_list(argv[2], names[t], &infos, &n, &err) != EM_OK) {
            code = checkpoint_failed(&err);
            break;
        }
        for (size_t i = 0; i < n; i++) {
            em_checkpoint_info failed;
            em_error why;
            /* the manifests' figures (the data is read by verify); a manifest that does
             * not read is listed as damaged, with the reason verify gives */
            if (strcmp(infos[i].kind, "?") != 0)
                print_checkpoint(c, &infos[i], i + 1 == n ? " (latest)" : "");
            else if (em_checkpoint_verify(infos[i].path, &failed, &why) != EM_OK)
                printf("%s %s: DAMAGED: %s\n", infos[i].id, infos[i].path, why.message);
            else /* whole again since it was listed */
                print_checkpoint(c, &failed, i + 1 == n ? " (latest)" : "");
        }
        free(infos);
    }
    em_checkpoint_free_names(names, count);
    return code;
}

/* A cluster checkpoint: the record, and every table's parts together (checksums, the
 * manifests the record names, each bucket in one part only). */
static int verify_cluster(cli *c, const char *dir)
{
    cJSON *record = NULL;
    em_error err;
    if (em_cluster_read(dir, &record, &err) != EM_OK)
        return checkpoint_failed(&err);
    int code = EXIT_OK;
    const cJSON *table = NULL;
    cJSON_ArrayForEach(table, cJSON_GetObjectItem(record, "tables"))
    {
        const char *name = cJSON_GetObjectItem(table, "name")->valuestring;
        char **paths = NULL;
        uint64_t *manifests = NULL;
        size_t count = 0;
        em_checkpoint_info info;
        em_status status = em_cluster_sources(record, dir, name, &paths, &manifests, &count,
                                               &err);
        if (status == EM_OK)
            status = em_checkpoint_verify_sources((const char *const *)paths, count, manifests,
                                                  &info, &err);
        em_cluster_free_sources(paths, manifests, count);
        if (status != EM_OK) {
            code = checkpoint_failed(&err);
            break;
        }
        if (c->json)
            printf("{\"table\": \"%s\", \"parts\": %zu, \"table_rows\": %" PRIu64 "}\n",
                   name, count, info.table_rows);
        else
            printf("%s: table %s, %zu parts, %" PRIu64 " rows: every checksum matches\n", dir,
                   name, count, info.table_rows);
    }
    cJSON_Delete(record);
    return code;
}

static int checkpoints_verify(cli *c, int argc, char **argv)
{
    if (argc != 3)
        return usage_error("checkpoints verify needs exactly one checkpoint path");
    char record[4200];
    snprintf(record, sizeof(record), "%s/%s", argv[2], EM_CLUSTER_FILE);
    if (access(record, F_OK) == 0)
        return verify_cluster(c, argv[2]);
    em_checkpoint_info info;
    em_error err;
    if (em_checkpoint_verify(argv[2], &info, &err) != EM_OK)
        return checkpoint_failed(&err);
    print_checkpoint(c, &info, ": every checksum matches");
    return EXIT_OK;
}

/* The parts of table (NULL: the record's only table) of the cluster checkpoint in dir,
 * exported into out. */
static em_status export_cluster(const char *dir, const char *table, const char *out,
                                bool weights_only, em_checkpoint_info *info, em_error *err)
{
    cJSON *record = NULL;
    em_status status = em_cluster_read(dir, &record, err);
    const cJSON *tables = cJSON_GetObjectItem(record, "tables");
    if (status == EM_OK && table == NULL && cJSON_GetArraySize(tables) != 1) {
        char names[512] = "";
        const cJSON *item = NULL;
        cJSON_ArrayForEach(item, tables)
        {
            size_t used = strlen(names);
            snprintf(names + used, sizeof(names) - used, "%s%s", used > 0 ? ", " : "",
                     cJSON_GetObjectItem(item, "name")->valuestring);
        }
        status = em_error_set(err, EM_INVALID_ARGUMENT,
                              "%s holds tables %s: name one with --table", dir, names);
    }
    if (status == EM_OK && table == NULL)
        table = cJSON_GetObjectItem(cJSON_GetArrayItem(tables, 0), "name")->valuestring;
    char **paths = NULL;
    uint64_t *manifests = NULL;
    size_t count = 0;
    if (status == EM_OK)
        status = em_cluster_sources(record, dir, table, &paths, &manifests, &count, err);
    if (status == EM_OK)
        status = em_checkpoint_export_sources((const char *const *)paths, count, manifests, out,
                                              weights_only, info, err);
    em_cluster_free_sources(paths, manifests, count);
    cJSON_Delete(record);
    return status;
}

static int checkpoints_export(cli *c, int argc, char **argv)
{
    const char *path = NULL, *out = NULL, *table = NULL;
    bool weights_only = false;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
            out = argv[++i];
        else if (strcmp(argv[i], "--table") == 0 && i + 1 < argc)
            table = argv[++i];
        else if (strcmp(argv[i], "--weights-only") == 0)
            weights_only = true;
        else if (argv[i][0] != '-' && path == NULL)
            path = argv[i];
        else
            return usage_error("checkpoints export: unexpected argument '%s'", argv[i]);
    }
    if (path == NULL || out == NULL)
        return usage_error("checkpoints export needs a checkpoint path and --out DIR");
    char record[4200];
    snprintf(record, sizeof(record), "%s/%s", path, EM_CLUSTER_FILE);
    bool cluster = access(record, F_OK) == 0;
    if (table != NULL && !cluster)
        return usage_error("checkpoints export: --table is for a cluster checkpoint");
    em_checkpoint_info info;
    em_error err;
    em_status status = cluster ? export_cluster(path, table, out, weights_only, &info, &err)
                               : em_checkpoint_export(path, out, weights_only, &info, &err);
    if (status != EM_OK)
        return checkpoint_failed(&err);
    if (c->json) {
        cJSON *result = cJSON_CreateObject();
        cJSON_AddStringToObject(result, "table", info.table);
        cJSON_AddStringToObject(result, "checkpoint", info.id);
        cJSON_AddStringToObject(result, "out", out);
        cJSON_AddNumberToObject(result, "rows", (double)info.rows);
        cJSON_AddBoolToObject(result, "weights_only", weights_only);
        cJSON_AddNumberToObject(result, "seconds", info.seconds);
        print_json(result);
        cJSON_Delete(result);
    } else {
        printf("%s: table %s, checkpoint %s, %" PRIu64 " rows%s, %.3f s\n", out, info.table,
               info.id, info.rows, weights_only ? " (weights only)" : "", info.seconds);
    }
    return EXIT_OK;
}

static int checkpoints_import(cli *c, int argc, char **argv)
{
    const char *dir = NULL, *root = NULL;
    em_checkpoint_import_options options;
    em_checkpoint_import_options_init(&options);
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--to") == 0 && i + 1 < argc)
            root = argv[++i];
        else if (strcmp(argv[i], "--name") == 0 && i + 1 < argc)
            options.name = argv[++i];
        else if (strcmp(argv[i], "--json-config") == 0 && i + 1 < argc)
            options.config_json = argv[++i];
        else if (strcmp(argv[i], "--weights-only") == 0)
            options.weights_only = true;
        else if (argv[i][0] != '-' && dir == NULL)
            dir = argv[i];
        else
            return usage_error("checkpoints import: unexpected argument '%s'", argv[i]);
    }
    if (dir == NULL || root == NULL)
        return usage_error("checkpoints import needs a directory of arrays and --to "
                           "CHECKPOINT_DIR");
    em_checkpoint_info info;
    em_error err;
    if (em_checkpoint_import(dir, root, &options, &info, &err) != EM_OK)
        return checkpoint_failed(&err);
    print_checkpoint(c, &info, "");
    return EXIT_OK;
}

static int command_checkpoints(cli *c, int argc, char **argv)
{
    if (argc < 2)
        return usage_error("checkpoints needs a subcommand: list, verify, export or import");
    if (strcmp(argv[1], "list") == 0)
        return checkpoints_list(c, argc, argv);
    if (strcmp(argv[1], "verify") == 0)
        return checkpoints_verify(c, argc, argv);
    if (strcmp(argv[1], "export") == 0)
        return checkpoints_export(c, argc, argv);
    if (strcmp(argv[1], "import") == 0)
        return checkpoints_import(c, argc, argv);
    return usage_error("unknown checkpoints subcommand '%s' (list, verify, export, import)",
                       argv[1]);
}

/* ---- main -------------------------------------------------------------------------- */

typedef struct command {
    const char *name;
    int (*run)(cli *c, int argc, char **argv);
} command;

static const command commands[] = {
    {"ping", command_ping},
    {"health", command_health},
    {"tables", command_tables},
    {"stats", command_stats},
    {"top", command_top},
    {"erase", command_erase},
    {"evicted", command_evicted},
    {"save", command_save},
    {"load", command_load},
    {"drain", command_drain},
    {"undrain", command_undrain},
    {"reload", command_reload},
    {"slowlog", command_slowlog},
    {"checkpoints", command_checkpoints},
};

enum { OPTION_SERVER = 256, OPTION_TOKEN, OPTION_TOKEN_FILE, OPTION_JSON, OPTION_TIMEOUT,
       OPTION_TLS_CA, OPTION_TLS_CERT, OPTION_TLS_KEY,
       OPTION_VERSION };

static int parse_timeout(cli *c, const char *text)
{
    double value;
    if (!parse_whole(text, &value) || value < 1 || value > 86400000)
        return usage_error("--timeout '%s' is not a number of milliseconds in 1..86400000",
                           text);
    c->timeout_ms = (uint32_t)value;
    return EXIT_OK;
}

/* Global options, up to the command; *done is set for --help and --version. */
static int parse_global_options(cli *c, int argc, char **argv, bool *done)
{
    static const struct option options[] = {
        {"server", required_argument, NULL, OPTION_SERVER},
        {"token", required_argument, NULL, OPTION_TOKEN},
        {"token-file", required_argument, NULL, OPTION_TOKEN_FILE},
        {"json", no_argument, NULL, OPTION_JSON},
        {"timeout", required_argument, NULL, OPTION_TIMEOUT},
        {"tls-ca", required_argument, NULL, OPTION_TLS_CA},
        {"tls-cert", required_argument, NULL, OPTION_TLS_CERT},
        {"tls-key", required_argument, NULL, OPTION_TLS_KEY},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, OPTION_VERSION},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int option, code = EXIT_OK;
    while (code == EXIT_OK && (option = getopt_long(argc, argv, "+h", options, NULL)) != -1) {
        switch (option) {
        case OPTION_SERVER:
            c->server = optarg;
            break;
        case OPTION_TOKEN:
            c->token = optarg;
            break;
        case OPTION_TOKEN_FILE:
            c->token_file = optarg;
            break;
        case OPTION_JSON:
            c->json = true;
            break;
        case OPTION_TIMEOUT:
            code = parse_timeout(c, optarg);
            break;
        case OPTION_TLS_CA:
            c->tls_ca = optarg;
            break;
        case OPTION_TLS_CERT:
            c->tls_cert = optarg;
            break;
        case OPTION_TLS_KEY:
            c->tls_key = optarg;
            break;
        case 'h':
            print_help(stdout);
            *done = true;
            return EXIT_OK;
        case OPTION_VERSION:
            printf("emberctl %s\n", EM_VERSION);
            *done = true;
            return EXIT_OK;
        default:
            return usage_error("unknown or incomplete option '%s'", argv[optind - 1]);
        }
    }
    return code;
}

static const command *find_command(const char *name)
{
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (strcmp(commands[i].name, name) == 0)
            return &commands[i];
    return NULL;
}

/* Global options may also follow the command ("emberctl stats --json"): they are moved
 * in front of it, so each command only sees its own arguments. */
static char **global_options_first(int argc, char **argv)
{
    static const char *const with_value[] = {"--server",  "--token",    "--token-file",
                                             "--timeout", "--tls-ca",   "--tls-cert",
                                             "--tls-key"};
    char **ordered = calloc((size_t)argc + 1, sizeof(*ordered));
    int front = 1, command_index = 0;
    ordered[0] = argv[0];
    char **rest = calloc((size_t)argc + 1, sizeof(*rest));
    int rest_count = 0;
    for (int i = 1; i < argc; i++) {
        bool global = strcmp(argv[i], "--json") == 0 || strncmp(argv[i], "--server=", 9) == 0 ||
                      strncmp(argv[i], "--token=", 8) == 0 ||
                      strncmp(argv[i], "--token-file=", 13) == 0 ||
                      strncmp(argv[i], "--timeout=", 10) == 0 ||
                      strncmp(argv[i], "--tls-", 6) == 0;
        bool takes_value = false;
        for (size_t v = 0; v < sizeof(with_value) / sizeof(with_value[0]); v++)
            takes_value |= strcmp(argv[i], with_value[v]) == 0;
        if (command_index == 0 && argv[i][0] != '-') {
            command_index = i;
            rest[rest_count++] = argv[i];
        } else if (command_index == 0 || global || takes_value) {
            ordered[front++] = argv[i];
            if (takes_value && i + 1 < argc)
                ordered[front++] = argv[++i];
        } else {
            rest[rest_count++] = argv[i];
        }
    }
    memcpy(ordered + front, rest, (size_t)rest_count * sizeof(*rest));
    free(rest);
    return ordered;
}

int main(int argc, char **argv)
{
    cli c = {.server = DEFAULT_ADMIN_SERVER, .timeout_ms = DEFAULT_TIMEOUT_MS};
    bool done = false;
    char **ordered = global_options_first(argc, argv);
    int code = parse_global_options(&c, argc, ordered, &done);
    if (code != EXIT_OK || done) {
        free(ordered);
        return code;
    }
    if (optind >= argc) {
        free(ordered);
        return usage_error("no command given (ping, health, tables, stats, top, erase, evicted,"
                           " save, load, drain, undrain, reload, slowlog, checkpoints)");
    }
    const command *chosen = find_command(ordered[optind]);
    if (chosen == NULL) {
        code = usage_error("unknown command '%s' (ping, health, tables, stats, top, erase, evicted, "
                           "save, load, drain, undrain, reload, slowlog, checkpoints)", ordered[optind]);
        free(ordered);
        return code;
    }
    code = chosen->run(&c, argc - optind, ordered + optind);
    em_client_destroy(c.client);
    free(ordered);
    return code;
}
