"""Several machines joined by plain TCP/IP Ethernet (no RDMA)."""

from __future__ import annotations

from mgpu.network.default import DefaultNetwork


class EthernetNetwork(DefaultNetwork):
    """Use it for multi-node jobs over TCP sockets: cloud VMs without RDMA, lab clusters.

    Its YAML turns the IB transport off, keeps NCCL off loopback and container bridges, and
    opens more sockets per peer (4 threads x 4 sockets: NCCL's suggestion for 100G networks, a
    single TCP stream cannot fill a fast link), and checks the kernel's socket-buffer limits,
    which cap the throughput of every TCP stream.
    """
