// EPMOE_HD marks functions shared by host code and CUDA device code (the CPU reference and the
// CUDA kernels call the same definitions, so both backends compute the same function).
#pragma once

#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__ __forceinline__
#else
#define EPMOE_HD inline
#endif
