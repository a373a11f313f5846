// SwiGLU and bias + GeLU (tanh approximation), forward and backward, elementwise in fp32.
// Each thread takes N values at a time: a 128-bit pack where the element count (for bias + GeLU,
// the row length) is a multiple of the pack and every pointer is 16-byte aligned, else N = 1.
#include <initializer_list>

#include "common.cuh"
#include "dr_kernels.h"

static constexpr int kThreads = 256;

static unsigned blocks_for(int64_t groups) {
  const int64_t b = (groups + kThreads - 1) / kThreads;
  return (unsigned)(b < 65535 * 32 ? b : 65535 * 32);  // grid-stride loops cover the rest
}

// Launch kernel<T, N> with N the pack size when `packed`, else 1; over n / N groups.
#define DR_PACKED_LAUNCH(packed, n, kernel, ...)                                         \
  if (packed) {                                                                          \
    constexpr int N = Pack<T>::N;                                                        \
    kernel<T, N><<<blocks_for((n) / N), kThreads, 0, stream>>>(__VA_ARGS__);             \
  } else {                                                                               \
    kernel<T, 1><<<blocks_for(n), kThreads, 0, stream>>>(__VA_ARGS__);                  \
  }

#define DR_GRID_STRIDE(i, groups)                                                        \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (groups);       \
       i += (int64_t)gridDim.x * blockDim.x)

template <typename T, int N>
__global__ void swiglu_fwd_kernel(const T* gate, const T* up, T* y, int64_t n) {
  DR_GRID_STRIDE(i, n / N) {
    float a[N], u[N];
    load_n<T, N>(gate + i * N, a);
    load_n<T, N>(up + i * N, u);
#pragma unroll
    for (int k = 0; k < N; ++k) a[k] = a[k] / (1.f + __expf(-a[k])) * u[k];
    store_n<T, N>(y + i * N, a);
  }
}

template <typename T, int N>
__global__ void swiglu_bwd_kernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup,
                                  int64_t n) {
  DR_GRID_STRIDE(i, n / N) {
    float a[N], u[N], g[N], da[N], du[N];
    load_n<T, N>(gate + i * N, a);
    load_n<T, N>(up + i * N, u);
    load_n<T, N>(dy + i * N, g);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float sig = 1.f / (1.f + __expf(-a[k]));
      da[k] = g[k] * u[k] * sig * (1.f + a[k] * (1.f - sig));
      du[k] = g[k] * a[k] * sig;
    }
    store_n<T, N>(dgate + i * N, da);
    store_n<T, N>(dup + i * N, du);
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

// a group of N never crosses a row: N divides cols on the packed path
template <typename T, int N>
__global__ void bias_gelu_fwd_kernel(const T* x, const T* bias, T* y, int64_t n, int64_t cols) {
  DR_GRID_STRIDE(i, n / N) {
    float v[N], b[N];
    load_n<T, N>(x + i * N, v);
    load_n<T, N>(bias + (i * N) % cols, b);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = gelu_tanh(v[k] + b[k], nullptr);
    store_n<T, N>(y + i * N, v);
  }
}

template <typename T, int N>
__global__ void bias_gelu_bwd_kernel(const T* dy, const T* x, const T* bias, T* dx, int64_t n,
                                     int64_t cols) {
  DR_GRID_STRIDE(i, n / N) {
    float v[N], b[N], g[N];
    load_n<T, N>(x + i * N, v);
    load_n<T, N>(bias + (i * N) % cols, b);
    load_n<T, N>(dy + i * N, g);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float d;
      gelu_tanh(v[k] + b[k], &d);
      g[k] *= d;
    }
    store_n<T, N>(dx + i * N, g);
  }
}

template <typename T>
static bool packs(int64_t count, std::initializer_list<const void*> ptrs) {
  if (count % Pack<T>::N) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

extern "C" cudaError_t dr_swiglu_fwd(int dtype, const void* gate, const void* up, void* y,
                                     int64_t n, cudaStream_t stream) {
  DR_DISPATCH(dtype, T, DR_PACKED_LAUNCH(packs<T>(n, {gate, up, y}), n, swiglu_fwd_kernel,
                                         (const T*)gate, (const T*)up, (T*)y, n));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_swiglu_bwd(int dtype, const void* dy, const void* gate, const void* up,
                                     void* dgate, void* dup, int64_t n, cudaStream_t stream) {
  DR_DISPATCH(dtype, T, DR_PACKED_LAUNCH(packs<T>(n, {dy, gate, up, dgate, dup}), n,
                                         swiglu_bwd_kernel, (const T*)dy, (const T*)gate,
                                         (const T*)up, (T*)dgate, (T*)dup, n));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_bias_gelu_fwd(int dtype, const void* x, const void* bias, void* y,
                                        int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  DR_DISPATCH(dtype, T, DR_PACKED_LAUNCH(packs<T>(cols, {x, bias, y}), n, bias_gelu_fwd_kernel,
                                         (const T*)x, (const T*)bias, (T*)y, n, cols));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_bias_gelu_bwd(int dtype, const void* dy, const void* x,
                                        const void* bias, void* dx, int64_t rows, int64_t cols,
                                        cudaStream_t stream) {
  const int64_t n = rows * cols;
  DR_DISPATCH(dtype, T, DR_PACKED_LAUNCH(packs<T>(cols, {dy, x, bias, dx}), n,
                                         bias_gelu_bwd_kernel, (const T*)dy, (const T*)x,
                                         (const T*)bias, (T*)dx, n, cols));
  return cudaGetLastError();
}
