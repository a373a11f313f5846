// Rotary position embedding in the half-split layout (pairs i and i + head_dim/2), as Llama
// checkpoints use it. The backward pass is the same rotation by the opposite angle (sign = -1).
#include "common.cuh"
#include "dr_kernels.h"

static constexpr int kThreads = 256;

template <typename T>
__global__ void rotary_kernel(const T* x, const float* cos, const float* sin, T* y, int64_t rows,
                              int64_t seq, int64_t head_dim, float sign) {
  const int64_t half = head_dim / 2;
  const int64_t n = rows * half;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / half, j = i % half;
    const int64_t pos = row % seq;  // rows are (batch, head, position) flattened
    const float x1 = to_f32(x[row * head_dim + j]), x2 = to_f32(x[row * head_dim + j + half]);
    const float c1 = cos[pos * head_dim + j], s1 = sign * sin[pos * head_dim + j];
    const float c2 = cos[pos * head_dim + j + half], s2 = sign * sin[pos * head_dim + j + half];
    y[row * head_dim + j] = from_f32<T>(x1 * c1 - x2 * s1);
    y[row * head_dim + j + half] = from_f32<T>(x2 * c2 + x1 * s2);
  }
}

extern "C" cudaError_t dr_rotary(int dtype, const void* x, const float* cos, const float* sin,
                                 void* y, int64_t rows, int64_t seq, int64_t head_dim, float sign,
                                 cudaStream_t stream) {
  const int64_t n = rows * (head_dim / 2);
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > 65535 * 32) blocks = 65535 * 32;
  DR_DISPATCH(dtype, T, rotary_kernel<T><<<(unsigned)blocks, kThreads, 0, stream>>>(
      (const T*)x, cos, sin, (T*)y, rows, seq, head_dim, sign));
  return cudaGetLastError();
}
