"""Host -> device copies that do not wait for the device.

A copy from pageable host memory (torch.tensor(values, device="cuda"), or .to("cuda") of an ordinary CPU tensor)
synchronises the stream first, so the host cannot queue the work that follows behind the forward still
running.  `upload` goes through pinned memory and an asynchronous copy instead; PyTorch keeps the pinned buffer
until the copy has run.
"""

from __future__ import annotations

import torch


def upload(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values (a host list or a CPU tensor) on `device`, queued behind the work already issued on a GPU."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or tensor.is_cuda:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
