"""Overlapped steps (engine/overlap.py): a plain decode step launched while the one before it is still in flight,
fed that step's tokens from the device, gives the engine's outputs without overlap token for token (greedy and
seeded sampling, stops of every kind, requests arriving, aborts, preemption), really takes the overlapped path
(and a broken feed would show), returns every block, and leaves logprob requests and steps that plan drafts alone."""

from __future__ import annotations

import types

import pytest

from specdec import LLM, ConfigError, SamplingParams
from specdec.engine.overlap import PLACEHOLDER
from specdec.engine.engine import Engine
from specdec.engine.overlap import InFlight
from specdec.engine.static_runner import StaticRunner
from specdec.speculate import SpecConfig
from tests.test_engine import prompts


def make_llm(model_dir, overlap: bool, **kw) -> LLM:
    """A CPU engine on the fixed-shape runner (fixed acceptance on), admitting at once (no timing in play)."""
    kw.setdefault("kv_cache_tokens", 2048)
    return LLM(model_dir, device="cpu", block_size=4, static_shapes=True, max_graph_batch=8, admission_batch=1,
               overlap_steps=overlap, **kw)


def serve(llm: LLM, arrivals: list[tuple[int, list[int], SamplingParams]], abort_at: dict[int, int] = None,
          returned: list | None = None):
    """Add each request at its step (arrivals: (step, prompt, params)) and step until all are done; abort_at:
    request index -> abort it once it has this many output tokens; returned: a list to gather what each step()
    returns in.  Returns the requests."""
    engine, reqs, step = llm.engine, [None] * len(arrivals), 0
    abort_at = abort_at or {}
    while engine.has_work() or any(r is None for r in reqs):
        for i, (at, ids, params) in enumerate(arrivals):
            if at == step:
                reqs[i] = engine.add_request(ids, params)
        for i, n in abort_at.items():
            if reqs[i] is not None and not reqs[i].finished and len(reqs[i].output_token_ids) >= n:
                engine.abort(reqs[i])
        done = engine.step()
        assert all(r.finished for r in done)
        if returned is not None:
            returned += done
        step += 1
    return reqs


def outcome(reqs) -> list[tuple]:
    return [(r.output_token_ids, r.finish_reason, r.text) for r in reqs]


def all_blocks_free(llm: LLM) -> bool:
    blocks = llm.engine.blocks
    return blocks.num_free == blocks.num_blocks and llm.engine.in_flight is None


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """Greedy outputs of 6 prompts without overlap or stops (the stops below are picked from them)."""
    llm = make_llm(qwen3_dir, overlap=False)
    return [o.token_ids for o in llm.generate(prompts(6), SamplingParams(max_tokens=24, temperature=0,
                                                                            ignore_eos=True))], llm


def stopping_arrivals(reference) -> list[tuple[int, list[int], SamplingParams]]:
    """Requests of different prompt lengths that end at different steps: by a stop token (as EOS does), a stop
    string, max_tokens, or the full 24 tokens; two arrive while the others decode."""
    tokens, llm = reference
    text = llm.tokenizer.decode(tokens[3])
    stop = text[9:11]
    greedy = dict(temperature=0, ignore_eos=True)
    params = [SamplingParams(max_tokens=24, stop_token_ids=[tokens[0][5]], **greedy),
              SamplingParams(max_tokens=7, **greedy),
              SamplingParams(max_tokens=24, **greedy),
              SamplingParams(max_tokens=24, stop=[stop], **greedy),
              SamplingParams(max_tokens=13, **greedy),
              SamplingParams(max_tokens=24, stop_token_ids=[tokens[5][17]], **greedy)]
    steps = [0, 0, 0, 3, 6, 9]
    return list(zip(steps, prompts(6), params))


def test_greedy_with_overlap_equals_without(qwen3_dir, reference):
    arrivals = stopping_arrivals(reference)
    plain = make_llm(qwen3_dir, overlap=False)
    want = outcome(serve(plain, arrivals))
    assert {reason for _, reason, _ in want} == {"stop", "length"}
    assert any(text is not None for _, _, text in want)  # the stop string was hit
    llm = make_llm(qwen3_dir, overlap=True)
    returned = []
    reqs = serve(llm, arrivals, returned=returned)
    assert outcome(reqs) == want
    assert sorted(r.request_id for r in returned) == sorted(r.request_id for r in reqs)  # each once
    stats = llm.engine.stats
    assert stats["overlapped_steps"] > 10 and plain.engine.stats["overlapped_steps"] == 0
    # every step is counted once, when committed: as many steps and tokens as without overlap
    for key in ("steps", "tokens_emitted", "tokens_fed", "verify_steps"):
        assert stats[key] == plain.engine.stats[key], key
    assert all_blocks_free(llm)


