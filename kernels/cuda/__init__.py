"""Fused CUDA kernels (norms, SwiGLU, bias + GeLU, rotary): what the model calls.

The kernels are torch-free .cu files behind a C interface (dr_kernels.h); binding.cpp is a thin
torch layer over it that checks every argument; library.py makes them torch.library custom ops
(with CPU and fake implementations and autograd) that torch.compile traces through. The extension
is built by torch.utils.cpp_extension on first use on a GPU, once per node (build.py; a minute or
two, then cached under ~/.cache/torch_extensions).
"""
import os
import socket
from pathlib import Path

import torch

from dr_scale.kernels.cuda import build, library
from dr_scale.runtime.ranks import local_rank

HERE = Path(__file__).resolve().parent
SOURCES = ["binding.cpp", "norms.cu", "activations.cu", "rotary.cu"]
HEADERS = ["dr_kernels.h", "common.cuh"]
_ext = None
_failure = None


def unavailable_reason():
    """None where the extension can be built and run here, else why not (the build is tried once;
    the launcher prints the reason at start)."""
    global _failure
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if _ext is None and _failure is None:
        try:
            extension()
        except build.BuildFailed as e:  # falls back to the next implementation, saying why
            _failure = str(e)
        except Exception as e:
            _failure = f"the CUDA extension did not load: {build.first_error(str(e))}"
    return _failure


def build_directory() -> Path:
    """Our own folder under torch's extension cache (TORCH_EXTENSIONS_DIR), per torch and CUDA
    version and per machine: the local rank 0s of several nodes sharing $HOME each build at once,
    and one folder would have them race on its lock and objects (a build is node-local work)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions"
    return (Path(root).expanduser() / f"dr_scale_cuda_torch{torch.__version__}_cu{torch.version.cuda}"
            / socket.gethostname())


def extension():
    """The built module: local rank 0 of each node builds it, the others wait and load it."""
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load

        where = build_directory()

        def compile_and_load():
            return load(name="dr_scale_cuda", sources=[str(HERE / s) for s in SOURCES],
                        extra_include_paths=[str(HERE)], extra_cflags=["-O3", "-std=c++20"],
                        extra_cuda_cflags=["-O3", "-std=c++20"], build_directory=str(where),
                        verbose=False)
        _ext = build.build_once(compile_and_load, where,
                                [HERE / s for s in (*SOURCES, *HEADERS)],
                                local_rank=local_rank())
    return _ext


def _rows(x):
    return x.contiguous().view(-1, x.shape[-1])


def rms_norm(x, weight, eps):
    return library.rms_norm_fwd(_rows(x), weight.contiguous(), float(eps))[0].view_as(x)


def layer_norm(x, weight, bias, eps):
    return library.layer_norm_fwd(_rows(x), weight.contiguous(), bias.contiguous(),
                                  float(eps))[0].view_as(x)


def swiglu(gate, up):
    return library.swiglu_fwd(gate.contiguous(), up.contiguous())


def bias_gelu(x, bias):
    return library.bias_gelu_fwd(x.contiguous(), bias.contiguous())


def apply_rotary(x, cos, sin):
    """x: (batch, heads, seq, head_dim); cos, sin: (seq, head_dim)."""
    return library.rotary(x.contiguous(), cos.float().contiguous(), sin.float().contiguous(), 1.0)
