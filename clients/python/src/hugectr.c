/*
 * DESIGN: HugeCTR's Norm and Raw dataset files, read into CSR batches per slot.
 *
 * Norm file: a 64-byte header of eight little-endian int64 (error_check 0 or 1,
 * number_of_records, label_dim, dense_dim, slot_num, three reserved), then
 * number_of_records samples, each: float label[label_dim], float dense[dense_dim], and per
 * slot an int32 nnz followed by nnz keys (uint32 or uint64: the file does not say which,
 * the reader is told). With error_check 1 (checksum mode) each sample is framed as an
 * int32 length (the bytes of the fields), the fields, and one check byte: the sum of
 * the fields' bytes modulo 256.
 *
 * Raw file: no header; samples of label_dim + dense_dim + slot_num 4-byte values: label
 * and dense as int32 (or float32 when told), then one uint32 key per slot (one-hot).
 *
 * A file is mapped read-only and walked with every length checked against its end, so
 * a damaged file is refused with an error naming the file, the sample and the field,
 * never read past. A batch comes out slot-major (TorchRec's KeyedJaggedTensor order):
 * lengths[slot][sample] and the keys of slot 0's samples, then slot 1's, and so on; the
 * batch is parsed and checked whole before any key is copied, in two passes over the
 * mapped samples.
 */
#include "clients/python/src/hugectr_module.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define NORM_HEADER_BYTES 64
/* Dimensions beyond these are taken as damage, not data: no dataset has more. */
#define MAX_LABEL_DIM 4096
#define MAX_DENSE_DIM (1 << 20)
#define MAX_SLOTS (1 << 16)

static PyObject *dataset_error_type;

static PyObject *raise_data_loss(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    PyObject *text = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (text == NULL)
        return NULL;
    PyObject *instance = PyObject_CallFunctionObjArgs(dataset_error_type, text, NULL);
    if (instance != NULL) {
        PyObject *status = PyUnicode_FromString("DATA_LOSS");
        if (status != NULL) {
            PyObject_SetAttrString(instance, "status", status);
            PyObject_SetAttrString(instance, "message", text);
            PyErr_SetObject(dataset_error_type, instance);
            Py_DECREF(status);
        }
        Py_DECREF(instance);
    }
    Py_DECREF(text);
    return NULL;
}

/* ---- a mapped file ------------------------------------------------------------------ */

typedef struct mapped_file {
    char *path;
    const uint8_t *bytes;
    size_t size;
} mapped_file;

static bool mapped_file_open(mapped_file *file, const char *path)
{
    file->path = strdup(path);
    file->bytes = NULL;
    file->size = 0;
    if (file->path == NULL) {
        PyErr_NoMemory();
        return false;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        return false;
    }
    struct stat info;
    if (fstat(fd, &info) != 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
        close(fd);
        return false;
    }
    file->size = (size_t)info.st_size;
    if (file->size > 0) {
        void *mapped = mmap(NULL, file->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (mapped == MAP_FAILED) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
            close(fd);
            return false;
        }
        madvise(mapped, file->size, MADV_SEQUENTIAL);
        file->bytes = mapped;
    }
    close(fd);
    return true;
}

static void mapped_file_close(mapped_file *file)
{
    if (file->bytes != NULL)
        munmap((void *)file->bytes, file->size);
    file->bytes = NULL;
    free(file->path);
    file->path = NULL;
}

static int64_t read_i64(const uint8_t *at)
{
    int64_t value;
    memcpy(&value, at, sizeof(value));
    return value;
}

static int32_t read_i32(const uint8_t *at)
{
    int32_t value;
    memcpy(&value, at, sizeof(value));
    return value;
}

/* ---- batch output --------------------------------------------------------------------- */

/* The arrays of one batch, as bytearrays the Python side views with numpy. */
typedef struct batch_out {
    PyObject *labels, *dense, *lengths, *keys;
    float *label_data, *dense_data;
    uint32_t *length_data;
    uint64_t *key_data;
} batch_out;

static PyObject *new_bytes(size_t size, void **data)
{
    PyObject *array = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (array != NULL)
        *data = PyByteArray_AS_STRING(array);
    return array;
}

