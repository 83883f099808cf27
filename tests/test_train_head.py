"""`specdec train head`: the training-time test equals drafting, and the pipeline end to end at tiny scale."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.kv_cache import BlockManager
from specdec.models.eagle3 import load_eagle3_head, random_head
from specdec.models.loader import load_model
from specdec.speculate import SpecConfig
from specdec.speculate.eagle3 import Eagle3Speculator
from specdec.train import head as pipeline
from specdec.train.head_loss import unrolled_logits
from specdec.train.head_unroll import Eagle3Unroll
from tests.checkpoints import save_tiny
from tests.test_train_drafter import _texts, _write_jsonl

LAYERS = (0, 1, 1)


def _signals(target_dir, ids):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[j] for j in LAYERS], -1)
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    return hf.get_input_embeddings()(nxt).detach(), features


def test_unrolled_training_steps_equal_drafting_with_teacher_tokens(qwen3_dir):
    """Step s of the training-time test at position p is what the speculator computes when, having read the
    target up to root p - s, it drafts s tokens that happen to be x_{p-s+2} .. x_{p+1}."""
    target = load_model(qwen3_dir, "cpu", torch.float32)
    head = random_head(target, seed=5, draft_vocab=64, std=0.3, feature_layers=LAYERS)
    tokens = [5, 17, 30, 2, 9, 44, 61, 3, 8, 12, 70, 23]
    ids = torch.tensor([tokens])
    embed, features = _signals(qwen3_dir, ids)
    with torch.no_grad():
        unrolled = unrolled_logits(Eagle3Unroll(head), embed, features, 3)  # per step [1, T, V_draft]
    blocks = BlockManager(16, 4)
    spec = Eagle3Speculator(head, blocks, target.config.vocab_size, LAYERS)
    block_ids = blocks.allocate(4)
    for root in (2, 5, 7):
        with torch.no_grad():  # read the target up to root, then chain with the teacher's tokens
            state = spec._forward(torch.tensor(tokens[1:root + 2]), head.project(features[0, :root + 1]),
                                  [(block_ids, 0, root + 1)])[0][-1:]
            for s in range(3):
                if s:
                    state, _ = spec._forward(torch.tensor([tokens[root + s + 1]]), state, [(block_ids, root + s, 1)])
                torch.testing.assert_close(head.logits(state)[0], unrolled[s][0, root + s], atol=1e-4, rtol=1e-4)


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    seqs = [np.array([3, 3, 3, 7, 7, 1]), np.array([7, 9, 3])]
    assert pipeline.draft_vocabulary(seqs, 10, 2).tolist() == [3, 7]
    assert pipeline.draft_vocabulary(seqs, 10, 3).tolist() == [1, 3, 7]  # 1 and 9 tie: the lower id
    assert pipeline.draft_vocabulary(seqs, 10, None).tolist() == list(range(10))


def sharpened(model_dir: Path, factor: float = 4.0) -> Path:
    """The tiny random model with its final norm scaled: logits `factor` times larger, so its greedy choices are
    clear (the plain tiny model is nearly uniform: entropy 4.2 nats of ln 96 = 4.6, no argmax to learn)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(factor)
    model.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("head")
    target = sharpened(save_tiny(base / "target", seed=0, num_hidden_layers=4))
    heldout = _write_jsonl(base / "heldout.jsonl", [{"id": f"h{i}", "prompt": t} for i, t in enumerate(_texts(24, 7))])
    prompts = _write_jsonl(base / "train.jsonl", [{"id": f"t{i}", "prompt": t} for i, t in enumerate(_texts(400, 3))])
    run = pipeline.HeadRun(str(target), [str(prompts)], str(base / "run"), heldout=str(heldout),
                           heldout_max_tokens=24, max_new_tokens=24, gen_batch_size=64, draft_vocab=80, ttt_steps=3,
                           seq_len=64, batch_size=16, lr=1e-2, max_steps=300, warmup_steps=5, checkpoint_every=100,
                           device="cpu")
    result = pipeline.run_pipeline(run, progress=False)
    return {"base": base, "target": target, "run": run, "result": result}


