// RMSNorm and LayerNorm, forward and backward. One block per row for the row statistics and dx;
// weight (and bias) gradients as fp32 partial sums over chunks of 512 rows, summed by the caller
// (a column-parallel pass that stays coalesced, instead of per-row atomics).
#include "common.cuh"
#include "dr_kernels.h"

static constexpr int kThreads = 256;
static constexpr int kRowChunk = 512;

template <typename T>
__global__ void rms_fwd_kernel(const T* x, const T* w, T* y, float* rstd, int64_t cols,
                               float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float sq = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_f32(xr[c]);
    sq += v * v;
  }
  const float r = rsqrtf(block_sum(sq) / cols + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    y[row * cols + c] = from_f32<T>(to_f32(xr[c]) * r * to_f32(w[c]));
}

template <typename T>
__global__ void rms_bwd_dx_kernel(const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                                  int64_t cols) {
  const int64_t row = blockIdx.x;
  const float r = rstd[row];
  float dot = 0.f;  // sum(dy * w * xhat)
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dot += to_f32(dy[row * cols + c]) * to_f32(w[c]) * to_f32(x[row * cols + c]) * r;
  const float mean_dot = block_sum(dot) / cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = to_f32(x[row * cols + c]) * r;
    const float g = to_f32(dy[row * cols + c]) * to_f32(w[c]);
    dx[row * cols + c] = from_f32<T>(r * (g - xhat * mean_dot));
  }
}

// grid: (ceil(cols / kThreads), ceil(rows / kRowChunk)); each thread one column of one chunk.
template <typename T>
__global__ void rms_bwd_dw_kernel(const T* dy, const T* x, const float* rstd, float* dw_partial,
                                  int64_t rows, int64_t cols) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = (int64_t)blockIdx.y * kRowChunk;
  const int64_t r1 = min(rows, r0 + kRowChunk);
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r) acc += to_f32(dy[r * cols + c]) * to_f32(x[r * cols + c]) * rstd[r];
  dw_partial[blockIdx.y * cols + c] = acc;
}

template <typename T>
__global__ void ln_fwd_kernel(const T* x, const T* w, const T* b, T* y, float* mean_out,
                              float* rstd_out, int64_t cols, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += to_f32(xr[c]);
  const float mean = block_sum(s) / cols;
  float var = 0.f;  // two passes over the row: exact variance without catastrophic cancellation
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_f32(xr[c]) - mean;
    var += d * d;
  }
  const float r = rsqrtf(block_sum(var) / cols + eps);
  if (threadIdx.x == 0) { mean_out[row] = mean; rstd_out[row] = r; }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    y[row * cols + c] = from_f32<T>((to_f32(xr[c]) - mean) * r * to_f32(w[c]) + to_f32(b[c]));
}

template <typename T>
__global__ void ln_bwd_dx_kernel(const T* dy, const T* x, const T* w, const float* mean,
                                 const float* rstd, T* dx, int64_t cols) {
  const int64_t row = blockIdx.x;
  const float mu = mean[row], r = rstd[row];
  float sum_g = 0.f, sum_gx = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_f32(dy[row * cols + c]) * to_f32(w[c]);
    sum_g += g;
    sum_gx += g * (to_f32(x[row * cols + c]) - mu) * r;
  }
  const float mean_g = block_sum(sum_g) / cols;
  const float mean_gx = block_sum(sum_gx) / cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_f32(x[row * cols + c]) - mu) * r;
    const float g = to_f32(dy[row * cols + c]) * to_f32(w[c]);
    dx[row * cols + c] = from_f32<T>(r * (g - mean_g - xhat * mean_gx));
  }
}

template <typename T>
__global__ void ln_bwd_dwdb_kernel(const T* dy, const T* x, const float* mean, const float* rstd,
                                   float* dw_partial, float* db_partial, int64_t rows,
                                   int64_t cols) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = (int64_t)blockIdx.y * kRowChunk;
  const int64_t r1 = min(rows, r0 + kRowChunk);
  float dw = 0.f, db = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float g = to_f32(dy[r * cols + c]);
    dw += g * (to_f32(x[r * cols + c]) - mean[r]) * rstd[r];
    db += g;
  }
  dw_partial[blockIdx.y * cols + c] = dw;
  db_partial[blockIdx.y * cols + c] = db;
}

static dim3 column_grid(int64_t rows, int64_t cols) {
  return dim3((unsigned)((cols + kThreads - 1) / kThreads),
              (unsigned)((rows + kRowChunk - 1) / kRowChunk));
}

extern "C" cudaError_t dr_rms_norm_fwd(int dtype, const void* x, const void* w, void* y,
                                       float* rstd, int64_t rows, int64_t cols, float eps,
                                       cudaStream_t stream) {
  DR_DISPATCH(dtype, T, rms_fwd_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
      (const T*)x, (const T*)w, (T*)y, rstd, cols, eps));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w,
                                       const float* rstd, void* dx, float* dw_partial,
                                       int64_t rows, int64_t cols, cudaStream_t stream) {
  DR_DISPATCH(dtype, T,
    rms_bwd_dx_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
        (const T*)dy, (const T*)x, (const T*)w, rstd, (T*)dx, cols);
    rms_bwd_dw_kernel<T><<<column_grid(rows, cols), kThreads, 0, stream>>>(
        (const T*)dy, (const T*)x, rstd, dw_partial, rows, cols));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_layer_norm_fwd(int dtype, const void* x, const void* w, const void* b,
                                         void* y, float* mean, float* rstd, int64_t rows,
                                         int64_t cols, float eps, cudaStream_t stream) {
  DR_DISPATCH(dtype, T, ln_fwd_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
      (const T*)x, (const T*)w, (const T*)b, (T*)y, mean, rstd, cols, eps));
  return cudaGetLastError();
}

extern "C" cudaError_t dr_layer_norm_bwd(int dtype, const void* dy, const void* x, const void* w,
                                         const float* mean, const float* rstd, void* dx,
                                         float* dw_partial, float* db_partial, int64_t rows,
                                         int64_t cols, cudaStream_t stream) {
  DR_DISPATCH(dtype, T,
    ln_bwd_dx_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
        (const T*)dy, (const T*)x, (const T*)w, mean, rstd, (T*)dx, cols);
    ln_bwd_dwdb_kernel<T><<<column_grid(rows, cols), kThreads, 0, stream>>>(
        (const T*)dy, (const T*)x, mean, rstd, dw_partial, db_partial, rows, cols));
  return cudaGetLastError();
}