static bool batch_out_create(batch_out *out, size_t count, size_t label_dim, size_t dense_dim,
                             size_t slot_num)
{
    memset(out, 0, sizeof(*out));
    out->labels = new_bytes(count * label_dim * sizeof(float), (void **)&out->label_data);
    out->dense = new_bytes(count * dense_dim * sizeof(float), (void **)&out->dense_data);
    out->lengths = new_bytes(count * slot_num * sizeof(uint32_t), (void **)&out->length_data);
    return out->labels != NULL && out->dense != NULL && out->lengths != NULL;
}

static bool batch_out_keys(batch_out *out, size_t nnz)
{
    out->keys = new_bytes(nnz * sizeof(uint64_t), (void **)&out->key_data);
    return out->keys != NULL;
}

static void batch_out_clear(batch_out *out)
{
    Py_CLEAR(out->labels);
    Py_CLEAR(out->dense);
    Py_CLEAR(out->lengths);
    Py_CLEAR(out->keys);
}

/* (count, labels, dense, lengths, keys); steals the arrays. */
static PyObject *batch_out_tuple(batch_out *out, size_t count)
{
    PyObject *result = Py_BuildValue("(nNNNN)", (Py_ssize_t)count, out->labels, out->dense,
                                     out->lengths, out->keys);
    if (result == NULL)
        batch_out_clear(out);
    memset(out, 0, sizeof(*out));
    return result;
}

/* ---- NormFile ------------------------------------------------------------------------ */

typedef struct norm_file {
    PyObject_HEAD
    mapped_file file;
    bool checksum;
    uint32_t key_bytes;
    uint64_t records, label_dim, dense_dim, slot_num;
    uint64_t next_sample; /* index of the next sample to read */
    size_t position;      /* its byte offset */
} norm_file;

static bool norm_check_header(norm_file *self)
{
    const char *path = self->file.path;
    if (self->file.size < NORM_HEADER_BYTES) {
        raise_data_loss("%s: header: the file has %zu bytes, a Norm header takes %d", path,
                        self->file.size, NORM_HEADER_BYTES);
        return false;
    }
    const uint8_t *header = self->file.bytes;
    int64_t error_check = read_i64(header), records = read_i64(header + 8);
    int64_t label_dim = read_i64(header + 16), dense_dim = read_i64(header + 24);
    int64_t slot_num = read_i64(header + 32);
    if (error_check != 0 && error_check != 1) {
        raise_data_loss("%s: header: error_check is %lld, expected 0 (none) or 1 (checksum)", path,
                        (long long)error_check);
        return false;
    }
    if (records < 0) {
        raise_data_loss("%s: header: number_of_records is %lld", path, (long long)records);
        return false;
    }
    struct {
        const char *name;
        int64_t value, max;
    } dims[] = {{"label_dim", label_dim, MAX_LABEL_DIM},
                {"dense_dim", dense_dim, MAX_DENSE_DIM},
                {"slot_num", slot_num, MAX_SLOTS}};
    for (size_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++) {
        if (dims[i].value < 0 || dims[i].value > dims[i].max) {
            raise_data_loss("%s: header: %s is %lld, outside 0..%lld", path, dims[i].name,
                            (long long)dims[i].value, (long long)dims[i].max);
            return false;
        }
    }
    self->checksum = error_check == 1;
    self->records = (uint64_t)records;
    self->label_dim = (uint64_t)label_dim;
    self->dense_dim = (uint64_t)dense_dim;
    self->slot_num = (uint64_t)slot_num;
    self->next_sample = 0;
    self->position = NORM_HEADER_BYTES;
    return true;
}

static int norm_init(norm_file *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"path", "key_bytes", NULL};
    const char *path;
    unsigned int key_bytes = 4;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|I", keywords, &path, &key_bytes))
        return -1;
    if (key_bytes != 4 && key_bytes != 8) {
        PyErr_Format(PyExc_ValueError, "key_bytes: expected 4 (uint32) or 8 (uint64), got %u",
                     key_bytes);
        return -1;
    }
    mapped_file_close(&self->file);
    self->key_bytes = key_bytes;
    if (!mapped_file_open(&self->file, path) || !norm_check_header(self))
        return -1;
    return 0;
}

