"""How a run ends early with a message instead of a traceback: `specroll train` prints a
`RunError`'s message and exits with status 1, a `Stopped` one's and exits with 128 + the
signal (the work done so far is on disk)."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run stopped for a reason its message explains and says how to go on from."""


class LearnerRankError(RunError):
    """A learner rank died or failed: the step did not happen."""


class NonFiniteError(RunError):
    """An update met a non-finite loss or gradient and was not applied."""


class CheckpointError(RunError):
    """A checkpoint could not be written (the previous ones are kept)."""


class Stopped(KeyboardInterrupt):
    """A run stopped on a signal (after saving a checkpoint, unless a second signal came);
    the exit status is 128 + `signum`, as if the signal had ended the process."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message)
        self.signum = signum
