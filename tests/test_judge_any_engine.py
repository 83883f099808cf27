"""The judge on engines specdec did not write (issue 24): engines without prompt log-probs, a local --scorer,
engines that name one model differently, and a real `transformers serve` where it can run."""

from __future__ import annotations

import json

import httpx
import pytest

from specdec.judge.engines import free_port
from tests.fakes.judging import fake_command, judge_fakes, write_prompts

SLOWER = ("--token-ms", "2")  # a token's time well above the HTTP overhead, so that speedups show
SPEEDUP = (*SLOWER, "--speedup", "3", "--speculate")
NO_LOGPROBS = (*SLOWER, "--no-logprobs")  # a stand-in for transformers serve
LOGPROB_GATES = {"fidelity", "likelihood", "argmax"}
# one workload and pass (the gate's checks do not need three); 24 sampled replies give the likelihood gate power
GATE_RUN = dict(workloads=("solo",), passes=1, num_prompts=24)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    """The fakes' own model as a checkpoint: a scorer whose log-probs are those the fakes sample from."""
    from tests.fakes.toy_checkpoint import save_toy_checkpoint

    return save_toy_checkpoint(tmp_path_factory.mktemp("toy"))


def verdicts(record: dict) -> dict[str, str]:
    return {g["key"]: g["verdict"] for g in record["gates"]}


