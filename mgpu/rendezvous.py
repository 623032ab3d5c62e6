"""The node agents of a multi-node job meet before their workers start, at the rendezvous
endpoint's store (the one `mgpu.rundir` and torch's rendezvous use), so that two mistakes end
as one line on every node instead of a hang or a silently different job:

- too few nodes: each node adds itself to a count and waits for `launch.nnodes`' minimum for
  `launch.rdzv_timeout_s`; then it names the endpoint and how many nodes arrived;
- different configs: each node posts a hash of its resolved job with the job's keys and values;
  every node compares them all, and where a hash differs names the keys that differ, with each
  node's value (the same line on every node).

A node that joins an elastic job later compares itself with the nodes before it, and fails
alone where it differs.
"""

from __future__ import annotations

import hashlib
import json
import socket
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from mgpu.elastic import parse_nnodes
from mgpu.errors import ConfigError, RunFailed
from mgpu.job import Job
from mgpu.rundir import open_store
from mgpu.tracking import flatten

ARRIVED_KEY = "mgpu/nodes/arrived"
NODE_KEY = "mgpu/nodes/{}"
# Paths each node resolves against its own working dir, and rank 0's replace on every rank.
NODE_LOCAL = ("output_dir", "checkpoint.dir", "tracking.uri")
SHOWN_KEYS = 5  # differing keys named in full; the rest are counted


def meet(job: Job) -> None:
    """Wait for the job's minimum of nodes at its endpoint, then check they run one config."""
    settings = job.launch
    host, port = parse_rendezvous_endpoint(settings.rdzv_endpoint, default_port=29400)
    store = open_store(host, port, settings.rdzv_timeout_s, may_host=True)
    store.set_timeout(timedelta(seconds=settings.rdzv_timeout_s))
    index = store.add(ARRIVED_KEY, 1) - 1
    values = comparable(job)
    store.set(NODE_KEY.format(index), json.dumps(
        {"node": f"node {index} ({socket.gethostname()})", "hash": digest(values),
         "values": values}))
    min_nodes = parse_nnodes(settings.nnodes)[0]
    try:
        store.wait([NODE_KEY.format(min_nodes - 1)])
    except RuntimeError:  # the store's timeout (torch raises DistStoreError, a RuntimeError)
        raise RunFailed(timed_out(job, arrived(store))) from None
    nodes = [json.loads(store.get(NODE_KEY.format(i))) for i in range(max(index + 1, min_nodes))]
    if len({node["hash"] for node in nodes}) > 1:
        raise ConfigError(differences(nodes))


def arrived(store: TCPStore) -> int | None:
    """How many nodes came to the rendezvous, where its store still answers."""
    try:
        return store.add(ARRIVED_KEY, 0)
    except RuntimeError:
        return None


def timed_out(job: Job, count: int | None) -> str:
    """The one line for a rendezvous that gave up: where, after how long, who came."""
    settings = job.launch
    min_nodes = parse_nnodes(settings.nnodes)[0]
    came = "an unknown number" if count is None else str(count)
    return (
        f"rendezvous at {settings.rdzv_endpoint} timed out after launch.rdzv_timeout_s="
        f"{settings.rdzv_timeout_s} s: {came} of {min_nodes} nodes arrived (launch.nnodes="
        f"{settings.nnodes}); start the other nodes with launch.rdzv_endpoint="
        f"{settings.rdzv_endpoint} and the same overrides, or raise launch.rdzv_timeout_s"
    )


def comparable(job: Job) -> dict[str, str]:
    """The job's keys and values as every node must agree on them (dotted keys, values as
    text), less the paths each node resolves for itself."""
    flat = flatten(job.as_dict())
    return {key: str(value) for key, value in flat.items() if key not in NODE_LOCAL}


def value_on(node: dict[str, Any], key: str) -> str:
    return f"{node['node']}: {node['values'].get(key, '(unset)')}"


def digest(values: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def differences(nodes: list[dict[str, Any]]) -> str:
    """One line naming each key on which the nodes differ, with every node's value."""
    keys = sorted({key for node in nodes for key in node["values"]})
    differing = [k for k in keys if len({node["values"].get(k) for node in nodes}) > 1]
    shown = [f"{key} ({', '.join(value_on(node, key) for node in nodes)})"
             for key in differing[:SHOWN_KEYS]]
    more = len(differing) - SHOWN_KEYS
    return (
        f"the nodes' configs differ: {'; '.join(shown)}{f'; and {more} more' if more > 0 else ''}"
        f"; start every node with the same overrides"
    )
