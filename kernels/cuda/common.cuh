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
