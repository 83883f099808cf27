"""Each check of the lossless gate fails on a candidate built to fail it (and only the checks it should)."""

from __future__ import annotations

import pytest

from tests.fakes.judging import judge_fakes

# One workload and pass: the gate's checks do not need three; more prompts give the statistics power.
GATE_RUN = dict(workloads=("solo",), passes=1, num_prompts=32, max_tokens=24, memory_slack_mib=100)


def failed_checks(record: dict) -> set[str]:
    return {g["key"] for g in record["gates"] if not g["ok"]}


@pytest.mark.parametrize("mode, fails", [
    ("hot", {"likelihood", "argmax"}),  # samples at 1.6 x the temperature
    ("short", {"lengths"}),  # stops replies at half their max_tokens
    ("perturb", {"fidelity"}),  # reports log-probs with noise
    ("hog", {"memory"}),  # holds 256 MiB more than stock
])
def test_gate_fails_on_a_candidate_built_to_fail_it(tmp_path, mode, fails):
    record = judge_fakes(tmp_path, (), ("--mode", mode), **GATE_RUN)
    assert failed_checks(record) >= fails, record["gates"]
    assert failed_checks(record) <= fails | {"lengths"}, record["gates"]  # hotter sampling also ends sooner
    assert record["score"] == 0.0 and record["specscore"] > 0
    assert record["reason"].startswith("gate failed: ")
    names = {g["key"]: g["check"] for g in record["gates"]}
    assert all(names[key] in record["reason"] for key in fails)


def test_greedy_agreement_floor_can_fail(tmp_path):
    record = judge_fakes(tmp_path, (), ("--mode", "short"), greedy_agreement_floor=0.99, **GATE_RUN)
    assert "greedy_agreement" in failed_checks(record) and record["greedy_agreement"] < 0.99
    split = record["greedy_divergences"]  # the short candidate's replies end where the stock's go on
    assert split and all(d["candidate"] is None and d["stock"] is not None for d in split)
    assert all(d["stock_margin"] is not None and d["stock_margin"] >= 0 for d in split)
    check = next(g for g in record["gates"] if g["key"] == "greedy_agreement")
    assert f"{len(split)} of " in check["measured"] and "replies split" in check["measured"]


def test_greedy_divergences_say_where_replies_split_and_how_close_the_stock_was():
    from specdec.judge.client import Reply
    from specdec.judge.config import Limits
    from specdec.judge.gates import greedy_agreement, greedy_divergences

    def reply(tokens, tops=None):
        return Reply("".join(tokens), len(tokens), "length", tokens, [-0.1] * len(tokens), tops)

    stock = [reply(["a", "b", "c"], [{"a": -0.1}, {"b": -0.69, "x": -0.70}, {"c": -0.2}]),
             reply(["a", "b"], [{"a": -0.1, "q": -3.0}, {"b": -0.1, "r": -2.6}]),
             reply(["d", "e"]),
             reply(["f"], [{"f": -0.5, "g": -0.9}])]
    candidate = [reply(["a", "x", "c"]), reply(["a", "b"]), reply(["d", "z"]), reply([])]
    split = greedy_divergences(candidate, stock)
    assert split == [{"reply": 0, "position": 1, "stock": "b", "candidate": "x", "stock_margin": 0.01},
                     {"reply": 2, "position": 1, "stock": "e", "candidate": "z", "stock_margin": None},
                     {"reply": 3, "position": 0, "stock": "f", "candidate": None, "stock_margin": 0.4}]
    value, check = greedy_agreement([r.tokens for r in candidate], [r.tokens for r in stock], Limits(), split)
    assert value == (1 / 3 + 1 + 1 / 2 + 0) / 4
    assert check.measured == ("0.4583; 3 of 4 replies split, where the stock's top two were within 0.4 nats "
                              "(1 without the stock's top two)")


def test_every_gate_passes_on_the_real_speculating_engine(tmp_path):
    """`specdec serve ref-target` alone against it with the ref-draft speculator: lossless, so all pass."""
    from specdec.assets import heldout_prompts_path, resolve_model
    from specdec.judge import JudgeConfig, run_judge
    from specdec.judge.cli import serve_command

    try:
        resolve_model("ref-target"), resolve_model("ref-draft")
    except FileNotFoundError:
        pytest.skip("the reference pair is not built")
    spec = "--speculator draft --draft-model ref-draft --num-draft-tokens 4 --fixed-k"  # fixed k: no cost probe
    # 12 sampled replies: the likelihood gate's standard error is taken over replies, and from 4 it is too rough
    config = JudgeConfig(stock=serve_command("ref-target", 1024), candidate=serve_command("ref-target", 1024, spec),
                         prompts=heldout_prompts_path(), out=tmp_path, workloads=("solo",), passes=1, num_prompts=12,
                         max_tokens=16, concurrency=2, gate_prompts=3, quiet=True, startup_timeout_s=300)
    record = run_judge(config)
    assert record["reason"] is None, record["reason"]
    assert all(g["ok"] for g in record["gates"]) and record["fidelity"] == 0.0
    assert record["acceptance"]["solo"] > 1.0


def test_inflated_token_claims_are_refused(tmp_path):
    record = judge_fakes(tmp_path, (), ("--mode", "inflate"), **GATE_RUN)
    assert record["score"] == 0.0 and "token counts" in record["reason"]
    assert record["token_counts"]["candidate"] == pytest.approx(2 * record["token_counts"]["stock"])


@pytest.mark.parametrize("size, verdict", [("default", "fail"), ("quick", "inconclusive")])
def test_a_different_model_under_the_same_name_is_refused_or_inconclusive_never_passed(tmp_path, size, verdict):
    """The candidate serves another toy model (a second table mixed in at 0.35) under stock's name.  At the
    default size the sampled-reply gates refuse it on their own; at --quick size they cannot tell and say so."""
    from specdec.judge.config import QUICK

    sized = dict(QUICK) if size == "quick" else dict(num_prompts=None, max_tokens=128, gate_prompts=32,
                                                     concurrency=16)
    record = judge_fakes(tmp_path, ("--token-ms", "0.05"), ("--token-ms", "0.05", "--variant", "0.35"),
                         workloads=("solo",), passes=3, quick=size == "quick", **sized)
    verdicts = {g["key"]: g["verdict"] for g in record["gates"]}
    assert verdicts["likelihood"] == verdicts["argmax"] == verdict, record["gates"]
    assert record["score"] == 0.0 and record["verdict"] == "fail"  # the fixed texts' check catches it too
    if size == "quick":
        assert {row["check"] for row in record["inconclusive"]} >= {"sampled replies' likelihood",
                                                                     "share of first choices"}
        assert "cannot tell" in record["quick"] and "x the bound" in record["inconclusive"][0]["power"]
