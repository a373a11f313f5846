"""DeepSpeed JSON: find it, read it, fill its "auto" values from the experiment config, and stop
with one line where the two disagree. DeepSpeed itself then owns everything the JSON says."""
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from dr_scale.runtime import nvme_offload
from dr_scale.errors import DrScaleError



def _bundled_dir() -> Path:
    """ds_configs/ inside an installed copy (setup.py ships it as package data), else the
    checkout's top-level folder (an editable install, or running from the source tree)."""
    package = Path(__file__).resolve().parents[1]  # dr_scale/
    installed = package / "ds_configs"
    return installed if installed.is_dir() else package.parent / "ds_configs"


DS_CONFIG_DIR = _bundled_dir()

# DeepSpeed scheduler params we know how to fill, by scheduler type.
_SCHEDULER_AUTO = {
    "WarmupLR": ("warmup_num_steps", "warmup_max_lr", "warmup_min_lr"),
    "WarmupDecayLR": ("warmup_num_steps", "warmup_max_lr", "warmup_min_lr", "total_num_steps"),
    "WarmupCosineLR": ("warmup_num_steps", "total_num_steps", "cos_min_ratio", "warmup_min_ratio"),
}


# ZeRO's communication settings where a config says "auto", by device. CPU (gloo): overlapping
# the reduction with backward gains nothing on shared cores and big buckets only cost memory
# (the values the CPU suite and benchmarks were measured with). GPU (NCCL): DeepSpeed's own
# defaults, which overlap the reduction with the backward pass.
ZERO_COMM = {
    "cpu": {"overlap_comm": False, "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000},
    "cuda": {"overlap_comm": True, "reduce_bucket_size": 500_000_000,
             "allgather_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
             "stage3_param_persistence_threshold": 100_000},
}


def resolve_path(name_or_path: str) -> Path:
    """A path as given, else a bare name (with or without .json) looked up in ds_configs/."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p.resolve()
    if p.parent == Path("."):
        for candidate in (Path.cwd() / "ds_configs" / p.name, DS_CONFIG_DIR / p.name):
            for c in (candidate, candidate.with_name(candidate.name + ".json")):
                if c.exists():
                    return c.resolve()
    known = ", ".join(sorted(q.name for q in DS_CONFIG_DIR.glob("*.json")))
    raise DrScaleError(f"--ds_config {name_or_path}: file not found (bare names resolve to "
                       f"{DS_CONFIG_DIR}: {known})")


def read_json(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DrScaleError(f"{path}: JSON syntax error at line {e.lineno}, column {e.colno}: "
                           f"{e.msg}") from None
    except OSError as e:
        raise DrScaleError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise DrScaleError(f"{path}: expected a JSON object at the top level")
    return data


def batch_sizes(train_cfg, dp_size: int) -> Dict[str, int]:
    """micro, accumulation and global batch sizes; the global size must split evenly."""
    micro = train_cfg.micro_batch_size
    global_bs = train_cfg.global_batch_size or micro * dp_size
    if global_bs % (micro * dp_size):
        raise DrScaleError(
            f"train.global_batch_size={global_bs} is not a multiple of train.micro_batch_size="
            f"{micro} x data-parallel size {dp_size} = {micro * dp_size}")
    return {"micro": micro, "accum": global_bs // (micro * dp_size), "global": global_bs}


def fill(ds: Dict[str, Any], cfg, dp_size: int, source: str = "ds_config",
         bf16_native: bool = True, device_type: str = "cpu",
         run_dir: Optional[Path] = None, batch: Optional[Dict[str, int]] = None
         ) -> Dict[str, Any]:
    """Return a copy of ``ds`` with every "auto" filled and every explicit value checked;
    ``bf16.enabled: "auto"`` becomes ``bf16_native`` (see dr_scale.runtime.hardware), ZeRO's
    communication settings come from ZERO_COMM for ``device_type``, offload's pin_memory is on
    where there is a GPU to copy to, an NVMe swap folder "auto" is ``run_dir``/offload (left
    "auto" without one). ``batch``: `batch_sizes`' answer where the caller has it."""
    ds = copy.deepcopy(ds)
    t = cfg.train
    b = batch or batch_sizes(t, dp_size)

    def settle(container: dict, key: str, value, exp_name: str, dotted: Optional[str] = None):
        dotted = dotted or key
        current = container.get(key, "auto")
        if current == "auto":
            container[key] = value
        elif not isinstance(current, (int, float)) or isinstance(current, bool):
            raise DrScaleError(f"{source}: {dotted}: expected a number or \"auto\", got {current!r}")
        elif abs(float(current) - float(value)) > 1e-12 * max(1.0, abs(float(value))):
            raise DrScaleError(
                f"{source}: {dotted}={current} disagrees with {exp_name}={value}; set one of "
                f"them to match, or set {dotted} to \"auto\"")

    settle(ds, "train_micro_batch_size_per_gpu", b["micro"], "train.micro_batch_size")
    settle(ds, "gradient_accumulation_steps", b["accum"],
           f"train.global_batch_size / (micro x dp) = {b['global']} / "
           f"({b['micro']} x {dp_size})")
    settle(ds, "train_batch_size", b["global"],
           f"train.micro_batch_size x accumulation x data-parallel = {b['micro']} x "
           f"{b['accum']} x {dp_size}")
    opt = settle_optimizer(ds, t, source)
    settle(ds, "gradient_clipping", grad_clip(t, optimizer_type(ds)), "train.grad_clip")
    if opt is not None:
        params = opt.setdefault("params", {})
        settle(params, "lr", t.lr, "train.lr", "optimizer.params.lr")
        settle(params, "weight_decay", t.weight_decay, "train.weight_decay",
               "optimizer.params.weight_decay")
        if optimizer_type(ds) == MUON:
            settle(params, "muon_lr", t.muon_lr, "train.muon_lr", "optimizer.params.muon_lr")
            settle(params, "momentum", t.muon_momentum, "train.muon_momentum",
                   "optimizer.params.momentum")
            check_muon(ds, params, t, source)

    sched = ds.get("scheduler")
    if sched is not None:
        kind = sched.get("type")
        if kind not in _SCHEDULER_AUTO:
            if _has_auto(sched):
                raise DrScaleError(f"{source}: scheduler.type={kind!r}: \"auto\" values are filled "
                                   f"only for {', '.join(_SCHEDULER_AUTO)}")
        else:
            decay = t.lr_decay_steps or t.max_steps
            values = {"warmup_num_steps": t.warmup_steps, "warmup_max_lr": t.lr,
                      "warmup_min_lr": 0.0, "total_num_steps": decay,
                      "cos_min_ratio": t.min_lr / t.lr if t.lr else 0.0, "warmup_min_ratio": 0.0}
            params = sched.setdefault("params", {})
            for key in _SCHEDULER_AUTO[kind]:
                if params.get(key) == "auto":
                    params[key] = values[key]

    bf16 = ds.get("bf16")
    if isinstance(bf16, dict) and bf16.get("enabled") == "auto":
        bf16["enabled"] = bool(bf16_native) and not ds.get("fp16", {}).get("enabled")
    if isinstance(bf16, dict) and not isinstance(bf16.get("enabled", False), bool):
        raise DrScaleError(f"{source}: bf16.enabled: expected true, false or \"auto\", got "
                           f"{bf16['enabled']!r}")

    if optimizer_type(ds) == MUON and ds["optimizer"]["params"]["ns_dtype"] == "auto":
        ds["optimizer"]["params"]["ns_dtype"] = "fp32" if precision(ds) == "fp32" else "deepspeed"

    zero = ds.get("zero_optimization", {})
    tuned = ZERO_COMM.get(device_type, ZERO_COMM["cuda"])
    for key, value in tuned.items():
        if zero.get(key) == "auto":
            zero[key] = value
    for section in nvme_offload.SECTIONS:
        if (zero.get(section) or {}).get("pin_memory") == "auto":
            zero[section]["pin_memory"] = device_type == "cuda"
    if run_dir is not None:  # else the run's engine config fills them (DeepSpeedView.for_run)
        nvme_offload.fill_paths(ds, run_dir)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise DrScaleError(f"{source}: zero_optimization.stage: expected 0, 1, 2 or 3, got {stage!r}")
    if ds.get("bf16", {}).get("enabled") is True and ds.get("fp16", {}).get("enabled"):
        raise DrScaleError(f"{source}: bf16.enabled and fp16.enabled are both true; pick one")
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if offload in ("cpu", "nvme") and "optimizer" not in ds:
        # DeepSpeed steps offloaded states with its own CPU Adam, built from this section; a
        # client optimizer ends in its ZeRORuntimeException
        raise DrScaleError(f"{source}: zero_optimization.offload_optimizer (device {offload}) "
                           "needs an \"optimizer\" section (e.g. {\"type\": \"AdamW\", "
                           "\"params\": {\"lr\": \"auto\", \"weight_decay\": \"auto\"}})")
    buffer_dtype = (ds.get("data_types") or {}).get("buffer_dtype")
    if buffer_dtype not in (None, "fp32", "float32"):
        # DeepSpeed would cast every buffer, the rotary tables (positions) included, straight
        # through .data: bf16 positions collapse past 256
        raise DrScaleError(f"{source}: data_types.buffer_dtype={buffer_dtype!r}: the models' "
                           "buffers (rotary tables) stay fp32; remove the key or set \"fp32\"")
    leftover = _find_auto(ds, skip=NVME_PATH)
    if leftover:
        raise DrScaleError(f"{source}: {leftover}: \"auto\" has no value in the experiment config "
                           "here; give a number")
    return ds


MUON = "muon"
# Newton-Schulz's dtype (parallel/muon.py): "auto" is fp32 in an fp32 run, else "deepspeed"
# (DeepSpeed's by method: fp16 for gram, bf16 for standard)
NS_DTYPES = ("auto", "deepspeed", "fp32", "bf16", "fp16")
# The bundled config whose optimizer section a Muon run takes when the DeepSpeed JSON names no
# optimizer (train.optimizer=muon)
MUON_CONFIG = "zero1_muon.json"


def optimizer_type(ds: dict) -> str:
    """The run's optimizer, lower case: the JSON's optimizer.type, or "adamw" (torch's, built
    from train.*, train/engine.py) where it has none."""
    opt = ds.get("optimizer")
    return str(opt.get("type", "")).lower() if isinstance(opt, dict) else "adamw"


def grad_clip(t, optimizer: str) -> float:
    """train.grad_clip, its null settled by the optimizer (check_muon says why Muon's is 0)."""
    if t.grad_clip is not None:
        return t.grad_clip
    return 0.0 if optimizer == MUON else 1.0


def settle_optimizer(ds: dict, t, source: str) -> Optional[dict]:
    """train.optimizer against the JSON's section: "auto" takes the JSON's; "muon" without a
    section adds MUON_SECTION; a named optimizer the JSON contradicts is refused."""
    opt = ds.get("optimizer")
    if opt is not None and not isinstance(opt, dict):
        raise DrScaleError(f"{source}: optimizer: expected a mapping with \"type\" and "
                           f"\"params\", got {opt!r}")
    if t.optimizer == MUON and opt is None:
        ds["optimizer"] = read_json(DS_CONFIG_DIR / MUON_CONFIG)["optimizer"]
    elif t.optimizer != "auto" and optimizer_type(ds) != t.optimizer:
        raise DrScaleError(f"{source}: optimizer.type={opt.get('type')!r} disagrees with "
                           f"train.optimizer={t.optimizer}; set one of them to match (for "
                           f"Muon: {{\"type\": \"Muon\"}}, or a config without an optimizer "
                           f"section, such as zero1_muon), or train.optimizer to auto")
    return ds.get("optimizer")


def check_muon(ds: dict, params: dict, t, source: str):
    """What DeepSpeed's Muon, as dr_scale builds it (parallel/muon.py), cannot do."""
    if "adam_lr" in params:
        # one rate for the AdamW half, the one the schedule and the logs show
        raise DrScaleError(f"{source}: optimizer.params.adam_lr: the AdamW half's rate is "
                           f"optimizer.params.lr (train.lr); remove adam_lr")
    ns_method = params.setdefault("ns_method", "gram")
    if ns_method not in ("gram", "standard"):
        raise DrScaleError(f"{source}: optimizer.params.ns_method: expected gram or standard, "
                           f"got {ns_method!r}")
    if params.setdefault("ns_dtype", "auto") not in NS_DTYPES:
        raise DrScaleError(f"{source}: optimizer.params.ns_dtype: expected one of "
                           f"{', '.join(NS_DTYPES)}, got {params['ns_dtype']!r}")
    if params.get("per_head_muon"):
        raise DrScaleError(f"{source}: optimizer.params.per_head_muon: not supported here; "
                           f"dr_scale orthogonalises whole matrices (tensor-parallel slices "
                           f"gathered first), as one rank would")
    if ds.get("gradient_clipping", 0):
        # ZeRO writes Muon's orthogonalised update where the gradient was before it clips:
        # the norm it clips (and reports) is the updates' (about sqrt(rows) a matrix, 86 for
        # the tiny model), so a clip at 1.0 divides every step by that.
        raise DrScaleError(f"{source}: gradient_clipping={ds['gradient_clipping']} with "
                           f"optimizer Muon: DeepSpeed clips Muon's orthogonalised update, not "
                           f"the gradient; set train.grad_clip to 0 or null (and "
                           f"gradient_clipping to 0 or \"auto\")")
    zero = ds.get("zero_optimization") or {}
    if zero.get("stage") == 3:
        # DeepSpeed's ZeRO-3 orthogonalises whole gradients it gathers itself, and refuses its
        # reduce-scatter beside Muon (stage3.py); the key left out means DeepSpeed's default, on
        if zero.get("reduce_scatter") is True:
            raise DrScaleError(f"{source}: zero_optimization.reduce_scatter=true with optimizer "
                               f"Muon: DeepSpeed's ZeRO-3 cannot run both; set it to false or "
                               f"remove it")
        ds["zero_optimization"]["reduce_scatter"] = False
    offload = (zero.get("offload_optimizer") or {}).get("device")
    if offload in ("cpu", "nvme"):
        raise DrScaleError(f"{source}: zero_optimization.offload_optimizer (device {offload}) "
                           f"with optimizer Muon: the offloaded step is DeepSpeed's CPU Adam; "
                           f"remove the offload or use AdamW")


NVME_PATH = "nvme_path"  # "auto": the run folder's offload/, known once the ranks chose it


def _has_auto(obj) -> bool:
    return _find_auto(obj) is not None


def _find_auto(obj, prefix="", skip=None) -> Optional[str]:
    if obj == "auto":
        return prefix.rstrip(".") or "<root>"
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == skip:
                continue
            hit = _find_auto(v, f"{prefix}{k}.", skip)
            if hit:
                return hit
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            hit = _find_auto(v, f"{prefix}[{i}].", skip)
            if hit:
                return hit
    return None


def bf16_choice(raw: Dict[str, Any], support, source: str) -> Tuple[str, Optional[str]]:
    """(why the precision is what it is, for the start line; a one-line warning or None) for the
    DeepSpeed JSON as written, on hardware ``support`` (a dr_scale.runtime.hardware.Bf16Support)."""
    enabled = raw.get("bf16", {}).get("enabled", False)
    if enabled == "auto":
        return f"bf16 \"auto\": {support.why}", None
    if enabled is True and not support.native:
        return "", (f"warning: {source}: bf16.enabled=true where {support.why}, slower than "
                    "fp32; \"auto\" would pick fp32 here")
    return "", None


def precision(ds: Dict[str, Any]) -> str:
    """The precision of a filled config: bf16, fp16 or fp32."""
    if ds.get("bf16", {}).get("enabled") is True:
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def torch_dtype(precision_name: str):
    """The torch dtype of a precision name (bf16, fp16 or fp32)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_name, torch.float32)


def reduction_dtype(ds: Dict[str, Any]) -> str:
    """The dtype DeepSpeed reduces gradients in, and why (its rule: communication_data_type if
    set, else the training precision)."""
    explicit = ds.get("communication_data_type")
    if explicit:
        return f"{explicit} (communication_data_type)"
    p = precision(ds)
    if p == "fp32":
        return "fp32"
    return f"{p} (the training precision; communication_data_type \"fp32\" reduces in fp32)"


def zero_stage(ds: Dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


# DeepSpeed's zero_optimization.sub_group_size where a config is silent (runtime/zero/config.py)
DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000


def sub_group_size(ds: Dict[str, Any]) -> int:
    """Parameters ZeRO-3's optimizer steps at a time (its fp32 gradient is made one such
    sub-group at a time; a checkpoint's optimizer state is laid out by them)."""
    return int(float(ds.get("zero_optimization", {}).get("sub_group_size",
                                                          DEEPSPEED_SUB_GROUP_SIZE)))


@dataclass(frozen=True)
class DeepSpeedView:
    """The DeepSpeed JSON as a run uses it, read once in the plan; every later step reads its
    facts here (the ZeRO stage, the precision, offload, the batch sizes) rather than from a dict.

    `raw` is the file as written (the start line says why bf16 "auto" chose what it chose);
    `filled` has every "auto" filled for this machine, AutoTP's `tensor_parallel` section under
    tensor parallelism and `checkpoint.load_universal` on a resume through the universal form;
    `for_run(run_dir)` is the engine's copy, its NVMe swap folders in the run folder."""
    path: Path
    raw: Dict[str, Any]
    filled: Dict[str, Any]
    batch: Dict[str, int]  # micro, accum (gradient accumulation steps), global
    bf16: Any              # runtime.hardware.Bf16Support: why bf16 "auto" chose what it chose

    @property
    def stage(self) -> int:
        return zero_stage(self.filled)

    @property
    def precision(self) -> str:
        return precision(self.filled)

    @property
    def dtype(self):
        return torch_dtype(self.precision)

    @property
    def source(self) -> str:
        """The file's name as errors give it."""
        return str(self.path)

    @property
    def nvme_sections(self):
        return tuple(nvme_offload.nvme_sections(self.filled))

    @property
    def optimizer(self) -> str:
        """"adamw" or the JSON's optimizer type, lower case ("muon": parallel/muon.py)."""
        return optimizer_type(self.filled)

    @property
    def has_scheduler(self) -> bool:
        return "scheduler" in self.filled

    def for_run(self, run_dir: Path) -> Dict[str, Any]:
        """The config the engine gets: `filled` with "auto" NVMe swap folders in `run_dir`."""
        ds = copy.deepcopy(self.filled)
        nvme_offload.fill_paths(ds, run_dir, raw=self.raw)
        return ds


def load(name_or_path: str, cfg, dp_size: int, bf16_native: bool = True) -> Dict[str, Any]:
    path = resolve_path(name_or_path)
    return fill(read_json(path), cfg, dp_size, source=str(path), bf16_native=bf16_native)
