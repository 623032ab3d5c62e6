"""NVML (the driver's management library) for the GPU a torch device names."""

from __future__ import annotations

import pynvml
import torch


def device_handle(device: torch.device):  # -> pynvml.c_nvmlDevice_t
    """NVML's handle for a CUDA device of this process, initialising NVML (calls nest).

    By UUID: NVML numbers every GPU of the machine, while torch numbers those
    CUDA_VISIBLE_DEVICES leaves, in its order. By index only where torch reports no UUID.
    Raises `pynvml.NVMLError` where NVML is not available.
    """
    pynvml.nvmlInit()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        text = str(uuid)  # torch's has no "GPU-" prefix, NVML's does
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(
                text if text.startswith("GPU") else f"GPU-{text}")
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
