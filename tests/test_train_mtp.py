"""`specdec train head --kind mtp`: the unrolled MTP head equals its drafting, and the pipeline end to end on a
tiny Qwen3.5 target that ships random mtp.* weights: the loss falls, the export drafts losslessly and is
accepted more often than the head it started from, a rerun resumes, a dense target is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.kv_cache import BlockManager
from specdec.errors import ConfigError
from specdec.models.config import ModelConfig
from specdec.models.loader import load_model, read_mtp_state
from specdec.models.mtp import load_mtp_head, random_mtp_state, read_mtp_head
from specdec.speculate import SpecConfig
from specdec.speculate.mtp import MTPSpeculator
from specdec.train import head as pipeline
from specdec.train.head_loss import head_loss, unrolled_logits
from specdec.train.head_unroll import MTPUnroll
from tests.checkpoints import add_mtp_weights, save_char_tokenizer, save_tiny
from tests.test_qwen3_5 import TEXT, build_hf
from tests.test_train_drafter import _write_jsonl

STEPS, K = 60, 2
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def save_target(path: Path, mtp: bool = True) -> Path:
    """The tiny two-full Qwen3.5 model with a character tokenizer, its final norm sharpened (logits 3 times
    larger: clear greedy choices to learn), and random mtp.* weights (the head training starts from)."""
    hf = build_hf("two-full")
    with torch.no_grad():  # zero-centred: the scale is 1 + w
        hf.model.norm.weight.copy_(3 * (1 + hf.model.norm.weight) - 1)
    hf.save_pretrained(path)
    save_char_tokenizer(path, TEXT["vocab_size"])
    return add_mtp_weights(path, random_mtp_state(ModelConfig.from_dir(path), seed=5)) if mtp else path


def _prompts(n: int, seed: int, length: int = 12) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"id": f"p{seed}-{i}", "prompt": torch.randint(2, TEXT["vocab_size"], (length,), generator=gen).tolist()}
            for i in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("mtptrain")
    target = save_target(base / "target")
    prompts = _write_jsonl(base / "train.jsonl", _prompts(16, 1))
    heldout = _write_jsonl(base / "heldout.jsonl", _prompts(4, 2))
    run = pipeline.HeadRun(str(target), [str(prompts)], str(base / "run"), heldout=str(heldout), kind="mtp",
                           heldout_max_tokens=24, max_new_tokens=24, gen_batch_size=16, ttt_steps=K,
                           seq_len=40, batch_size=8, lr=5e-3, max_steps=STEPS, warmup_steps=5,
                           checkpoint_every=STEPS // 2, device="cpu", formats=("bf16",))
    result = pipeline.run_pipeline(run, progress=False)
    return {"target": target, "run": run, "result": result, "export": result["exports"]["bf16"]["dir"]}


def _events(run_dir, name: str, skip: int = 0) -> list[dict]:
    """The run's log events of this name, after the first `skip` lines."""
    rows = [json.loads(line) for line in (Path(run_dir) / "train_log.jsonl").read_text().splitlines()[skip:]]
    return [r for r in rows if r["event"] == name]


def _greedy_records(trained) -> list[dict]:
    shard = next((Path(trained["run"].out) / "continuations-greedy").glob("*.jsonl"))
    return [json.loads(line) for line in shard.read_text().splitlines()]


@torch.no_grad()
def _loss(head_dir, target, records) -> float:
    """The training-time-test loss of the MTP head in head_dir on the records' sequences."""
    rows = [r["prompt"] + r["continuation"] for r in records]
    ids = torch.tensor([row + [0] * (max(map(len, rows)) - len(row)) for row in rows])
    signals = pipeline.TargetSignals(str(target), torch.device("cpu"), (4,))
    head = read_mtp_head(head_dir, ModelConfig.from_dir(target), torch.device("cpu"), torch.float32)
    unroll = MTPUnroll(head, signals.model.get_output_embeddings())
    return head_loss(unroll, *signals(ids, None), torch.tensor([len(r) for r in rows]), K)[0].item()


def test_training_lowers_the_loss_and_writes_its_provenance(trained):
    result, out, target = trained["result"], Path(trained["run"].out), trained["target"]
    records = _greedy_records(trained)
    assert _loss(trained["export"], target, records) < _loss(target, target, records) - 0.1
    assert result["steps"] == STEPS and result["start"] == "target" and result["feature_layers"] == [4]
    train = _events(out, "train")
    assert [e["step"] for e in train] == [50, 60] and train[-1]["accuracy"][0] > 0.5
    assert len(result["acceptance_before"]) == len(result["acceptance_after"]) == K  # held out: random tokens
    manifest = (out / "DATA_MANIFEST.md").read_text()
    assert "MTP head" in manifest and "mtp.* weights" in manifest
    sha = json.loads((Path(trained["export"]) / "weights.sha256.json").read_text())
    assert set(sha) == {"model.safetensors", "model-mtp.safetensors"}


def test_the_export_keeps_the_target_and_carries_the_trained_head(trained):
    target, export = trained["target"], Path(trained["export"])
    for name in ("config.json", "tokenizer.json"):
        assert (export / name).read_bytes() == (target / name).read_bytes()
    before, after = read_mtp_state(target, "cpu", torch.float32), read_mtp_state(export, "cpu", torch.float32)
    assert before.keys() == after.keys() and not torch.equal(before["mtp.fc.weight"], after["mtp.fc.weight"])
    plain_target, plain_export = load_model(target), load_model(export)
    for (name, a), b in zip(plain_target.state_dict().items(), plain_export.state_dict().values()):
        assert torch.equal(a, b), name


