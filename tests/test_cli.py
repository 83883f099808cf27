"""The `specdec` command: generate, twin, train dispatch, and clear errors."""

from __future__ import annotations

import json

from specdec import LLM, SamplingParams
from specdec.cli import main
from tests.test_twin import SHAPE


def test_generate_prints_json_equal_to_the_api(qwen3_dir, capsys):
    assert main(["generate", str(qwen3_dir), "--prompt", "abc", "--max-tokens", "6", "--device", "cpu",
                 "--json", "--speculator", "ngram"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = LLM(qwen3_dir, device="cpu").generate("abc", SamplingParams(max_tokens=6, temperature=0))[0]
    assert out["token_ids"] == ref.token_ids and out["finish_reason"] == ref.finish_reason


def test_twin_command_writes_a_loadable_twin(qwen3_dir, tmp_path, capsys):
    shape_file = tmp_path / "shape.json"
    shape_file.write_text(json.dumps(SHAPE))
    assert main(["twin", str(qwen3_dir), "--shape", str(shape_file), "--out", str(tmp_path / "twin")]) == 0
    twin = LLM(tmp_path / "twin", device="cpu")
    assert twin.model.config.hidden_size == SHAPE["hidden_size"]
    ids = [5, 6, 7, 8, 9]
    small = LLM(qwen3_dir, device="cpu")
    got = twin.engine.all_logits(ids)[:, :96].log_softmax(-1)
    assert (got - small.engine.all_logits(ids).log_softmax(-1)).abs().max().item() <= 1e-4


def test_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and "Traceback" not in err
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x", "--speculator", "draft"]) == 2
    assert "drafter model" in capsys.readouterr().err


def test_generate_ends_with_one_summary_line_on_stderr(qwen3_dir, capsys):
    prompt = ["--prompt", "abcabcabcabc", "--max-tokens", "12", "--device", "cpu"]
    assert main(["generate", str(qwen3_dir), *prompt]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("specdec: 12 tokens in ") and "tok/s" in err and "ngram" not in err
    assert main(["generate", str(qwen3_dir), *prompt, "--speculator", "ngram", "--fixed-k"]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("specdec: 12 tokens in ") and "; ngram: " in err
    assert "drafts accepted" in err  # fixed k: the repeated prompt gives n-gram matches to verify


def test_generate_says_what_its_start_up_did(qwen3_dir, capsys):
    """A line per start-up phase on stderr before the replies: the load, and an adaptive speculator's calibration
    (on a GPU also the graph capture and the eager warm-up)."""
    assert main(["generate", str(qwen3_dir), "--prompt", "abcabc", "--max-tokens", "3", "--device", "cpu",
                 "--speculator", "ngram"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"specdec: loaded {qwen3_dir.name} on cpu in ") and lines[0].endswith(" s")
    assert lines[1].startswith("specdec: KV cache: ") and " GiB); requests up to " in lines[1]
    assert any(line.startswith("specdec: measured the ngram speculator's step costs in ") for line in lines)
    assert lines[-1].startswith("specdec: 3 tokens in ")


def test_attention_backend_reaches_the_engine(qwen3_dir, capsys):
    """--attention-backend is the engine's choice; one that cannot run here is a one-line error."""
    assert main(["generate", str(qwen3_dir), "--prompt", "abc", "--max-tokens", "2", "--device", "cpu",
                 "--attention-backend", "sdpa"]) == 0
    assert main(["generate", str(qwen3_dir), "--prompt", "abc", "--device", "cpu",
                 "--attention-backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert "runs on a GPU" in err and "Traceback" not in err


def test_train_dispatches_to_the_stage(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["train", "lm", "--help"])
    assert exc.value.code == 0
    assert "--corpus" in capsys.readouterr().out


def test_overlap_steps_flag_reaches_the_engine(qwen3_dir, capsys):
    """--overlap-steps is EngineConfig.overlap_steps: off runs, on without the fixed-shape runner (a CPU's
    default) is a one-line error naming what it needs."""
    from specdec.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", str(qwen3_dir), "--overlap-steps"])
    assert engine_kwargs(args)["overlap_steps"] is True
    assert engine_kwargs(args)["column_major_weights"] is None
    args = build_parser().parse_args(["generate", str(qwen3_dir), "--no-column-major-weights"])
    assert engine_kwargs(args)["column_major_weights"] is False
    assert main(["generate", str(qwen3_dir), "--prompt", "abc", "--max-tokens", "2", "--device", "cpu",
                 "--no-overlap-steps"]) == 0
    assert main(["generate", str(qwen3_dir), "--prompt", "abc", "--device", "cpu", "--overlap-steps"]) == 2
    err = capsys.readouterr().err
    assert "overlap_steps needs static_shapes" in err and "Traceback" not in err


def test_a_start_up_phase_that_counted_nothing_says_nothing(caplog):
    """A phase logs its line with its counts and seconds; one whose count is 0 (a CPU's graph capture) is silent."""
    import logging

    from specdec.llm import _phase

    caplog.set_level(logging.INFO, logger="specdec.startup")
    with _phase("captured {graphs} CUDA graphs in {seconds:.1f} s") as found:
        found["graphs"] = 72
    with _phase("ran {steps} eager warm-up steps in {seconds:.1f} s") as found:
        found["steps"] = 0
    assert [r.getMessage() for r in caplog.records] == ["captured 72 CUDA graphs in 0.0 s"]
