/*
 * DESIGN: ember._ember, the CPython face of libember-client.
 *
 * The Python package (ember/__init__.py) checks arguments with numpy and names the one
 * that is wrong; this module takes what it hands over as buffers (the buffer protocol,
 * so numpy arrays and torch tensors' numpy views pass without a copy), checks each
 * buffer's element type and contiguity once more, and calls the C client with the GIL
 * released: other Python threads run while a call waits on the network.
 *
 * A libember-client client is used by one thread at a time, so each Client holds a
 * lock taken (with the GIL released, so a waiting thread never blocks the interpreter)
 * around every call into it.
 *
 * Pipelined calls: pull_start / push_start return a Call that holds the request's
 * buffers (the client reads keys and gradients and writes the answer into them until
 * the call is finished) and a reference to its Client. Call.finish() waits for the
 * answer; a Call dropped unfinished is finished in its destructor, so the client never
 * writes into memory Python has released.
 *
 * Errors raise ember.Error with attributes `status` (the status name, as
 * "NOT_FOUND") and `message` (the server's or the client's message).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#include <string.h>

#include "clients/ember_client.h"
#include "clients/python/src/hugectr_module.h"

/* ---- errors ----------------------------------------------------------------------- */

static PyObject *ember_error_type;

static PyObject *raise_status(em_status status, const char *message)
{
    PyObject *instance =
        PyObject_CallFunction(ember_error_type, "s", message[0] != '\0' ? message : em_status_message(status));
    if (instance == NULL)
        return NULL;
    PyObject *name = PyUnicode_FromString(em_status_name(status));
    PyObject *text = PyUnicode_FromString(message);
    if (name != NULL && text != NULL) {
        PyObject_SetAttrString(instance, "status", name);
        PyObject_SetAttrString(instance, "message", text);
        PyErr_SetObject(ember_error_type, instance);
    }
    Py_XDECREF(name);
    Py_XDECREF(text);
    Py_DECREF(instance);
    return NULL;
}

static PyObject *raise_error(const em_error *err)
{
    return raise_status(err->status, err->message);
}

/* ---- buffers ---------------------------------------------------------------------- */

typedef enum element_type { ELEMENT_U32, ELEMENT_U64, ELEMENT_F32 } element_type;

static const char *element_type_name(element_type type)
{
    switch (type) {
    case ELEMENT_U32:
        return "uint32";
    case ELEMENT_U64:
        return "uint64";
    case ELEMENT_F32:
        return "float32";
    }
    return "?";
}

/* Whether a struct-module format string (optionally with a native or little-endian
 * prefix) describes type. */
static bool format_matches(const char *format, Py_ssize_t itemsize, element_type type)
{
    if (format == NULL)
        format = "B";
    if (format[0] == '@' || format[0] == '=' || format[0] == '<')
        format++;
    if (format[0] == '\0' || format[1] != '\0')
        return false;
    char code = format[0];
    switch (type) {
    case ELEMENT_U32:
        return itemsize == 4 && (code == 'I' || (code == 'L' && sizeof(unsigned long) == 4));
    case ELEMENT_U64:
        return itemsize == 8 && (code == 'Q' || (code == 'L' && sizeof(unsigned long) == 8));
    case ELEMENT_F32:
        return itemsize == 4 && code == 'f';
    }
    return false;
}

/* Takes a C-contiguous buffer of type from object; names the argument in the error. */
static bool get_buffer(PyObject *object, const char *argument, element_type type, bool writable,
                       Py_buffer *view)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s buffer of %s, got %.100s",
                     argument, writable ? " writable" : "", element_type_name(type),
                     Py_TYPE(object)->tp_name);
        return false;
    }
    if (!format_matches(view->format, view->itemsize, type)) {
        PyErr_Format(PyExc_TypeError, "%s: expected elements of %s, got format '%s' of %zd bytes",
                     argument, element_type_name(type), view->format ? view->format : "B",
                     view->itemsize);
        PyBuffer_Release(view);
        return false;
    }
    return true;
}

static uint64_t buffer_count(const Py_buffer *view)
{
    return (uint64_t)(view->len / view->itemsize);
}

