"""The warm-up before a CUDA-graph capture, shared by every runner that captures (static, piecewise, acceptance)."""

from __future__ import annotations

import torch


def warm_up(device: torch.device, fn, times: int = 2):
    """Run fn() `times` times on a side stream before a CUDA-graph capture, so that the allocator's and the
    kernels' lazy set-up stay out of the graph; the current stream then waits for it.  Returns fn's last result."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(times):
            result = fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return result
