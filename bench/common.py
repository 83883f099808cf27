"""Shared helpers for the benchmark scripts: timing, device facts, JSON output."""

from __future__ import annotations

import gc
import json
import platform
import time
from pathlib import Path

import torch

from specdec.models.provenance import source_commit


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(device: torch.device, gib: float = 4.0) -> float:
    """Device memory bandwidth from a large copy, counting bytes read + written, in GB/s."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=10, warmup=2)
    return 2 * n * 2 / seconds / 1e9


def environment(device: torch.device) -> dict:
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "commit": git_commit()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def git_commit() -> str:
    return source_commit() or "unknown"


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


def free_device_memory(device: torch.device) -> None:
    """Give back what engines the caller has just dropped held (their graph pools and cached blocks), so that the
    next engine it builds starts from an empty card."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def alloc_retries(device) -> int:
    """Times the CUDA caching allocator found no free block, freed its cache (a device-wide sync) and retried, so
    far in this process: a step that does so near a full card pays ~10-100 ms.  0 on a CPU."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def compiles() -> int:
    """Graphs torch.compile has built so far in this process (a compile inside a timed load costs ~1 s)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def triton_compiles() -> int:
    """Kernel binaries the project's own Triton kernels (every triton.jit function of the specdec.kernels modules
    imported so far) hold in their JIT caches, summed over devices: a new entry is a compile (or an on-disk cache
    load) of a new specialization, which stalls the step that launched it.  0 where Triton is absent or its
    caches are laid out otherwise; never raises (a diagnostic must not break a bench)."""
    try:
        return sum(_cached_binaries(f) for f in _kernel_functions())
    except Exception:
        return 0


_kernels_seen: tuple[int, list] = (-1, [])  # (len(sys.modules) when found, the JIT functions found)


def _kernel_functions() -> list:
    """The triton.jit functions of the imported specdec.kernels modules; found again only when modules were
    imported since (benches read the count around every step)."""
    global _kernels_seen
    import sys

    if _kernels_seen[0] != len(sys.modules):
        modules = [m for name, m in list(sys.modules.items())
                   if m is not None and (name == "specdec.kernels" or name.startswith("specdec.kernels."))]
        functions = {id(f): f for m in modules for f in _jit_functions(m)}
        _kernels_seen = (len(sys.modules), list(functions.values()))
    return _kernels_seen[1]


def _jit_functions(module) -> list:
    """The module's Triton JIT functions (those an autotune / heuristics wrapper holds included)."""
    found = []
    for value in list(vars(module).values()):
        for _ in range(4):  # Autotuner / Heuristics wrap the JITFunction as .fn (perhaps one in another)
            if type(value).__name__ == "JITFunction":
                found.append(value)
                break
            value = getattr(value, "fn", None)
    return found


def _cached_binaries(fn) -> int:
    """Compiled binaries in one JITFunction's caches: Triton 3.x keeps device -> (kernel cache, ...) in
    `device_caches` (a defaultdict: only its values are read, so no device's entry is made); older versions kept
    device -> {key: kernel} in `cache`."""
    caches = getattr(fn, "device_caches", None)
    if isinstance(caches, dict):
        return sum(len(entry[0]) for entry in list(caches.values())
                   if isinstance(entry, tuple) and entry and isinstance(entry[0], dict))
    caches = getattr(fn, "cache", None)
    if isinstance(caches, dict):
        return sum(len(kernels) for kernels in list(caches.values()) if isinstance(kernels, dict))
    return 0