/* The CSR batch over an offsets and a keys buffer; rows = offsets - 1. */
static bool batch_from_buffers(const Py_buffer *offsets, const Py_buffer *keys, em_csr *batch)
{
    uint64_t offset_count = buffer_count(offsets);
    if (offset_count == 0 || offset_count - 1 > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "offsets: expected 1 to 2^32 entries, got %llu",
                     (unsigned long long)offset_count);
        return false;
    }
    batch->rows = (uint32_t)(offset_count - 1);
    batch->nnz = buffer_count(keys);
    batch->offsets = offsets->buf;
    batch->keys = keys->buf;
    return true;
}

/* ---- Client ----------------------------------------------------------------------- */

typedef struct client_object {
    PyObject_HEAD
    em_client *client;
    PyThread_type_lock lock;
} client_object;

/* Runs the expression with the GIL released and the client's lock held. */
#define WITH_CLIENT(self, expression)                                                          \
    do {                                                                                       \
        Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock((self)->lock, WAIT_LOCK);                \
        expression;                                                                            \
        PyThread_release_lock((self)->lock);                                                   \
        Py_END_ALLOW_THREADS                                                                   \
    } while (0)

static bool client_open(client_object *self)
{
    if (self->client == NULL) {
        PyErr_SetString(PyExc_ValueError, "the client is closed");
        return false;
    }
    return true;
}

static int client_init(client_object *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"servers", "token", "timeout_ms", "connect_timeout_ms", "window",
                               "reconnect_attempts", "tls_ca_file", "tls_cert_file",
                               "tls_key_file", "tls_server_name", NULL};
    em_client_options options;
    em_client_options_init(&options);
    unsigned int timeout_ms = options.timeout_ms, connect_timeout_ms = options.connect_timeout_ms;
    unsigned int window = options.window, reconnect_attempts = options.reconnect_attempts;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|zIIIIzzzz", keywords, &options.servers,
                                     &options.token, &timeout_ms, &connect_timeout_ms, &window,
                                     &reconnect_attempts, &options.tls_ca_file,
                                     &options.tls_cert_file, &options.tls_key_file,
                                     &options.tls_server_name))
        return -1;
    options.timeout_ms = timeout_ms;
    options.connect_timeout_ms = connect_timeout_ms;
    options.window = window;
    options.reconnect_attempts = reconnect_attempts;
    if (self->lock == NULL && (self->lock = PyThread_allocate_lock()) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (self->client != NULL) {
        em_client_destroy(self->client);
        self->client = NULL;
    }
    em_error err = {0};
    em_status status;
    em_client *created = NULL;
    Py_BEGIN_ALLOW_THREADS status = em_client_create(&options, &created, &err);
    Py_END_ALLOW_THREADS
    if (status != EM_OK) {
        raise_error(&err);
        return -1;
    }
    self->client = created;
    return 0;
}

static void client_close_now(client_object *self)
{
    if (self->client != NULL) {
        em_client *client = self->client;
        self->client = NULL;
        WITH_CLIENT(self, em_client_destroy(client));
    }
}

static void client_dealloc(client_object *self)
{
    client_close_now(self);
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *client_close(client_object *self, PyObject *unused)
{
    (void)unused;
    client_close_now(self);
    Py_RETURN_NONE;
}

static PyObject *client_server_count(client_object *self, PyObject *unused)
{
    (void)unused;
    if (!client_open(self))
        return NULL;
    return PyLong_FromUnsignedLong(em_client_server_count(self->client));
}

/* ---- Call (pipelined pull or push) ------------------------------------------------- */

typedef enum call_kind { CALL_PULL, CALL_PUSH } call_kind;

typedef struct call_object {
    PyObject_HEAD
    client_object *owner; /* strong reference until finished */
    em_client_call *call;
    call_kind kind;
    Py_buffer offsets, keys, data; /* data: the answer (pull) or the gradients (push) */
    bool finished;
    em_status status;
    em_error err;
    em_client_pull_result pull_result;
    em_client_push_result push_result;
} call_object;

static PyTypeObject call_type;

static void call_release_buffers(call_object *self)
{
    PyBuffer_Release(&self->offsets);
    PyBuffer_Release(&self->keys);
    PyBuffer_Release(&self->data);
}

/* Waits for the answer (GIL released) and releases the buffers; idempotent. */
static void call_wait(call_object *self)
{
    if (self->finished)
        return;
    void *result = self->kind == CALL_PULL ? (void *)&self->pull_result : (void *)&self->push_result;
    client_object *owner = self->owner;
    em_client_call *call = self->call;
    em_status status = EM_OK;
    if (owner->client == NULL) {
        /* closed while this call was in flight: the client dropped it already */
        em_error_set(&self->err, EM_CANCELLED, "the client was closed before the call finished");
        status = EM_CANCELLED;
    } else {
        WITH_CLIENT(owner, status = em_client_finish(owner->client, call, result, &self->err));
    }
    self->status = status;
    self->finished = true;
    self->call = NULL;
    call_release_buffers(self);
    Py_CLEAR(self->owner);
}

static PyObject *pull_result_tuple(const em_client_pull_result *result)
{
    return Py_BuildValue("(IKKK)", result->dim, (unsigned long long)result->unique_keys,
                         (unsigned long long)result->missing, (unsigned long long)result->created);
}

static PyObject *push_result_tuple(const em_client_push_result *result)
{
    return Py_BuildValue("(KK)", (unsigned long long)result->updated,
                         (unsigned long long)result->created);
}

static PyObject *call_finish(call_object *self, PyObject *unused)
{
    (void)unused;
    call_wait(self);
    if (self->status != EM_OK)
        return raise_error(&self->err);
    return self->kind == CALL_PULL ? pull_result_tuple(&self->pull_result)
                                   : push_result_tuple(&self->push_result);
}

static PyObject *call_done(call_object *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->finished);
}

