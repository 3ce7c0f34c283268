/*
 * DESIGN: the one qualifier that lets a function compile for the host and the GPU.
 *
 * common/ is a leaf: its headers include nothing of the project but each other, so
 * lib/ (C) and kernels/ (CUDA) share the same element math without kernels/ ever
 * reaching into lib/. Under nvcc EM_HOST_DEVICE expands to __host__ __device__
 * __forceinline__; in C it is static inline.
 */
#ifndef EMBER_COMMON_HOST_DEVICE_H
#define EMBER_COMMON_HOST_DEVICE_H

#ifdef __CUDACC__
#define EM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EM_HOST_DEVICE static inline
#endif

#endif
