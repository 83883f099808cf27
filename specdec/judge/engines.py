"""Engines under judgement: a command line the judge starts (and stops), or the URL of a running server.

A command gets its port from the judge: every `{port}` in it is replaced by a free port (and `{host}` by
127.0.0.1); a command without `{port}` gets `--port PORT` appended.  While an engine the judge started is
up, a thread samples the peak memory of its process tree: GPU memory through NVML when the tree holds any,
else resident memory (RSS).  A URL engine's memory is read from its /metrics
(`*peak_memory_bytes{kind="device"|"rss"}` or `process_resident_memory_bytes`) where it has that.

A launched engine runs in a session of its own, which `Engine.stop` ends (SIGTERM to the group, SIGKILL
after 30 s); its environment names the judge (SPECDEC_PARENT_PID), so that `specdec serve` ends itself
and its engine process if the judge is killed (SIGKILL) before it can stop it: specdec/parent_watch.py.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil

from specdec.judge.client import ENGINE_MEMORY_BYTES, fetch_metrics_sync, find_metric, http_get
from specdec.parent_watch import child_env

MIB = 1024 * 1024
WAIT_NOTE_EVERY_S = 15.0  # while an engine is not healthy yet, how often the person watching is told


class JudgeFailure(Exception):
    """The run cannot give a fair score; `reason` says why in one sentence."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def command_line(spec: str, port: int) -> list[str]:
    argv = shlex.split(spec)
    if not any("{port}" in a for a in argv):
        argv += ["--port", "{port}"]
    return [a.replace("{port}", str(port)).replace("{host}", "127.0.0.1") for a in argv]


class Nvml:
    """GPU memory through NVML (pynvml / nvidia-ml-py), or `available` False where there is none."""

    def __init__(self):
        self.available = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.pynvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self.handles)
        except Exception:  # no library, no driver or no GPU: measure RSS instead
            self.handles = []

    def used_bytes(self) -> int:
        return sum(self.pynvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles)

    def names(self) -> list[str]:
        """The visible GPUs' names (e.g. 'NVIDIA H100 80GB HBM3'), none without NVML."""
        return [str(self.pynvml.nvmlDeviceGetName(h)) for h in self.handles] if self.available else []

    def process_bytes(self) -> dict[int, int]:
        """{pid: GPU bytes} over every device (pids as NVML sees them)."""
        usage: dict[int, int] = {}
        for h in self.handles:
            for proc in self.pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                usage[proc.pid] = usage.get(proc.pid, 0) + (proc.usedGpuMemory or 0)
        return usage


_nvml: Nvml | None = None


def nvml() -> Nvml:
    global _nvml  # one NVML session per judge process
    if _nvml is None:
        _nvml = Nvml()
    return _nvml


def gpu_visible() -> bool:
    return nvml().available


