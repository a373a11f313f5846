"""Which checkpoint a resume continues from, agreed by every rank once the process group exists.

The plan picked the newest candidate from what a listing shows (resume.candidates). Here each
rank checks its share of that checkpoint's files (manifest.share: sizes, then checksums) and the
ranks agree in one collective: the lowest rank that found a fault, or none. So no rank reads
another's files, no rank waits on one reader's full pass with a fixed deadline, and the traffic
per rank is one all-reduce. A damaged checkpoint gets a note (manifest.mark_damaged) and the next
candidate is checked the same way; a storage error (EIO) while reading is a fault of the run,
not of the checkpoint, and ends the attempt with the exit code a scheduler retries.
"""
import dataclasses

import torch

from dr_scale.checkpoint import manifest
from dr_scale.checkpoint.reshard import universal_ready
from dr_scale.checkpoint.resume import convert, no_intact, plan_for_tag, say_skipped
from dr_scale.errors import DrScaleError
from dr_scale.runtime import comm, hangs


def agree_on_checkpoint(plan, group):
    """The plan with the checkpoint every rank found intact (the planned one, or an older one
    with the same load path), converted to the universal form where the layout changed."""
    resume = plan.resume
    if resume is None:
        return plan
    rank, world = group.topology.rank, group.topology.world
    skipped = []
    for tag in (resume.tag, *resume.earlier):
        with hangs.doing(f"checking this rank's share of checkpoint {tag}"):
            fault = _first_fault(resume, tag, rank, world)
        if fault is None:
            break
        skipped.append((tag, fault))
    else:
        raise no_intact(resume.ckpt_dir, skipped)
    say_skipped(resume.ckpt_dir, skipped, tag)
    if tag != resume.tag:
        chosen = plan_for_tag(resume.ckpt_dir, tag, plan.topology, plan.deepspeed)
        if chosen.mode != resume.mode:
            # the engine's config (load_universal) was planned for the other load path
            raise DrScaleError(f"{resume.ckpt_dir / resume.tag}: not intact ({skipped[0][1]}); "
                               f"{tag} loads another way ({chosen.mode}), which this attempt "
                               "was not planned for: the next attempt resumes from it")
        resume = dataclasses.replace(chosen, earlier=resume.earlier[resume.earlier.index(tag)
                                                                    + 1:])
        plan = dataclasses.replace(plan, resume=resume)
    with hangs.doing(f"converting checkpoint {tag} to the universal form"):
        convert(resume, plan.cfg.train.collective_timeout_s)
    return plan


def _first_fault(resume, tag: str, rank: int, world: int):
    """None when every rank found its share of `tag` intact; else the lowest such rank's line
    (rank 0 notes the checkpoint damaged). One all-reduce; a broadcast only after a fault."""
    tag_dir = resume.ckpt_dir / tag
    if resume.mode == "universal" and tag == resume.tag and \
            universal_ready(resume.ckpt_dir, tag, resume.target):
        return None  # converted from it after an earlier check; the conversion is what loads
    body = manifest.read(tag_dir)
    fault, storage = None, False
    if body is not None:  # written before manifests: DeepSpeed's own checks alone
        try:
            fault = manifest.share_fault(tag_dir, body, rank, world)
        except OSError as e:
            fault, storage = f"{e.filename}: {e.strerror} (errno {e.errno})", True
    first = torch.tensor([rank if fault else world], dtype=torch.int64)
    comm.all_reduce(first, op="min")
    if int(first) == world:
        return None
    fault, storage = comm.broadcast_object((fault, storage), src=int(first))
    if storage:
        raise DrScaleError(f"{tag_dir}: rank {int(first)} could not read its share of the "
                           f"checkpoint: {fault}")
    if rank == 0:
        manifest.mark_damaged(tag_dir, fault)
    return fault