static void norm_dealloc(norm_file *self)
{
    mapped_file_close(&self->file);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* One sample's fields: where they start and end in the file. */
typedef struct sample_span {
    size_t start, end;
} sample_span;

/* Finds the fields of the sample at *position (checking the checksum framing), and
 * advances *position past it. */
static bool norm_frame_sample(const norm_file *self, uint64_t sample, size_t *position,
                              sample_span *span)
{
    const mapped_file *file = &self->file;
    size_t at = *position;
    if (!self->checksum) {
        span->start = at;
        span->end = file->size; /* the fields find their own end */
        return true;
    }
    if (file->size - at < 4) {
        raise_data_loss("%s: sample %llu: length: the file ends at byte %zu", file->path,
                        (unsigned long long)sample, file->size);
        return false;
    }
    int32_t length = read_i32(file->bytes + at);
    if (length < 0 || (size_t)length + 5 > file->size - at) {
        raise_data_loss("%s: sample %llu: length: %d bytes (and the check byte) from byte %zu run "
                        "past the end of the file at %zu",
                        file->path, (unsigned long long)sample, length, at + 4, file->size);
        return false;
    }
    span->start = at + 4;
    span->end = span->start + (size_t)length;
    uint8_t sum = 0;
    for (size_t i = span->start; i < span->end; i++)
        sum = (uint8_t)(sum + file->bytes[i]);
    uint8_t check = file->bytes[span->end];
    if (sum != check) {
        raise_data_loss("%s: sample %llu: checkbits: the sample's bytes sum to %u (mod 256), its "
                        "check byte says %u",
                        file->path, (unsigned long long)sample, sum, check);
        return false;
    }
    *position = span->end + 1;
    return true;
}

/* Walks one sample's fields within span: records nnz per slot (lengths[slot * count +
 * index]), labels and dense, and returns the byte after the last field. */
static bool norm_parse_sample(const norm_file *self, uint64_t sample, const sample_span *span,
                              size_t index, size_t count, batch_out *out, uint64_t *nnz_total,
                              size_t *fields_end)
{
    const mapped_file *file = &self->file;
    size_t at = span->start;
    size_t fixed = (size_t)(self->label_dim + self->dense_dim) * sizeof(float);
    if (span->end - at < fixed) {
        raise_data_loss("%s: sample %llu: label and dense: %zu bytes from byte %zu run past the "
                        "%s at %zu",
                        file->path, (unsigned long long)sample, fixed, at,
                        self->checksum ? "sample's length" : "end of the file", span->end);
        return false;
    }
    memcpy(out->label_data + index * self->label_dim, file->bytes + at,
           self->label_dim * sizeof(float));
    memcpy(out->dense_data + index * self->dense_dim, file->bytes + at + self->label_dim * 4,
           self->dense_dim * sizeof(float));
    at += fixed;
    for (uint64_t slot = 0; slot < self->slot_num; slot++) {
        if (span->end - at < 4) {
            raise_data_loss("%s: sample %llu: slot %llu: nnz: runs past the %s at %zu", file->path,
                            (unsigned long long)sample, (unsigned long long)slot,
                            self->checksum ? "sample's length" : "end of the file", span->end);
            return false;
        }
        int32_t nnz = read_i32(file->bytes + at);
        at += 4;
        if (nnz < 0 || (uint64_t)nnz * self->key_bytes > span->end - at) {
            raise_data_loss("%s: sample %llu: slot %llu: nnz %d: its keys (%u bytes each) from "
                            "byte %zu run past the %s at %zu",
                            file->path, (unsigned long long)sample, (unsigned long long)slot, nnz,
                            self->key_bytes, at,
                            self->checksum ? "sample's length" : "end of the file", span->end);
            return false;
        }
        out->length_data[slot * count + index] = (uint32_t)nnz;
        *nnz_total += (uint64_t)nnz;
        at += (size_t)nnz * self->key_bytes;
    }
    if (self->checksum && at != span->end) {
        raise_data_loss("%s: sample %llu: length: %zu bytes, but its fields take %zu", file->path,
                        (unsigned long long)sample, span->end - span->start, at - span->start);
        return false;
    }
    *fields_end = at;
    return true;
}

/* Copies the keys of a sample whose fields begin at start (already checked). */
static void norm_copy_keys(const norm_file *self, size_t start, size_t index, size_t count,
                           const batch_out *out, uint64_t *slot_cursor)
{
    const uint8_t *at = self->file.bytes + start + (self->label_dim + self->dense_dim) * 4;
    for (uint64_t slot = 0; slot < self->slot_num; slot++) {
        uint32_t nnz = out->length_data[slot * count + index];
        at += 4;
        uint64_t *target = out->key_data + slot_cursor[slot];
        if (self->key_bytes == 8) {
            memcpy(target, at, (size_t)nnz * 8);
        } else {
            for (uint32_t k = 0; k < nnz; k++) {
                uint32_t key;
                memcpy(&key, at + (size_t)k * 4, 4);
                target[k] = key;
            }
        }
        at += (size_t)nnz * self->key_bytes;
        slot_cursor[slot] += nnz;
    }
}

static PyObject *norm_read(norm_file *self, PyObject *args)
{
    Py_ssize_t max_samples;
    if (!PyArg_ParseTuple(args, "n", &max_samples))
        return NULL;
    if (max_samples <= 0)
        return PyErr_Format(PyExc_ValueError, "batch_size: expected a positive count, got %zd",
                            max_samples);
    uint64_t left = self->records - self->next_sample;
    size_t count = (size_t)((uint64_t)max_samples < left ? (uint64_t)max_samples : left);
    batch_out out;
    size_t *starts = PyMem_Malloc((count + 1) * sizeof(size_t));
    uint64_t *slot_cursor = PyMem_Calloc(self->slot_num + 1, sizeof(uint64_t));
    if (starts == NULL || slot_cursor == NULL ||
        !batch_out_create(&out, count, self->label_dim, self->dense_dim, self->slot_num)) {
        PyMem_Free(starts);
        PyMem_Free(slot_cursor);
        batch_out_clear(&out);
        return PyErr_NoMemory();
    }
    size_t position = self->position;
    uint64_t nnz_total = 0;
    bool ok = true;
    for (size_t i = 0; ok && i < count; i++) {
        uint64_t sample = self->next_sample + i;
        sample_span span = {position, position};
        size_t fields_end = 0;
        ok = norm_frame_sample(self, sample, &position, &span) &&
             norm_parse_sample(self, sample, &span, i, count, &out, &nnz_total, &fields_end);
        starts[i] = span.start;
        if (ok && !self->checksum)
            position = fields_end;
    }
    if (ok && self->next_sample + count == self->records && position != self->file.size) {
        raise_data_loss("%s: %zu bytes follow the last of the header's %llu samples (from byte %zu)",
                        self->file.path, self->file.size - position,
                        (unsigned long long)self->records, position);
        ok = false;
    }
    ok = ok && batch_out_keys(&out, nnz_total);
    if (ok) {
        uint64_t begin = 0;
        for (uint64_t slot = 0; slot < self->slot_num; slot++) {
            slot_cursor[slot] = begin;
            for (size_t i = 0; i < count; i++)
                begin += out.length_data[slot * count + i];
        }
        for (size_t i = 0; i < count; i++)
            norm_copy_keys(self, starts[i], i, count, &out, slot_cursor);
        self->next_sample += count;
        self->position = position;
    }
    PyMem_Free(starts);
    PyMem_Free(slot_cursor);
    if (!ok) {
        batch_out_clear(&out);
        return NULL;
    }
    return batch_out_tuple(&out, count);
}

static PyObject *norm_rewind(norm_file *self, PyObject *unused)
{
    (void)unused;
    self->next_sample = 0;
    self->position = NORM_HEADER_BYTES;
    Py_RETURN_NONE;
}

static PyMethodDef norm_methods[] = {
    {"read", (PyCFunction)norm_read, METH_VARARGS,
     "read(max_samples) -> (count, labels, dense, lengths, keys) as bytearrays: float32 "
     "labels [count, label_dim], float32 dense [count, dense_dim], uint32 lengths [slot_num, "
     "count], uint64 keys slot-major; count 0 at the end"},
    {"rewind", (PyCFunction)norm_rewind, METH_NOARGS, "Back to the first sample."},
    {NULL, NULL, 0, NULL},
};

static PyObject *norm_get_header(norm_file *self, void *closure)
{
    (void)closure;
    return Py_BuildValue("{s:O,s:K,s:K,s:K,s:K}", "checksum", self->checksum ? Py_True : Py_False,
                         "records", (unsigned long long)self->records, "label_dim",
                         (unsigned long long)self->label_dim, "dense_dim",
                         (unsigned long long)self->dense_dim, "slot_num",
                         (unsigned long long)self->slot_num);
}

static PyObject *norm_get_next(norm_file *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->next_sample);
}