def test_the_stand_in_answers_as_transformers_serve_does():
    """Echo and logprobs are ignored (text and usage only) and max_tokens=0 is refused with 400."""
    import subprocess
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.engine", "--port", str(port), *NO_LOGPROBS])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        scoring = {"model": "fake-toy", "prompt": "kan lo", "echo": True, "logprobs": 1, "temperature": 0.0}
        answer = httpx.post(f"{url}/v1/completions", json={**scoring, "max_tokens": 2}).json()
        refused = httpx.post(f"{url}/v1/completions", json={**scoring, "max_tokens": 0})
    finally:
        proc.terminate()
        proc.wait()
    choice = answer["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith("kan lo")
    assert answer["usage"]["completion_tokens"] >= 1 and refused.status_code == 400


def test_stock_without_log_probs_gives_speedups_and_unmeasurable_log_prob_gates(tmp_path):
    record = judge_fakes(tmp_path, NO_LOGPROBS, SPEEDUP)
    for workload in ("solo", "team", "busy"):  # every pass timed on both engines
        speeds = record["workloads"][workload]
        assert len(speeds["stock_tps"]) == len(speeds["candidate_tps"]) == 3 and record["ratios"][workload]["ratio"] > 0
    assert record["ratios"]["solo"]["ratio"] > 1.5 and record["specscore"] > 1.0  # busy is noisy on a shared CPU
    found = verdicts(record)
    assert {key for key, v in found.items() if v == "not measurable"} == LOGPROB_GATES, found
    assert found["lengths"] == "pass" and found["memory"] == "pass"
    assert record["score"] == 0.0 and record["verdict"] == "not measurable"
    assert record["reason"].startswith("gate not measurable: ") and "--scorer MODEL_DIR" in record["reason"]
    assert "(stock)" in record["reason"]  # the fixed texts' check names the engine without log-probs
    assert record["scorer"].startswith("none") and record["likelihood"] is None
    assert {row["check"] for row in record["not_measurable"]} == {
        "fixed texts' log-probabilities", "sampled replies' likelihood", "share of first choices"}


def test_the_toy_checkpoint_scores_text_as_the_fakes_sample_it(toy_dir):
    """The scorer of the tests below gives each word the fakes' own log-prob (else they would test nothing)."""
    from specdec.judge.scoring import LocalScorer
    from tests.fakes.engine import ToyModel, word_id

    table = ToyModel().logprobs
    scorer = LocalScorer(toy_dir, "cpu", kv_cache_tokens=512)
    prompt, reply = "kan lo mi", " ros sit tu kan lo"
    words = (prompt + reply).split()
    expected = [table[word_id(a), word_id(b)] for a, b in zip(words[2:], words[3:])]
    top1 = sum(int(table[word_id(a)].argmax() == word_id(b)) for a, b in zip(words[2:], words[3:]))
    scored = scorer.score(prompt, reply)
    assert scored.num_tokens == len(expected) == 5 and scored.num_top1 == top1
    assert scored.logprob_sum == pytest.approx(sum(expected), abs=1e-4)


@pytest.mark.parametrize("mode, likelihood", [("normal", "pass"), ("cold", "fail")])
def test_scorer_measures_every_gate_without_log_probs(tmp_path, toy_dir, mode, likelihood):
    """Both engines give no log-probs; the toy checkpoint scores.  The same model passes every gate; a candidate
    that samples at half the temperature fails the likelihood gate (its replies are likelier)."""
    record = judge_fakes(tmp_path, NO_LOGPROBS, (*SPEEDUP, "--no-logprobs", "--mode", mode), scorer=toy_dir,
                         **GATE_RUN)
    found = verdicts(record)
    assert record["scorer"].startswith(f"local reference {toy_dir}")
    assert not {key for key, v in found.items() if v == "not measurable"}, found
    assert found["fidelity"] == "pass" and record["greedy_agreement"] == 1.0  # greedy decoding is unchanged
    assert found["likelihood"] == likelihood, record["gates"]
    if mode == "normal":
        assert record["reason"] is None and record["verdict"] == "pass", record["gates"]
        assert all(g["ok"] for g in record["gates"]) and record["score"] == record["specscore"] > 1.5
    else:
        assert record["likelihood"]["gap"] > 0  # colder sampling: likelier tokens
        assert record["score"] == 0.0 and record["reason"].startswith("gate failed: ")
        assert "sampled replies' likelihood" in record["reason"]
        assert {g["key"] for g in record["gates"] if not g["ok"]} <= {"likelihood", "argmax", "lengths"}


RENAMED = (*SPEEDUP, "--served-model-name", "toy-renamed")


def test_a_candidate_that_names_the_model_differently_is_judged(tmp_path):
    """--stock-model / --candidate-model through the CLI: no 404, and the record keeps both names."""
    from specdec.cli import main

    code = main(["judge", "--stock", fake_command(*SLOWER), "--candidate", fake_command(*RENAMED), "--quick",
                 "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--out", str(tmp_path / "out"),
                 "--workloads", "solo", "--passes", "1", "--quiet",
                 "--stock-model", "fake-toy", "--candidate-model", "toy-renamed"])
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert code == 0 and record["reason"] is None, record["reason"]
    assert record["models"] == {"stock": "fake-toy", "candidate": "toy-renamed"}
    assert record["settings"]["stock_model"] == "fake-toy" and record["settings"]["candidate_model"] == "toy-renamed"


def test_one_model_name_for_both_fails_with_a_hint(tmp_path):
    """The control of the test above: --model alone sends the stock engine's name to the candidate, which
    answers 404; the reason says which names it serves and which flag to give."""
    record = judge_fakes(tmp_path, SLOWER, RENAMED, model="fake-toy", workloads=("solo",), passes=1)
    assert record["score"] == 0.0 and "candidate engine: a request failed during warm-up: HTTP 404" in record["reason"]
    assert "lists 'toy-renamed'" in record["reason"] and "--candidate-model NAME" in record["reason"]


def transformers_serve_missing() -> str | None:
    """Why `transformers serve` cannot run here (None where it can): its optional dependencies."""
    import importlib.util

    if importlib.util.find_spec("transformers.cli.serve") is None:
        return "this transformers has no `transformers serve` (transformers 5.x has)"
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return "transformers serve's optional dependencies are missing: pip install 'transformers[serving]'"
    if importlib.util.find_spec("accelerate") is None:  # it always loads with a device_map
        return "transformers serve needs accelerate to load a model: pip install accelerate"
    return None


def test_transformers_serve_against_specdec_serve(tmp_path, toy_dir):
    """The real `transformers serve` (no prompt log-probs) as stock, `specdec serve` with n-gram speculation as
    candidate, the toy checkpoint as both engines' model and as --scorer: every gate is measured, none fails."""
    import shlex
    import sys

    from specdec.judge import JudgeConfig, run_judge
    from specdec.judge.cli import serve_command

    missing = transformers_serve_missing()
    if missing:
        pytest.skip(missing)
    stock = shlex.join([sys.executable, "-m", "transformers.cli.transformers", "serve", str(toy_dir),
                        "--device", "cpu", "--host", "127.0.0.1"]) + " --port {port}"
    candidate = serve_command(str(toy_dir), 1024, "--speculator ngram --num-draft-tokens 4")
    config = JudgeConfig(stock=stock, candidate=candidate, prompts=write_prompts(tmp_path / "p.jsonl"),
                         out=tmp_path / "out", workloads=("solo", "team"), passes=1, num_prompts=24, max_tokens=16,
                         concurrency=4, gate_prompts=4, scorer=toy_dir, quiet=True, startup_timeout_s=180)
    record = run_judge(config)
    assert record["reason"] is None, record["reason"]
    assert {g["verdict"] for g in record["gates"]} <= {"pass", "inconclusive", "reported"}, record["gates"]
    assert record["fidelity"] == 0.0 and record["greedy_agreement"] == 1.0  # one model, decoded greedily alike
    assert record["models"]["stock"] == str(toy_dir) and record["scorer"].startswith("local reference")
    assert set(record["ratios"]) == {"solo", "team"} and record["specscore"] > 0
