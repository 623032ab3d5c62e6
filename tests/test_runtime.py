"""The per-rank runtime: a process group with a backend for every tensor a collective holds."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import Backend
from torch.distributed.distributed_c10d import BackendConfig

from mgpu.runtime import process_group_backend


def backend_per_device(backend: str) -> dict[str, str]:
    """The backend string as torch reads it: which backend serves which device type."""
    return BackendConfig(Backend(backend)).get_device_backend_map()


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        # CPU tensors (memory figures, timings, pickled objects) go to gloo beside nccl.
        (torch.device("cuda", 1), {"cpu": "gloo", "cuda": "nccl"}),
        (torch.device("cpu"), {"cpu": "gloo", "cuda": "gloo"}),
    ],
)
def test_every_device_type_has_a_backend(device, expected):
    assert backend_per_device(process_group_backend(device)) == expected
