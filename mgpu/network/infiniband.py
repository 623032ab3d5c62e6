"""Several machines joined by InfiniBand or RoCE, GPUs reading the network directly (RDMA)."""

from __future__ import annotations

from mgpu.network.default import DefaultNetwork


class InfiniBandNetwork(DefaultNetwork):
    """Use it for multi-node jobs on an InfiniBand or RoCE fabric.

    Its YAML keeps the IB transport on, sets the RoCE v2 GID index (3 on most RoCE setups;
    ignored on native InfiniBand), keeps NCCL's bootstrap sockets off loopback and container
    bridges, and checks the kernel's socket-buffer limits (used by the rendezvous and gloo).
    """
