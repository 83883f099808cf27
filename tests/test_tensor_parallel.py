"""Tensor parallelism on CPU: 2 gloo ranks must reproduce the single-process logits and generations."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from specdec import LLM, SamplingParams
from specdec.errors import ConfigError
from specdec.judge.engines import free_port
from specdec.parallel.tensor_parallel import RankZeroController
from specdec.speculate.config import SpecConfig
from tests.checkpoints import save_tiny

WORLD = 2
TIMEOUT_S = 90  # a hung collective fails the test instead of blocking CI
CASES = {  # name -> save_tiny kwargs (4 query heads, 2 KV heads, intermediate 64: all divide 2)
    "qwen3": dict(arch="qwen3"),
    # tied embeddings, an odd vocabulary (uneven vocab slices) and biased attention (row-parallel bias)
    "llama-tied-odd-vocab": dict(arch="llama", tie=True, vocab_size=97, attention_bias=True),
}
PROMPTS = [[3, 17, 42, 5, 9], [60, 2, 33], list(range(10, 40))]


def run_all(path) -> dict:
    """What the comparison needs from one model, single process or one rank of a TP group."""
    tp = int(os.environ.get("WORLD_SIZE", 1))
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    prefill = LLM(path, device="cpu", kv_cache_tokens=256, block_size=16, tensor_parallel_size=tp)
    decode = LLM(path, device="cpu", kv_cache_tokens=256, block_size=4, max_num_batched_tokens=1,
                 tensor_parallel_size=tp)
    gen = LLM(path, device="cpu", kv_cache_tokens=1024, block_size=4, tensor_parallel_size=tp)
    params = [SamplingParams(max_tokens=12, temperature=0.0)] * len(PROMPTS)
    params += [SamplingParams(max_tokens=12, temperature=1.0, seed=7)]
    # n-gram speculation (k goes through RankZeroController: rank 0 decides for all)
    spec = LLM(path, device="cpu", kv_cache_tokens=1024, block_size=4,
               speculator=SpecConfig(method="ngram", num_draft_tokens=3, adaptive=False), tensor_parallel_size=tp)
    return {
        "prefill": prefill.engine.all_logits(ids),
        "decode": decode.engine.all_logits(ids),
        "generate": [c.token_ids for c in gen.generate(PROMPTS + PROMPTS[:1], params)],
        "speculative": [(c.token_ids, c.num_drafted) for c in spec.generate(PROMPTS, params[:len(PROMPTS)])],
        "kv_heads": gen.engine.kv_cache.layers[0][0].shape[1],
    }


def _worker(rank: int, port: int, paths: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    results = {name: run_all(path) for name, path in paths.items()}
    results["k"] = RankZeroController(_RankDependentController(rank)).choose(["r0"], 0)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    # both ranks done before either tears the group down: a rank that exits while the other still talks to it
    # aborted once ("terminate called without an active exception") in a loaded CI trial
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


class _RankDependentController:
    """Chooses k from something local (as timings are); RankZeroController must override it."""

    def __init__(self, rank: int):
        self.rank, self.last_k = rank, None

    def choose(self, request_ids, other_tokens) -> int:
        return 3 + self.rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    paths = {name: str(save_tiny(tmp_path_factory.mktemp(name), **kw)) for name, kw in CASES.items()}
    out_dir = tmp_path_factory.mktemp("tp-out")
    ctx = mp.start_processes(_worker, args=(free_port(), paths, str(out_dir)), nprocs=WORLD, join=False,
                             start_method="spawn")
    single = {name: run_all(path) for name, path in paths.items()}  # overlaps the workers' start-up
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"tensor-parallel workers did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]
    return single, ranks


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp_logits_match_single_process(runs, name):
    single, ranks = runs
    for rank in ranks:
        for key in ("prefill", "decode"):
            assert rank[name][key].shape == single[name][key].shape
            assert (rank[name][key] - single[name][key]).abs().max().item() <= 1e-4, key


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp_generations_match_single_process(runs, name):
    single, ranks = runs
    for rank in ranks:  # SPMD: every rank produced the same tokens, equal to the single process's
        assert rank[name]["generate"] == single[name]["generate"]
        assert [t for t, _ in rank[name]["speculative"]] == single[name]["generate"][:len(PROMPTS)]
        assert sum(d for _, d in rank[name]["speculative"]) > 0  # speculation happened


def test_each_rank_caches_only_its_kv_heads(runs):
    single, ranks = runs
    assert single["qwen3"]["kv_heads"] == 2
    assert all(rank["qwen3"]["kv_heads"] == 1 for rank in ranks)


def test_rank_zero_chooses_the_draft_length(runs):
    _, ranks = runs
    assert [rank["k"] for rank in ranks] == [3] * WORLD


def test_indivisible_kv_heads_is_a_config_error(tmp_path):
    from specdec.models.loader import load_model
    from specdec.parallel.tensor_parallel import shard_model

    model = load_model(save_tiny(tmp_path, arch="qwen3", num_key_value_heads=1, tokenizer=False))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        shard_model(model, 0, WORLD)


def test_tensor_parallel_without_torchrun_says_how_to_launch(qwen3_dir, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        LLM(qwen3_dir, device="cpu", tensor_parallel_size=2)
