"""mgpu: declarative, config-driven multi-GPU training experiments."""

from mgpu.errors import ConfigError, RunFailed

__all__ = ["ConfigError", "RunFailed"]