def test_pipeline_trains_a_head_that_drafts_better_than_its_start(tiny):
    result = tiny["result"]
    before, after = result["acceptance_before"], result["acceptance_after"]
    assert len(after) == 3 and result["steps"] == 300 and result["draft_vocab"] == 80
    assert after[0] > before[0] + 0.2  # the first draft position, on ~500 held-out roots (after: ~0.3)
    out = Path(tiny["run"].out)
    events = [json.loads(line)["event"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    for event in ("overlap-check", "continuations", "train", "eval", "export"):
        assert event in events
    manifest = (out / "DATA_MANIFEST.md").read_text()
    assert "greedy" in manifest and "temperature 1" in manifest and "sha256" in manifest
    sampled = [json.loads(line) for line in (out / "continuations-t1").glob("*.jsonl").__next__().open()]
    assert sampled and all(r["continuation"] for r in sampled)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_exports_load_and_draft_losslessly(tiny, fmt):
    export = tiny["result"]["exports"][fmt]["dir"]
    target = load_model(tiny["target"], "cpu", torch.float32)
    head = load_eagle3_head(export, target, torch.device("cpu"), torch.float32)
    assert head.config.feature_layers == (2, 2, 1)  # the default for 4 layers, written into the config
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 30, 2, 9], [40, 41, 42], [7] * 9]
    plain = [o.token_ids for o in LLM(tiny["target"], device="cpu", kv_cache_tokens=2048).generate(prompts, params)]
    spec = LLM(tiny["target"], device="cpu", kv_cache_tokens=2048,
               speculator=SpecConfig("eagle3", model=export, num_draft_tokens=3, adaptive=False))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.num_accepted for o in outs) > 0


def test_a_rerun_resumes_from_the_checkpoint(tiny, tmp_path):
    import dataclasses
    import shutil

    run_dir = shutil.copytree(tiny["run"].out, tmp_path / "run")
    run = dataclasses.replace(tiny["run"], out=str(run_dir), max_steps=310)
    earlier = len((run_dir / "train_log.jsonl").read_text().splitlines())
    result = pipeline.run_pipeline(run, progress=False)
    assert result["steps"] == 310
    events = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()[earlier:]]
    assert any(e["event"] == "resume" and e["step"] == 300 for e in events)
    assert not any(e["event"] == "continuations-shard" for e in events)  # continuations came from the cache


@pytest.mark.parametrize("start", ["target", "random"])
def test_a_head_starts_from_the_targets_output_side_or_at_random(tiny, start):
    import dataclasses

    run = dataclasses.replace(tiny["run"], start=start)
    sequences = [np.array([5, 17, 30, 2, 9, 5, 17]), np.array([40, 41, 42, 40])]
    model = pipeline.eagle3_model(run, sequences, torch.device("cpu"))
    target = load_model(tiny["target"], "cpu", torch.float32)
    vocab = (torch.arange(model.vocab) + model.module.d2t).long()  # the draft ids' target ids
    same_lm_head = torch.equal(model.module.lm_head.weight, target.lm_head.weight[vocab])
    same_norm = torch.equal(model.module.norm.weight, target.model.norm.weight)
    assert model.start == start and same_lm_head == same_norm == (start == "target")
    identity = dataclasses.replace(tiny["run"], start=start).identity()
    assert identity.get("start") == ("target" if start == "target" else None)  # a resume cannot switch starts


