#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib/base/log.h"
#include "tests/support/test_support.h"

/* Reads back everything written to the temporary file behind fd. */
static void read_all(int fd, char *buffer, size_t capacity)
{
    off_t end = lseek(fd, 0, SEEK_CUR);
    ck_assert_int_ge(end, 0);
    ck_assert_int_lt(end, (off_t)capacity);
    ssize_t got = pread(fd, buffer, (size_t)end, 0);
    ck_assert_int_eq(got, end);
    buffer[got] = '\0';
}

static int temporary_fd(void)
{
    FILE *file = tmpfile();
    ck_assert_ptr_nonnull(file);
    return dup(fileno(file));
}

/* A temporary file that JOURNAL_STREAM names, as systemd sets it for the journal. */
static int journal_fd(void)
{
    int fd = temporary_fd();
    struct stat info;
    ck_assert_int_eq(fstat(fd, &info), 0);
    char stream[64];
    snprintf(stream, sizeof(stream), "%lu:%lu", (unsigned long)info.st_dev,
             (unsigned long)info.st_ino);
    setenv("JOURNAL_STREAM", stream, 1);
    return fd;
}

START_TEST(plain_lines_have_timestamp_and_level)
{
    unsetenv("JOURNAL_STREAM");
    int fd = temporary_fd();
    em_log log;
    em_log_init(&log, EM_LOG_INFO, fd);
    ck_assert(!log.journal);
    em_log_info(&log, "listening on %s", "127.0.0.1:7070");
    em_log_debug(&log, "dropped below the level");
    char text[1024];
    read_all(fd, text, sizeof(text));
    /* 2026-11-21T10:04:05.123Z info listening on 127.0.0.1:7070 */
    ck_assert_int_eq(text[4], '-');
    ck_assert_int_eq(text[10], 'T');
    ck_assert_int_eq(text[23], 'Z');
    ck_assert_str_eq(text + 24, " info listening on 127.0.0.1:7070\n");
    close(fd);
}
END_TEST

START_TEST(journal_lines_have_priority_prefix)
{
    int fd = journal_fd();
    em_log log;
    em_log_init(&log, EM_LOG_DEBUG, fd);
    ck_assert(log.journal);
    em_log_warning(&log, "pool %s at %d%%", "cpu0", 93);
    em_log_error(&log, "bad");
    char text[256];
    read_all(fd, text, sizeof(text));
    ck_assert_str_eq(text, "<4>pool cpu0 at 93%\n<3>bad\n");
    close(fd);
}
END_TEST

START_TEST(level_names_parse)
{
    em_log_level level;
    em_error err;
    ck_assert_int_eq(em_log_level_parse("WARNING", &level, &err), EM_OK);
    ck_assert_int_eq(level, EM_LOG_WARNING);
    ck_assert_int_eq(em_log_level_parse("loud", &level, &err), EM_INVALID_ARGUMENT);
    ck_assert(strstr(err.message, "'loud'") != NULL);
    ck_assert_str_eq(em_log_level_name(EM_LOG_DEBUG), "debug");
}
END_TEST

START_TEST(null_log_is_silent)
{
    em_log_error(NULL, "nobody hears this");
    ck_assert(!em_log_enabled(NULL, EM_LOG_ERROR));
}
END_TEST

/* A reload changes the level while workers log: the next line obeys the new level. */
START_TEST(the_level_changes_while_logging)
{
    unsetenv("JOURNAL_STREAM");
    int fd = temporary_fd();
    em_log log;
    em_log_init(&log, EM_LOG_WARNING, fd);
    em_log_info(&log, "hidden");
    ck_assert(!em_log_enabled(&log, EM_LOG_INFO));
    em_log_set_level(&log, EM_LOG_DEBUG);
    ck_assert(em_log_enabled(&log, EM_LOG_DEBUG));
    em_log_info(&log, "shown");
    em_log_set_level(&log, EM_LOG_ERROR);
    em_log_warning(&log, "hidden again");
    char text[256];
    read_all(fd, text, sizeof(text));
    ck_assert_msg(strstr(text, "hidden") == NULL, "%s", text);
    ck_assert_msg(strstr(text, " info shown\n") != NULL, "%s", text);
    close(fd);
}
END_TEST

START_TEST(overlong_lines_are_cut)
{
    unsetenv("JOURNAL_STREAM");
    int fd = temporary_fd();
    em_log log;
    em_log_init(&log, EM_LOG_INFO, fd);
    char *big = malloc(10000);
    memset(big, 'y', 9999);
    big[9999] = '\0';
    em_log_info(&log, "%s", big);
    free(big);
    char *text = malloc(8192);
    read_all(fd, text, 8192);
    size_t length = strlen(text);
    ck_assert_uint_le(length, 4096);
    ck_assert_str_eq(text + length - 4, "...\n");
    free(text);
    close(fd);
}
END_TEST

START_TEST(logfmt_lines_quote_the_message)
{
    unsetenv("JOURNAL_STREAM");
    int fd = temporary_fd();
    em_log log;
    em_log_init(&log, EM_LOG_INFO, fd);
    em_log_set_logfmt(&log, true);
    em_log_notice(&log, "table \"%s\": a\\b\nnext", "t");
    char text[1024];
    read_all(fd, text, sizeof(text));
    /* ts=2026-11-21T10:04:05.123Z level=notice msg="..." */
    ck_assert_int_eq(strncmp(text, "ts=", 3), 0);
    ck_assert_int_eq(text[26], 'Z');
    ck_assert_str_eq(text + 27, " level=notice msg=\"table \\\"t\\\": a\\\\b\\nnext\"\n");
    close(fd);

    /* under the journal: the priority prefix, no timestamp; long lines stay quoted */
    fd = journal_fd();
    em_log_init(&log, EM_LOG_INFO, fd);
    em_log_set_logfmt(&log, true);
    em_log_error(&log, "bad");
    char *big = malloc(10000);
    memset(big, '"', 9999);
    big[9999] = '\0';
    em_log_error(&log, "%s", big);
    free(big);
    char *all = malloc(16384);
    read_all(fd, all, 16384);
    ck_assert_int_eq(strncmp(all, "<3>level=error msg=\"bad\"\n<3>level=error msg=\"\\\"", 31),
                     0);
    size_t length = strlen(all);
    ck_assert_str_eq(all + length - 2, "\"\n");
    size_t backslashes = 0; /* the closing quote is not escaped */
    while (all[length - 3 - backslashes] == '\\')
        backslashes++;
    ck_assert_uint_eq(backslashes % 2, 0);
    ck_assert_uint_le(length, 4096 + 25);
    free(all);
    unsetenv("JOURNAL_STREAM");
    close(fd);
}
END_TEST

int main(void)
{
    Suite *suite = suite_create("log");
    TCase *tc = tcase_create("log");
    tcase_add_test(tc, plain_lines_have_timestamp_and_level);
    tcase_add_test(tc, journal_lines_have_priority_prefix);
    tcase_add_test(tc, level_names_parse);
    tcase_add_test(tc, null_log_is_silent);
    tcase_add_test(tc, the_level_changes_while_logging);
    tcase_add_test(tc, overlong_lines_are_cut);
    tcase_add_test(tc, logfmt_lines_quote_the_message);
    suite_add_tcase(suite, tc);
    return em_test_run(suite);
}
