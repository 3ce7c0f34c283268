/*
 * DESIGN: NumPy's array files (.npy, format versions 1.0 to 3.0), the form a table's
 * export takes (em_checkpoint_export) and an import reads (em_checkpoint_import): a magic
 * string, the version, a header that is a Python dict literal (descr, fortran_order,
 * shape) padded to 64 bytes, then the elements in C order. Only what a table needs is
 * read: little-endian uint64 and float32 ("<u8", "<f4"), one or two dimensions, C order.
 * Anything else is refused with a message that names the file and what it holds.
 */
#ifndef EMBER_LIB_CHECKPOINT_NPY_H
#define EMBER_LIB_CHECKPOINT_NPY_H

#include <stdint.h>
#include <stdio.h>

#include "lib/base/status.h"

/* An array file's shape and where its elements start. */
typedef struct em_npy_array {
    char descr[16];       /* as the header says it, e.g. "<f4" */
    uint32_t dimensions;  /* 1 or 2 */
    uint64_t rows;        /* the first dimension */
    uint64_t columns;     /* the second (1 for one dimension) */
    uint64_t data_offset; /* bytes before the first element */
} em_npy_array;

/* Writes the header of a C-order array of descr ("<u8" or "<f4") with shape (rows,) when
 * columns is 0, else (rows, columns), at the start of file (path names it in errors).
 * Errors: INTERNAL naming the path and the system's reason. */
em_status em_npy_write_header(FILE *file, const char *path, const char *descr, uint64_t rows,
                              uint64_t columns, em_error *err);

/* Reads the header of the array file open at file (at its start) and checks that the file
 * holds exactly the elements its shape says, of a type em_npy_element_bytes knows.
 * Errors: INVALID_ARGUMENT naming the path and what is wrong (not an array file, a
 * header that does not read, Fortran order, three or more dimensions, an element type
 * it does not take, a size that does not match the shape). */
em_status em_npy_read_header(FILE *file, const char *path, em_npy_array *out, em_error *err);

/* Bytes of one element of descr, 0 for a type this module does not take. */
uint32_t em_npy_element_bytes(const char *descr);

#endif
