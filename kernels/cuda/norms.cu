// RMSNorm and LayerNorm, forward and backward.
//
// Vector path (the row a multiple of 16 bytes, pointers 16-byte aligned, up to kMaxPacks packs a
// thread): each thread keeps its packs of the row in registers, read with 128-bit loads once.
//   forward:  one read of x, statistics from registers, one write of y;
//   backward: one pass per row over x and dy (read once), dx written, and the weight (and bias)
//             gradient accumulated in registers over the block's rows: fused, no second pass.
// Each backward block takes a run of rows and writes one fp32 partial row of dw (and db), summed
// by the caller; the number of blocks is set by the device's SM count (dr_norm_bwd_rows_per_block).
// Scalar path (anything else): one block per row for the statistics and dx, and a column-parallel
// pass over the same runs of rows for dw/db.
#include "common.cuh"
#include "dr_kernels.h"

static constexpr int kThreads = 256;
static constexpr int kMaxPacks = 4;  // per thread: 8,192 bf16 / 4,096 fp32 columns at most

template <typename T>
static int packs_per_thread(int64_t cols) {
  const int64_t n = Pack<T>::N;
  if (cols % n) return 0;
  const int64_t per = (cols / n + kThreads - 1) / kThreads;
  return per <= 1 ? 1 : per <= 2 ? 2 : per <= kMaxPacks ? kMaxPacks : 0;
}

// ---- vector path ---------------------------------------------------------------------------

template <typename T, int P>
__global__ void rms_fwd_vec(const T* x, const T* w, T* y, float* rstd, int64_t cols, float eps) {
  constexpr int N = Pack<T>::N;
  const int64_t row = blockIdx.x, packs = cols / N;
  float v[P][N];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
    if (j < packs) {
      load_pack(x + row * cols + j * N, v[i]);
#pragma unroll
      for (int k = 0; k < N; ++k) sq += v[i][k] * v[i][k];
    }
  }
  const float r = rsqrtf(block_sum(sq) / cols + eps);
  if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
    if (j < packs) {
      float wv[N];
      load_pack(w + j * N, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[i][k] *= r * wv[k];
      store_pack(y + row * cols + j * N, v[i]);
    }
  }
}

template <typename T, int P>
__global__ void rms_bwd_vec(const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                            float* dw_partial, int64_t rows, int64_t cols,
                            int64_t rows_per_block) {
  constexpr int N = Pack<T>::N;
  const int64_t packs = cols / N;
  float wv[P][N], dw[P][N];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
#pragma unroll
    for (int k = 0; k < N; ++k) dw[i][k] = 0.f;
    if (j < packs) load_pack(w + j * N, wv[i]);
  }
  const int64_t r0 = (int64_t)blockIdx.x * rows_per_block;
  const int64_t r1 = min(rows, r0 + rows_per_block);
  for (int64_t row = r0; row < r1; ++row) {  // uniform over the block: block_sum is safe
    const float r = rstd[row];
    float xh[P][N], g[P][N];
    float dot = 0.f;  // sum(dy * w * xhat)
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int64_t j = threadIdx.x + (int64_t)i * kThreads;
      if (j < packs) {
        load_pack(x + row * cols + j * N, xh[i]);
        load_pack(dy + row * cols + j * N, g[i]);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          xh[i][k] *= r;
          dw[i][k] += g[i][k] * xh[i][k];
          g[i][k] *= wv[i][k];
          dot += g[i][k] * xh[i][k];
        }
      }
    }
    const float mean_dot = block_sum(dot) / cols;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int64_t j = threadIdx.x + (int64_t)i * kThreads;
      if (j < packs) {
#pragma unroll
        for (int k = 0; k < N; ++k) g[i][k] = r * (g[i][k] - xh[i][k] * mean_dot);
        store_pack(dx + row * cols + j * N, g[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
    if (j < packs) {
#pragma unroll
      for (int k = 0; k < N; ++k) dw_partial[blockIdx.x * cols + j * N + k] = dw[i][k];
    }
  }
}

template <typename T, int P>
__global__ void ln_fwd_vec(const T* x, const T* w, const T* b, T* y, float* mean_out,
                           float* rstd_out, int64_t cols, float eps) {
  constexpr int N = Pack<T>::N;
  const int64_t row = blockIdx.x, packs = cols / N;
  float v[P][N];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
    if (j < packs) {
      load_pack(x + row * cols + j * N, v[i]);
#pragma unroll
      for (int k = 0; k < N; ++k) s += v[i][k];
    }
  }
  const float mean = block_sum(s) / cols;
  float var = 0.f;  // from the registers: exact two-pass variance, one read of the row
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
    if (j < packs) {
#pragma unroll
      for (int k = 0; k < N; ++k) var += (v[i][k] - mean) * (v[i][k] - mean);
    }
  }
  const float r = rsqrtf(block_sum(var) / cols + eps);
  if (threadIdx.x == 0) { mean_out[row] = mean; rstd_out[row] = r; }
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
    if (j < packs) {
      float wv[N], bv[N];
      load_pack(w + j * N, wv);
      load_pack(b + j * N, bv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[i][k] = (v[i][k] - mean) * r * wv[k] + bv[k];
      store_pack(y + row * cols + j * N, v[i]);
    }
  }
}