def test_a_head_reads_the_feature_layers_asked_for_and_refuses_ids_past_the_target(tiny):
    import dataclasses

    from specdec.errors import ConfigError

    sequences = [np.array([5, 17, 30, 2, 9, 5, 17])]
    model = pipeline.eagle3_model(dataclasses.replace(tiny["run"], feature_layers=(1, 2, 4)), sequences,
                                  torch.device("cpu"))
    assert model.feature_layers == (1, 2, 4) and model.module.config.feature_layers == (1, 2, 4)
    assert model.signals.layers == (1, 2, 4)
    with pytest.raises(ConfigError, match="each id must be in 0..4"):
        pipeline.eagle3_model(dataclasses.replace(tiny["run"], feature_layers=(1, 2, 5)), sequences,
                              torch.device("cpu"))
    fresh = dataclasses.replace(tiny["run"], feature_layers=(1, 2, 5), out=str(tiny["base"] / "bad-layers"))
    with pytest.raises(ConfigError, match="the target has 4 layers"):
        pipeline.run_pipeline(fresh, progress=False)
    assert not (tiny["base"] / "bad-layers").exists()  # refused before any continuation was made
    for source, what in ((tiny["base"] / "no-such.jsonl", "no such file"), (tiny["base"], "without manifest.json")):
        missing = dataclasses.replace(tiny["run"], sources=[str(source)], out=str(tiny["base"] / "bad-prompts"))
        with pytest.raises(ConfigError, match=f"prompt source .*{what}.*specdec.data.corpus"):
            pipeline.run_pipeline(missing, progress=False)
        assert not (tiny["base"] / "bad-prompts").exists()
    assert dataclasses.replace(tiny["run"], feature_layers=(1, 2, 4)).identity()["feature_layers"] == [1, 2, 4]
    with pytest.raises(SystemExit):
        pipeline.main(["--target", str(tiny["target"]), "--prompts", "x", "--out", "y", "--feature-layers", "1,2"])


def test_the_command_line_names_a_missing_prompt_source_without_a_traceback(tiny, tmp_path, capsys):
    from specdec.cli import main

    code = main(["train", "head", "--target", str(tiny["target"]), "--prompts", str(tmp_path / "nothing"),
                 "--out", str(tmp_path / "run")])
    assert code == 2 and not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: prompt source") and "Traceback" not in err
    with pytest.raises(SystemExit):
        pipeline.main(["--target", str(tiny["target"]), "--prompts", "x", "--out", "y", "--draft-vocab", "0"])
    assert "--draft-vocab must be at least 1" in capsys.readouterr().err


def _write_corpus(path: Path, train: list[str], heldout: list[str]) -> Path:
    """A corpus directory in specdec.data.corpus's layout with these documents."""
    path.mkdir(parents=True, exist_ok=True)
    manifest = {"splits": {}}
    for split, texts in (("train", train), ("heldout", heldout)):
        shard = f"{split}-00000.jsonl"
        _write_jsonl(path / shard, [{"package": "p", "version": "0", "path": f"{split}{i}.py", "text": t}
                                    for i, t in enumerate(texts)])
        manifest["splits"][split] = {"shards": [shard]}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_corpus_windows_cut_the_train_documents_into_pieces_and_pick_a_seeded_choice(tiny, tmp_path):
    from specdec.train.data import corpus_windows

    # the tiny target's tokenizer is one token a character: a document of n characters is n tokens
    corpus = _write_corpus(tmp_path / "corpus", ["a" * 10, "bcdefgh", "x" * 3], ["held out " * 5])
    jsonl = _write_jsonl(tmp_path / "p.jsonl", [{"id": "0", "prompt": "abc"}])
    windows, rows = corpus_windows([str(jsonl), str(corpus)], tiny["target"], 100, 4, seed=0, min_length=2)
    assert [len(w["window"]) for w in windows] == [4, 4, 2, 4, 3, 3]  # 10 -> 4 4 2, 7 -> 4 3, 3 -> 3
    assert [w["opening"] for w in windows] == [True, False, False, True, False, True]
    assert np.concatenate([w["window"] for w in windows[:3]]).tolist() == windows[0]["window"][:1].tolist() * 10
    assert {w["source"] for w in windows} == {str(corpus)}  # the JSON-lines source has no documents
    assert rows == [{"source": str(corpus), "windows": 6, "picked": 6, "tokens": 20}]
    short, _ = corpus_windows([str(corpus)], tiny["target"], 100, 4, seed=0, min_length=3)
    assert [len(w["window"]) for w in short] == [4, 4, 4, 3, 3]  # the 2-token tail is left out
    picked, rows = corpus_windows([str(corpus)], tiny["target"], 3, 4, seed=1, min_length=2)
    again, _ = corpus_windows([str(corpus)], tiny["target"], 3, 4, seed=1, min_length=2)
    ids = [w["id"] for w in corpus_windows([str(corpus)], tiny["target"], 100, 4, seed=0, min_length=2)[0]]
    assert [w["id"] for w in picked] == [w["id"] for w in again] and len(picked) == 3
    assert set(w["id"] for w in picked) <= set(ids) and rows[0]["picked"] == 3