static PyGetSetDef norm_getset[] = {
    {"header", (getter)norm_get_header, NULL, "the header's fields", NULL},
    {"next_sample", (getter)norm_get_next, NULL, "index of the next sample read", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject norm_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ember._ember.NormFile",
    .tp_basicsize = sizeof(norm_file),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NormFile(path, key_bytes=4): one HugeCTR Norm data file, mapped.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)norm_init,
    .tp_dealloc = (destructor)norm_dealloc,
    .tp_methods = norm_methods,
    .tp_getset = norm_getset,
};

/* ---- RawFile ------------------------------------------------------------------------- */

typedef struct raw_file {
    PyObject_HEAD
    mapped_file file;
    uint64_t label_dim, dense_dim, slot_num;
    bool float_label_dense;
    uint64_t records, next_sample;
} raw_file;

static int raw_init(raw_file *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"path", "label_dim", "dense_dim", "slot_num", "float_label_dense",
                               NULL};
    const char *path;
    unsigned int label_dim, dense_dim, slot_num;
    int float_label_dense = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sIII|p", keywords, &path, &label_dim,
                                     &dense_dim, &slot_num, &float_label_dense))
        return -1;
    if (label_dim + (uint64_t)dense_dim + slot_num == 0) {
        PyErr_SetString(PyExc_ValueError, "label_dim, dense_dim and slot_num are all 0");
        return -1;
    }
    mapped_file_close(&self->file);
    if (!mapped_file_open(&self->file, path))
        return -1;
    self->label_dim = label_dim;
    self->dense_dim = dense_dim;
    self->slot_num = slot_num;
    self->float_label_dense = float_label_dense != 0;
    size_t sample_bytes = (size_t)(label_dim + (uint64_t)dense_dim + slot_num) * 4;
    if (self->file.size % sample_bytes != 0) {
        raise_data_loss("%s: sample %zu: truncated: the file's %zu bytes are not a whole number "
                        "of %zu-byte samples (%u labels, %u dense, %u slots of 4 bytes)",
                        path, self->file.size / sample_bytes, self->file.size, sample_bytes,
                        label_dim, dense_dim, slot_num);
        return -1;
    }
    self->records = self->file.size / sample_bytes;
    self->next_sample = 0;
    return 0;
}

