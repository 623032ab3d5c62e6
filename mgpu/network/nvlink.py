"""One machine whose GPUs are joined by NVLink or NVSwitch (DGX/HGX, SXM boards)."""

from __future__ import annotations

from mgpu.network.default import DefaultNetwork


class NVLinkNetwork(DefaultNetwork):
    """Use it when every rank is on one machine with NVLink between the GPUs.

    Its YAML turns the InfiniBand transport off (nothing leaves the machine, and NCCL skips
    probing the adapters), keeps peer-to-peer traffic on NVLink (NCCL_P2P_LEVEL=NVL), and puts
    NVLink peers next to each other in the rank order.
    """

    single_node = True
