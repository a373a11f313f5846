"""Kernels chosen by measurement (GPUs): never an untested kernel by priority alone.

For each op, every implementation that can run here is called on the run's own shapes (forward and
backward), checked against the fp32 reference within its precision policy, and timed (median of a
few repetitions after a warm-up); the fastest that passes is used. Rank 0 measures and the other
ranks take its choice (they must all run the same kernels). The table is printed, and the choice
cached by device, library versions, kernel sources, dtype and shape in
$DR_SCALE_CACHE/kernel_choices.json, so a restart of the same job does not measure again.

The precision check runs at a capped shape (one sequence of at most 2,048 tokens, 8,192 rows for
the row-wise ops): the fp32 reference attention materialises its scores, which at a training
micro-batch would not fit beside the run. The timing runs at the full shape.
"""
import dataclasses
import hashlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from dr_scale.runtime import comm, disk_cache
from dr_scale.errors import DrScaleError
from dr_scale.kernels import reference
from dr_scale.kernels.policy import dtype_name
from dr_scale.kernels.registry import Kernel

CACHE = "kernel_choices.json"
CHECK_SEQ, CHECK_ROWS = 2048, 8192
# Attention is checked at the run's own length (the Triton kernel's autotuned block sizes are
# keyed on it: a shorter check would pass another configuration), up to where the fp32 eager
# reference's scores (heads x seq^2 x 4 bytes at batch 1) stay a few GiB.
ATTENTION_CHECK_SEQ = 8192
REFERENCES = {"rms_norm": reference.rms_norm, "layer_norm": reference.layer_norm,
              "swiglu": reference.swiglu, "bias_gelu": reference.bias_gelu,
              "rotary": reference.apply_rotary, "cross_entropy": reference.cross_entropy,
              "attention": reference.attention, "experts": reference.grouped_experts}


@dataclass(frozen=True)
class Problem:
    """One rank's shapes in the run: what each op is timed on."""
    batch: int
    seq: int
    hidden: int
    ffn: int            # this rank's share under tensor parallelism
    heads: int          # this rank's query heads
    kv_heads: int
    head_dim: int
    vocab: int          # this rank's vocabulary slice
    loss_rows: int      # tokens the loss sees at once (a chunk of the fused head, or all)
    documents: int = 1  # packed documents per sequence (document masking), 1 without it
    experts: int = 0    # a mixture of experts' experts per block (this rank's), 0: dense
    expert_ffn: int = 0  # an expert's width (whole: experts are not split by tensor parallelism)
    top_k: int = 0      # experts each token is routed to

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def for_check(self, op: str) -> "Problem":
        """The shapes `op` is checked at: batch 1; attention at the run's length (see
        ATTENTION_CHECK_SEQ), the row-wise ops shorter (their kernels do not depend on it)."""
        seq = min(self.seq, ATTENTION_CHECK_SEQ if op == "attention" else CHECK_SEQ)
        return dataclasses.replace(self, batch=1, seq=seq,
                                   loss_rows=min(self.loss_rows, CHECK_ROWS))


