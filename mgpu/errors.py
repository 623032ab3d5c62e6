"""The two ways a run ends badly, each reported to the user as one line."""


class ConfigError(ValueError):
    """A user mistake in the configuration: names the key, the value and what is valid.

    Raised in the parent before any worker starts and before any tracking run is created.
    """


class RunFailed(RuntimeError):
    """The worker group failed; the message summarises which rank failed and why."""