static void raw_dealloc(raw_file *self)
{
    mapped_file_close(&self->file);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void raw_copy_values(float *target, const uint8_t *source, uint64_t count, bool as_float)
{
    if (as_float) {
        memcpy(target, source, count * sizeof(float));
        return;
    }
    for (uint64_t j = 0; j < count; j++)
        target[j] = (float)read_i32(source + j * 4);
}

static PyObject *raw_read(raw_file *self, PyObject *args)
{
    Py_ssize_t max_samples;
    if (!PyArg_ParseTuple(args, "n", &max_samples))
        return NULL;
    if (max_samples <= 0)
        return PyErr_Format(PyExc_ValueError, "batch_size: expected a positive count, got %zd",
                            max_samples);
    uint64_t left = self->records - self->next_sample;
    size_t count = (size_t)((uint64_t)max_samples < left ? (uint64_t)max_samples : left);
    batch_out out;
    if (!batch_out_create(&out, count, self->label_dim, self->dense_dim, self->slot_num) ||
        !batch_out_keys(&out, count * self->slot_num)) {
        batch_out_clear(&out);
        return PyErr_NoMemory();
    }
    size_t sample_bytes = (size_t)(self->label_dim + self->dense_dim + self->slot_num) * 4;
    for (size_t i = 0; i < count; i++) {
        const uint8_t *sample = self->file.bytes + (self->next_sample + i) * sample_bytes;
        raw_copy_values(out.label_data + i * self->label_dim, sample, self->label_dim,
                        self->float_label_dense);
        raw_copy_values(out.dense_data + i * self->dense_dim, sample + self->label_dim * 4,
                        self->dense_dim, self->float_label_dense);
        const uint8_t *keys = sample + (self->label_dim + self->dense_dim) * 4;
        for (uint64_t slot = 0; slot < self->slot_num; slot++) {
            uint32_t key;
            memcpy(&key, keys + slot * 4, 4);
            out.key_data[slot * count + i] = key;
            out.length_data[slot * count + i] = 1;
        }
    }
    self->next_sample += count;
    return batch_out_tuple(&out, count);
}

static PyObject *raw_rewind(raw_file *self, PyObject *unused)
{
    (void)unused;
    self->next_sample = 0;
    Py_RETURN_NONE;
}

static PyObject *raw_get_records(raw_file *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->records);
}

