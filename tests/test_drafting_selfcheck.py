"""The self-check gates fail on servers that are never healthy, answer garbage or die; pass on the real one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specdec.cli import main
from specdec.drafting.heldout import load_heldout
from specdec.parent_watch import PARENT_GONE, child_env
from specdec.drafting.selfcheck import SelfCheckConfig, run_selfcheck, spread_windows, url_from_launch
from tests.checkpoints import save_tiny

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    g = np.random.default_rng(1)
    rows = [{"id": f"c{i}", "prompt": g.integers(2, 96, 6).tolist(),
             "continuation": g.integers(2, 96, int(n)).tolist()} for i, n in enumerate(g.integers(0, 120, 40))]
    path = tmp_path_factory.mktemp("selfcheck") / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("drafter"), "qwen3", seed=7, num_hidden_layers=1)


def fake(mode: str, port: int) -> str:
    return f"cd {REPO} && exec {sys.executable} -m tests.fakes_draft.server --mode {mode} --port {port}"


def check(launch: str, heldout: Path, drafter_dir: Path, **options) -> dict[int, bool]:
    config = SelfCheckConfig(launch, load_heldout(heldout), drafter_dir=str(drafter_dir), vocab_size=96,
                             timeout_s=5.0, **options)
    return {g.number: g.passed for g in run_selfcheck(config)}


def test_windows_spread_from_openings_to_ends():
    conversations = [{"continuation": [0] * n} for n in (200, 200, 200, 50)]
    assert spread_windows(conversations, 76) == [(0, 76), (41, 117), (83, 159), (0, 50)]
    assert url_from_launch("specdec draft serve ref-draft --port 9001") == "http://127.0.0.1:9001"


def test_a_server_that_never_becomes_healthy_fails(heldout, drafter_dir):
    gates = check(fake("never-healthy", free_port()), heldout, drafter_dir, startup_timeout_s=2.0)
    assert gates == {1: True, 2: False, 3: False, 4: False, 5: False, 6: False}


def test_a_server_that_answers_garbage_fails(heldout, drafter_dir):
    gates = check(fake("garbage", free_port()), heldout, drafter_dir)
    assert gates[2] and not gates[3] and not gates[5]


def test_a_server_that_dies_after_requests_fails(heldout, drafter_dir):
    gates = check(fake("dies-after", free_port()), heldout, drafter_dir)
    assert gates[1] and gates[2] and gates[3] and not gates[5] and not gates[6]


def test_the_real_server_passes_every_gate(heldout, drafter_dir, tmp_path, capsys):
    port = free_port()
    launch = f"cd {REPO} && exec {sys.executable} -m specdec.cli draft serve {drafter_dir} --port {port} --device cpu"
    out = tmp_path / "gates.json"
    code = main(["draft", "selfcheck", "--launch", launch, "--heldout", str(heldout), "--vocab-size", "96",
                 "--out", str(out), "--startup-timeout", "120"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    record = json.loads(out.read_text())
    assert record["passed"] and [g["number"] for g in record["gates"]] == [1, 2, 3, 4, 5, 6]
    assert "all gates pass" in printed and "projected" in printed


def test_the_launched_command_is_told_whose_death_to_follow(heldout, drafter_dir, tmp_path):
    """The self-check names itself in SPECDEC_PARENT_PID, so a server it launched ends if it is killed."""
    log = tmp_path / "launch.log"
    config = SelfCheckConfig('echo "parent=$SPECDEC_PARENT_PID"; exit 3', load_heldout(heldout),
                             url=f"http://127.0.0.1:{free_port()}", drafter_dir=str(drafter_dir), vocab_size=96,
                             timeout_s=2.0, startup_timeout_s=2.0)
    run_selfcheck(config, log_path=log)
    assert f"parent={os.getpid()}" in log.read_text()


def test_draft_serve_ends_itself_once_its_parent_is_killed(drafter_dir):
    parent = subprocess.Popen(["sleep", "600"])  # the supervisor's stand-in
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "specdec.cli", "draft", "serve", str(drafter_dir), "--port",
                                str(port), "--device", "cpu"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=child_env(parent.pid))
    try:
        deadline = time.monotonic() + 120
        while not listening(port):
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read() if \
                process.poll() is not None else "draft serve never listened"
            time.sleep(0.2)
        parent.kill()
        status = process.wait(10)
    finally:
        parent.kill()
        parent.wait()
        if process.poll() is None:
            process.kill()
            process.wait()
    assert status == PARENT_GONE, process.stdout.read()


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
