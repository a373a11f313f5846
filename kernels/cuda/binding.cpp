// Thin torch binding over the C launchers in dr_kernels.h: checks and allocation. The caller
// passes the current CUDA stream as an integer (torch.cuda.current_stream().cuda_stream), which
// keeps this file free of torch's CUDA headers: it then compiles against any torch build, so CI
// (CPU-only torch) checks it too. The autograd wiring lives in Python (kernels/cuda/__init__.py).
#include <torch/extension.h>
#include "dr_kernels.h"

namespace {

int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return 0;
    case torch::kBFloat16: return 1;
    case torch::kFloat16: return 2;
    default: TORCH_CHECK(false, "dr_scale cuda kernels: unsupported dtype ", t.scalar_type());
  }
  return -1;
}

// Every argument is checked before a kernel reads it: a weight in another dtype than the input
// would otherwise be read as the input's dtype (silent garbage), a strided view as contiguous.
void check(const char* op, const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "dr_scale ", op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == like.device(), "dr_scale ", op, ": ", name, " is on ", t.device(),
              ", the input on ", like.device());
  TORCH_CHECK(t.is_contiguous(), "dr_scale ", op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "dr_scale ", op, ": ", name, " is ",
              t.scalar_type(), ", the input ", like.scalar_type(), " (one dtype for all)");
}

void check_same_shape(const char* op, const torch::Tensor& t, const char* name,
                      const torch::Tensor& like) {
  TORCH_CHECK(t.sizes() == like.sizes(), "dr_scale ", op, ": ", name, " has shape ", t.sizes(),
              ", expected ", like.sizes());
}

void check_vector(const char* op, const torch::Tensor& t, const char* name, int64_t cols) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == cols, "dr_scale ", op, ": ", name, " has shape ",
              t.sizes(), ", expected [", cols, "] (the input's last dimension)");
}

void check_stats(const char* op, const torch::Tensor& t, const char* name,
                 const torch::Tensor& x, int64_t rows) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device() && t.is_contiguous() &&
              t.scalar_type() == torch::kFloat32 && t.numel() == rows,
              "dr_scale ", op, ": ", name, " must be a contiguous fp32 CUDA tensor of ", rows,
              " values on the input's device");
}

int64_t last_dim(const char* op, const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "dr_scale ", op, ": input has shape ", x.sizes());
  return x.size(-1);
}

void ok(cudaError_t e) { TORCH_CHECK(e == cudaSuccess, "dr_scale cuda kernel: ", cudaGetErrorString(e)); }

cudaStream_t as_stream(int64_t s) { return reinterpret_cast<cudaStream_t>(s); }

std::vector<torch::Tensor> rms_norm_fwd(torch::Tensor x, torch::Tensor w, double eps, int64_t stream) {
  const char* op = "rms_norm";
  check(op, x, "x", x); check(op, w, "weight", x);
  const int64_t cols = last_dim(op, x), rows = x.numel() / cols;
  check_vector(op, w, "weight", cols);
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  ok(dr_rms_norm_fwd(dtype_code(x), x.data_ptr(), w.data_ptr(), y.data_ptr(),
                     rstd.data_ptr<float>(), rows, cols, (float)eps, as_stream(stream)));
  return {y, rstd};
}

std::vector<torch::Tensor> rms_norm_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor w,
                                        torch::Tensor rstd, int64_t stream) {
  const char* op = "rms_norm backward";
  check(op, x, "x", x); check(op, dy, "dy", x); check(op, w, "weight", x);
  check_same_shape(op, dy, "dy", x);
  const int64_t cols = last_dim(op, x), rows = x.numel() / cols;
  check_vector(op, w, "weight", cols);
  check_stats(op, rstd, "rstd", x, rows);
  auto dx = torch::empty_like(x);
  const int64_t per_block = dr_norm_bwd_rows_per_block(rows);
  auto partial = torch::empty({(rows + per_block - 1) / per_block, cols},
                              x.options().dtype(torch::kFloat32));
  ok(dr_rms_norm_bwd(dtype_code(x), dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                     rstd.data_ptr<float>(), dx.data_ptr(), partial.data_ptr<float>(), rows,
                     cols, per_block, as_stream(stream)));
  return {dx, partial.sum(0).to(w.scalar_type())};
}

std::vector<torch::Tensor> layer_norm_fwd(torch::Tensor x, torch::Tensor w, torch::Tensor b,
                                          double eps, int64_t stream) {
  const char* op = "layer_norm";
  check(op, x, "x", x); check(op, w, "weight", x); check(op, b, "bias", x);
  const int64_t cols = last_dim(op, x), rows = x.numel() / cols;
  check_vector(op, w, "weight", cols); check_vector(op, b, "bias", cols);
  auto y = torch::empty_like(x);
  auto mean = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  ok(dr_layer_norm_fwd(dtype_code(x), x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(),
                       mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols, (float)eps,
                       as_stream(stream)));
  return {y, mean, rstd};
}

