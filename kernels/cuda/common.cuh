// Shared helpers for the dr_scale CUDA kernels: dtype codes, loads/stores through fp32, block sums.
// Torch-free on purpose: these files compile with plain nvcc (CI compile-checks them that way).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// dtype codes shared with binding.cpp
#define DR_FP32 0
#define DR_BF16 1
#define DR_FP16 2

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half(v); }

// 128-bit memory access: a Pack is 16 bytes of T (8 bf16/fp16 or 4 fp32), read or written in one
// instruction and converted to/from fp32 registers. Used where the row length (or element
// count) is a multiple of the pack and the pointers are 16-byte aligned (aligned16); the
// kernels keep a scalar path for the rest.
template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ void load_pack(const T* p, float* out) {
  const Pack<T> pk = *reinterpret_cast<const Pack<T>*>(p);
#pragma unroll
  for (int i = 0; i < Pack<T>::N; ++i) out[i] = to_f32(pk.v[i]);
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const float* in) {
  Pack<T> pk;
#pragma unroll
  for (int i = 0; i < Pack<T>::N; ++i) pk.v[i] = from_f32<T>(in[i]);
  *reinterpret_cast<Pack<T>*>(p) = pk;
}

// N values at p: one 128-bit access when N fills a Pack, else N scalar ones (N = 1: the path
// for sizes or pointers that do not allow packs).
template <typename T, int N>
__device__ __forceinline__ void load_n(const T* p, float* out) {
  if constexpr (N == Pack<T>::N) {
    load_pack(p, out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_f32(p[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_n(T* p, const float* in) {
  if constexpr (N == Pack<T>::N) {
    store_pack(p, in);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_f32<T>(in[i]);
  }
}

static inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Sum over a block of up to 1024 threads; every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffff, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = (blockDim.x + 31) >> 5;
    float w = lane < n_warps ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) w += __shfl_down_sync(0xffffffff, w, offset);
    if (lane == 0) total = w;
  }
  __syncthreads();
  const float out = total;
  __syncthreads();  // warp_sums and total are reused by the next call
  return out;
}

// Dispatch a templated launch on a dtype code; returns cudaErrorInvalidValue for unknown codes.
#define DR_DISPATCH(dtype, T, ...)                       \
  switch (dtype) {                                       \
    case DR_FP32: { typedef float T; __VA_ARGS__; break; }          \
    case DR_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; break; }  \
    case DR_FP16: { typedef __half T; __VA_ARGS__; break; }         \
    default: return cudaErrorInvalidValue;               \
  }
