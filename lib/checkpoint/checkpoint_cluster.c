#include "lib/checkpoint/checkpoint_cluster.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/keyhash.h"
#include "lib/checkpoint/checkpoint_internal.h"

#define RECORD_MAX_BYTES (16u << 20)
#define ID_DIGITS 20

static em_status io_error(em_error *err, const char *step, const char *path)
{
    return em_error_set(err, EM_INTERNAL, "cluster checkpoint: %s %s: %s", step, path,
                        strerror(errno));
}

static em_status bad_record(em_error *err, const char *dir, const char *what, const char *name)
{
    return em_error_set(err, EM_DATA_LOSS, "cluster checkpoint %s: %s: %s%s%s", dir,
                        EM_CLUSTER_FILE, what, name != NULL ? " " : "",
                        name != NULL ? name : "");
}

em_status em_cluster_prepare(const char *dir, em_error *err)
{
    if (dir == NULL || dir[0] != '/')
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cluster checkpoint dir '%s' is not absolute: the client and every "
                            "server must see it under the same path", dir == NULL ? "" : dir);
    if (strlen(dir) > 3000)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cluster checkpoint dir is longer than 3000 characters");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return io_error(err, "cannot create", dir);
    char path[3100];
    snprintf(path, sizeof(path), "%s/%s", dir, EM_CLUSTER_FILE);
    struct stat st;
    if (stat(path, &st) == 0)
        return em_error_set(err, EM_ALREADY_EXISTS,
                            "cluster checkpoint %s exists already (%s): give a new dir", dir,
                            EM_CLUSTER_FILE);
    return EM_OK;
}

static em_status write_all(int fd, const char *data, size_t size, const char *path,
                           em_error *err)
{
    for (size_t done = 0; done < size;) {
        ssize_t n = write(fd, data + done, size - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return io_error(err, "cannot write", path);
        done += (size_t)n;
    }
    return EM_OK;
}

em_status em_cluster_write(const char *dir, const cJSON *record, em_error *err)
{
    char *text = cJSON_Print(record);
    if (text == NULL)
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cluster checkpoint: out of memory");
    size_t length = strlen(text);
    char *signed_text = malloc(length + 32);
    if (signed_text == NULL) {
        free(text);
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cluster checkpoint: out of memory");
    }
    memcpy(signed_text, text, length);
    signed_text[length++] = '\n';
    int tail = snprintf(signed_text + length, 32, "xxh3 %016" PRIx64 "\n",
                        (uint64_t)XXH3_64bits(signed_text, length));
    length += (size_t)tail;
    free(text);
    char tmp[3200], final[3200];
    snprintf(tmp, sizeof(tmp), "%s/%s.tmp", dir, EM_CLUSTER_FILE);
    snprintf(final, sizeof(final), "%s/%s", dir, EM_CLUSTER_FILE);
    em_status status = EM_OK;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        status = io_error(err, "cannot create", tmp);
    if (status == EM_OK)
        status = write_all(fd, signed_text, length, tmp, err);
    if (status == EM_OK && fsync(fd) != 0)
        status = io_error(err, "cannot fsync", tmp);
    if (fd >= 0)
        close(fd);
    if (status == EM_OK && rename(tmp, final) != 0)
        status = io_error(err, "cannot rename into", final);
    if (status == EM_OK) {
        int dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dir_fd < 0 || fsync(dir_fd) != 0)
            status = io_error(err, "cannot fsync", dir);
        if (dir_fd >= 0)
            close(dir_fd);
    }
    if (status != EM_OK)
        unlink(tmp);
    free(signed_text);
    return status;
}

/* ---- reading ----------------------------------------------------------------------- */

static bool parse_hex64(const char *text, uint64_t *out)
{
    if (text == NULL || strlen(text) != 16 || strspn(text, "0123456789abcdef") != 16)
        return false;
    *out = strtoull(text, NULL, 16);
    return true;
}

/* A part's path: relative, below dir, no "." or ".." component. */
static bool inside(const char *path)
{
    if (path[0] == '\0' || path[0] == '/')
        return false;
    for (const char *at = path; *at != '\0';) {
        size_t n = strcspn(at, "/");
        if (n == 0 || (n == 1 && at[0] == '.') || (n == 2 && at[0] == '.' && at[1] == '.'))
            return false;
        at += n;
        if (*at == '/')
            at++;
    }
    return true;
}

