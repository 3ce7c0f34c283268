/*
 * libFuzzer harness: the NumPy array header reader that an import runs on files from
 * anywhere (lib/checkpoint/npy.h). Any bytes either read as a header whose shape the
 * file's size matches exactly, or are refused with a message naming the file; a header
 * that reads is written again by em_npy_write_header and reads back alike (but for
 * (n, 0), which the writer has no way to write and a table never needs).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lib/checkpoint/npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static FILE *file_of(const void *data, size_t size)
{
    FILE *file = tmpfile();
    if (file == NULL)
        abort();
    if (size > 0 && fwrite(data, 1, size, file) != size)
        abort();
    fflush(file);
    rewind(file);
    return file;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FILE *file = file_of(data, size);
    em_npy_array array;
    em_error err;
    em_status status = em_npy_read_header(file, "fuzz.npy", &array, &err);
    fclose(file);
    if (status != EM_OK) {
        if (strstr(err.message, "fuzz.npy") == NULL)
            abort(); /* every refusal names the file */
        return 0;
    }
    uint64_t elements = array.rows * array.columns * em_npy_element_bytes(array.descr);
    if (array.data_offset + elements != size || (array.dimensions != 1 && array.dimensions != 2))
        abort();
    /* the same shape written again reads back alike (the writer's shapes: (n,) or (n, c)
     * with c > 0) */
    if (array.dimensions == 2 && array.columns == 0)
        return 0;
    FILE *again = tmpfile();
    if (again == NULL ||
        em_npy_write_header(again, "again.npy", array.descr, array.rows,
                            array.dimensions == 1 ? 0 : array.columns, &err) != EM_OK)
        abort();
    long header = ftell(again);
    if (elements > 0) {
        fseek(again, (long)(header + (long)elements - 1), SEEK_SET);
        fputc(0, again);
    }
    fflush(again);
    rewind(again);
    em_npy_array back;
    if (em_npy_read_header(again, "again.npy", &back, &err) != EM_OK || back.rows != array.rows ||
        back.columns != array.columns || back.dimensions != array.dimensions ||
        strcmp(back.descr, array.descr) != 0)
        abort();
    fclose(again);
    return 0;
}