class MemoryMonitor:
    """Peak memory of a process tree (or of a URL engine), sampled every `interval_s` while started."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.peak_rss = 0
        self.peak_gpu = 0
        self.method: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pid: int | None, url: str | None, gpu_baseline: int | None) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(pid, url, gpu_baseline), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def peak_mib(self) -> float | None:
        peak = self.peak_gpu if self.peak_gpu else self.peak_rss
        return peak / MIB if peak else None

    def _run(self, pid, url, gpu_baseline):
        while True:
            try:
                self._sample(pid, url, gpu_baseline)
            except (psutil.Error, OSError, httpx.HTTPError):
                pass  # the process is going away; the peak so far stands
            if self._stop.wait(self.interval_s if pid is not None else max(self.interval_s, 0.5)):
                return

    def _sample(self, pid, url, gpu_baseline):
        if pid is None:
            value = find_metric(fetch_metrics_sync(url) or {}, ENGINE_MEMORY_BYTES)
            if value:
                self.peak_rss = max(self.peak_rss, int(value))
                self.method = "the engine's own /metrics (peak_memory_bytes or process_resident_memory_bytes)"
            return
        root = psutil.Process(pid)
        tree = [root] + root.children(recursive=True)
        self.peak_rss = max(self.peak_rss, sum(p.memory_info().rss for p in tree))
        self.method = self.method or "peak RSS of the engine's process tree"
        if nvml().available:
            self._sample_gpu({p.pid for p in tree}, gpu_baseline)

    def _sample_gpu(self, pids: set[int], gpu_baseline: int | None):
        per_process = nvml().process_bytes()
        ours = sum(v for p, v in per_process.items() if p in pids)
        if ours:
            self.peak_gpu = max(self.peak_gpu, ours)
            self.method = "NVML: GPU memory of the engine's processes"
        elif per_process and gpu_baseline is not None:
            # NVML sees processes but not under our pids (a container's pid namespace): use the device's
            # used memory above what was used before this engine started.
            self.peak_gpu = max(self.peak_gpu, nvml().used_bytes() - gpu_baseline)
            self.method = "NVML: device memory used above the level before the engine started"


class Engine:
    """One side of the comparison ("stock" or "candidate")."""

    def __init__(self, role: str, spec: str, log_dir: Path, startup_timeout_s: float = 600.0):
        self.role = role
        self.spec = spec
        self.log_path = None if is_url(spec) else log_dir / f"{role}.log"
        self.startup_timeout_s = startup_timeout_s
        self.url = spec.rstrip("/") if is_url(spec) else None
        self.proc: subprocess.Popen | None = None
        self.argv: list[str] | None = None  # the command line as last launched (its port filled in)
        self.exit_codes: list[int] = []
        self.exited_on_its_own = False
        self.starts = 0
        self.healthy = False
        self._gpu_baseline: int | None = None
        self.memory = MemoryMonitor()

    @property
    def launched(self) -> bool:
        return not is_url(self.spec)

    @property
    def command(self) -> str:
        """What runs: the command line as launched (the real port, not `{port}`), or the URL."""
        return shlex.join(self.argv) if self.launched and self.argv else self.spec

    @property
    def up(self) -> bool:
        return self.proc is not None if self.launched else self.starts > 0

    def start(self) -> None:
        """Launch (if a command), wait for /health, start the memory monitor."""
        self.launch()
        self.ready()

    def launch(self) -> None:
        if self.up:
            return
        self.starts += 1
        self._gpu_baseline = nvml().used_bytes() if nvml().available else None
        if self.launched:
            port = free_port()
            argv = self.argv = command_line(self.spec, port)
            self.url = f"http://127.0.0.1:{port}"
            with open(self.log_path, "a") as log:
                log.write(f"\n$ {shlex.join(argv)}\n")
                log.flush()
                # its own session (stop() signals the whole group); SPECDEC_PARENT_PID so that a specdec server
                # ends itself if the judge is killed before it can stop it (specdec/parent_watch.py)
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, env=child_env())
        self.healthy = False

    def ready(self, note=None) -> None:
        """Wait for /health (note(text), if given, hears every WAIT_NOTE_EVERY_S how the wait goes)."""
        if self.healthy:
            return
        self.wait_healthy(note)
        self.healthy = True
        self.memory.start(self.proc.pid if self.proc else None, self.url, self._gpu_baseline)

    def wait_healthy(self, note=None) -> None:
        started = time.monotonic()
        deadline, next_note = started + self.startup_timeout_s, started + WAIT_NOTE_EVERY_S
        delay = 0.02
        last = "no answer"
        while time.monotonic() < deadline:
            self.check_alive("while starting")
            if note is not None and time.monotonic() >= next_note:
                next_note += WAIT_NOTE_EVERY_S
                note(self._waiting(last, time.monotonic() - started))
            try:
                resp = http_get(f"{self.url}/health", 5.0)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
        self.stop()
        where = "is not reachable" if not self.launched else "did not become healthy"
        raise JudgeFailure(f"{self.role} engine {where} at {self.url}/health within "
                           f"{self.startup_timeout_s:g} s (last: {last}){self.log_tail()}")

    def _waiting(self, last: str, waited_s: float) -> str:
        """What a wait for /health has seen so far, and what the person watching can do about it."""
        text = (f"{self.role}: waiting for {self.url}/health ({last}), {waited_s:.0f} s of "
                f"{self.startup_timeout_s:g} s (--startup-timeout)")
        if not self.launched and last == "ConnectError":
            text += f"; nothing answers there yet: start the server, or check --{self.role}"
        return text

    def check_alive(self, when: str, grace_s: float = 0.0) -> None:
        """Raise JudgeFailure if a launched engine has exited (or does within grace_s seconds)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            return
        code = self.proc.returncode
        self.exit_codes.append(code)
        self.exited_on_its_own = True
        self.proc = None
        self.healthy = False
        self.memory.stop()
        raise JudgeFailure(f"{self.role} engine exited with code {code} {when}{self.log_tail()}")

    def stop(self) -> None:
        """Stop a launched engine (SIGTERM to its process group, SIGKILL after 30 s) and keep its exit code."""
        self.memory.stop()
        self.healthy = False
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        else:
            self.exited_on_its_own = True
        self.exit_codes.append(proc.returncode)

    def log_tail(self, lines: int = 6) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        return f"; last lines of {self.log_path.name}: " + " | ".join(t.strip() for t in tail) if tail else ""

    def summary(self) -> dict:
        return {"spec": self.spec, "url": self.url, "launched": self.launched, "starts": self.starts,
                "exit_codes": self.exit_codes, "exited_on_its_own": self.exited_on_its_own,
                "log": str(self.log_path) if self.log_path else None,
                "peak_memory_mib": self.memory.peak_mib(), "memory_method": self.memory.method}


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
