/*
 * DESIGN: train_logreg, the first program a new ember user runs.
 *
 * Logistic regression on synthetic click data, with every weight living in ember:
 *
 *   - a sample has 8 categorical fields (a few thousand values each) plus a bias
 *     feature; its features are one CSR row of keys, key = field << 32 | value;
 *   - labels come from a hidden "true" logistic model over the same features, so the
 *     best achievable loss is known and printed next to ours;
 *   - the model is a table of dim 1: a pull with combiner SUM gives each row's logit
 *     (create_missing: a value seen for the first time starts at 0);
 *   - dL/dlogit = p - y per row, pushed with combiner SUM, hands every feature of the
 *     row that gradient; the server's adagrad (lr 0.1) does the rest.
 *
 * The average log-loss is printed after the first batch and then every
 * --report-every batches; it starts at ln 2 = 0.693 (every weight 0) and falls toward
 * the hidden model's own loss on the same samples.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clients/ember_client.h"

#define FIELDS 8
#define BIAS_FIELD FIELDS
#define FIRST_FIELD_VALUES 1000 /* field f has 1000 + 250 f values */
#define TRUE_WEIGHT_STDDEV 1.0
#define TRUE_BIAS -0.5
#define LEARNING_RATE 0.1
#define TABLE_CAPACITY 1000000
#define DEVELOPMENT_ADMIN_TOKEN "ember-dev-admin-token"

typedef struct settings {
    const char *server;
    const char *admin;
    const char *token;
    const char *data_token;
    const char *table;
    uint32_t batches;
    uint32_t batch_size;
    uint32_t report_every;
    uint64_t seed;
} settings;

/* ---- random numbers ---------------------------------------------------------------- */

typedef struct rng {
    uint64_t state;
} rng;

