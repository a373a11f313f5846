"""The one exception type for bad user input, and the exit codes.

Every message is a single line that names the file, the key and what was expected; the launcher
and the console script print it without a traceback. The launcher's exit code says what kind of
fault it was, which a scheduler acts on (launchers/slurm_pretrain.sbatch): a configuration error
found by the plan, before any process group (EXIT_CONFIG: retrying cannot help), or a fault met
while running (EXIT_FAULT: an I/O error, a full disk, a save another rank could not write, a
lost or silent rank; the configuration was fine, and a requeue may get past it).
"""


class DrScaleError(Exception):
    """A user-facing error: bad config, CLI argument, data file or checkpoint."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


def where(path, key=None) -> str:
    """'file.yaml: key' prefix for error messages."""
    if key:
        return f"{path}: {key}" if path else str(key)
    return str(path)


EXIT_CONFIG = 2      # a configuration error: the plan refused the run; not retried
EXIT_STOPPED = 3     # a callback stopped training (e.g. nan_guard)
EXIT_FAULT = 74      # a fault while running (sysexits' EX_IOERR); retried within a budget
EXIT_PREEMPTED = 75  # a stop signal: checkpoint saved; run the same command with --resume auto


class TrainingStopped(DrScaleError):
    """Training stopped itself on purpose (e.g. too many non-finite steps in a row)."""


class Preempted(TrainingStopped):
    """A stop signal arrived; every rank saved and stopped at the same step."""
