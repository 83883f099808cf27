"""End to end on CPU at tiny scale: corpus -> tokenizer -> target -> continuations -> drafter -> evaluation.

One run of ``bench/refpair.py --tiny --pack-mib 0.1`` (about 15 s on 2 cores) feeds every test below.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.assets import heldout_prompts_path, resolve_model, short_name_path
from specdec.data import bpe, corpus
from specdec.train import distill

REPO = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("refpair_bench", REPO / "bench" / "refpair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny run: its --out, --work, the unpacked assets and reference-pair.json."""
    out, work, unpacked = (tmp_path_factory.mktemp(n) for n in ("out", "work", "unpacked"))
    rc = _load_bench().main(["--out", str(out), "--work", str(work), "--tiny", "--device", "cpu", "--pack-mib", "0.1"])
    parts = sorted(out.glob("refpair.tar.part*"))
    subprocess.run(f"cat {' '.join(map(str, parts))} | tar -xf - -C {unpacked}", shell=True, check=True)
    return {"rc": rc, "out": out, "work": work, "assets": unpacked,
            "results": json.loads((out / "reference-pair.json").read_text())}


def test_run_completes_with_all_metrics(run):
    r = run["results"]
    assert run["rc"] == 0, r["errors"]
    assert r["errors"] == []
    for key in ("target_params", "draft_params", "target_heldout_loss", "draft_heldout_loss", "tau_k4", "tau_k7",
                "tau_k16", "gpu", "times_s"):
        assert key in r, key
    assert r["draft_params"] < r["target_params"]
    for k in (4, 7, 16):
        assert 1.0 <= r[f"tau_k{k}"] <= k + 1
    assert r["sizes_bytes"]["total"] <= r["sizes_bytes"]["limit"]
    assert len(list(run["out"].glob("refpair.tar.part*"))) >= 2  # 0.1 MiB pieces
    assert len(list(run["out"].iterdir())) <= 8


def test_manifest_lists_packages_with_disjoint_splits(run):
    manifest = corpus.load_manifest(run["work"] / "corpus")
    text = (run["assets"] / "DATA_MANIFEST.md").read_text()
    assert (run["out"] / "DATA_MANIFEST.md").read_text() == text
    assert "python -m specdec.data.corpus" in text and manifest["python"] in text
    by_split = {s: {p["name"] for p in manifest["packages"] if p["split"] == s} for s in corpus.SPLITS}
    assert by_split["train"] and by_split["heldout"]
    assert not by_split["train"] & by_split["heldout"]
    for row in manifest["packages"]:
        assert f"| {row['name']} | {row['version']} | {row['split']} | {row['files']} | {row['bytes']} |" in text
    for split in corpus.SPLITS:
        docs = list(corpus.iter_documents(run["work"] / "corpus", split))
        assert {d["package"] for d in docs} == by_split[split]
        assert len(docs) == manifest["splits"][split]["files"]
    assert sum(s["bytes"] for s in manifest["splits"].values()) <= 1.5e6


def test_tokenizer_round_trips_source_and_loads_in_transformers(run):
    from transformers import AutoTokenizer

    tok_dir = run["assets"] / "ref-target"
    tok = bpe.load_tokenizer(tok_dir)
    assert tok.get_vocab_size() == 512
    texts = [d["text"] for d in corpus.iter_documents(run["work"] / "corpus", "heldout")][:20]
    texts.append("def f(x):\r\n\tif x:  \n\t\treturn '<|endoftext|>'   \n\n\n# é ü 中文 \U0001f600\n")
    for text in texts:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert bpe.special_ids(tok) == {"eos": 0, "im_start": 1, "im_end": 2}
    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert hf.eos_token == "<|endoftext|>" and hf.pad_token == "<|endoftext|>" and hf.eos_token_id == 0
    assert hf.decode(hf(texts[0])["input_ids"]) == texts[0]
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["ref-target", "ref-draft"])
def test_checkpoints_load_as_qwen3(run, name):
    from transformers import AutoModelForCausalLM

    path = run["assets"] / name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "bfloat16"
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    # --tiny shards at 100KB: the target (~210 KB) is sharded with an index, the drafter (~50 KB) is not
    assert (path / "model.safetensors.index.json").is_file() == (name == "ref-target")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    params = sum(p.numel() for p in model.parameters())
    assert params == run["results"]["target_params" if name == "ref-target" else "draft_params"]