def test_overlap_is_on_by_default_without_cuda_graphs(qwen3_dir):
    assert make_llm(qwen3_dir, overlap=None).engine.overlap_steps
    assert not LLM(qwen3_dir, device="cpu", kv_cache_tokens=256).engine.overlap_steps  # no fixed-shape runner
    with pytest.raises(ConfigError, match="overlap_steps needs static_shapes"):
        LLM(qwen3_dir, device="cpu", kv_cache_tokens=256, overlap_steps=True)
    with pytest.raises(ConfigError, match="overlap_steps needs"):
        make_llm(qwen3_dir, overlap=True, fixed_acceptance=False)


def test_with_cuda_graphs_fixed_acceptance_and_overlap_are_on_by_default():
    """The defaults where the fixed-shape runner captures CUDA graphs (a GPU), as measured there: fixed acceptance
    and overlapped steps on unless set off; neither without the runner."""
    with_graphs = types.SimpleNamespace(runner=types.SimpleNamespace(static=types.SimpleNamespace(capture=True)))
    assert Engine._on_unless_set_off(with_graphs, None) and not Engine._on_unless_set_off(with_graphs, False)
    no_runner = types.SimpleNamespace(runner=types.SimpleNamespace(static=None))
    assert not Engine._on_unless_set_off(no_runner, None) and not Engine._on_unless_set_off(no_runner, True)


def test_the_step_behind_is_fed_from_the_device(qwen3_dir, monkeypatch):
    """The host stages the step behind with placeholders: the tokens it feeds come from the device only."""
    staged = []
    run = StaticRunner.run

    def spy(self, seqs, fed_ids=None):
        if fed_ids is not None:
            staged.append([s.request.output_token_ids[-1] for s in seqs])
        return run(self, seqs, fed_ids)

    monkeypatch.setattr(StaticRunner, "run", spy)
    llm = make_llm(qwen3_dir, overlap=True)
    llm.generate(prompts(3), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert len(staged) > 5 and all(t == PLACEHOLDER for step in staged for t in step)
    assert not any(t == PLACEHOLDER for r in llm.engine.scheduler.running for t in r.output_token_ids)


def test_the_engine_has_work_while_a_step_is_in_flight(qwen3_dir):
    """A request finishing when a step is committed leaves the step behind it in flight: the engine still has
    work, and the next step() commits nothing of it and returns nothing."""
    engine = make_llm(qwen3_dir, overlap=True).engine
    req = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finished = []
    while not req.finished:
        finished += engine.step()
    assert finished == [req] and len(req.output_token_ids) == 5
    assert not engine.scheduler.has_work() and engine.in_flight is not None and engine.has_work()
    assert engine.step() == [] and not engine.has_work() and len(req.output_token_ids) == 5
    assert engine.stats["steps"] == 5 and engine.blocks.num_free == engine.blocks.num_blocks


def test_a_wrong_device_token_changes_the_output(qwen3_dir, reference, monkeypatch):
    """Negative control: feeding the step behind another token than the one sampled shows in the output, so
    the equality above has power."""
    tokens_for = InFlight.tokens_for
    monkeypatch.setattr(InFlight, "tokens_for", lambda self, reqs, device: (tokens_for(self, reqs, device) + 1) % 96)
    arrivals = stopping_arrivals(reference)
    want = outcome(serve(make_llm(qwen3_dir, overlap=False), arrivals))
    assert outcome(serve(make_llm(qwen3_dir, overlap=True), arrivals)) != want


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 0.9)])
def test_seeded_sampling_with_overlap_equals_without(qwen3_dir, top_k, top_p):
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=1.0, top_k=top_k, top_p=top_p, seed=100 + i,
                             ignore_eos=True) for i in range(5)]
    arrivals = [(2 * i, p, sp) for i, (p, sp) in enumerate(zip(prompts(5, seed=2), params))]
    want = outcome(serve(make_llm(qwen3_dir, overlap=False), arrivals))
    llm = make_llm(qwen3_dir, overlap=True)
    assert outcome(serve(llm, arrivals)) == want
    assert llm.engine.stats["overlapped_steps"] > 5 and all_blocks_free(llm)