def make_inputs(op: str, p: Problem, device, dtype, seed: int = 0) -> Tuple[tuple, dict]:
    """The op's arguments at the problem's shapes; floating tensors that training differentiates
    require grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def t(*shape, grad=True, scale=1.0, dt=dtype):
        x = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)
        return x.requires_grad_(grad)

    rows = p.tokens
    if op == "rms_norm":
        return (t(rows, p.hidden), t(p.hidden, scale=0.1).detach().add_(1).requires_grad_(),
                1e-5), {}
    if op == "layer_norm":
        return (t(rows, p.hidden), t(p.hidden, scale=0.1).detach().add_(1).requires_grad_(),
                t(p.hidden, scale=0.1), 1e-5), {}
    if op == "swiglu":
        return (t(rows, p.ffn), t(rows, p.ffn)), {}
    if op == "bias_gelu":
        return (t(rows, p.ffn), t(p.ffn, scale=0.1)), {}
    if op == "rotary":
        cos, sin = reference.rotary_tables(p.seq, p.head_dim, 10000.0, device=device)
        return (t(p.batch, p.heads, p.seq, p.head_dim), cos, sin), {}
    if op == "cross_entropy":
        labels = torch.randint(0, p.vocab, (p.loss_rows,), generator=g).to(device)
        return (t(p.loss_rows, p.vocab), labels), {}
    if op == "attention":
        # as the model hands them over: (batch, seq, heads, head_dim) projections viewed as
        # (batch, heads, seq, head_dim), not contiguous (the kernel reads the strides in place)
        q = t(p.batch, p.seq, p.heads, p.head_dim, grad=False).transpose(1, 2).requires_grad_()
        k, v = (t(p.batch, p.seq, p.kv_heads, p.head_dim, grad=False).transpose(1, 2)
                .requires_grad_() for _ in range(2))
        kwargs = {"causal": True}
        if p.documents > 1:
            bounds = torch.arange(p.seq, device=device) * p.documents // p.seq
            kwargs["doc_ids"] = bounds.to(torch.int32).expand(p.batch, p.seq).contiguous()
        return (q, k, v), kwargs
    if op == "experts":
        # the routed rows spread unevenly, as training meets them (0.5x to 1.5x the mean, the
        # remainder on the first): groups of odd sizes, which a GPU's grouped matmul must pad
        rows = p.tokens * p.top_k
        share = torch.linspace(0.5, 1.5, p.experts, dtype=torch.float64)
        counts = (rows * share / share.sum()).floor().to(torch.int64)
        counts[0] += rows - counts.sum()
        f = p.expert_ffn
        w = [t(*s, scale=p.hidden ** -0.5) for s in ((p.experts, f, p.hidden),
                                                    (p.experts, p.hidden, f),
                                                    (p.experts, f, p.hidden))]
        return (t(rows, p.hidden), *w, counts.to(device)), {}
    raise ValueError(f"no measurement inputs for op '{op}'")


def _forward_backward(fn: Callable, args, kwargs):
    """(output, gradients of the args that require grad) of one forward and a backward from a
    fixed upstream gradient (the same values for a kernel and the reference)."""
    out = fn(*args, **kwargs)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grad_out = None
    if out.dim() > 0:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return out, torch.autograd.grad(out, leaves, grad_out)


def check_error(kernel: Kernel, p: Problem, device, dtype) -> float:
    """Worst max|error| / (atol + rtol * max|reference|) over the output and every input
    gradient, against the fp32 reference on the same inputs: <= 1 passes the kernel's policy.
    Scaled by each tensor's largest value, not element by element: a reduced gradient (a norm's
    weight, a bias) has elements near zero whose bf16 rounding is set by the terms summed, not by
    the result; a broken kernel (a wrong mask, a weight read in the wrong dtype) is off by the
    tensor's own scale."""
    args, kwargs = make_inputs(kernel.op, p.for_check(kernel.op), device, dtype)
    ref_args = tuple(a.detach().float().requires_grad_(a.requires_grad)
                     if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
    ref = _forward_backward(REFERENCES[kernel.op], ref_args, kwargs)
    got = _forward_backward(kernel.fn, args, kwargs)
    tol = kernel.policy.tol(dtype)
    worst = 0.0
    for mine, want in zip((got[0], *got[1]), (ref[0], *ref[1])):
        if mine.shape != want.shape:
            return float("inf")
        error = (mine.detach().float() - want.detach()).abs().max().item()
        worst = max(worst, error / (tol.atol + tol.rtol * want.detach().abs().max().item()))
    return worst if worst == worst else float("inf")  # NaN fails


def time_ms(kernel: Kernel, p: Problem, device, dtype, reps: int = 5) -> float:
    """Median milliseconds of forward + backward at the full shape."""
    args, kwargs = make_inputs(kernel.op, p, device, dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    _forward_backward(kernel.fn, args, kwargs)  # warm-up: compilation, autotuning, caches
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        _forward_backward(kernel.fn, args, kwargs)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@dataclass
class Row:
    op: str
    name: str
    ms: Optional[float] = None
    error: Optional[float] = None   # as a fraction of the policy's tolerance
    failed: Optional[str] = None
    chosen: bool = False
    cached: bool = False            # read from the cache, measured by an earlier run

    @property
    def verdict(self) -> str:
        if self.chosen:
            return "chosen" if self.ms is not None else f"chosen untimed ({self.failed})"
        if self.failed:
            return f"failed: {self.failed}"
        if self.error is not None and self.error > 1.0:
            return "outside its precision policy"
        return "passed"


def measure(op: str, candidates: List[Kernel], p: Problem, device, dtype) -> List[Row]:
    rows = []
    for k in candidates:
        row = Row(op, k.name)
        try:
            row.error = check_error(k, p, device, dtype)
            if row.error <= 1.0:
                row.ms = time_ms(k, p, device, dtype)
        except Exception as e:  # a kernel that cannot run here is a row, not a crash
            row.failed = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        rows.append(row)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    timed = [r for r in rows if r.ms is not None]
    checked = [r for r in rows if r.error is not None and r.error <= 1.0]
    if timed:
        min(timed, key=lambda r: r.ms).chosen = True
    elif checked:  # none could be timed at the run's shape (out of memory there, say): the
        checked[-1].chosen = True  # lowest priority that passed its check, torch's as a rule
    return rows


def _device_name(device) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def cache_key(op: str, p: Problem, device, dtype, names: List[str]) -> str:
    where = _device_name(device)
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = "none"
    return " | ".join([where, f"torch {torch.__version__}", f"triton {tv}", f"cuda {torch.version.cuda}",
                       f"kernels {sources_digest()}", dtype_name(dtype), op,
                       ",".join(sorted(names)), repr(dataclasses.astuple(p))])


def sources_digest() -> str:
    """A changed kernel is measured again: the digest of every source in this package."""
    here = Path(__file__).resolve().parent
    h = hashlib.blake2b(digest_size=8)
    for path in sorted(here.rglob("*")):
        if path.suffix in (".py", ".cu", ".cuh", ".cpp", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def choose(candidates: Dict[str, List[Kernel]], p: Problem, device, dtype,
           use_cache: bool = True) -> Tuple[Dict[str, str], List[Row]]:
    """{op: implementation name} for every op with candidates, and the table behind it (rows of
    ops read from the cache say so). Measured on rank 0 only; every rank returns its choice."""
    return comm.decided_by_rank0(lambda: _choose_here(candidates, p, device, dtype, use_cache))


def _choose_here(candidates, p, device, dtype, use_cache):
    choices, table = {}, []
    cached = disk_cache.read(CACHE) if use_cache else {}
    for op, kernels in candidates.items():
        key = cache_key(op, p, device, dtype, [k.name for k in kernels])
        if key in cached:
            choices[op] = cached[key]["name"]
            table.extend(Row(**dict(r, cached=True)) for r in cached[key]["rows"])
            continue
        rows = measure(op, kernels, p, device, dtype)
        table.extend(rows)
        best = [r for r in rows if r.chosen]
        if not best:
            raise_none_passed(op, rows)
        choices[op] = best[0].name
        disk_cache.store(CACHE, key, {"name": best[0].name,
                                      "rows": [dataclasses.asdict(r) for r in rows]})
    return choices, table


def raise_none_passed(op: str, rows: List[Row]):
    why = "; ".join(f"{r.name}: {r.verdict}" for r in rows)
    raise DrScaleError(f"kernels.{op}: no implementation passed its precision check here ({why})")


def format_table(rows: List[Row], p: Problem, device, dtype) -> str:
    where = _device_name(device)
    source = "measured now" if not any(r.cached for r in rows) else \
        f"{'all' if all(r.cached for r in rows) else 'some'} from {disk_cache.cache_file(CACHE)}"
    lines = [f"kernels measured on {where} ({dtype_name(dtype)}, batch {p.batch} x {p.seq}, "
             f"hidden {p.hidden}, ffn {p.ffn}, heads {p.heads}:{p.kv_heads} x {p.head_dim}, "
             f"loss {p.loss_rows} x {p.vocab}; {source}):",
             f"  {'op':<14}{'implementation':<16}{'fwd+bwd ms':>11}{'error/tol':>11}  verdict"]
    for r in rows:
        ms = "-" if r.ms is None else f"{r.ms:.3f}"
        err = "-" if r.error is None else ("inf" if r.error == float("inf") else f"{r.error:.2f}")
        lines.append(f"  {r.op:<14}{r.name:<16}{ms:>11}{err:>11}  {r.verdict}")
    return "\n".join(lines)
