/*
 * libFuzzer harness: emberd's configuration parser (daemon/daemon_config.h), tables and
 * tokens included. Any text either parses or is refused with a message; what parses
 * prints as JSON that parses again to a configuration that prints the same (the
 * round trip `emberd --print-config` relies on).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "daemon/daemon_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char *print_config(const em_daemon_config *config)
{
    cJSON *json = em_config_to_json(&em_daemon_config_schema, config);
    char *text = json != NULL ? cJSON_PrintUnformatted(json) : NULL;
    cJSON_Delete(json);
    return text;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (text == NULL)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    em_daemon_config config;
    em_error err;
    em_status status = em_daemon_config_parse_text(text, "fuzz", &config, &err);
    free(text);
    if (status != EM_OK) {
        if (err.message[0] == '\0')
            abort(); /* every refusal says why */
        return 0;
    }
    char *printed = print_config(&config);
    em_daemon_config_deinit(&config);
    if (printed == NULL)
        abort();
    em_daemon_config again;
    if (em_daemon_config_parse_text(printed, "printed", &again, &err) != EM_OK) {
        fprintf(stderr, "printed configuration does not parse: %s\n%s\n", err.message, printed);
        abort();
    }
    char *reprinted = print_config(&again);
    em_daemon_config_deinit(&again);
    if (reprinted == NULL || strcmp(printed, reprinted) != 0) {
        fprintf(stderr, "printed configuration changes when read again:\n%s\n%s\n", printed,
                reprinted != NULL ? reprinted : "(null)");
        abort();
    }
    cJSON_free(printed);
    cJSON_free(reprinted);
    return 0;
}