std::vector<torch::Tensor> layer_norm_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor w,
                                          torch::Tensor mean, torch::Tensor rstd, int64_t stream) {
  const char* op = "layer_norm backward";
  check(op, x, "x", x); check(op, dy, "dy", x); check(op, w, "weight", x);
  check_same_shape(op, dy, "dy", x);
  const int64_t cols = last_dim(op, x), rows = x.numel() / cols;
  check_vector(op, w, "weight", cols);
  check_stats(op, mean, "mean", x, rows); check_stats(op, rstd, "rstd", x, rows);
  auto dx = torch::empty_like(x);
  auto opts = x.options().dtype(torch::kFloat32);
  const int64_t per_block = dr_norm_bwd_rows_per_block(rows);
  auto dw = torch::empty({(rows + per_block - 1) / per_block, cols}, opts);
  auto db = torch::empty_like(dw);
  ok(dr_layer_norm_bwd(dtype_code(x), dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                       mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr(),
                       dw.data_ptr<float>(), db.data_ptr<float>(), rows, cols, per_block,
                       as_stream(stream)));
  return {dx, dw.sum(0).to(w.scalar_type()), db.sum(0).to(w.scalar_type())};
}

torch::Tensor swiglu_fwd(torch::Tensor gate, torch::Tensor up, int64_t stream) {
  const char* op = "swiglu";
  check(op, gate, "gate", gate); check(op, up, "up", gate);
  check_same_shape(op, up, "up", gate);
  auto y = torch::empty_like(gate);
  ok(dr_swiglu_fwd(dtype_code(gate), gate.data_ptr(), up.data_ptr(), y.data_ptr(), gate.numel(),
                   as_stream(stream)));
  return y;
}

std::vector<torch::Tensor> swiglu_bwd(torch::Tensor dy, torch::Tensor gate, torch::Tensor up, int64_t stream) {
  const char* op = "swiglu backward";
  check(op, gate, "gate", gate); check(op, up, "up", gate); check(op, dy, "dy", gate);
  check_same_shape(op, up, "up", gate); check_same_shape(op, dy, "dy", gate);
  auto dgate = torch::empty_like(gate), dup = torch::empty_like(up);
  ok(dr_swiglu_bwd(dtype_code(gate), dy.data_ptr(), gate.data_ptr(), up.data_ptr(),
                   dgate.data_ptr(), dup.data_ptr(), gate.numel(), as_stream(stream)));
  return {dgate, dup};
}

torch::Tensor bias_gelu_fwd(torch::Tensor x, torch::Tensor bias, int64_t stream) {
  const char* op = "bias_gelu";
  check(op, x, "x", x); check(op, bias, "bias", x);
  const int64_t cols = last_dim(op, x), rows = x.numel() / cols;
  check_vector(op, bias, "bias", cols);
  auto y = torch::empty_like(x);
  ok(dr_bias_gelu_fwd(dtype_code(x), x.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, cols,
                      as_stream(stream)));
  return y;
}

torch::Tensor bias_gelu_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor bias, int64_t stream) {
  const char* op = "bias_gelu backward";
  check(op, x, "x", x); check(op, bias, "bias", x); check(op, dy, "dy", x);
  check_same_shape(op, dy, "dy", x);
  const int64_t cols = last_dim(op, x), rows = x.numel() / cols;
  check_vector(op, bias, "bias", cols);
  auto dx = torch::empty_like(x);
  ok(dr_bias_gelu_bwd(dtype_code(x), dy.data_ptr(), x.data_ptr(), bias.data_ptr(), dx.data_ptr(),
                      rows, cols, as_stream(stream)));
  return dx;
}

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, double sign, int64_t stream) {
  const char* op = "rotary";
  check(op, x, "x", x);
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "dr_scale rotary: x has shape ", x.sizes(),
              ", expected (..., seq, head_dim) with an even head_dim");
  const int64_t head_dim = x.size(-1), seq = x.size(-2), rows = x.numel() / head_dim;
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_cuda() && t->device() == x.device() && t->is_contiguous() &&
                t->scalar_type() == torch::kFloat32 && t->dim() == 2 && t->size(0) == seq &&
                t->size(1) == head_dim, "dr_scale rotary: cos and sin must be contiguous fp32 "
                "CUDA tensors of shape [", seq, ", ", head_dim, "] on x's device, got ",
                t->sizes(), " ", t->scalar_type());
  }
  auto y = torch::empty_like(x);
  ok(dr_rotary(dtype_code(x), x.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(),
               y.data_ptr(), rows, seq, head_dim, (float)sign, as_stream(stream)));
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_fwd", &rms_norm_fwd);
  m.def("rms_norm_bwd", &rms_norm_bwd);
  m.def("layer_norm_fwd", &layer_norm_fwd);
  m.def("layer_norm_bwd", &layer_norm_bwd);
  m.def("swiglu_fwd", &swiglu_fwd);
  m.def("swiglu_bwd", &swiglu_bwd);
  m.def("bias_gelu_fwd", &bias_gelu_fwd);
  m.def("bias_gelu_bwd", &bias_gelu_bwd);
  m.def("rotary", &rotary);
}
