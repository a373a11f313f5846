"""Whether each decoder block runs compiled: `model.compile` false, true, or auto.

true compiles every decoder block on its own (regional compilation, torchtitan's way: one
compiled region, reused by every block of the same code) at the first step. auto measures one
block, forward and backward at the run's micro-batch, shapes and kernels, eager and compiled, on
rank 0, keeps the faster for every rank and caches the choice like the kernel choices
($DR_SCALE_CACHE/compile_choices.json, keyed by device, torch, dtype, shape, tokens, kernels):
a restart of the same job does not measure again. Where compiling is refused (with activation
checkpointing: parallel/checkpointing.py) auto is eager and says why.

Inductor's own cache lives in the run's cache folder (data.cache_dir/inductor, unless
TORCHINDUCTOR_CACHE_DIR is set), so a restart compiles from it in seconds.

The measured block is the unsplit one (under tensor parallelism a rank runs a slice of it).
"""
import os
import statistics
import time
from pathlib import Path

import torch

from dr_scale.errors import DrScaleError
from dr_scale.runtime import comm, disk_cache

CACHE = "compile_choices.json"
REPEATS = 5
# The user's own setting, read before anything imports inductor: inductor writes its default
# (/tmp/torchinductor_<user>) into the environment when it first looks.
USER_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def use_inductor_cache(cache_dir: str) -> Path:
    """Inductor's compiled code kept in the run's cache folder (TORCHINDUCTOR_CACHE_DIR set
    before the launch wins, unless it is inductor's own default: a process forked after
    inductor was imported inherits that as if a user had set it, and /tmp/torchinductor_<user>
    is shared by every torch on the machine; a CI run's compiled ranks failed there to build the
    precompiled header another torch had left)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    user = USER_INDUCTOR_CACHE if USER_INDUCTOR_CACHE != default_cache_dir() else None
    path = user or str(Path(cache_dir).expanduser() / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return Path(path)


def settle(shape, cfg, topology, zero_stage: int, device, dtype, micro: int,
           kernels_line: str):
    """(compile the blocks?, the start line's sentence)."""
    from dr_scale.parallel.checkpointing import compile_problem

    mode = cfg.model.compile
    if mode is False:
        return False, "compile: off (model.compile=false)"
    where = use_inductor_cache(cfg.data.cache_dir)
    if mode is True:
        return True, (f"compile: each decoder block compiled at the first step (model.compile="
                      f"true; inductor cache {where})")
    problem = compile_problem(zero_stage, cfg.parallel.activation_checkpointing)
    if topology.experts_split:
        problem = "expert parallelism: the all-to-all of the tokens breaks each block's graph"
    if problem:
        return False, f"compile: auto -> eager ({problem})"
    key = cache_key(shape, device, dtype, micro, cfg.data.seq_length, kernels_line)

    def cached_or_measured():
        cached = disk_cache.read(CACHE).get(key)
        if cached:
            return dict(cached, cached=True)
        try:
            measured = measure(shape, device, dtype, micro, cfg.data.seq_length)
        except Exception as e:  # every rank stops with rank 0's reason
            raise DrScaleError(f"model.compile=auto: measuring a compiled block failed "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); set "
                               "model.compile=false") from None
        disk_cache.store(CACHE, key, measured)
        return measured

    result = comm.decided_by_rank0(cached_or_measured)
    compiled = result["compiled_ms"] < result["eager_ms"]
    source = f"cached in {disk_cache.cache_file(CACHE)}" if result.get("cached") else \
        f"compiling took {result['compile_s']:.1f} s; inductor cache {where}"
    return compiled, (f"compile: auto -> {'compiled' if compiled else 'eager'} (one block "
                      f"forward + backward at this micro-batch: eager {result['eager_ms']:.2f} "
                      f"ms, compiled {result['compiled_ms']:.2f} ms; {source})")


def cache_key(shape, device, dtype, micro: int, seq: int, kernels_line: str) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dims = (shape.arch, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
            shape.ffn_hidden_size, shape.moe, shape.attention)
    return " | ".join([where, f"torch {torch.__version__}", str(dtype), repr(dims),
                       f"{micro} x {seq}", kernels_line, f"threads {torch.get_num_threads()}"])


def measure(shape, device, dtype, micro: int, seq: int) -> dict:
    """Median forward + backward time of one block, eager then compiled (its first call, the
    compilation, timed on its own)."""
    block, extra = one_block(shape, device, dtype, seq)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(micro, seq, shape.hidden_size, generator=g).to(device, dtype)
    x.requires_grad_()
    grad = torch.randn(x.shape, generator=g).to(device, dtype)

    def once(fn):
        sync(device)
        start = time.perf_counter()
        fn(x, *extra).backward(grad)
        sync(device)
        return time.perf_counter() - start

    once(block)
    eager = statistics.median(once(block) for _ in range(REPEATS))
    compiled_block = torch.compile(block)
    compile_s = once(compiled_block)
    compiled = statistics.median(once(compiled_block) for _ in range(REPEATS))
    return {"eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3, "compile_s": compile_s}


def one_block(shape, device, dtype, seq: int):
    """The family's first decoder block alone, made real on `device` in `dtype` with small
    random weights (norm weights 1), and the extra arguments its forward takes (the rotary
    tables)."""
    from dr_scale.models.build import construct, spec_of
    from dr_scale.models.layers import Rotary, decoder_blocks

    block = decoder_blocks(construct(shape, "meta"))[0].to_empty(device=device)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    block = block.to(dtype)
    if not spec_of(shape.arch).rotary:
        return block, ()
    rotary = Rotary(shape.head_dim, max(seq, 1), shape.rope_theta, shape.rope_scaling)
    return block, (tuple(t.to(device) for t in rotary(seq)),)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