static void call_dealloc(call_object *self)
{
    if (self->owner != NULL && !self->finished)
        call_wait(self);
    call_release_buffers(self);
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef call_methods[] = {
    {"finish", (PyCFunction)call_finish, METH_NOARGS,
     "Waits for the answer; returns the result tuple or raises ember.Error."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef call_getset[] = {
    {"finished", (getter)call_done, NULL, "whether finish() has run", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject call_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ember._ember.Call",
    .tp_basicsize = sizeof(call_object),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pipelined pull or push in flight.",
    .tp_dealloc = (destructor)call_dealloc,
    .tp_methods = call_methods,
    .tp_getset = call_getset,
};

/* ---- pull and push ------------------------------------------------------------------ */

/* Parses (table, offsets, keys, data, combiner[, create_missing]) into a call object
 * holding the buffers; pull: data is the writable answer. */
static call_object *call_prepare(client_object *self, call_kind kind, PyObject *args,
                                 const char **table, int *combiner, int *create_missing)
{
    PyObject *offsets, *keys, *data;
    if (!client_open(self))
        return NULL;
    if (kind == CALL_PULL) {
        if (!PyArg_ParseTuple(args, "sOOOip", table, &offsets, &keys, &data, combiner,
                              create_missing))
            return NULL;
    } else if (!PyArg_ParseTuple(args, "sOOOi", table, &offsets, &keys, &data, combiner)) {
        return NULL;
    }
    call_object *call = PyObject_New(call_object, &call_type);
    if (call == NULL)
        return NULL;
    call->owner = NULL;
    call->call = NULL;
    call->kind = kind;
    call->finished = true; /* nothing to wait for until a call is started */
    call->status = EM_OK;
    memset(&call->err, 0, sizeof(call->err));
    memset(&call->offsets, 0, sizeof(Py_buffer));
    memset(&call->keys, 0, sizeof(Py_buffer));
    memset(&call->data, 0, sizeof(Py_buffer));
    bool ok = get_buffer(offsets, "offsets", ELEMENT_U32, false, &call->offsets) &&
              get_buffer(keys, "keys", ELEMENT_U64, false, &call->keys) &&
              get_buffer(data, kind == CALL_PULL ? "out" : "grads", ELEMENT_F32, kind == CALL_PULL,
                         &call->data);
    if (!ok) {
        Py_DECREF(call);
        return NULL;
    }
    return call;
}

static call_object *call_start(client_object *self, call_kind kind, PyObject *args)
{
    const char *table;
    int combiner = 0, create_missing = 1;
    call_object *call = call_prepare(self, kind, args, &table, &combiner, &create_missing);
    if (call == NULL)
        return NULL;
    em_csr batch;
    if (!batch_from_buffers(&call->offsets, &call->keys, &batch)) {
        Py_DECREF(call);
        return NULL;
    }
    em_error err = {0};
    em_status status;
    em_client_call *started = NULL;
    if (kind == CALL_PULL) {
        em_client_pull_args pull = {table, batch, (em_combiner)combiner, create_missing != 0,
                                    call->data.buf, buffer_count(&call->data)};
        WITH_CLIENT(self, status = em_client_pull_start(self->client, &pull, &started, &err));
    } else {
        em_client_push_args push = {table, batch, (em_combiner)combiner, call->data.buf,
                                    buffer_count(&call->data)};
        WITH_CLIENT(self, status = em_client_push_start(self->client, &push, &started, &err));
    }
    if (status != EM_OK) {
        Py_DECREF(call);
        raise_error(&err);
        return NULL;
    }
    Py_INCREF(self);
    call->owner = self;
    call->call = started;
    call->finished = false;
    return call;
}

static PyObject *client_pull_start(client_object *self, PyObject *args)
{
    return (PyObject *)call_start(self, CALL_PULL, args);
}

static PyObject *client_push_start(client_object *self, PyObject *args)
{
    return (PyObject *)call_start(self, CALL_PUSH, args);
}

static PyObject *client_pull(client_object *self, PyObject *args)
{
    call_object *call = call_start(self, CALL_PULL, args);
    if (call == NULL)
        return NULL;
    PyObject *result = call_finish(call, NULL);
    Py_DECREF(call);
    return result;
}

static PyObject *client_push(client_object *self, PyObject *args)
{
    call_object *call = call_start(self, CALL_PUSH, args);
    if (call == NULL)
        return NULL;
    PyObject *result = call_finish(call, NULL);
    Py_DECREF(call);
    return result;
}

/* ---- health and admin ---------------------------------------------------------------- */

/* Returns the JSON text of value (NULL: None) and frees value. */
static PyObject *json_text(cJSON *value)
{
    if (value == NULL)
        Py_RETURN_NONE;
    char *text = cJSON_PrintUnformatted(value);
    cJSON_Delete(value);
    if (text == NULL)
        return PyErr_NoMemory();
    PyObject *result = PyUnicode_FromString(text);
    cJSON_free(text);
    return result;
}

static PyObject *client_ping(client_object *self, PyObject *unused)
{
    (void)unused;
    if (!client_open(self))
        return NULL;
    char version[64] = "";
    uint64_t uptime_ms = 0;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_ping(self->client, version, sizeof(version), &uptime_ms,
                                              &err));
    if (status != EM_OK)
        return raise_error(&err);
    return Py_BuildValue("(sK)", version, (unsigned long long)uptime_ms);
}

static PyObject *client_health(client_object *self, PyObject *unused)
{
    (void)unused;
    if (!client_open(self))
        return NULL;
    em_client_health health;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_health_check(self->client, &health, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return Py_BuildValue("{s:O,s:s,s:s,s:I,s:I}", "ready", health.ready ? Py_True : Py_False,
                         "state", health.state, "backend", health.backend, "devices",
                         health.devices, "tables", health.tables);
}

static PyObject *client_create_table(client_object *self, PyObject *args)
{
    const char *config;
    if (!client_open(self) || !PyArg_ParseTuple(args, "s", &config))
        return NULL;
    cJSON *info = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_create_table(self->client, config, &info, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(info);
}

static PyObject *client_drop_table(client_object *self, PyObject *args)
{
    const char *table;
    if (!client_open(self) || !PyArg_ParseTuple(args, "s", &table))
        return NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_drop_table(self->client, table, &err));
    if (status != EM_OK)
        return raise_error(&err);
    Py_RETURN_NONE;
}

static PyObject *client_list_tables(client_object *self, PyObject *unused)
{
    (void)unused;
    if (!client_open(self))
        return NULL;
    cJSON *tables = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_list_tables(self->client, &tables, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(tables);
}

static PyObject *client_stats(client_object *self, PyObject *args)
{
    const char *table = NULL;
    if (!client_open(self) || !PyArg_ParseTuple(args, "|z", &table))
        return NULL;
    cJSON *stats = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_stats(self->client, table, &stats, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(stats);
}

static PyObject *client_save(client_object *self, PyObject *args)
{
    const char *table = NULL;
    int delta = 0;
    if (!client_open(self) || !PyArg_ParseTuple(args, "|zp", &table, &delta))
        return NULL;
    cJSON *saved = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_save(self->client, table, delta != 0, &saved, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(saved);
}

static PyObject *client_checkpoints(client_object *self, PyObject *args)
{
    const char *table = NULL;
    if (!client_open(self) || !PyArg_ParseTuple(args, "|z", &table))
        return NULL;
    cJSON *listed = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_checkpoints(self->client, table, &listed, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(listed);
}

static PyObject *client_load(client_object *self, PyObject *args)
{
    const char *table, *path = NULL;
    int weights_only = 0;
    if (!client_open(self) || !PyArg_ParseTuple(args, "s|zp", &table, &path, &weights_only))
        return NULL;
    cJSON *loaded = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_load(self->client, table, path, weights_only != 0,
                                              &loaded, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(loaded);
}

static PyObject *client_cluster_save(client_object *self, PyObject *args)
{
    const char *dir, *table = NULL;
    if (!client_open(self) || !PyArg_ParseTuple(args, "s|z", &dir, &table))
        return NULL;
    cJSON *record = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_cluster_save(self->client, table, dir, &record, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(record);
}

static PyObject *client_cluster_load(client_object *self, PyObject *args)
{
    const char *dir, *table = NULL;
    unsigned int shards = 0;
    if (!client_open(self) || !PyArg_ParseTuple(args, "s|zI", &dir, &table, &shards))
        return NULL;
    cJSON *loaded = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_cluster_load(self->client, dir, table, shards, &loaded,
                                                      &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(loaded);
}

static PyObject *client_erase(client_object *self, PyObject *args)
{
    const char *table;
    PyObject *keys;
    if (!client_open(self) || !PyArg_ParseTuple(args, "sO", &table, &keys))
        return NULL;
    Py_buffer view;
    if (!get_buffer(keys, "keys", ELEMENT_U64, false, &view))
        return NULL;
    uint64_t erased = 0;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_erase(self->client, table, view.buf, buffer_count(&view),
                                               &erased, &err));
    PyBuffer_Release(&view);
    if (status != EM_OK)
        return raise_error(&err);
    return PyLong_FromUnsignedLongLong(erased);
}

static PyObject *client_erase_older(client_object *self, PyObject *args)
{
    const char *table;
    unsigned int steps;
    if (!client_open(self) || !PyArg_ParseTuple(args, "sI", &table, &steps))
        return NULL;
    uint64_t erased = 0;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_erase_older(self->client, table, steps, &erased, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return PyLong_FromUnsignedLongLong(erased);
}

static PyObject *client_erase_before(client_object *self, PyObject *args)
{
    const char *table;
    unsigned long long since_unix_ms;
    if (!client_open(self) || !PyArg_ParseTuple(args, "sK", &table, &since_unix_ms))
        return NULL;
    uint64_t erased = 0;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_erase_before(self->client, table, since_unix_ms, &erased,
                                                      &err));
    if (status != EM_OK)
        return raise_error(&err);
    return PyLong_FromUnsignedLongLong(erased);
}

static PyObject *client_evicted(client_object *self, PyObject *args)
{
    const char *table;
    unsigned long long after = 0;
    unsigned int max = 0;
    if (!client_open(self) || !PyArg_ParseTuple(args, "s|KI", &table, &after, &max))
        return NULL;
    cJSON *evicted = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_evicted(self->client, table, after, max, &evicted, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(evicted);
}

static PyObject *client_drain(client_object *self, PyObject *unused)
{
    (void)unused;
    if (!client_open(self))
        return NULL;
    em_client_drain_state state;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_drain(self->client, &state, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return Py_BuildValue("{s:O,s:K,s:I}", "was_drained", state.was_drained ? Py_True : Py_False,
                         "requests_running", (unsigned long long)state.requests_running,
                         "data_connections", state.data_connections);
}

static PyObject *client_undrain(client_object *self, PyObject *unused)
{
    (void)unused;
    if (!client_open(self))
        return NULL;
    bool was_drained = false;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_undrain(self->client, &was_drained, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return PyBool_FromLong(was_drained);
}

static PyObject *client_reload(client_object *self, PyObject *unused)
{
    (void)unused;
    if (!client_open(self))
        return NULL;
    cJSON *report = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_reload(self->client, &report, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(report);
}

static PyObject *client_slowlog(client_object *self, PyObject *args)
{
    unsigned int max = 0;
    int reset = 0;
    if (!client_open(self) || !PyArg_ParseTuple(args, "|Ip", &max, &reset))
        return NULL;
    cJSON *log = NULL;
    em_error err = {0};
    em_status status;
    WITH_CLIENT(self, status = em_client_slowlog(self->client, max, reset != 0, &log, &err));
    if (status != EM_OK)
        return raise_error(&err);
    return json_text(log);
}

static PyMethodDef client_methods[] = {
    {"close", (PyCFunction)client_close, METH_NOARGS, "Closes the connections."},
    {"server_count", (PyCFunction)client_server_count, METH_NOARGS, "Servers in the list."},
    {"pull", (PyCFunction)client_pull, METH_VARARGS,
     "pull(table, offsets, keys, out, combiner, create_missing) -> (dim, unique, missing, "
     "created)"},
    {"push", (PyCFunction)client_push, METH_VARARGS,
     "push(table, offsets, keys, grads, combiner) -> (updated, created)"},
    {"pull_start", (PyCFunction)client_pull_start, METH_VARARGS, "pull, pipelined: a Call"},
    {"push_start", (PyCFunction)client_push_start, METH_VARARGS, "push, pipelined: a Call"},
    {"ping", (PyCFunction)client_ping, METH_NOARGS, "ping() -> (version, uptime_ms)"},
    {"health", (PyCFunction)client_health, METH_NOARGS, "health() -> dict"},
    {"create_table", (PyCFunction)client_create_table, METH_VARARGS,
     "create_table(config_json) -> JSON text"},
    {"drop_table", (PyCFunction)client_drop_table, METH_VARARGS, "drop_table(name)"},
    {"list_tables", (PyCFunction)client_list_tables, METH_NOARGS, "-> JSON text"},
    {"stats", (PyCFunction)client_stats, METH_VARARGS, "stats([table]) -> JSON text"},
    {"save", (PyCFunction)client_save, METH_VARARGS, "save([table]) -> JSON text"},
    {"checkpoints", (PyCFunction)client_checkpoints, METH_VARARGS,
     "checkpoints([table]) -> JSON text"},
    {"load", (PyCFunction)client_load, METH_VARARGS,
     "load(table[, path[, weights_only]]) -> JSON text"},
    {"cluster_save", (PyCFunction)client_cluster_save, METH_VARARGS,
     "cluster_save(dir[, table]) -> JSON text"},
    {"cluster_load", (PyCFunction)client_cluster_load, METH_VARARGS,
     "cluster_load(dir[, table[, shards]]) -> JSON text"},
    {"erase", (PyCFunction)client_erase, METH_VARARGS, "erase(table, keys) -> erased"},
    {"erase_older", (PyCFunction)client_erase_older, METH_VARARGS,
     "erase_older(table, steps) -> erased"},
    {"erase_before", (PyCFunction)client_erase_before, METH_VARARGS,
     "erase_before(table, since_unix_ms) -> erased"},
    {"evicted", (PyCFunction)client_evicted, METH_VARARGS,
     "evicted(table[, after[, max]]) -> JSON text"},
    {"drain", (PyCFunction)client_drain, METH_NOARGS, "-> dict"},
    {"undrain", (PyCFunction)client_undrain, METH_NOARGS, "-> was_drained"},
    {"reload", (PyCFunction)client_reload, METH_NOARGS, "-> JSON text"},
    {"slowlog", (PyCFunction)client_slowlog, METH_VARARGS, "slowlog([max[, reset]]) -> JSON"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject client_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ember._ember.Client",
    .tp_basicsize = sizeof(client_object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A connection to one emberd or a list of them (libember-client).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)client_init,
    .tp_dealloc = (destructor)client_dealloc,
    .tp_methods = client_methods,
};

/* ---- module ------------------------------------------------------------------------- */

static struct PyModuleDef ember_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ember._ember",
    .m_doc = "libember-client and the HugeCTR dataset readers, for the ember package.",
    .m_size = -1,
    .m_methods = em_hugectr_methods,
};

static bool add_type(PyObject *module, PyTypeObject *type, const char *name)
{
    if (PyType_Ready(type) != 0)
        return false;
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) != 0) {
        Py_DECREF(type);
        return false;
    }
    return true;
}

PyMODINIT_FUNC PyInit__ember(void);

PyMODINIT_FUNC PyInit__ember(void)
{
    PyObject *module = PyModule_Create(&ember_module);
    if (module == NULL)
        return NULL;
    ember_error_type = PyErr_NewExceptionWithDoc(
        "ember.Error", "An error from emberd or the client: .status names it ('NOT_FOUND'), "
                       ".message explains it.",
        NULL, NULL);
    if (ember_error_type == NULL || PyModule_AddObject(module, "Error", ember_error_type) != 0 ||
        !add_type(module, &client_type, "Client") || !add_type(module, &call_type, "Call") ||
        !em_hugectr_module_init(module, ember_error_type)) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(ember_error_type); /* the module holds one reference, this file another */
    return module;
}
