"""ConfigError, the one-line error for bad input, in a module that imports nothing of the project.

config.py assembles every module's config dataclass and validates across them; the modules it
imports (checkpoint, data, optim, parallel, ...) raise this error for their own settings. Defined
here, neither side has to import the other back. config.py re-exports it (config.ConfigError).
"""


class ConfigError(ValueError):
    """A bad setting. str() is the one line the user sees."""

    def __init__(self, key: str, problem: str, fix: str):
        super().__init__(f"config error: {key}: {problem}. Fix: {fix}")
        self.key = key
