"""This process's place as its launcher announced it (deepspeed, torchrun, srun), readable
before the process group exists and after it, and the one-line messages every rank writes.

Read here, and only here, so that a plain `python launchers/pretrain.py` (no launcher: a world
of one) and every launcher agree on what rank 0 is.
"""
import os
import sys


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """The rank on this node: one rank per node does what one node needs once."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def say(line: str):
    """One line to stderr in one write. print() writes the text and its newline separately, and
    with stderr unbuffered (PYTHONUNBUFFERED, as launchers and schedulers often set it) two ranks
    stopping at once printed "line0line1\\n\\n": one merged line, seen in CI. A pipe takes a
    write of up to 4 KiB whole, so each rank's line stays its own."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def warn(text: str):
    """`dr_scale: warning: text` in one line."""
    say(f"dr_scale: warning: {text}")


def say_error(text: str):
    """`dr_scale: error: text`, prefixed by the rank on every rank but 0."""
    rank = global_rank()
    say(f"{'' if rank == 0 else f'[rank {rank}] '}dr_scale: error: {text}")
