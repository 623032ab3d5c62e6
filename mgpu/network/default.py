"""Library defaults: sets no communication variable beyond the user's `env` map."""

from __future__ import annotations

from mgpu.errors import ConfigError


class DefaultNetwork:
    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ConfigError(f"network.bucket_cap_mb={bucket_cap_mb}: must be > 0")
        self.bucket_cap_mb = bucket_cap_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.extra_env = dict(env or {})

    def env(self) -> dict[str, str]:
        return dict(self.extra_env)