template <typename T, int P>
__global__ void ln_bwd_vec(const T* dy, const T* x, const T* w, const float* mean,
                           const float* rstd, T* dx, float* dw_partial, float* db_partial,
                           int64_t rows, int64_t cols, int64_t rows_per_block) {
  constexpr int N = Pack<T>::N;
  const int64_t packs = cols / N;
  float wv[P][N], dw[P][N], db[P][N];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
#pragma unroll
    for (int k = 0; k < N; ++k) dw[i][k] = db[i][k] = 0.f;
    if (j < packs) load_pack(w + j * N, wv[i]);
  }
  const int64_t r0 = (int64_t)blockIdx.x * rows_per_block;
  const int64_t r1 = min(rows, r0 + rows_per_block);
  for (int64_t row = r0; row < r1; ++row) {
    const float mu = mean[row], r = rstd[row];
    float xh[P][N], g[P][N];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int64_t j = threadIdx.x + (int64_t)i * kThreads;
      if (j < packs) {
        load_pack(x + row * cols + j * N, xh[i]);
        load_pack(dy + row * cols + j * N, g[i]);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          xh[i][k] = (xh[i][k] - mu) * r;
          dw[i][k] += g[i][k] * xh[i][k];
          db[i][k] += g[i][k];
          g[i][k] *= wv[i][k];
          sum_g += g[i][k];
          sum_gx += g[i][k] * xh[i][k];
        }
      }
    }
    const float mean_g = block_sum(sum_g) / cols;
    const float mean_gx = block_sum(sum_gx) / cols;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int64_t j = threadIdx.x + (int64_t)i * kThreads;
      if (j < packs) {
#pragma unroll
        for (int k = 0; k < N; ++k) g[i][k] = r * (g[i][k] - mean_g - xh[i][k] * mean_gx);
        store_pack(dx + row * cols + j * N, g[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * kThreads;
    if (j < packs) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        dw_partial[blockIdx.x * cols + j * N + k] = dw[i][k];
        db_partial[blockIdx.x * cols + j * N + k] = db[i][k];
      }
    }
  }
}

// ---- scalar path ---------------------------------------------------------------------------

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

// grid: (ceil(cols / kThreads), blocks of rows_per_block rows); each thread one column.
template <typename T>
__global__ void rms_bwd_dw_kernel(const T* dy, const T* x, const float* rstd, float* dw_partial,
                                  int64_t rows, int64_t cols, int64_t rows_per_block) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_block;
  const int64_t r1 = min(rows, r0 + rows_per_block);
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
                                   int64_t cols, int64_t rows_per_block) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = (int64_t)blockIdx.y * rows_per_block;
  const int64_t r1 = min(rows, r0 + rows_per_block);
  float dw = 0.f, db = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float g = to_f32(dy[r * cols + c]);
    dw += g * (to_f32(x[r * cols + c]) - mean[r]) * rstd[r];
    db += g;
  }
  dw_partial[blockIdx.y * cols + c] = dw;
  db_partial[blockIdx.y * cols + c] = db;
}

// ---- launchers -----------------------------------------------------------------------------

static dim3 column_grid(int64_t blocks, int64_t cols) {
  return dim3((unsigned)((cols + kThreads - 1) / kThreads), (unsigned)blocks);
}

static int64_t blocks_of(int64_t rows, int64_t rows_per_block) {
  return (rows + rows_per_block - 1) / rows_per_block;
}

extern "C" int64_t dr_norm_bwd_rows_per_block(int64_t rows) {
  // about 4 blocks per SM: enough to fill the GPU, few partial rows for the caller to sum
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t blocks = 4 * (int64_t)sms;
  const int64_t per = (rows + blocks - 1) / blocks;
  return per > 0 ? per : 1;
}