def test_a_head_trains_on_corpus_windows_beside_the_continuations(tiny, tmp_path):
    import dataclasses

    from specdec.errors import ConfigError

    texts = _texts(40, 11, length=150)
    corpus = _write_corpus(tmp_path / "corpus", texts, _texts(4, 12))
    run = dataclasses.replace(tiny["run"], sources=[str(corpus)], out=str(tmp_path / "run"), n_prompts=8,
                              corpus_windows=50, max_steps=4, checkpoint_every=2, formats=("bf16",))
    records, heldout, _, _ = pipeline.make_records(run, pipeline.TrainLog(tmp_path / "log.jsonl", name="t"))
    windows = [r for r in records if "window" in r]
    assert len(windows) == 50 and len(records) == 58  # 150 tokens a document: 64 + 64 (+ 22, < 32): 50 of 80
    assert all(len(w["window"]) <= run.seq_len for w in windows)
    assert pipeline.sequence_of(windows[0]).tolist() == list(windows[0]["window"])
    result = pipeline.run_pipeline(run, progress=False)
    assert result["steps"] == 4
    manifest = (tmp_path / "run" / "DATA_MANIFEST.md").read_text()
    assert "Corpus windows: 50 pieces of at most 64 tokens" in manifest
    assert run.identity()["corpus_windows"] == 50 and "corpus_windows" not in tiny["run"].identity()
    # a held-out prompt that is a document's opening: its windows are refused, or left out with --drop-overlap
    heldout = [{"prompt": LLM(tiny["target"], device="cpu").encode(texts[3][:40]), "continuation": []}]
    everything = dataclasses.replace(run, corpus_windows=1000)
    with pytest.raises(ConfigError, match="overlap the held-out set"):
        pipeline.windows_of(everything, heldout, pipeline.TrainLog(tmp_path / "l2.jsonl", name="t"))
    kept = pipeline.windows_of(dataclasses.replace(everything, drop_overlap=True), heldout,
                               pipeline.TrainLog(tmp_path / "l3.jsonl", name="t"))
    assert len(kept) == 79 and not any(w["id"] == "w0-000003-0" for w in kept)
    # no corpus among the sources: refused before any work
    jsonl_only = dataclasses.replace(run, sources=tiny["run"].sources, out=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="--corpus-windows cuts windows from corpus directories"):
        pipeline.run_pipeline(jsonl_only, progress=False)
    assert not (tmp_path / "none").exists()


def test_the_command_defaults_to_the_bundled_heads_recipe_for_eagle3_and_not_for_mtp(tmp_path):
    corpus = _write_corpus(tmp_path / "corpus", ["a" * 10], ["b" * 10])
    jsonl = _write_jsonl(tmp_path / "p.jsonl", [{"id": "0", "prompt": "abc"}])
    both, prompts_only = [str(jsonl), str(corpus)], [str(jsonl)]
    assert pipeline.defaults_for_kind("eagle3", both, None, None) == (pipeline.EAGLE3_LR, pipeline.EAGLE3_WINDOWS)
    assert pipeline.defaults_for_kind("eagle3", prompts_only, None, None) == (pipeline.EAGLE3_LR, 0)  # no documents
    assert pipeline.defaults_for_kind("mtp", both, None, None) == (1e-3, 0)
    assert pipeline.defaults_for_kind("eagle3", both, 5e-4, 0) == (5e-4, 0)  # what the command line gives stays
    assert pipeline.defaults_for_kind("mtp", both, 3e-3, 7) == (3e-3, 7)


