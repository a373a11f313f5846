"""The launcher's command line: `pretrain.py --ds_config NAME_OR_PATH [--config YAML] [--run_dir
DIR] [--resume [auto]] [--stop_at_step N] [--skip_memory_check] [dotted.key=value ...]`, a bad
one in one line."""
import argparse
import sys

from dr_scale.errors import DrScaleError

USAGE = ("deepspeed launchers/pretrain.py --ds_config NAME_OR_PATH [--config YAML] "
         "[--run_dir DIR] [--resume [auto]] [--stop_at_step N] [--skip_memory_check] "
         "[dotted.key=value ...]")
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise DrScaleError(f"command line: {message} (usage: {USAGE})")


def parse_args(argv=None):
    p = _Parser(prog="pretrain.py", usage=USAGE)
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON; bare names resolve to ds_configs/")
    p.add_argument("--config", help="experiment YAML; default: the embedded default")
    p.add_argument("--run_dir", help="run folder; default: runs/<date>-<time>")
    p.add_argument("--resume", action="store_const", const="latest",
                   help="continue from the run folder's latest checkpoint; `--resume auto`: "
                        "continue if it has one, start fresh if not (one command for launch and "
                        "requeue)")
    p.add_argument("--resume_mode", dest="resume", help=argparse.SUPPRESS)  # `--resume auto`
    p.add_argument("--stop_at_step", type=int, default=None, metavar="N",
                   help="save and exit after step N (the schedule still runs to train.max_steps)")
    p.add_argument("--skip_memory_check", action="store_true",
                   help="start even when the memory estimate exceeds what a rank has")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value")
    # overrides may come before, between or after the options, as people type them
    return p.parse_intermixed_args(_resume_forms(sys.argv[1:] if argv is None else list(argv)))


def _resume_forms(argv):
    """`--resume auto` / `--resume=auto` as one option, so a bare `--resume` never swallows the
    override that follows it."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--resume" and i + 1 < len(argv) and argv[i + 1] in ("auto", "latest"):
            out.append(f"--resume_mode={argv[i + 1]}")
            i += 2
            continue
        if tok.startswith("--resume="):
            mode = tok.split("=", 1)[1]
            if mode not in ("auto", "latest"):
                raise DrScaleError(f"command line: --resume={mode}: expected auto or latest")
            tok = f"--resume_mode={mode}"
        out.append(tok)
        i += 1
    return out