// A launch templated on the packs per thread PP (1, 2 or kMaxPacks).
#define DR_NORM_VEC(P, ...)                                        \
  switch (P) {                                                     \
    case 1: { constexpr int PP = 1; __VA_ARGS__; break; }          \
    case 2: { constexpr int PP = 2; __VA_ARGS__; break; }          \
    default: { constexpr int PP = kMaxPacks; __VA_ARGS__; break; } \
  }

extern "C" cudaError_t dr_rms_norm_fwd(int dtype, const void* x, const void* w, void* y,
                                       float* rstd, int64_t rows, int64_t cols, float eps,
                                       cudaStream_t stream) {
  const bool aligned = aligned16(x) && aligned16(w) && aligned16(y);
  DR_DISPATCH(dtype, T,
    const int p = aligned ? packs_per_thread<T>(cols) : 0;
    if (p) {
      DR_NORM_VEC(p, rms_fwd_vec<T, PP><<<(unsigned)rows, kThreads, 0, stream>>>(
          (const T*)x, (const T*)w, (T*)y, rstd, cols, eps));
    } else {
      rms_fwd_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
          (const T*)x, (const T*)w, (T*)y, rstd, cols, eps);
    });
  return cudaGetLastError();
}

extern "C" cudaError_t dr_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w,
                                       const float* rstd, void* dx, float* dw_partial,
                                       int64_t rows, int64_t cols, int64_t rows_per_block,
                                       cudaStream_t stream) {
  const bool aligned = aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx);
  const int64_t blocks = blocks_of(rows, rows_per_block);
  DR_DISPATCH(dtype, T,
    const int p = aligned ? packs_per_thread<T>(cols) : 0;
    if (p) {
      DR_NORM_VEC(p, rms_bwd_vec<T, PP><<<(unsigned)blocks, kThreads, 0, stream>>>(
          (const T*)dy, (const T*)x, (const T*)w, rstd, (T*)dx, dw_partial, rows, cols,
          rows_per_block));
    } else {
      rms_bwd_dx_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
          (const T*)dy, (const T*)x, (const T*)w, rstd, (T*)dx, cols);
      rms_bwd_dw_kernel<T><<<column_grid(blocks, cols), kThreads, 0, stream>>>(
          (const T*)dy, (const T*)x, rstd, dw_partial, rows, cols, rows_per_block);
    });
  return cudaGetLastError();
}

extern "C" cudaError_t dr_layer_norm_fwd(int dtype, const void* x, const void* w, const void* b,
                                         void* y, float* mean, float* rstd, int64_t rows,
                                         int64_t cols, float eps, cudaStream_t stream) {
  const bool aligned = aligned16(x) && aligned16(w) && aligned16(b) && aligned16(y);
  DR_DISPATCH(dtype, T,
    const int p = aligned ? packs_per_thread<T>(cols) : 0;
    if (p) {
      DR_NORM_VEC(p, ln_fwd_vec<T, PP><<<(unsigned)rows, kThreads, 0, stream>>>(
          (const T*)x, (const T*)w, (const T*)b, (T*)y, mean, rstd, cols, eps));
    } else {
      ln_fwd_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
          (const T*)x, (const T*)w, (const T*)b, (T*)y, mean, rstd, cols, eps);
    });
  return cudaGetLastError();
}

extern "C" cudaError_t dr_layer_norm_bwd(int dtype, const void* dy, const void* x, const void* w,
                                         const float* mean, const float* rstd, void* dx,
                                         float* dw_partial, float* db_partial, int64_t rows,
                                         int64_t cols, int64_t rows_per_block,
                                         cudaStream_t stream) {
  const bool aligned = aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx);
  const int64_t blocks = blocks_of(rows, rows_per_block);
  DR_DISPATCH(dtype, T,
    const int p = aligned ? packs_per_thread<T>(cols) : 0;
    if (p) {
      DR_NORM_VEC(p, ln_bwd_vec<T, PP><<<(unsigned)blocks, kThreads, 0, stream>>>(
          (const T*)dy, (const T*)x, (const T*)w, mean, rstd, (T*)dx, dw_partial, db_partial,
          rows, cols, rows_per_block));
    } else {
      ln_bwd_dx_kernel<T><<<(unsigned)rows, kThreads, 0, stream>>>(
          (const T*)dy, (const T*)x, (const T*)w, mean, rstd, (T*)dx, cols);
      ln_bwd_dwdb_kernel<T><<<column_grid(blocks, cols), kThreads, 0, stream>>>(
          (const T*)dy, (const T*)x, mean, rstd, dw_partial, db_partial, rows, cols,
          rows_per_block);
    });
  return cudaGetLastError();
}
