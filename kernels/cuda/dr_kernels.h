// C interface of the dr_scale CUDA kernels (implemented in the .cu files beside this header).
// Tensors are contiguous, row-major; `dtype` is DR_FP32 / DR_BF16 / DR_FP16 (common.cuh);
// statistics and partial sums are fp32. Every launcher returns the launch's cudaError_t.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// RMSNorm over the last dimension: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
cudaError_t dr_rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd,
                            int64_t rows, int64_t cols, float eps, cudaStream_t stream);
// dx per row; dw_partial[ceil(rows / rows_per_block), cols] fp32, to be summed over its first
// dim. rows_per_block: dr_norm_bwd_rows_per_block(rows) (set by the device's SM count).
int64_t dr_norm_bwd_rows_per_block(int64_t rows);
cudaError_t dr_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w,
                            const float* rstd, void* dx, float* dw_partial, int64_t rows,
                            int64_t cols, int64_t rows_per_block, cudaStream_t stream);

// LayerNorm over the last dimension (w and b may not be null).
cudaError_t dr_layer_norm_fwd(int dtype, const void* x, const void* w, const void* b, void* y,
                              float* mean, float* rstd, int64_t rows, int64_t cols, float eps,
                              cudaStream_t stream);
cudaError_t dr_layer_norm_bwd(int dtype, const void* dy, const void* x, const void* w,
                              const float* mean, const float* rstd, void* dx, float* dw_partial,
                              float* db_partial, int64_t rows, int64_t cols,
                              int64_t rows_per_block, cudaStream_t stream);

// SwiGLU: y = silu(gate) * up, elementwise over n values.
cudaError_t dr_swiglu_fwd(int dtype, const void* gate, const void* up, void* y, int64_t n,
                          cudaStream_t stream);
cudaError_t dr_swiglu_bwd(int dtype, const void* dy, const void* gate, const void* up,
                          void* dgate, void* dup, int64_t n, cudaStream_t stream);

// Bias + GeLU (tanh approximation): y = gelu(x + bias[col]); dbias is dx summed over rows.
cudaError_t dr_bias_gelu_fwd(int dtype, const void* x, const void* bias, void* y, int64_t rows,
                             int64_t cols, cudaStream_t stream);
cudaError_t dr_bias_gelu_bwd(int dtype, const void* dy, const void* x, const void* bias, void* dx,
                             int64_t rows, int64_t cols, cudaStream_t stream);

// Rotary embedding, half-split layout: x (rows = batch*heads*seq, head_dim), cos/sin fp32
// (seq, head_dim); sign = +1 applies the rotation, -1 its transpose (the backward pass).
cudaError_t dr_rotary(int dtype, const void* x, const float* cos, const float* sin, void* y,
                      int64_t rows, int64_t seq, int64_t head_dim, float sign,
                      cudaStream_t stream);

#ifdef __cplusplus
}
#endif
