/*
 * HugeCTR dataset files (Norm and Raw formats) for the ember Python package: readers
 * that turn a file into CSR batches per slot, and writers, in C for speed. The format is
 * described in clients/python/src/hugectr.c and clients/python/ember/hugectr.py.
 */
#ifndef EMBER_CLIENTS_PYTHON_HUGECTR_MODULE_H
#define EMBER_CLIENTS_PYTHON_HUGECTR_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>

/* The module functions (norm_write and the reader types' factories), terminated. */
extern PyMethodDef em_hugectr_methods[];

/* Adds the reader types to module; errors are raised as error_type (ember.Error).
 * Returns false with a Python exception set on failure. */
bool em_hugectr_module_init(PyObject *module, PyObject *error_type);

#endif
