"""Checkpoints that survive a crash at any moment: their folder's layout, and the facts a
checkpoint records about itself.

A checkpoint is written into checkpoints/.incoming/<tag>/ (DeepSpeed's files plus our state per
rank), fsynced, renamed to checkpoints/<tag>/, and only then named in checkpoints/latest (written
to a temporary file and renamed): writer.py. A half-written checkpoint is therefore never the
latest one; leftovers in .incoming are cleared on resume. This file: tags, `latest`, atomic
writes, the universal forms' folders, and the entries of our per-rank state that tools read
without loading it (the trainer's position, the layout `WrittenLayout` records); state.py says
who owns each entry, load.py reads a checkpoint into an engine.
"""
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dr_scale.config import ds_config as dsc
from dr_scale.errors import DrScaleError
from dr_scale.parallel.topology import Topology

STATE_FILE = "dr_scale_state_rank{rank}.pt"
STAGING = ".incoming"
REHEARSAL = ".rehearsal"  # writer.prepare_snapshot's: DeepSpeed makes folders there
LATEST = "latest"
_TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    m = _TAG.match(tag)
    if not m:
        raise DrScaleError(f"checkpoint tag {tag!r}: expected step_NNNNNNNN")
    return int(m.group(1))


def fsync_file(path: Path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def complete_tags(ckpt_dir: Path):
    """Tags of complete checkpoints, oldest first (staging folders never match the pattern)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and _TAG.match(p.name))


def latest_tag(ckpt_dir: Path) -> Optional[str]:
    latest = Path(ckpt_dir) / LATEST
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    step_of(tag)
    return tag


def find_tag(ckpt_dir: Path, step: Optional[int] = None) -> str:
    """The latest complete checkpoint, or the one of ``step``."""
    ckpt_dir = Path(ckpt_dir)
    tags = complete_tags(ckpt_dir)
    if step is not None:
        if tag_for(step) not in tags:
            have = ", ".join(str(step_of(t)) for t in tags) or "none"
            raise DrScaleError(f"{ckpt_dir}: step {step}: no such checkpoint; have: {have}")
        return tag_for(step)
    tag = latest_tag(ckpt_dir)
    if tag is None:
        raise DrScaleError(f"{ckpt_dir}: no checkpoint (no '{LATEST}' file)")
    if tag not in tags:
        raise DrScaleError(f"{ckpt_dir / LATEST}: names {tag}, which is missing")
    return tag


DELETING = ".deleting-"  # a checkpoint set aside to be deleted: its name no longer a tag's


def set_aside(ckpt_dir: Path, tag: str) -> list:
    """Rename checkpoint `tag` and every universal form converted from it out of the way, one
    rename each, so nothing that lists checkpoints ever meets one half deleted; the folders to
    delete."""
    ckpt_dir = Path(ckpt_dir)
    folders = []
    for folder in [*(ckpt_dir / "universal").glob(f"*/{tag}"), ckpt_dir / tag]:
        if folder.is_dir():
            aside = folder.with_name(f"{DELETING}{folder.name}.{os.getpid()}")
            os.rename(folder, aside)
            folders.append(aside)
    return folders


def set_aside_earlier(ckpt_dir: Path) -> list:
    """Folders set aside by a process that ended before it had deleted them."""
    ckpt_dir = Path(ckpt_dir)
    return [*ckpt_dir.glob(f"{DELETING}*"), *(ckpt_dir / "universal").glob(f"*/{DELETING}*")]


def ranks_written(tag_dir: Path) -> int:
    written = len(list(tag_dir.glob(STATE_FILE.format(rank="*"))))
    if written == 0:
        raise DrScaleError(f"{tag_dir}: not a dr_scale checkpoint (no {STATE_FILE.format(rank=0)})")
    return written


def saved_zero_family(tag_dir: Path) -> int:
    """0 (one full file), 1 (ZeRO-1/2 optimizer shards) or 3 (ZeRO-3 parameter shards)."""
    if list(tag_dir.glob("zero_pp_rank_*_model_states.pt")):
        return 3
    if list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        return 1
    return 0


def saved_parallel_layout(tag_dir: Path) -> tuple:
    """(tensor_parallel, pipeline_parallel, expert_parallel) the checkpoint was written with:
    from our rank-0 state, or, in checkpoints older than those fields, the tensor ranks of
    DeepSpeed's file names (and no expert parallelism)."""
    state = _rank0_state(tag_dir)
    if "parallel" in state:
        p = state["parallel"]
        return p["tensor"], p["pipeline"], p.get("expert", 1)
    return max(1, len(tensor_ranks(tag_dir))), 1, 1


def saved_optimizer(tag_dir: Path) -> str:
    """The optimizer whose state the checkpoint holds, as config/ds_config.optimizer_type names
    it (checkpoints older than that field: "adamw", the only one then)."""
    return _rank0_state(tag_dir).get("optimizer", "adamw")


def saved_sub_group_size(tag_dir: Path) -> int:
    """The zero_optimization.sub_group_size the checkpoint was written with (checkpoints older
    than that field: DeepSpeed's default, which the bundled configs then kept)."""
    return int(_rank0_state(tag_dir).get("zero_sub_group_size", dsc.DEEPSPEED_SUB_GROUP_SIZE))


def saved_position(tag_dir: Path) -> tuple:
    """(step, samples consumed) the checkpoint was written at."""
    state = _rank0_state(tag_dir)
    return int(state["step"]), int(state["consumed_samples"])


def refuse_other_shape(tag_dir: Path, written_for: dict, expected: dict, unknown=()):
    """A checkpoint of another model shape, in one line. `written_for`: its `model` entry (empty
    in older checkpoints: nothing to compare); `unknown`: fields the caller cannot know yet (the
    plan, the vocabulary of a tokenizer the data step trains)."""
    if not written_for:
        return
    keys = [k for k in dict.fromkeys([*expected, *written_for]) if k not in unknown]
    diff = [f"{k}={written_for.get(k)} (this run: {expected.get(k)})" for k in keys
            if written_for.get(k) != expected.get(k)]
    if diff:
        raise DrScaleError(f"{tag_dir}: checkpoint of another model shape: {', '.join(diff[:4])}")


def saved_model(tag_dir: Path) -> dict:
    """The weights' shape fields the checkpoint was written for (empty in older checkpoints)."""
    return _rank0_state(tag_dir).get("model") or {}


def _rank0_state(tag_dir: Path) -> dict:
    # mmap: only the small entries asked for are read, not the RNG and callback (EMA) tensors
    path = Path(tag_dir) / STATE_FILE.format(rank=0)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise DrScaleError(f"{path}: missing") from None
    except Exception as e:  # noqa: BLE001 - a torn or damaged file fails in many ways
        raise DrScaleError(f"{path}: unreadable ({type(e).__name__})") from None


def saved_topology(tag_dir: Path) -> Topology:
    """The layout of the ranks that wrote the checkpoint (export reads slices by it)."""
    tensor, pipeline, expert = saved_parallel_layout(Path(tag_dir))
    return Topology(ranks_written(Path(tag_dir)), tensor, pipeline, expert=expert)


def rank0_model_states(tag_dir: Path) -> Optional[Path]:
    """Tensor rank 0's model-states file (`mp_rank_00_model_states.pt`, ZeRO-3's
    `zero_pp_rank_0_mp_rank_00_model_states.pt`), not an expert's (`layer_*_expert_*`), which
    sorts first; None where there is none."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (Path(tag_dir) / name).is_file():
            return Path(tag_dir) / name
    return None


def saved_buffers(tag_dir: Path) -> dict:
    """The buffers DeepSpeed saved whole in tensor rank 0's model-states file (`buffer_names`),
    by name. The file is mapped, not read: it holds the module's weights too (the whole model
    under ZeRO-1/2), and only the buffers' pages are touched."""
    found = rank0_model_states(tag_dir)
    if found is None:
        return {}
    # DeepSpeed's own pickle (it loads it with weights_only=False too)
    states = torch.load(found, map_location="cpu", weights_only=False, mmap=True)
    module = states.get("module") or {}
    return {n: module[n].clone() for n in states.get("buffer_names") or [] if n in module}


