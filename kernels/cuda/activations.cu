// SwiGLU and bias + GeLU (tanh approximation), forward and backward, elementwise in fp32.
#include "common.cuh"
#include "dr_kernels.h"

static constexpr int kThreads = 256;

static unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return (unsigned)(b < 65535 * 32 ? b : 65535 * 32);  // grid-stride loops cover the rest
}

template <typename T>
__global__ void swiglu_fwd_kernel(const T* gate, const T* up, T* y, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float a = to_f32(gate[i]);
    y[i] = from_f32<T>(a / (1.f + __expf(-a)) * to_f32(up[i]));
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup,
                                  int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float a = to_f32(gate[i]), u = to_f32(up[i]), g = to_f32(dy[i]);
    const float sig = 1.f / (1.f + __expf(-a));
    dgate[i] = from_f32<T>(g * u * sig * (1.f + a * (1.f - sig)));
    dup[i] = from_f32<T>(g * a * sig);
  }
}

__device__ __forceinline__ float gelu_tanh(float z, float* dgelu) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  const float inner = k * (z + 0.044715f * z * z * z);
  const float t = tanhf(inner);
  if (dgelu)
    *dgelu = 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * k * (1.f + 3.f * 0.044715f * z * z);
  return 0.5f * z * (1.f + t);
}

template <typename T>
__global__ void bias_gelu_fwd_kernel(const T* x, const T* bias, T* y, int64_t n, int64_t cols) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = from_f32<T>(gelu_tanh(to_f32(x[i]) + to_f32(bias[i % cols]), nullptr));
}

template <typename T>
__global__ void bias_gelu_bwd_kernel(const T* dy, const T* x, const T* bias, T* dx, int64_t n,
                                     int64_t cols) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float d;
    gelu_tanh(to_f32(x[i]) + to_f32(bias[i % cols]), &d);
    dx[i] = from_f32<T>(to_f32(dy[i]) * d);
  }
}

extern "C" cudaError_t dr_swiglu_fwd(int dtype, const void* gate, const void* up, void* y,
                                     int64_t n, cudaStream_t stream) {
  DR_DISPATCH(dtype, T, swiglu_fwd_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
      (const T*)gate, (const T*)up, (T*)y, n));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_swiglu_bwd(int dtype, const void* dy, const void* gate, const void* up,
                                     void* dgate, void* dup, int64_t n, cudaStream_t stream) {
  DR_DISPATCH(dtype, T, swiglu_bwd_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
      (const T*)dy, (const T*)gate, (const T*)up, (T*)dgate, (T*)dup, n));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_bias_gelu_fwd(int dtype, const void* x, const void* bias, void* y,
                                        int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  DR_DISPATCH(dtype, T, bias_gelu_fwd_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
      (const T*)x, (const T*)bias, (T*)y, n, cols));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_bias_gelu_bwd(int dtype, const void* dy, const void* x,
                                        const void* bias, void* dx, int64_t rows, int64_t cols,
                                        cudaStream_t stream) {
  const int64_t n = rows * cols;
  DR_DISPATCH(dtype, T, bias_gelu_bwd_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
      (const T*)dy, (const T*)x, (const T*)bias, (T*)dx, n, cols));
  return cudaGetLastError();
}