def _greedy(model_dir, k: int | None, prompts) -> tuple[list[list[int]], int]:
    """(greedy continuations, drafts accepted) of the engine, with the MTP speculator at k when given."""
    spec = SpecConfig("mtp", num_draft_tokens=k, adaptive=False) if k else None
    llm = LLM(model_dir, device="cpu", kv_cache_tokens=2048, block_size=4, speculator=spec)
    before = dict(llm.engine.metrics())
    outs = llm.generate(prompts, GREEDY)
    accepted = sum(llm.engine.metrics()["accepted_per_position"][:k or 0]) - sum(
        before["accepted_per_position"][:k or 0]) if k else 0
    return [o.token_ids for o in outs], accepted


def test_the_export_drafts_losslessly_and_is_accepted_more_than_its_start(trained):
    """Measured on the target's greedy replies to the prompts it was trained on (memorised: a clear margin)."""
    prompts = [r["prompt"] for r in _greedy_records(trained)]
    plain, _ = _greedy(trained["target"], None, prompts)
    started, accepted_start = _greedy(trained["target"], K, prompts)
    trained_out, accepted_trained = _greedy(trained["export"], K, prompts)
    assert started == plain and trained_out == plain
    print("accepted drafts: start", accepted_start, "trained", accepted_trained)
    assert accepted_trained > accepted_start + 10, (accepted_start, accepted_trained)


def test_a_rerun_resumes_from_the_checkpoint(trained, tmp_path):
    run_dir = shutil.copytree(trained["run"].out, tmp_path / "run")
    run = dataclasses.replace(trained["run"], out=str(run_dir), max_steps=STEPS + 4)
    earlier = len((run_dir / "train_log.jsonl").read_text().splitlines())
    result = pipeline.run_pipeline(run, progress=False)
    assert result["steps"] == STEPS + 4
    assert [e["step"] for e in _events(run_dir, "resume", earlier)] == [STEPS]
    assert not _events(run_dir, "continuations-shard", earlier)  # the continuations came from the cache
    assert [e["step"] for e in _events(run_dir, "eval", earlier)] == [STEPS + 4]  # no second "before"


def test_unrolled_steps_equal_mtp_drafting_with_teacher_tokens(tmp_path):
    """Step s of the training-time test at position p is what the MTP speculator computes when, having read the
    target up to root p - s, it drafts s tokens that happen to be x_{p-s+2} .. x_{p+1}; and a target without
    mtp.* weights starts a random head whose parameters are the mtp.* weights alone."""
    import transformers

    target_dir = save_target(tmp_path / "target")
    target = load_model(target_dir, "cpu", torch.float32)
    head = load_mtp_head(target_dir, target, torch.device("cpu"), torch.float32)
    tokens = [5, 17, 30, 2, 9, 44, 61, 3, 8, 12, 70, 23]
    ids = torch.tensor([tokens])
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = hf(ids, output_hidden_states=True).hidden_states[-1]  # [1, T, H]: final-normed
        embed = hf.get_input_embeddings()(torch.cat([ids[:, 1:], ids[:, -1:]], 1))
        unrolled = unrolled_logits(MTPUnroll(head, hf.get_output_embeddings()), embed, features, 3)
    blocks = BlockManager(16, 4)
    spec = MTPSpeculator(head, blocks)
    block_ids = blocks.allocate(4)
    for root in (2, 5, 7):
        with torch.no_grad():
            state = spec._forward(torch.tensor(tokens[1:root + 2]), features[0, :root + 1],
                                  [(block_ids, 0, root + 1)])[0][-1:]
            for s in range(3):
                if s:
                    state, _ = spec._forward(torch.tensor([tokens[root + s + 1]]), state, [(block_ids, root + s, 1)])
                torch.testing.assert_close(head.logits(state)[0], unrolled[s][0, root + s], atol=1e-4, rtol=1e-4)


def test_a_target_without_mtp_weights_starts_a_random_head(tmp_path):
    from specdec.train.mtp_head import mtp_model

    target_dir = save_target(tmp_path / "target", mtp=False)
    signals = pipeline.TargetSignals(str(target_dir), torch.device("cpu"), (4,))
    head, unroll, start = mtp_model(str(target_dir), signals, 0, torch.device("cpu"))
    assert start == "random" and unroll.target_ids() is None
    assert all(p.requires_grad for p in head.parameters())
    assert {"mtp." + k for k in head.state_dict()} == set(random_mtp_state(ModelConfig.from_dir(target_dir)))


def test_a_dense_target_is_refused(tmp_path):
    target = save_tiny(tmp_path / "qwen3")
    run = pipeline.HeadRun(str(target), [], str(tmp_path / "run"), kind="mtp")
    with pytest.raises(ConfigError, match="Qwen3.5.*qwen3 model.*--kind eagle3"):
        pipeline.run_pipeline(run, progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):  # an eagle3-only flag
        pipeline.main(["--target", str(target), "--kind", "mtp", "--draft-vocab", "8", "--prompts", "x", "--out",
                       str(tmp_path / "run")])
