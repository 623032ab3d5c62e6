"""`${mgpu.now:PATTERN}`: the time a job started, the same in every process that composes it.

Hydra resolves `hydra.run.dir` in every process that runs the app: under torchrun in every
rank, in a multi-node job in every node's parent. Hydra's `${now:...}` reads each process's own
clock, so ranks started a second apart made different folders and wrote their logs, checkpoints
and `.hydra/` into different places. This resolver reads the job's start from a store that all
of its processes reach before any of them creates a folder; the first process to ask sets it,
the others read it:

- under torchrun, the launcher's store (`MASTER_ADDR:MASTER_PORT`, the agent's own store, which
  lives as long as the torchrun command, restarts included);
- in a multi-node job (`launch.nnodes` above 1 with a `launch.rdzv_endpoint`), the rendezvous
  store at that endpoint, which the elastic agent of the node hosting it reuses later;
- anywhere else, this process's clock, as `${now:...}`.

So the default output dir is one path on every node: it must be on a filesystem they share.
"""

from __future__ import annotations

import functools
import os
import time
from datetime import datetime, timedelta

from omegaconf import DictConfig, OmegaConf
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

STARTED_KEY = "mgpu/started"
# The stores this process opened: the server of one that this process hosts must outlive the
# composition, until the elastic agent of this process takes it over (`multi_tenant`).
_KEPT: list[TCPStore] = []


def now(pattern: str, _root_: DictConfig) -> str:
    """The job's start time, formatted with `pattern` (strftime)."""
    return datetime.fromtimestamp(started(*store_address(_root_))).strftime(pattern)


def store_address(root: DictConfig) -> tuple[str, int, int, bool] | tuple[()]:
    """(host, port, timeout in s, whether this process may host it) of the store the job's
    processes share, or () where there is none."""
    timeout_s = int(OmegaConf.select(root, "launch.timeout_s", default=300))
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return ()  # the store is rank 0's own, created only once it joins the group
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s, False
    endpoint = str(OmegaConf.select(root, "launch.rdzv_endpoint", default="") or "")
    nnodes = str(OmegaConf.select(root, "launch.nnodes", default="1"))
    max_nodes = nnodes.rpartition(":")[2]
    if not endpoint or not max_nodes.isdigit() or int(max_nodes) < 2:
        return ()  # one node (a wrong launch.nnodes is reported by `prepare`)
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    return host, port, timeout_s, True


@functools.cache
def started(host: str = "", port: int = 0, timeout_s: int = 300, may_host: bool = False) -> float:
    """Seconds since the epoch at which the first process of the job asked; cached, so that
    every pattern of one run dir formats the same instant."""
    mine = time.time()
    if not host:
        return mine
    store = open_store(host, port, timeout_s, may_host)
    _KEPT.append(store)
    return float(store.compare_set(STARTED_KEY, "", repr(mine)).decode())


def open_store(host: str, port: int, timeout_s: int, may_host: bool) -> TCPStore:
    """A client of the store at host:port; with `may_host`, on the host it names, its server
    if none runs yet (as the elastic agent decides, and shared with it: `multi_tenant`)."""
    timeout = timedelta(seconds=timeout_s)
    if may_host and _matches_machine_hostname(host):
        try:
            return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout,
                            wait_for_workers=False)
        except (RuntimeError, ValueError):
            pass  # another process on this machine hosts it (nodes on loopback)
    return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)


OmegaConf.register_new_resolver("mgpu.now", now, replace=True)
