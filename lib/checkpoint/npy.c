#include "lib/checkpoint/npy.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_BYTES 6
/* Headers (magic, version, length and dict) end on this boundary, as NumPy writes them. */
#define NPY_HEADER_ALIGN 64
/* A longer header is not an array of one or two dimensions. */
#define NPY_HEADER_MAX ((uint32_t)1 << 16)

em_status em_npy_write_header(FILE *file, const char *path, const char *descr, uint64_t rows,
                              uint64_t columns, em_error *err)
{
    char dict[256];
    int length = columns == 0
                     ? snprintf(dict, sizeof(dict),
                                "{'descr': '%s', 'fortran_order': False, 'shape': (%" PRIu64
                                ",), }",
                                descr, rows)
                     : snprintf(dict, sizeof(dict),
                                "{'descr': '%s', 'fortran_order': False, 'shape': (%" PRIu64
                                ", %" PRIu64 "), }",
                                descr, rows, columns);
    /* magic, version 1.0, a u16 length, the dict, spaces, a newline */
    size_t used = NPY_MAGIC_BYTES + 2 + 2 + (size_t)length + 1;
    size_t padded = (used + NPY_HEADER_ALIGN - 1) / NPY_HEADER_ALIGN * NPY_HEADER_ALIGN;
    uint16_t header_length = (uint16_t)(padded - NPY_MAGIC_BYTES - 4);
    unsigned char header[320];
    memcpy(header, NPY_MAGIC, NPY_MAGIC_BYTES);
    header[6] = 1;
    header[7] = 0;
    header[8] = (unsigned char)(header_length & 0xff);
    header[9] = (unsigned char)(header_length >> 8);
    memcpy(header + 10, dict, (size_t)length);
    memset(header + 10 + length, ' ', padded - used);
    header[padded - 1] = '\n';
    if (fwrite(header, 1, padded, file) != padded)
        return em_error_set(err, EM_INTERNAL, "writing %s failed: %s", path, strerror(errno));
    return EM_OK;
}

uint32_t em_npy_element_bytes(const char *descr)
{
    /* a byte order, a kind (bool, signed, unsigned, float), a size in bytes */
    if (strchr("<>|=", descr[0]) == NULL || descr[0] == '\0' || strchr("biuf", descr[1]) == NULL ||
        descr[1] == '\0')
        return 0;
    char *end;
    unsigned long bytes = strtoul(descr + 2, &end, 10);
    bool plain = end != descr + 2 && *end == '\0' &&
                 (bytes == 1 || bytes == 2 || bytes == 4 || bytes == 8);
    return plain ? (uint32_t)bytes : 0;
}

/* The text after the dict key `name` and its colon, or NULL. */
static const char *after_key(const char *dict, const char *name)
{
    size_t length = strlen(name);
    for (const char *at = dict; (at = strstr(at, name)) != NULL; at += length) {
        if (at == dict || (at[-1] != '\'' && at[-1] != '"') || at[length] != at[-1])
            continue;
        const char *p = at + length + 1;
        while (isspace((unsigned char)*p))
            p++;
        if (*p != ':')
            continue;
        p++;
        while (isspace((unsigned char)*p))
            p++;
        return p;
    }
    return NULL;
}

static em_status bad_header(const char *path, const char *what, em_error *err)
{
    return em_error_set(err, EM_INVALID_ARGUMENT, "%s: %s", path, what);
}

/* The dict's descr, fortran_order and shape into out. */
static em_status parse_dict(const char *dict, const char *path, em_npy_array *out, em_error *err)
{
    const char *descr = after_key(dict, "descr");
    if (descr == NULL || (*descr != '\'' && *descr != '"'))
        return bad_header(path, "the array header names no element type (descr)", err);
    const char *close = strchr(descr + 1, *descr);
    if (close == NULL || (size_t)(close - descr - 1) >= sizeof(out->descr))
        return bad_header(path, "the array header's element type (descr) does not read", err);
    memcpy(out->descr, descr + 1, (size_t)(close - descr - 1));
    out->descr[close - descr - 1] = '\0';
    for (const char *c = out->descr; *c != '\0'; c++)
        if (!isgraph((unsigned char)*c))
            return bad_header(path, "the array header's element type (descr) does not read",
                              err);
    const char *order = after_key(dict, "fortran_order");
    if (order == NULL || (strncmp(order, "False", 5) != 0 && strncmp(order, "True", 4) != 0))
        return bad_header(path, "the array header has no fortran_order", err);
    if (strncmp(order, "True", 4) == 0)
        return bad_header(path, "the array is in Fortran order; write it in C order "
                                "(np.ascontiguousarray)", err);
    const char *shape = after_key(dict, "shape");
    if (shape == NULL || *shape != '(')
        return bad_header(path, "the array header has no shape", err);
    uint64_t sizes[3];
    uint32_t count = 0;
    const char *p = shape + 1;
    for (;;) {
        while (isspace((unsigned char)*p))
            p++;
        if (*p == ')')
            break;
        if (!isdigit((unsigned char)*p) || count == 3)
            return bad_header(path, "the array header's shape does not read", err);
        char *end;
        errno = 0;
        sizes[count++] = strtoull(p, &end, 10);
        if (errno != 0)
            return bad_header(path, "the array header's shape does not read", err);
        p = end;
        while (isspace((unsigned char)*p))
            p++;
        if (*p == ',')
            p++;
        else if (*p != ')')
            return bad_header(path, "the array header's shape does not read", err);
    }
    if (count == 0 || count > 2)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: the array has %u dimensions; ember reads arrays of one or two",
                            path, count);
    out->dimensions = count;
    out->rows = sizes[0];
    out->columns = count == 2 ? sizes[1] : 1;
    return EM_OK;
}

