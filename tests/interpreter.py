"""Running Triton kernel tests on the CPU under Triton's interpreter, in a child process.

TRITON_INTERPRET must be set before triton is first imported (triton's own helpers, tl.zeros among them, are
decorated then), and it would change every later triton user of the process.  So a kernel test file marks its
kernel cases `child_only` and has one parent test call `run_child(__file__, ...)`: pytest on the same file in a
child process started with TRITON_INTERPRET=1, where the kernel cases run and the parent test is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "triton is not installed (it comes with the test extra: pip install -e .[test])"
child_only = pytest.mark.skipif(not CHILD, reason="runs in the interpreter's child process (see the module doc)")
parent_only = pytest.mark.skipif(CHILD or not HAS_TRITON, reason="this is the child" if CHILD else NO_TRITON)


def run_child(test_file: str, min_passed: int, parent_tests: int = 1) -> None:
    """pytest on test_file under TRITON_INTERPRET=1: it passes, at least min_passed cases ran and only the
    file's parent_tests (the caller, any GPU test) were skipped."""
    repo = Path(__file__).resolve().parents[1]
    # without the parent's PYTEST_ADDOPTS: a --basetemp there would make the child wipe the parent's tmp_path
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}
    child = subprocess.run([sys.executable, "-m", "pytest", test_file, "-p", "no:cacheprovider", "-rs"], cwd=repo,
                           env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    report = child.stdout[-8000:] + child.stderr[-2000:]
    assert child.returncode == 0, report
    passed, skipped = (re.search(rf"(\d+) {word}", child.stdout) for word in ("passed", "skipped"))
    assert passed and int(passed.group(1)) >= min_passed, report
    assert skipped is None or int(skipped.group(1)) == parent_tests, report  # skipped in the child


def kernel_module(name: str):
    """The kernel module `name` in the child (imported under the interpreter); None in the parent, which never
    imports triton."""
    if not CHILD:
        return None
    module = pytest.importorskip(name, reason=NO_TRITON)
    assert module.INTERPRETED
    return module
