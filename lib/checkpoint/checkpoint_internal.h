/*
 * DESIGN: what the checkpoint writer and reader share besides the format.
 */
#ifndef EMBER_LIB_CHECKPOINT_INTERNAL_H
#define EMBER_LIB_CHECKPOINT_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

/* The virtual bucket of a key (checkpoint.h). */
uint32_t em__checkpoint_bucket(uint64_t key);

/* Whether name is a checkpoint id: exactly EM_CHECKPOINT_ID_DIGITS decimal digits. */
bool em__checkpoint_is_id(const char *name);

/* Removes a directory of plain files, best effort. */
void em__checkpoint_remove_dir(const char *path);

#endif
