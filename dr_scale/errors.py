"""The one exception type for bad user input.

Every message is a single line that names the file, the key and what was expected; the launcher
and the console script print it without a traceback and exit with status 2.
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


EXIT_STOPPED = 3     # a callback stopped training (e.g. nan_guard)
EXIT_PREEMPTED = 75  # a stop signal: checkpoint saved; run the same command with --resume auto


class TrainingStopped(DrScaleError):
    """Training stopped itself on purpose (e.g. too many non-finite steps in a row)."""


class Preempted(TrainingStopped):
    """A stop signal arrived; every rank saved and stopped at the same step."""
