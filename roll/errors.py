"""Error types for mistakes a user can make, and roll-train's exit codes. The CLI prints errors without a traceback.

Exit codes (documented in the README, "When things go wrong"):

- 0 ``EXIT_OK``: trained (and saved);
- 1: an unexpected error (a bug or an environment failure): the traceback is printed;
- 2 ``EXIT_USAGE``: a mistake in the recipe, command line, data, model or checkpoint (a ``RollError``);
  nothing was trained and nothing in output_dir was touched;
- 3 ``EXIT_DIVERGED``: training stopped after ``max_consecutive_skipped_steps`` non-finite steps in a row;
- 4 ``EXIT_HUNG``: a collective did not finish within ``ddp_timeout`` or a peer rank died;
- 75 ``EXIT_PREEMPTED``: stopped by SIGTERM / SIGINT after writing a checkpoint (resume with
  ``resume_from_checkpoint: true``); 130 when stopped without one.
"""

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_HUNG = 4
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


class RollError(Exception):
    """Base class for errors caused by user input (recipe, command line, data, model path)."""


class ConfigError(RollError, ValueError):
    """A recipe or command-line value is unknown, has the wrong type, or conflicts with another."""


class DataError(RollError, ValueError):
    """A dataset file or row cannot be used; the message names the file and row."""


class ModelError(RollError, ValueError):
    """A model path, architecture or checkpoint cannot be used as configured."""


class TrainingStopped(Exception):
    """Training ended early on purpose; ``exit_code`` is one of the EXIT_* codes above."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)


class Preempted(TrainingStopped):
    """SIGTERM / SIGINT: the step finished and (with save_on_preemption) a checkpoint was written."""

    exit_code = EXIT_PREEMPTED


class Diverged(TrainingStopped):
    """Too many non-finite steps in a row."""

    exit_code = EXIT_DIVERGED


class Hung(TrainingStopped):
    """A collective timed out or a peer rank died."""

    exit_code = EXIT_HUNG
