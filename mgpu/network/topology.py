"""GPU interconnect of this machine, read through NVML: what `nvidia-smi topo -m` shows.

Each pair of GPUs is joined by NVLink (`NV<links>`) or through PCIe, whose label names the
closest common ancestor: PIX (one switch), PXB (several switches), PHB (the CPU's host
bridge), NODE (host bridges of one NUMA node), SYS (across the CPUs' interconnect).

`device_order` turns the matrix into a device order (CUDA_VISIBLE_DEVICES) in which local rank
i and i+1 share the fastest links. NCCL builds its own rings inside a machine whatever the rank
order; the order matters for what follows ranks: neighbouring pipeline stages, the contiguous
rank blocks of a device mesh's inner dimension, rings that span several machines.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import pynvml

log = logging.getLogger(__name__)

TOPOLOGY_FILE = "topology.txt"
# Larger is faster. Any NVLink beats any PCIe path; more links beat fewer.
PCIE_SCORES = {"PIX": 50, "PXB": 40, "PHB": 30, "NODE": 20, "SYS": 10}
NVLINK_SCORE = 100
# Every ring is tried up to this many GPUs (7! = 5040 rings); beyond, nearest neighbour first.
EXACT_SEARCH_MAX = 8


@dataclass(frozen=True)
class Topology:
    names: list[str]  # one per GPU, in NVML order: model and PCI bus id
    uuids: list[str]  # what CUDA_VISIBLE_DEVICES accepts, independent of CUDA's own order
    links: list[list[str]]  # links[i][j]: "X" on the diagonal, "NV<n>" or a PCIe label

    def score(self, i: int, j: int) -> int:
        label = self.links[i][j]
        if label.startswith("NV"):
            return NVLINK_SCORE + int(label[2:])
        return PCIE_SCORES[label]

    def ring_quality(self, ring: list[int]) -> tuple[int, int]:
        """(slowest link, sum of links) around the ring: the slowest link bounds a ring."""
        scores = [self.score(a, b) for a, b in zip(ring, ring[1:] + ring[:1], strict=True)]
        return min(scores), sum(scores)

    def ring_order(self) -> list[int]:
        """The GPU order whose ring has the best slowest link (then the best total)."""
        n = len(self.names)
        if n <= 3:  # every ring of 3 or fewer is the same ring
            return list(range(n))
        if n <= EXACT_SEARCH_MAX:
            rings = ([0, *rest] for rest in itertools.permutations(range(1, n)))
            return max(rings, key=self.ring_quality)  # the first best: identity wins ties
        ring = [0]
        while len(ring) < n:
            rest = [j for j in range(n) if j not in ring]
            ring.append(max(rest, key=lambda j: self.score(ring[-1], j)))
        return ring

    def table(self) -> str:
        """The matrix as `nvidia-smi topo -m` prints it, with the GPUs and the ring order."""
        n = len(self.names)
        header = "      " + "".join(f"{f'GPU{j}':>7}" for j in range(n))
        rows = [f"GPU{i:<3}" + "".join(f"{self.links[i][j]:>7}" for j in range(n))
                for i in range(n)]
        gpus = [f"GPU{i}: {name}" for i, name in enumerate(self.names)]
        order = ",".join(map(str, self.ring_order()))
        return "\n".join([header, *rows, "", *gpus, f"ring order: {order}", ""])


def read_topology() -> Topology | None:
    """The GPU matrix from NVML, or None (after one log line) where NVML is not available."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.info("network: no NVML (%s); GPU topology not read", e)
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        bus_ids = [_text(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        names = [f"{_text(pynvml.nvmlDeviceGetName(h))} ({bus})"
                 for h, bus in zip(handles, bus_ids, strict=True)]
        uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        return Topology(names, uuids, _links(handles, bus_ids))
    finally:
        pynvml.nvmlShutdown()


def device_order(found: Topology) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES in ring order, unless the user already chose the devices."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        log.info("network: CUDA_VISIBLE_DEVICES is set; device order left as given")
        return {}
    order = found.ring_order()
    log.info("network: local ranks on GPUs %s (topology-aware ring)", order)
    return {"CUDA_VISIBLE_DEVICES": ",".join(found.uuids[i] for i in order)}


def _links(handles: list, bus_ids: list[str]) -> list[list[str]]:
    """Label every pair: NVLink links counted per peer (or through NVSwitch), else PCIe path."""
    n = len(handles)
    direct = [[0] * n for _ in range(n)]
    to_switch = [0] * n  # links whose far end is not a GPU: an NVSwitch
    for i, handle in enumerate(handles):
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except pynvml.NVMLError:  # no such link, or no NVLink on this GPU
                continue
            if remote in bus_ids:
                direct[i][bus_ids.index(remote)] += 1
            else:
                to_switch[i] += 1
    links = [["X"] * n for _ in range(n)]
    for i, j in itertools.permutations(range(n), 2):
        if direct[i][j]:
            links[i][j] = f"NV{direct[i][j]}"
        elif to_switch[i] and to_switch[j] and _nvlink_p2p(handles[i], handles[j]):
            links[i][j] = f"NV{min(to_switch[i], to_switch[j])}"
        else:
            links[i][j] = _pcie_label(handles[i], handles[j])
    return links


def _nvlink_p2p(a: object, b: object) -> bool:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except pynvml.NVMLError:
        return False
    return status == pynvml.NVML_P2P_STATUS_OK


def _pcie_label(a: object, b: object) -> str:
    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    if level <= pynvml.NVML_TOPOLOGY_SINGLE:  # same board or one PCIe switch
        return "PIX"
    return {
        pynvml.NVML_TOPOLOGY_MULTIPLE: "PXB",
        pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
        pynvml.NVML_TOPOLOGY_NODE: "NODE",
    }.get(level, "SYS")


def _text(value: str | bytes) -> str:
    """NVML strings are bytes in some versions of the bindings."""
    return value.decode() if isinstance(value, bytes) else value