def test_a_run_trains_on_from_a_head_with_its_vocabulary_and_layers(tiny, tmp_path):
    import dataclasses
    import shutil

    export = tiny["result"]["exports"]["bf16"]["dir"]
    out = tmp_path / "run"
    shutil.copytree(Path(tiny["run"].out), out, ignore=shutil.ignore_patterns("checkpoint", "export", "run.json"))
    run = dataclasses.replace(tiny["run"], out=str(out), init_from=export, draft_vocab=None, max_steps=20, lr=1e-3)
    # from the head's weights, draft vocabulary and feature layers, not from these sequences' (tokens 2 .. 42)
    model = pipeline.eagle3_model(run, [np.array([5, 17, 30, 2, 9, 42])], torch.device("cpu"))
    saved = load_eagle3_head(export, load_model(tiny["target"], "cpu", torch.float32), torch.device("cpu"),
                             torch.float32)
    trained = model.module.state_dict()
    assert model.start == "head" and model.vocab == 80 and model.feature_layers == (2, 2, 1)
    assert all(torch.equal(trained[name], tensor) for name, tensor in saved.state_dict().items()
               if not name.startswith("embed_tokens"))
    assert all(p.requires_grad for p in model.module.parameters())
    assert run.identity()["init_from"] == str(Path(export).resolve()) and "init_from" not in tiny["run"].identity()
    # end to end (continuations from the copied cache): it starts where the first run ended, not where it began
    result = pipeline.run_pipeline(run, progress=False)
    first = tiny["result"]
    assert result["start"] == "head" and result["steps"] == 20
    assert result["acceptance_before"][0] > first["acceptance_before"][0] + 0.15
    assert abs(result["acceptance_before"][0] - first["acceptance_after"][0]) < 0.05  # bf16 export: near, not equal
    manifest = (out / "DATA_MANIFEST.md").read_text()
    assert f"`{export}` (model.safetensors sha256 " in manifest


def test_a_head_to_train_on_is_refused_before_any_work_where_it_does_not_fit(tiny, tmp_path, capsys):
    import dataclasses
    import re
    import shutil

    from specdec.errors import ConfigError, ModelLoadError

    export = tiny["result"]["exports"]["bf16"]["dir"]
    run = dataclasses.replace(tiny["run"], init_from=export, draft_vocab=None, out=str(tmp_path / "bad"))
    for changes, error, what in (
            ({"feature_layers": (1, 2, 4)}, ConfigError, "--feature-layers 1,2,4 (the head reads 2,2,1)"),
            ({"draft_vocab": 50}, ConfigError, "--draft-vocab 50 (the head's is 80)"),
            ({"start": "target"}, ConfigError, "--start target (the head's output side is trained already)"),
            ({"kind": "mtp"}, ConfigError, "--init-from continues an EAGLE-3 head"),
            ({"init_from": str(tiny["target"])}, ModelLoadError, "is not an EAGLE-3 head")):
        with pytest.raises(error, match=re.escape(what)):
            pipeline.run_pipeline(dataclasses.replace(run, **changes), progress=False)
        assert not (tmp_path / "bad").exists()
    other = shutil.copytree(export, tmp_path / "other")  # a head made for a target of another width
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"target_hidden_size": 999}))
    with pytest.raises(ModelLoadError, match=r"config\.json: this EAGLE-3 head does not fit .*target_hidden_size"):
        pipeline.run_pipeline(dataclasses.replace(run, init_from=str(other)), progress=False)
    assert not (tmp_path / "bad").exists()
    from specdec.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", "head", "--target", str(tiny["target"]), "--prompts", *tiny["run"].sources,
              "--out", str(tmp_path / "bad"), "--init-from", str(tmp_path / "no-such-head")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "error: --init-from: unknown model" in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()