static em_status check_part(const cJSON *part, const char *dir, const char *table,
                            em_error *err)
{
    const cJSON *server = cJSON_GetObjectItemCaseSensitive(part, "server");
    const cJSON *path = cJSON_GetObjectItemCaseSensitive(part, "path");
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(part, "id");
    const cJSON *hash = cJSON_GetObjectItemCaseSensitive(part, "manifest_xxh3");
    const cJSON *rows = cJSON_GetObjectItemCaseSensitive(part, "rows");
    uint64_t ignored;
    if (!em__json_count(server, &ignored) || !cJSON_IsString(path) ||
        !inside(path->valuestring) || !cJSON_IsString(id) ||
        strlen(id->valuestring) != ID_DIGITS ||
        strspn(id->valuestring, "0123456789") != ID_DIGITS || !cJSON_IsString(hash) ||
        !parse_hex64(hash->valuestring, &ignored) || !em__json_count(rows, &ignored))
        return bad_record(err, dir, "a malformed part of table", table);
    return EM_OK;
}

static em_status check_record(const cJSON *record, const char *dir, em_error *err)
{
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(record, "format");
    const cJSON *version = cJSON_GetObjectItemCaseSensitive(record, "version");
    const cJSON *buckets = cJSON_GetObjectItemCaseSensitive(record, "buckets");
    if (!cJSON_IsString(format) || strcmp(format->valuestring, "ember-cluster-checkpoint") != 0)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cluster checkpoint %s: %s is not an ember cluster checkpoint's",
                            dir, EM_CLUSTER_FILE);
    if (!cJSON_IsNumber(version) || version->valuedouble != EM_CLUSTER_FORMAT_VERSION)
        return em_error_set(err, EM_INVALID_ARGUMENT,
                            "cluster checkpoint %s: format version %g, this ember reads %d",
                            dir, cJSON_IsNumber(version) ? version->valuedouble : -1.0,
                            EM_CLUSTER_FORMAT_VERSION);
    if (!cJSON_IsNumber(buckets) || buckets->valuedouble != EM_KEY_BUCKETS)
        return bad_record(err, dir, "buckets is not 4096", NULL);
    const cJSON *servers = cJSON_GetObjectItemCaseSensitive(record, "servers");
    const cJSON *tables = cJSON_GetObjectItemCaseSensitive(record, "tables");
    if (!cJSON_IsArray(servers) || cJSON_GetArraySize(servers) < 1 || !cJSON_IsArray(tables))
        return bad_record(err, dir, "servers or tables is missing", NULL);
    const cJSON *table = NULL;
    cJSON_ArrayForEach(table, tables)
    {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(table, "name");
        const cJSON *parts = cJSON_GetObjectItemCaseSensitive(table, "parts");
        if (!cJSON_IsString(name) || !cJSON_IsArray(parts) || cJSON_GetArraySize(parts) < 1)
            return bad_record(err, dir, "a table without a name or parts", NULL);
        const cJSON *part = NULL;
        cJSON_ArrayForEach(part, parts)
        {
            em_status status = check_part(part, dir, name->valuestring, err);
            if (status != EM_OK)
                return status;
        }
    }
    return EM_OK;
}