/* splitmix64 */
static uint64_t rng_next(rng *r)
{
    uint64_t z = (r->state += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static double rng_unit(rng *r)
{
    return (double)(rng_next(r) >> 11) * 0x1.0p-53;
}

static double rng_normal(rng *r)
{
    double u = rng_unit(r), v = rng_unit(r);
    return sqrt(-2.0 * log(1.0 - u)) * cos(2.0 * M_PI * v);
}

/* ---- the hidden model and the data ----------------------------------------------- */

typedef struct hidden_model {
    uint32_t values[FIELDS];
    double *weights[FIELDS];
} hidden_model;

static bool hidden_model_init(hidden_model *model, rng *r)
{
    for (int f = 0; f < FIELDS; f++) {
        model->values[f] = FIRST_FIELD_VALUES + 250u * (uint32_t)f;
        model->weights[f] = malloc(model->values[f] * sizeof(double));
        if (model->weights[f] == NULL)
            return false;
        for (uint32_t v = 0; v < model->values[f]; v++)
            model->weights[f][v] = TRUE_WEIGHT_STDDEV * rng_normal(r);
    }
    return true;
}

static void hidden_model_deinit(hidden_model *model)
{
    for (int f = 0; f < FIELDS; f++)
        free(model->weights[f]);
}

static uint64_t feature_key(uint32_t field, uint32_t value)
{
    return (uint64_t)field << 32 | value;
}

static double sigmoid(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

static double log_loss(double p, double label)
{
    const double tiny = 1e-12;
    p = p < tiny ? tiny : p > 1.0 - tiny ? 1.0 - tiny : p;
    return -(label * log(p) + (1.0 - label) * log(1.0 - p));
}

typedef struct batch {
    uint32_t rows;
    uint32_t *offsets;
    uint64_t *keys;
    float *labels;
    float *logits;    /* pulled */
    float *gradients; /* pushed */
    double true_loss; /* the hidden model's loss on these samples */
} batch;

static bool batch_init(batch *b, uint32_t rows)
{
    b->rows = rows;
    b->offsets = malloc(((size_t)rows + 1) * sizeof(uint32_t));
    b->keys = malloc((size_t)rows * (FIELDS + 1) * sizeof(uint64_t));
    b->labels = malloc((size_t)rows * sizeof(float));
    b->logits = malloc((size_t)rows * sizeof(float));
    b->gradients = malloc((size_t)rows * sizeof(float));
    return b->offsets != NULL && b->keys != NULL && b->labels != NULL && b->logits != NULL &&
           b->gradients != NULL;
}

static void batch_deinit(batch *b)
{
    free(b->offsets);
    free(b->keys);
    free(b->labels);
    free(b->logits);
    free(b->gradients);
}

/* One sample: skewed value choices (a few values are frequent and most are rare, as
 * in real categories), its label drawn from the hidden model. */
static void draw_sample(const hidden_model *model, rng *r, uint64_t *keys, float *label,
                        double *true_loss)
{
    double logit = TRUE_BIAS;
    for (uint32_t f = 0; f < FIELDS; f++) {
        double u = rng_unit(r);
        uint32_t value = (uint32_t)(u * u * u * model->values[f]);
        keys[f] = feature_key(f, value);
        logit += model->weights[f][value];
    }
    keys[FIELDS] = feature_key(BIAS_FIELD, 0);
    double p = sigmoid(logit);
    *label = rng_unit(r) < p ? 1.0f : 0.0f;
    *true_loss = log_loss(p, *label);
}

static void batch_fill(batch *b, const hidden_model *model, rng *r)
{
    b->true_loss = 0.0;
    b->offsets[0] = 0;
    for (uint32_t row = 0; row < b->rows; row++) {
        double loss;
        draw_sample(model, r, b->keys + (size_t)row * (FIELDS + 1), &b->labels[row], &loss);
        b->true_loss += loss;
        b->offsets[row + 1] = (row + 1) * (FIELDS + 1);
    }
}

static em_csr batch_csr(const batch *b)
{
    return (em_csr){.rows = b->rows,
                    .nnz = (uint64_t)b->rows * (FIELDS + 1),
                    .offsets = b->offsets,
                    .keys = b->keys};
}

/* ---- ember ------------------------------------------------------------------------- */

static em_client *connect_to(const char *servers, const char *token, em_error *err)
{
    em_client_options options;
    em_client_options_init(&options);
    options.servers = servers;
    options.token = token;
    em_client *client = NULL;
    em_client_create(&options, &client, err);
    return client;
}

/* Creates the table (dim 1, adagrad, zeros) unless it exists. */
static em_status ensure_table(const settings *s, em_error *err)
{
    em_client *admin = connect_to(s->admin, s->token, err);
    if (admin == NULL)
        return err->status;
    char config[512];
    snprintf(config, sizeof(config),
             "{\"name\":\"%s\",\"dim\":1,\"capacity\":%d,"
             "\"optimizer\":{\"type\":\"adagrad\",\"lr\":%g},"
             "\"initializer\":{\"type\":\"zeros\"}}",
             s->table, TABLE_CAPACITY, LEARNING_RATE);
    em_status status = em_client_create_table(admin, config, NULL, err);
    if (status == EM_OK)
        printf("created table '%s' on %s: dim 1, adagrad lr %g, zeros\n", s->table, s->admin,
               LEARNING_RATE);
    else if (status == EM_ALREADY_EXISTS)
        printf("table '%s' exists on %s: training continues from its weights\n", s->table,
               s->admin);
    em_client_destroy(admin);
    return status == EM_ALREADY_EXISTS ? EM_OK : status;
}

/* Pulls the logits, computes the loss and p - y, pushes the gradients. Returns the
 * batch's summed loss in *loss. */
static em_status train_step(em_client *client, const settings *s, batch *b, double *loss,
                            em_error *err)
{
    em_client_pull_args pull = {.table = s->table,
                                .batch = batch_csr(b),
                                .combiner = EM_COMBINER_SUM,
                                .create_missing = true,
                                .out = b->logits,
                                .out_capacity = b->rows};
    em_client_pull_result pulled;
    em_status status = em_client_pull(client, &pull, &pulled, err);
    if (status != EM_OK)
        return status;
    if (pulled.dim != 1)
        return em_error_set(err, EM_FAILED_PRECONDITION,
                            "table '%s' has dim %u; logistic regression needs dim 1", s->table,
                            pulled.dim);
    *loss = 0.0;
    for (uint32_t row = 0; row < b->rows; row++) {
        double p = sigmoid(b->logits[row]);
        *loss += log_loss(p, b->labels[row]);
        b->gradients[row] = (float)(p - b->labels[row]);
    }
    em_client_push_args push = {.table = s->table,
                                .batch = batch_csr(b),
                                .combiner = EM_COMBINER_SUM,
                                .gradients = b->gradients,
                                .gradient_count = b->rows};
    return em_client_push(client, &push, NULL, err);
}

/* Losses averaged over one reporting window. */
typedef struct window {
    double loss, true_loss;
    uint64_t samples;
} window;

static void report(uint32_t batch_number, uint64_t samples_seen, const window *w)
{
    printf("batch %6u  samples %9llu  loss %.4f  (hidden model %.4f)\n", batch_number,
           (unsigned long long)samples_seen, w->loss / (double)w->samples,
           w->true_loss / (double)w->samples);
    fflush(stdout);
}

static em_status train(const settings *s, em_error *err)
{
    rng r = {.state = s->seed};
    hidden_model model = {0};
    batch b = {0};
    em_client *client = NULL;
    em_status status = EM_OK;
    if (!hidden_model_init(&model, &r) || !batch_init(&b, s->batch_size))
        status = em_error_set(err, EM_RESOURCE_EXHAUSTED, "synthetic data: out of memory");
    if (status == EM_OK && (client = connect_to(s->server, s->data_token, err)) == NULL)
        status = err->status;
    window current = {0}, first = {0};
    uint64_t samples = 0;
    for (uint32_t n = 1; status == EM_OK && n <= s->batches; n++) {
        batch_fill(&b, &model, &r);
        double loss = 0.0;
        status = train_step(client, s, &b, &loss, err);
        current.loss += loss;
        current.true_loss += b.true_loss;
        current.samples += b.rows;
        samples += b.rows;
        /* the first batch alone shows where training starts: ln 2 from zero weights */
        if (status == EM_OK && (n == 1 || n % s->report_every == 0 || n == s->batches)) {
            report(n, samples, &current);
            if (first.samples == 0)
                first = current;
            if (n == s->batches)
                printf("loss went from %.4f to %.4f; the hidden model scores %.4f\n",
                       first.loss / (double)first.samples,
                       current.loss / (double)current.samples,
                       current.true_loss / (double)current.samples);
            current = (window){0};
        }
    }
    em_client_destroy(client);
    batch_deinit(&b);
    hidden_model_deinit(&model);
    return status;
}

/* ---- command line ------------------------------------------------------------------- */

static void print_help(void)
{
    printf("Usage: train_logreg [OPTIONS]\n"
           "\n"
           "Trains logistic regression on synthetic click data with its weights in ember.\n"
           "\n"
           "  --server HOST:PORT    data listener(s), comma-separated (default 127.0.0.1:7070)\n"
           "  --admin HOST:PORT     admin listener that creates the table (default "
           "127.0.0.1:7071)\n"
           "  --token TOKEN         admin token (default $EMBER_ADMIN_TOKEN, else the\n"
           "                        development token \"%s\")\n"
           "  --data-token TOKEN    data token, when the server has one ($EMBER_DATA_TOKEN)\n"
           "  --table NAME          table to train (default logreg_demo)\n"
           "  --batches N           batches to train (default 600)\n"
           "  --batch-size N        samples per batch (default 512)\n"
           "  --report-every N      batches per loss report, after the first batch (default 50)\n"
           "  --seed N              seed of the hidden model and the data (default 1)\n",
           DEVELOPMENT_ADMIN_TOKEN);
}

static bool parse_count(const char *text, uint64_t max, uint64_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (text[0] < '0' || text[0] > '9' || *end != '\0' || errno != 0 || value > max)
        return false;
    *out = value;
    return true;
}

static const char *environment_or(const char *name, const char *fallback)
{
    const char *value = getenv(name);
    return value != NULL && value[0] != '\0' ? value : fallback;
}

/* A count option: a whole number in 1..max. */
static bool parse_positive(const char *text, uint64_t max, uint32_t *out)
{
    uint64_t value;
    if (!parse_count(text, max, &value) || value == 0)
        return false;
    *out = (uint32_t)value;
    return true;
}

/* Applies one option; false when its value is not valid. */
static bool apply_option(int option, const char *value, settings *s)
{
    switch (option) {
    case 's':
        s->server = value;
        return true;
    case 'a':
        s->admin = value;
        return true;
    case 't':
        s->token = value;
        return true;
    case 'd':
        s->data_token = value;
        return true;
    case 'T':
        s->table = value;
        return true;
    case 'b':
        return parse_positive(value, UINT32_MAX, &s->batches);
    case 'B':
        return parse_positive(value, UINT32_C(1) << 20, &s->batch_size);
    case 'r':
        return parse_positive(value, UINT32_MAX, &s->report_every);
    default:
        return parse_count(value, UINT64_MAX, &s->seed);
    }
}

/* Returns 0 to go on, 1 after --help, 2 on a usage error. */
static int parse_settings(int argc, char **argv, settings *s)
{
    static const struct option options[] = {
        {"server", required_argument, NULL, 's'},
        {"admin", required_argument, NULL, 'a'},
        {"token", required_argument, NULL, 't'},
        {"data-token", required_argument, NULL, 'd'},
        {"table", required_argument, NULL, 'T'},
        {"batches", required_argument, NULL, 'b'},
        {"batch-size", required_argument, NULL, 'B'},
        {"report-every", required_argument, NULL, 'r'},
        {"seed", required_argument, NULL, 'S'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int option;
    opterr = 0;
    while ((option = getopt_long(argc, argv, "h", options, NULL)) != -1) {
        if (option == 'h') {
            print_help();
            return 1;
        }
        if (option == '?') {
            fprintf(stderr, "train_logreg: unknown or incomplete option '%s' (see --help)\n",
                    argv[optind - 1]);
            return 2;
        }
        if (!apply_option(option, optarg, s)) {
            fprintf(stderr, "train_logreg: %s '%s' is not a positive whole number in range\n",
                    argv[optind - 2], optarg);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "train_logreg: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }
    return 0;
}

int main(int argc, char **argv)
{
    settings s = {
        .server = "127.0.0.1:7070",
        .admin = "127.0.0.1:7071",
        .token = environment_or("EMBER_ADMIN_TOKEN", DEVELOPMENT_ADMIN_TOKEN),
        .data_token = environment_or("EMBER_DATA_TOKEN", NULL),
        .table = "logreg_demo",
        .batches = 600,
        .batch_size = 512,
        .report_every = 50,
        .seed = 1,
    };
    int parsed = parse_settings(argc, argv, &s);
    if (parsed != 0)
        return parsed == 1 ? 0 : 2;
    printf("train_logreg: %d fields + bias, labels from a hidden logistic model (seed %llu)\n",
           FIELDS, (unsigned long long)s.seed);
    em_error err;
    em_status status = ensure_table(&s, &err);
    if (status == EM_OK)
        status = train(&s, &err);
    if (status != EM_OK) {
        fprintf(stderr, "train_logreg: %s: %s\n", em_status_name(status), err.message);
        return 1;
    }
    return 0;
}
