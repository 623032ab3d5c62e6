"""Library defaults: NCCL and gloo choose everything themselves; only the `env` map is set.

`DefaultNetwork` is also the class behind the other options (nvlink, pcie, infiniband,
ethernet). They tune the same few variables and differ only in the values their YAML sets,
so the keys, the checks and the way they become environment variables live here once; each
option's module is a subclass whose docstring says when to use it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from mgpu.errors import ConfigError
from mgpu.network import sysctl, topology

if TYPE_CHECKING:
    from mgpu.job import Job
    from mgpu.options import Options

log = logging.getLogger(__name__)

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class DefaultNetwork:
    #: Options for one machine set this: their settings would cripple traffic between nodes.
    single_node = False

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        nccl_ib_disable: bool | None = None,
        nccl_ib_gid_index: int | None = None,
        nccl_socket_ifname: str | None = None,
        nccl_socket_nthreads: int | None = None,
        nccl_nsocks_perthread: int | None = None,
        nccl_graph_file: str | None = None,
        nccl_algo: str | None = None,
        nccl_proto: str | None = None,
        gloo_socket_ifname: str | None = None,
        env: dict[str, str] | None = None,
        topology_aware_order: bool = False,
        check_sysctl: bool = False,
    ) -> None:
        """Every key left null (None) leaves its variable to the library's own choice."""
        if bucket_cap_mb <= 0:
            raise ConfigError(f"network.bucket_cap_mb={bucket_cap_mb}: must be > 0")
        self.bucket_cap_mb = bucket_cap_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        variables = {  # each key's variable is its name upper-cased
            "NCCL_IB_DISABLE": nccl_ib_disable,
            "NCCL_IB_GID_INDEX": nccl_ib_gid_index,
            "NCCL_SOCKET_IFNAME": nccl_socket_ifname,
            "NCCL_SOCKET_NTHREADS": nccl_socket_nthreads,
            "NCCL_NSOCKS_PERTHREAD": nccl_nsocks_perthread,
            "NCCL_GRAPH_FILE": nccl_graph_file,
            "NCCL_ALGO": nccl_algo,
            "NCCL_PROTO": nccl_proto,
            "GLOO_SOCKET_IFNAME": gloo_socket_ifname,
        }
        self.settings = {k: _as_env_value(v) for k, v in variables.items() if v is not None}
        self.extra_env = dict(env or {})
        self.topology_aware_order = topology_aware_order
        self.check_sysctl = check_sysctl
        _check_settings(self.settings)
        _check_env_map(self.extra_env, self.settings)

    def env(self) -> dict[str, str]:
        """The variables this option sets: its NCCL/gloo settings, then the `env` map."""
        return {**self.settings, **self.extra_env}

    def validate(self, job: Job, options: Options) -> None:
        launch = job.launch
        if self.single_node and launch.world_size > launch.nproc_per_node:
            raise ConfigError(
                f"network={type(self).__module__.rsplit('.', 1)[-1]} is for one machine but "
                f"launch.nnodes={launch.nnodes}; use network=infiniband, ethernet or default"
            )

    def prepare_node(self, output_dir: Path) -> dict[str, str]:
        """In the parent, before the workers start: warn about kernel network limits, record the
        GPU topology in `output_dir`, and order the devices. Returns every variable to set."""
        if self.check_sysctl:
            for warning in sysctl.check():
                log.warning("network: %s", warning)
        found = topology.read_topology()
        if found is None:
            return self.env()
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / topology.TOPOLOGY_FILE).write_text(found.table())
        order = topology.device_order(found) if self.topology_aware_order else {}
        return {**self.env(), **order}


def _as_env_value(value: bool | int | str) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _check_settings(settings: dict[str, str]) -> None:
    """The documented ranges (NCCL's environment-variable reference)."""
    threads = int(settings.get("NCCL_SOCKET_NTHREADS", 1))
    socks = int(settings.get("NCCL_NSOCKS_PERTHREAD", 1))
    if not 1 <= threads <= 16:
        raise ConfigError(f"network.nccl_socket_nthreads={threads}: must be in 1..16")
    if socks < 1 or threads * socks > 64:
        raise ConfigError(
            f"network.nccl_nsocks_perthread={socks}: must be >= 1, and "
            f"nccl_socket_nthreads x nccl_nsocks_perthread ({threads * socks}) at most 64"
        )
    if int(settings.get("NCCL_IB_GID_INDEX", 0)) < 0:
        raise ConfigError(
            f"network.nccl_ib_gid_index={settings['NCCL_IB_GID_INDEX']}: must be >= 0"
        )
    graph = settings.get("NCCL_GRAPH_FILE")
    if graph is not None and not Path(graph).is_file():
        raise ConfigError(f"network.nccl_graph_file={graph}: no such file on this machine")


def _check_env_map(env: dict, settings: dict[str, str]) -> None:
    for name, value in env.items():
        if not ENV_NAME.fullmatch(str(name)):
            raise ConfigError(f"network.env.{name}: not a valid environment variable name")
        if not isinstance(value, str):
            raise ConfigError(
                f"network.env.{name}={value}: environment values must be strings, e.g. "
                f"network.env.{name}='\"...\"'"
            )
        if name in settings:
            raise ConfigError(
                f"network.env.{name}: also set by network.{name.lower()}; set it in one place"
            )