def tensor_ranks(tag_dir: Path) -> list:
    """The tensor ranks ("00", "01", ...) DeepSpeed's model-states file names hold."""
    return sorted({m.group(1) for f in Path(tag_dir).glob("*_model_states.pt")
                   if (m := re.search(r"mp_rank_(\d+)", f.name))})


@dataclass(frozen=True)
class TargetLayout:
    """The layout a checkpoint is loaded into: its ranks, ZeRO stage, and tensor, pipeline and
    expert-parallel sizes."""
    world: int
    stage: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1

    @classmethod
    def of(cls, topology: Topology, stage: int) -> "TargetLayout":
        return cls(topology.world, stage, topology.tensor, topology.pipeline, topology.expert)

    @property
    def pipelined(self) -> bool:
        return self.pipeline > 1


def universal_dir(ckpt_dir: Path, target: TargetLayout) -> Path:
    """Where the universal form for a target layout lives (ZeRO-3 needs a file per rank; a
    pipeline names its parameters by layer and loads its weights from layer files; expert
    parallelism keeps the experts in optimizer groups of their own)."""
    family = "zero3" if target.stage == 3 else "zero12"
    name = f"{family}-{target.world}ranks" if target.stage == 3 else family
    return Path(ckpt_dir) / "universal" / (name + ("-pipeline" if target.pipelined else "")
                                           + (f"-ep{target.expert}" if target.expert > 1 else ""))


class WrittenLayout:
    """The entries saying what wrote a checkpoint (the model's weight shapes, the parallel
    layout, ZeRO-3's sub-group size): read by `saved_*` above, by load.py's shape check and by
    resharding, never restored."""

    def __init__(self, topology: Topology, model_signature: dict, zero_sub_group_size: int,
                 optimizer: str = "adamw"):
        self.topology, self.model_signature = topology, model_signature
        self.zero_sub_group_size, self.optimizer = zero_sub_group_size, optimizer

    def state_dict(self) -> dict:
        t = self.topology
        return {"model": self.model_signature,
                "parallel": {"tensor": t.tensor, "pipeline": t.pipeline, "expert": t.expert},
                # ZeRO-3 lays its optimizer state out by sub-groups of this size
                "zero_sub_group_size": int(self.zero_sub_group_size),
                # Muon's momentum is laid out otherwise than AdamW's moments (reshard.py)
                "optimizer": self.optimizer}

    def load_state_dict(self, state: dict):
        pass  # checked before the weights load (load.py), not restored