def test_an_abort_while_a_step_is_in_flight_loses_nothing(qwen3_dir, reference, monkeypatch):
    """Request 2 is aborted once it has 11 tokens, each run then holding a step of it in flight (overlap) or
    not: the same tokens for everyone, request 2 cut at 11, every block back in the pool."""
    seen = []
    arrivals = stopping_arrivals(reference)
    want = outcome(serve(make_llm(qwen3_dir, overlap=False), arrivals, abort_at={2: 11}))
    llm = make_llm(qwen3_dir, overlap=True)
    engine_abort = llm.engine.abort

    def spy(req):
        flight = llm.engine.in_flight
        seen.append(flight is not None and req in [s.request for s in flight.seqs])
        engine_abort(req)

    llm.engine.abort = spy
    got = outcome(serve(llm, arrivals, abort_at={2: 11}))
    assert seen == [True]  # the abort came while a step of the request was in flight
    assert got == want and got[2][0] == reference[0][2][:11] and got[2][1] == "abort"
    assert all_blocks_free(llm)


def test_preemption_under_a_tight_cache_keeps_outputs(qwen3_dir):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = make_llm(qwen3_dir, overlap=False, kv_cache_tokens=96)
    want = [o.token_ids for o in plain.generate(prompts(6), greedy)]
    llm = make_llm(qwen3_dir, overlap=True, kv_cache_tokens=96)
    assert [o.token_ids for o in llm.generate(prompts(6), greedy)] == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats["overlapped_steps"] > 0
    assert all_blocks_free(llm)


def test_logprob_requests_are_not_overlapped(qwen3_dir):
    ps = prompts(3, seed=9)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    want = make_llm(qwen3_dir, overlap=False).generate(ps, params)
    llm = make_llm(qwen3_dir, overlap=True)
    got = llm.generate(ps, params)
    assert llm.engine.stats["overlapped_steps"] == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    # beside plain requests: the steps with the logprob request run as without overlap, the rest overlap
    mixed = [params, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    want = make_llm(qwen3_dir, overlap=False).generate(ps[:2], mixed)
    got = llm.generate(ps[:2], mixed)
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]
    assert llm.engine.stats["overlapped_steps"] > 0


def test_steps_that_plan_drafts_are_not_overlapped(qwen3_dir):
    """A controller that plans k = 3 on every step leaves no step in flight, not even one where the n-gram lookup
    found no drafts (test_overlap_speculative: steps planned at k = 0 are)."""
    ps = prompts(4, seed=3)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in make_llm(qwen3_dir, overlap=False).generate(ps, greedy)]
    llm = make_llm(qwen3_dir, overlap=True, speculator=SpecConfig("ngram", num_draft_tokens=3, adaptive=False))
    assert [o.token_ids for o in llm.generate(ps, greedy)] == want
    assert llm.engine.stats["overlapped_steps"] == 0 and llm.engine.stats["verify_steps"] > 0


def test_setting_a_speculator_commits_the_step_in_flight(qwen3_dir):
    """A step left in flight is committed before a speculator takes over; its finished requests are returned by
    the next step()."""
    from specdec.speculate.build import build_speculator, speculation_for

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ps = prompts(2, seed=4)
    want = [o.token_ids for o in make_llm(qwen3_dir, overlap=False).generate(ps, greedy)]
    llm = make_llm(qwen3_dir, overlap=True)
    engine = llm.engine
    reqs = [engine.add_request(p, greedy) for p in ps]
    while engine.in_flight is None:
        engine.step()
    spec = SpecConfig("ngram", num_draft_tokens=3, adaptive=False)
    engine.set_speculation(speculation_for(engine, *build_speculator(spec, llm)))
    assert engine.in_flight is None
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert [r.output_token_ids for r in reqs] == want and set(finished) == set(reqs)


def test_the_gpu_check_runs_and_finds_the_tokens_equal(tmp_path):
    """bench/overlap_equal.py, the GPU call's check, on a CPU (the bundled ref-target: the held-out prompts need
    its context): both engines, equal replies, overlap taken."""
    import json

    from bench.overlap_equal import main

    out = tmp_path / "overlap-equal.json"
    assert main(["--device", "cpu", "--target", "ref-target", "--target-twin", "", "--prompts", "2",
                 "--tokens", "4", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["equal"] == {"greedy": True, "sampled": True}
    assert all(r["overlapped_steps"] > 0 for r in record["rows"] if r["overlap"])
    assert all(r["overlapped_steps"] == 0 for r in record["rows"] if not r["overlap"])