static PyMethodDef raw_methods[] = {
    {"read", (PyCFunction)raw_read, METH_VARARGS,
     "read(max_samples) -> (count, labels, dense, lengths, keys), as NormFile.read"},
    {"rewind", (PyCFunction)raw_rewind, METH_NOARGS, "Back to the first sample."},
    {NULL, NULL, 0, NULL},
};

static PyObject *raw_get_next(raw_file *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->next_sample);
}

static PyGetSetDef raw_getset[] = {
    {"records", (getter)raw_get_records, NULL, "samples in the file", NULL},
    {"next_sample", (getter)raw_get_next, NULL, "index of the next sample read", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject raw_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ember._ember.RawFile",
    .tp_basicsize = sizeof(raw_file),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RawFile(path, label_dim, dense_dim, slot_num, float_label_dense=False)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)raw_init,
    .tp_dealloc = (destructor)raw_dealloc,
    .tp_methods = raw_methods,
    .tp_getset = raw_getset,
};

/* ---- norm_write --------------------------------------------------------------------- */

typedef struct norm_writer {
    FILE *stream;
    uint8_t *sample; /* checksum mode: the sample's fields, framed when complete */
    size_t sample_size, sample_capacity;
    bool checksum;
} norm_writer;

static bool writer_put(norm_writer *writer, const void *data, size_t size)
{
    if (!writer->checksum)
        return fwrite(data, 1, size, writer->stream) == size;
    if (writer->sample_size + size > writer->sample_capacity) {
        size_t capacity = 2 * (writer->sample_size + size);
        uint8_t *grown = realloc(writer->sample, capacity);
        if (grown == NULL)
            return false;
        writer->sample = grown;
        writer->sample_capacity = capacity;
    }
    memcpy(writer->sample + writer->sample_size, data, size);
    writer->sample_size += size;
    return true;
}

static bool writer_end_sample(norm_writer *writer)
{
    if (!writer->checksum)
        return true;
    int32_t length = (int32_t)writer->sample_size;
    uint8_t sum = 0;
    for (size_t i = 0; i < writer->sample_size; i++)
        sum = (uint8_t)(sum + writer->sample[i]);
    bool ok = fwrite(&length, 4, 1, writer->stream) == 1 &&
              fwrite(writer->sample, 1, writer->sample_size, writer->stream) ==
                  writer->sample_size &&
              fwrite(&sum, 1, 1, writer->stream) == 1;
    writer->sample_size = 0;
    return ok;
}

typedef struct norm_arrays {
    Py_buffer labels, dense, lengths, keys;
} norm_arrays;

static void norm_arrays_release(norm_arrays *arrays)
{
    PyBuffer_Release(&arrays->labels);
    PyBuffer_Release(&arrays->dense);
    PyBuffer_Release(&arrays->lengths);
    PyBuffer_Release(&arrays->keys);
}

/* Writes the samples; keys of sample i in slot s start at key_starts[s] (advanced). */
static bool norm_write_samples(norm_writer *writer, const norm_arrays *arrays, size_t count,
                               uint64_t label_dim, uint64_t dense_dim, uint64_t slot_num,
                               unsigned key_bytes, uint64_t *key_starts)
{
    const float *labels = arrays->labels.buf, *dense = arrays->dense.buf;
    const uint32_t *lengths = arrays->lengths.buf;
    const uint64_t *keys = arrays->keys.buf;
    for (size_t i = 0; i < count; i++) {
        if (!writer_put(writer, labels + i * label_dim, label_dim * 4) ||
            !writer_put(writer, dense + i * dense_dim, dense_dim * 4))
            return false;
        for (uint64_t slot = 0; slot < slot_num; slot++) {
            int32_t nnz = (int32_t)lengths[slot * count + i];
            if (!writer_put(writer, &nnz, 4))
                return false;
            const uint64_t *slot_keys = keys + key_starts[slot];
            for (int32_t k = 0; k < nnz; k++) {
                uint32_t narrow = (uint32_t)slot_keys[k];
                if (!writer_put(writer, key_bytes == 8 ? (const void *)&slot_keys[k] : &narrow,
                                key_bytes))
                    return false;
            }
            key_starts[slot] += (uint64_t)nnz;
        }
        if (!writer_end_sample(writer))
            return false;
    }
    return true;
}