/* Checks that the file's bytes after the header are exactly the shape's elements. */
static em_status check_size(FILE *file, const char *path, const em_npy_array *array,
                            em_error *err)
{
    uint32_t element = em_npy_element_bytes(array->descr);
    if (element == 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: elements of type '%s', which ember does not read (keys are "
                            "'<u8', values '<f4')",
                            path, array->descr);
    struct stat st;
    if (fstat(fileno(file), &st) != 0)
        return em_error_set(err, EM_INTERNAL, "stat of %s failed: %s", path, strerror(errno));
    uint64_t data = (uint64_t)st.st_size - array->data_offset;
    bool overflow = array->columns != 0 && array->rows > UINT64_MAX / array->columns / element;
    if (overflow || data != array->rows * array->columns * element) {
        char shape[64];
        if (array->dimensions == 1)
            snprintf(shape, sizeof(shape), "(%" PRIu64 ",)", array->rows);
        else
            snprintf(shape, sizeof(shape), "(%" PRIu64 ", %" PRIu64 ")", array->rows,
                     array->columns);
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: holds %" PRIu64 " bytes of elements where its shape %s of '%s' "
                            "needs %s%" PRIu64 " (a truncated file?)",
                            path, data, shape, array->descr, overflow ? "more than " : "",
                            overflow ? UINT64_MAX : array->rows * array->columns * element);
    }
    return EM_OK;
}

em_status em_npy_read_header(FILE *file, const char *path, em_npy_array *out, em_error *err)
{
    memset(out, 0, sizeof(*out));
    unsigned char start[12];
    size_t got = fread(start, 1, sizeof(start), file);
    if (got < 10 || memcmp(start, NPY_MAGIC, NPY_MAGIC_BYTES) != 0)
        return bad_header(path, "not a NumPy array file (.npy: no \\x93NUMPY magic)", err);
    uint8_t major = start[6];
    if (major < 1 || major > 3)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: array file format version %u.%u, which ember does not read "
                            "(1.0 to 3.0)",
                            path, major, start[7]);
    uint32_t length_bytes = major == 1 ? 2 : 4;
    if (got < 8 + length_bytes)
        return bad_header(path, "the array header is cut short", err);
    uint32_t length = (uint32_t)start[8] | (uint32_t)start[9] << 8;
    if (length_bytes == 4)
        length |= (uint32_t)start[10] << 16 | (uint32_t)start[11] << 24;
    if (length > NPY_HEADER_MAX)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "%s: an array header of %" PRIu32 " bytes (at most %" PRIu32 ")",
                            path, length, NPY_HEADER_MAX);
    out->data_offset = 8 + length_bytes + (uint64_t)length;
    char *dict = malloc((size_t)length + 1);
    if (dict == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "%s: out of memory", path);
    em_status status = EM_OK;
    if (fseek(file, (long)(8 + length_bytes), SEEK_SET) != 0 ||
        fread(dict, 1, length, file) != length)
        status = bad_header(path, "the array header is cut short", err);
    dict[length] = '\0';
    if (status == EM_OK && strlen(dict) != length)
        status = bad_header(path, "the array header holds a zero byte", err);
    if (status == EM_OK)
        status = parse_dict(dict, path, out, err);
    free(dict);
    if (status == EM_OK)
        status = check_size(file, path, out, err);
    if (status == EM_OK && fseek(file, (long)out->data_offset, SEEK_SET) != 0)
        status = em_error_set(err, EM_INTERNAL, "seek in %s failed: %s", path, strerror(errno));
    return status;
}
