"""The pre-training pipeline (specdec.train.lm) with ``--arch qwen3_5``: a tiny Qwen3.5-shaped hybrid trained a
few steps on a tiny corpus lowers its loss, is saved in the text-only layout, loads in the engine, the engine's
greedy output equals transformers' greedy generate on it, and it feeds the MTP head training. ``--arch`` defaults
to Qwen3 as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.train import lm
from specdec.train.shapes import HYBRID_TARGET_SHAPE, HybridShape, layer_types, mrope_section, qwen3_5_config

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "specdec" / "assets" / "ref-target"  # the reference pair's BPE (8192 tokens)
TINY = HybridShape(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, max_position_embeddings=512)
STEPS = 40
NEW_TOKENS = 16


def write_corpus(path: Path) -> Path:
    """A corpus directory in specdec.data.corpus's layout: this repo's specdec/train sources to train on,
    specdec/data's held out."""
    splits = {"train": sorted((REPO / "specdec" / "train").glob("*.py")),
              "heldout": sorted((REPO / "specdec" / "data").glob("*.py"))}
    path.mkdir(parents=True, exist_ok=True)
    manifest = {"splits": {}}
    for split, files in splits.items():
        shard = f"{split}-00000.jsonl"
        lines = [json.dumps({"package": "specdec", "version": "0", "path": f.name, "text": f.read_text()})
                 for f in files]
        (path / shard).write_text("\n".join(lines) + "\n")
        manifest["splits"][split] = {"shards": [shard]}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """Prompt records ``{"id", "prompt"}`` of ``texts``, one a line."""
    path.write_text("".join(json.dumps({"id": f"{path.stem}-{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Matrices this small gain nothing from a second thread, and lose much on a busy shared host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, pretrain's result) of a tiny hybrid pre-trained for STEPS steps on CPU."""
    tmp = tmp_path_factory.mktemp("hybridlm")
    cfg = lm.TrainConfig(seq_len=64, batch_size=8, lr=3e-3, warmup_steps=3, max_steps=STEPS, eval_points=2,
                         eval_windows=8, device="cpu")
    result = lm.pretrain(write_corpus(tmp / "corpus"), TOKENIZER, tmp / "ckpt", TINY, cfg)
    return tmp / "ckpt", result


def test_pretraining_lowers_the_loss(trained):
    _, result = trained
    assert result["steps"] == STEPS
    assert result["final_train_loss"] < result["first_loss"] - 1.0, result
    held = [row["heldout_loss"] for row in result["history"] if "heldout_loss" in row]
    assert result["final_heldout_loss"] < held[0] or len(held) == 1
    assert result["final_heldout_loss"] < result["first_loss"] - 1.0


def test_checkpoint_is_the_text_only_qwen3_5_layout(trained):
    path, result = trained
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    assert result["params"] > 0


def test_engine_greedy_equals_transformers_generate(trained):
    import transformers

    path, _ = trained
    llm = LLM(path, device="cpu", kv_cache_tokens=1024, block_size=4)
    prompts = [llm.encode(text) for text in ("def train(model, data):\n    ", "import torch\n\n\nclass ",
                                             '"""Pre-training a small')]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    for ids, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist()


def test_engine_scores_equal_transformers_log_probs(trained):
    """Every position of a held-out text, across the 64-token chunks of the Gated DeltaNet prefill."""
    import transformers

    path, _ = trained
    llm = LLM(path, device="cpu", kv_cache_tokens=1024, block_size=4)
    ids = llm.encode((REPO / "specdec" / "data" / "corpus.py").read_text())[:150]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)  # [T, V]
    ref = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (torch.tensor(llm.score([ids])[0]) - ref).abs().max().item() < 1e-4


def test_checkpoint_feeds_the_mtp_head_training(trained, tmp_path):
    """The next step to ref-hybrid: ``train head --kind mtp`` on the checkpoint (no mtp.*: a random head
    starts), whose export drafts with ``--speculator mtp`` and decodes exactly as the target alone."""
    from specdec.speculate import SpecConfig
    from specdec.train import head as pipeline

    path, _ = trained
    texts = [f.read_text()[:400] for f in sorted((REPO / "specdec" / "train").glob("*.py"))]
    prompts, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    write_jsonl(prompts, texts[:8])
    write_jsonl(heldout, [t[-200:] for t in texts[-2:]])
    run = pipeline.HeadRun(str(path), [str(prompts)], str(tmp_path / "mtp"), heldout=str(heldout), kind="mtp",
                           heldout_max_tokens=12, max_new_tokens=12, gen_batch_size=8, ttt_steps=2, seq_len=64,
                           batch_size=4, lr=3e-3, max_steps=6, warmup_steps=2, device="cpu", formats=("bf16",))
    export = pipeline.run_pipeline(run, progress=False)["exports"]["bf16"]["dir"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = LLM(path, device="cpu", kv_cache_tokens=1024, block_size=4).encode(texts[0][:200])
    plain = LLM(export, device="cpu", kv_cache_tokens=1024, block_size=4).generate([ids], greedy)[0].token_ids
    spec = LLM(export, device="cpu", kv_cache_tokens=1024, block_size=4,
               speculator=SpecConfig("mtp", num_draft_tokens=2)).generate([ids], greedy)[0].token_ids
    assert spec == plain


def test_hybrid_shape_defaults_and_config():
    config = qwen3_5_config(HYBRID_TARGET_SHAPE, 8192, 0)
    assert layer_types(HYBRID_TARGET_SHAPE) == config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert mrope_section(64) == [11, 11, 10] and config.rope_parameters["mrope_section"] == [3, 3, 2]
    params = lm.count_params(lm.new_model(config))
    ref_target = lm.count_params(lm.new_model(lm.qwen3_config(lm.TARGET_SHAPE, 8192, 0)))
    assert 0.9 < params / ref_target < 1.2  # comparable in size to ref-target
    with pytest.raises(ValueError, match="rotary"):
        qwen3_5_config(HybridShape(head_dim=4), 8192, 0)


@pytest.mark.parametrize("arch, shape", [(None, lm.TARGET_SHAPE), ("qwen3", lm.TARGET_SHAPE),
                                         ("qwen3_5", HYBRID_TARGET_SHAPE)])
def test_cli_arch_picks_the_shape(monkeypatch, arch, shape):
    seen = {}

    def fake_pretrain(corpus, tokenizer, out, shape, cfg, max_shard_size):
        seen["shape"] = shape
        return {"params": 1, "steps": 1, "tokens": 1, "final_heldout_loss": 0.0}

    monkeypatch.setattr(lm, "pretrain", fake_pretrain)
    argv = ["--corpus", "c", "--tokenizer", "t", "--out", "o", "--max-steps", "1"]
    assert lm.main(argv + (["--arch", arch] if arch else [])) == 0
    assert seen["shape"] == shape and type(seen["shape"]) is type(shape)
    if arch == "qwen3_5":
        lm.main(argv + ["--arch", arch, "--linear-num-value-heads", "4", "--full-attention-interval", "2"])
        assert seen["shape"].linear_num_value_heads == 4 and seen["shape"].full_attention_interval == 2