em_status em_cluster_read(const char *dir, cJSON **record, em_error *err)
{
    *record = NULL;
    char path[3200];
    snprintf(path, sizeof(path), "%s/%s", dir, EM_CLUSTER_FILE);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return em_error_set(err, errno == ENOENT ? EM_NOT_FOUND : EM_INTERNAL,
                            "cluster checkpoint %s: cannot open %s: %s", dir, EM_CLUSTER_FILE,
                            strerror(errno));
    struct stat st;
    char *text = NULL;
    size_t size = 0;
    if (fstat(fd, &st) == 0 && st.st_size <= RECORD_MAX_BYTES) {
        text = malloc((size_t)st.st_size + 1);
        while (text != NULL && size < (size_t)st.st_size) {
            ssize_t n = read(fd, text + size, (size_t)st.st_size - size);
            if (n <= 0)
                break;
            size += (size_t)n;
        }
    }
    close(fd);
    if (text == NULL || size != (size_t)st.st_size) {
        free(text);
        return bad_record(err, dir, "unreadable or larger than 16 MiB", NULL);
    }
    text[size] = '\0';
    /* the last line: "xxh3 <16 hex digits>" over everything before it */
    char *line = size >= 23 ? text + size - 22 : NULL;
    uint64_t expected = 0;
    if (line == NULL || line[-1] != '\n' || strncmp(line, "xxh3 ", 5) != 0 ||
        text[size - 1] != '\n') {
        free(text);
        return bad_record(err, dir, "its checksum line is missing (truncated?)", NULL);
    }
    line[21] = '\0';
    uint64_t seen = XXH3_64bits(text, (size_t)(line - text));
    if (!parse_hex64(line + 5, &expected) || seen != expected) {
        char what[96];
        snprintf(what, sizeof(what), "checksum mismatch: expected %s, seen %016" PRIx64,
                 line + 5, seen);
        free(text);
        return bad_record(err, dir, what, NULL);
    }
    line[0] = '\0';
    cJSON *json = cJSON_Parse(text);
    free(text);
    if (json == NULL)
        return bad_record(err, dir, "not valid JSON", NULL);
    em_status status = check_record(json, dir, err);
    if (status != EM_OK) {
        cJSON_Delete(json);
        return status;
    }
    *record = json;
    return EM_OK;
}

void em_cluster_free_sources(char **paths, uint64_t *manifests, size_t count)
{
    for (size_t i = 0; paths != NULL && i < count; i++)
        free(paths[i]);
    free(paths);
    free(manifests);
}

em_status em_cluster_sources(const cJSON *record, const char *dir, const char *table,
                              char ***paths, uint64_t **manifests, size_t *count,
                              em_error *err)
{
    *paths = NULL;
    *manifests = NULL;
    *count = 0;
    const cJSON *tables = cJSON_GetObjectItemCaseSensitive(record, "tables");
    const cJSON *entry = NULL, *found = NULL;
    char names[256] = "";
    cJSON_ArrayForEach(entry, tables)
    {
        const char *name = cJSON_GetObjectItemCaseSensitive(entry, "name")->valuestring;
        if (strcmp(name, table) == 0)
            found = entry;
        size_t used = strlen(names);
        snprintf(names + used, sizeof(names) - used, "%s'%s'", used > 0 ? ", " : "", name);
    }
    if (found == NULL)
        return em_error_set(err, EM_NOT_FOUND,
                            "cluster checkpoint %s has no table '%s' (it has %s)", dir, table,
                            names[0] != '\0' ? names : "none");
    const cJSON *parts = cJSON_GetObjectItemCaseSensitive(found, "parts");
    size_t n = (size_t)cJSON_GetArraySize(parts);
    *paths = calloc(n, sizeof(char *));
    *manifests = calloc(n, sizeof(uint64_t));
    if (*paths == NULL || *manifests == NULL) {
        em_cluster_free_sources(*paths, *manifests, 0);
        *paths = NULL;
        *manifests = NULL;
        return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cluster checkpoint: out of memory");
    }
    const cJSON *part = NULL;
    cJSON_ArrayForEach(part, parts)
    {
        const char *path = cJSON_GetObjectItemCaseSensitive(part, "path")->valuestring;
        size_t length = strlen(dir) + strlen(path) + 2;
        char *joined = malloc(length);
        if (joined == NULL) {
            em_cluster_free_sources(*paths, *manifests, *count);
            *paths = NULL;
            *manifests = NULL;
            *count = 0;
            return em_error_set(err, EM_RESOURCE_EXHAUSTED, "cluster checkpoint: out of memory");
        }
        snprintf(joined, length, "%s/%s", dir, path);
        parse_hex64(cJSON_GetObjectItemCaseSensitive(part, "manifest_xxh3")->valuestring,
                    &(*manifests)[*count]);
        (*paths)[(*count)++] = joined;
    }
    return EM_OK;
}
