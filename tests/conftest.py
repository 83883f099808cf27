from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoints import save_tiny

torch.set_num_threads(2)
# every test measures its own calibration (tests/test_calibration_cache.py turns the cache on where it checks it)
os.environ["SPECDEC_CALIBRATION_CACHE"] = "off"


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def llm(qwen3_dir):
    from specdec import LLM

    return LLM(qwen3_dir, device="cpu", kv_cache_tokens=4096, block_size=4)