def test_training_loss_decreases(run):
    for name in ("target_train", "draft_train"):
        train = run["results"][name]
        assert train["final_train_loss"] < train["first_loss"] - 0.3, train
    history = run["results"]["target_train"]["history"]
    held = [row["heldout_loss"] for row in history if "heldout_loss" in row]
    assert held[-1] < held[0]


def test_heldout_prompts_come_from_heldout_packages(run):
    manifest = corpus.load_manifest(run["work"] / "corpus")
    heldout = {p["name"] for p in manifest["packages"] if p["split"] == "heldout"}
    lines = (run["assets"] / "heldout-prompts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == run["results"]["corpus"]["heldout_prompts"] > 0
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        assert r["prompt"].endswith("\n") and r["source"].split("/")[0] in heldout


def test_greedy_continuations_batched_equal_single_and_tau_matches_definition(run):
    target = distill.load_model(run["assets"] / "ref-target", "cpu")
    draft = distill.load_model(run["assets"] / "ref-draft", "cpu")
    tok = bpe.load_tokenizer(run["assets"] / "ref-target")
    records = [json.loads(line) for line in (run["assets"] / "heldout-prompts.jsonl").read_text().splitlines()]
    prompts = [tok.encode(r["prompt"][-120:]).ids for r in records[:5]]
    batched = distill.greedy_continuations(target, prompts, 16, batch_size=5, progress=False)
    single = [distill.greedy_continuations(target, [p], 16, batch_size=1, progress=False)[0] for p in prompts]
    assert batched == single and all(1 <= len(c) <= 16 for c in batched)
    texts = distill.greedy_continuations(run["assets"] / "ref-target", [r["prompt"][-120:] for r in records[:5]],
                                         16, batch_size=5, device="cpu", progress=False)
    assert texts == batched
    matches = distill.draft_matches(draft, prompts, batched)
    for k in (1, 3):
        assert distill.acceptance_tau(matches, k) == pytest.approx(distill.literal_tau(draft, prompts, batched, k))


def test_acceptance_walk():
    m = np.array([True, True, False, True, True, True, True, False])
    assert distill.acceptance_walk(m, 4) == (8, 2)  # steps: 2 accepted + 1, then 4 accepted + 1
    assert distill.acceptance_walk(m, 1) == (8, 5)
    assert distill.acceptance_walk(np.ones(10, bool), 16) == (10, 1)
    assert distill.acceptance_tau([np.zeros(5, bool)], 7) == 1.0


def test_pair_batcher_masks_continuation_targets_only():
    pairs = [(np.array([5, 6, 7]), np.array([8, 9]))]
    ids, ce, kl = distill.PairBatcher(pairs, seq_len=7, batch_size=2, pad_id=0).next(torch.device("cpu"))
    assert ids.shape == (2, 8) and ids[0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert ce[0].tolist() == [0, 0, 1, 1, 0, 0, 0]  # targets ids[:, 1:] = 6 7 [8 9] pad...
    assert kl[0].tolist() == [1, 1, 1, 1, 0, 0, 0]
    long = [(np.arange(1, 11), np.array([20, 21]))]  # 12 tokens into a width of 8: the prompt's start is cut
    ids, ce, _ = distill.PairBatcher(long, seq_len=7, batch_size=1, pad_id=0).next(torch.device("cpu"))
    assert ids[0].tolist() == [5, 6, 7, 8, 9, 10, 20, 21] and ce[0].tolist() == [0, 0, 0, 0, 0, 1, 1]


def test_resolver(tmp_path):
    assert short_name_path("ref-target").parts[-2:] == ("assets", "ref-target")
    assert short_name_path("ref-draft").parts[-2:] == ("assets", "ref-draft")
    assert heldout_prompts_path().name == "heldout-prompts.jsonl"
    for name in ("ref-target", "ref-draft"):
        if (short_name_path(name) / "config.json").is_file():
            assert resolve_model(name) == short_name_path(name)
        else:
            with pytest.raises(FileNotFoundError, match="bench/refpair.py"):
                resolve_model(name)
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("no-such-model-xyz")
    message = str(err.value)
    assert "ref-target" in message and "ref-draft" in message and "Hugging Face model directory" in message


def test_cli_entry_points_parse():
    from specdec.train import lm

    for module in (lm, distill):
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--help"])
        assert exit_info.value.code == 0
