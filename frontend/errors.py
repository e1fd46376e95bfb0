"""User-facing errors of the frontend. The CLIs print them as one line and exit with code 2."""


class FrontendError(Exception):
    """Base class: a checkpoint, config or option that cannot be served, with what was expected."""


class ConfigError(FrontendError):
    """A config.json key is missing, has the wrong type, or contradicts another key."""


class CheckpointError(FrontendError):
    """A checkpoint file or tensor is missing, unknown, truncated or of the wrong shape/dtype."""
