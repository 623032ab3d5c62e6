"""One machine whose GPUs talk over PCIe only (workstations, PCIe cards in servers)."""

from __future__ import annotations

from mgpu.network.default import DefaultNetwork


class PCIeNetwork(DefaultNetwork):
    """Use it when every rank is on one machine and the GPUs have no NVLink between them.

    Its YAML turns the InfiniBand transport off, allows direct GPU-to-GPU copies only below a
    common host bridge (NCCL_P2P_LEVEL=PHB: across CPU sockets, P2P over PCIe is often slower
    than staging through host memory), and orders ranks so neighbours share a PCIe switch.
    """

    single_node = True
