"""ConfigError, the one-line error for bad input, in a module that imports nothing of the project.

config.py assembles every module's config dataclass and validates across them; the modules it
imports (checkpoint, data, optim, parallel, ...) raise this error for their own settings. Defined
here, neither side has to import the other back. config.py re-exports it (config.ConfigError).
"""
import os
import sys


class ConfigError(ValueError):
    """A bad setting. str() is the one line the user sees."""

    def __init__(self, key: str, problem: str, fix: str):
        super().__init__(f"config error: {key}: {problem}. Fix: {fix}")
        self.key = key


def fail(line: str) -> None:
    """Bad input's exit: one line on stderr, exit code 2. Under torchrun or srun every rank meets
    the same bad input and stops, and rank 0 alone says so (RANK, or SLURM_PROCID before the
    process group exists): one line is what the user reads, not one per rank."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        print(line, file=sys.stderr)
    sys.exit(2)