static PyObject *hugectr_norm_write(PyObject *module, PyObject *args)
{
    (void)module;
    const char *path;
    unsigned long long count, label_dim, dense_dim, slot_num;
    unsigned int key_bytes;
    int checksum;
    PyObject *labels, *dense, *lengths, *keys;
    if (!PyArg_ParseTuple(args, "sKKKKIpOOOO", &path, &count, &label_dim, &dense_dim, &slot_num,
                          &key_bytes, &checksum, &labels, &dense, &lengths, &keys))
        return NULL;
    norm_arrays arrays;
    memset(&arrays, 0, sizeof(arrays));
    if (PyObject_GetBuffer(labels, &arrays.labels, PyBUF_C_CONTIGUOUS) != 0 ||
        PyObject_GetBuffer(dense, &arrays.dense, PyBUF_C_CONTIGUOUS) != 0 ||
        PyObject_GetBuffer(lengths, &arrays.lengths, PyBUF_C_CONTIGUOUS) != 0 ||
        PyObject_GetBuffer(keys, &arrays.keys, PyBUF_C_CONTIGUOUS) != 0) {
        norm_arrays_release(&arrays);
        return NULL;
    }
    /* the Python side checked shapes and types; these guard the memory reads */
    uint64_t nnz = 0;
    bool sizes_ok = (uint64_t)arrays.labels.len == count * label_dim * 4 &&
                    (uint64_t)arrays.dense.len == count * dense_dim * 4 &&
                    (uint64_t)arrays.lengths.len == count * slot_num * 4;
    for (uint64_t i = 0; sizes_ok && i < count * slot_num; i++)
        nnz += ((const uint32_t *)arrays.lengths.buf)[i];
    if (!sizes_ok || (uint64_t)arrays.keys.len != nnz * 8) {
        norm_arrays_release(&arrays);
        return PyErr_Format(PyExc_ValueError,
                            "norm_write: array sizes do not match count %llu and the dims",
                            count);
    }
    uint64_t *key_starts = PyMem_Calloc(slot_num + 1, sizeof(uint64_t));
    norm_writer writer = {.checksum = checksum != 0};
    writer.stream = key_starts != NULL ? fopen(path, "wb") : NULL;
    bool ok = writer.stream != NULL;
    if (ok) {
        int64_t header[8] = {checksum ? 1 : 0, (int64_t)count, (int64_t)label_dim,
                             (int64_t)dense_dim, (int64_t)slot_num, 0, 0, 0};
        uint64_t begin = 0;
        for (uint64_t slot = 0; slot < slot_num; slot++) {
            key_starts[slot] = begin;
            for (uint64_t i = 0; i < count; i++)
                begin += ((const uint32_t *)arrays.lengths.buf)[slot * count + i];
        }
        Py_BEGIN_ALLOW_THREADS ok = fwrite(header, sizeof(header), 1, writer.stream) == 1 &&
                                    norm_write_samples(&writer, &arrays, (size_t)count, label_dim,
                                                       dense_dim, slot_num, key_bytes, key_starts);
        Py_END_ALLOW_THREADS
    }
    int saved_errno = errno;
    bool closed = writer.stream == NULL || fclose(writer.stream) == 0;
    free(writer.sample);
    PyMem_Free(key_starts);
    norm_arrays_release(&arrays);
    if (!ok || !closed) {
        errno = saved_errno != 0 ? saved_errno : EIO;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    }
    Py_RETURN_NONE;
}

PyMethodDef em_hugectr_methods[] = {
    {"norm_write", hugectr_norm_write, METH_VARARGS,
     "norm_write(path, count, label_dim, dense_dim, slot_num, key_bytes, checksum, labels, "
     "dense, lengths, keys): writes a Norm file (arrays as NormFile.read returns them)"},
    {NULL, NULL, 0, NULL},
};

bool em_hugectr_module_init(PyObject *module, PyObject *error_type)
{
    dataset_error_type = error_type;
    PyTypeObject *types[] = {&norm_type, &raw_type};
    const char *names[] = {"NormFile", "RawFile"};
    for (size_t i = 0; i < 2; i++) {
        if (PyType_Ready(types[i]) != 0)
            return false;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(module, names[i], (PyObject *)types[i]) != 0) {
            Py_DECREF(types[i]);
            return false;
        }
    }
    return true;
}
