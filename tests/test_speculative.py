"""Speculative decoding in the engine is lossless: greedy token for token, sampling in distribution."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specdec import LLM, ConfigError, SamplingParams
from specdec.speculate import SpecConfig
from specdec.speculate.controller import KController
from specdec.speculate.step_costs import CalibratedCosts, StepCostTable
from specdec.speculate.ngram import ngram_draft
from tests.broken_verify import accept_everything
from tests.checkpoints import save_tiny
from tests.stats import chi_square_p

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A different, smaller random model with the target's tokenizer."""
    return save_tiny(tmp_path_factory.mktemp("drafter"), "qwen3", seed=7, num_hidden_layers=1)


def mixed_prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed lengths with some repetition, so that n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in torch.randint(3, 30, (n,), generator=g).tolist():
        p = torch.randint(2, 96, (length,), generator=g).tolist()
        out.append(p + p[: length // 2] + p)
    return out


@pytest.fixture(scope="module")
def plain(llm):
    return [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)]


def spec_llm(model_dir, spec: SpecConfig, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("block_size", 4)
    return LLM(model_dir, device="cpu", speculator=spec, **kw)


@pytest.mark.parametrize("method,k", [("ngram", 1), ("ngram", 4), ("ngram", 8), ("draft", 1), ("draft", 3),
                                      ("draft", 8)])
def test_greedy_equals_plain(qwen3_dir, drafter_dir, plain, method, k):
    model = str(drafter_dir) if method == "draft" else None
    llm = spec_llm(qwen3_dir, SpecConfig(method, model=model, num_draft_tokens=k, adaptive=False))
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert llm.engine.metrics()["draft_tokens"] > 0


@pytest.mark.parametrize("method,piecewise", [("ngram", False), ("draft", False), ("ngram", True), ("draft", True)])
def test_greedy_equals_plain_under_preemption_chunking_and_prefix_hits(qwen3_dir, drafter_dir, plain, method,
                                                                     piecewise):
    model = str(drafter_dir) if method == "draft" else None
    spec = SpecConfig(method, model=model, num_draft_tokens=4, adaptive=False)
    tight = spec_llm(qwen3_dir, spec, kv_cache_tokens=160, max_num_batched_tokens=24, piecewise_graphs=piecewise)
    assert [o.token_ids for o in tight.generate(mixed_prompts(), GREEDY)] == plain
    assert tight.engine.scheduler.num_preemptions > 0
    if piecewise:  # the target's eager steps, and a drafter's catch-ups, went through the pieces
        assert tight.engine.runner.piecewise.forwards > 0
        if method == "draft":
            assert tight.engine.speculator.runner.piecewise.forwards > 0
    again = tight.generate(mixed_prompts(), GREEDY)
    assert [o.token_ids for o in again] == plain


def test_identical_drafter_has_every_draft_accepted(qwen3_dir, plain):
    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(qwen3_dir), num_draft_tokens=5, adaptive=False))
    outs = llm.generate(mixed_prompts(), GREEDY)
    m = llm.engine.metrics()
    assert [o.token_ids for o in outs] == plain
    assert m["draft_tokens"] > 0 and m["accepted_tokens"] == m["draft_tokens"]
    assert all(o.num_accepted == o.num_drafted for o in outs)


def test_full_acceptance_needs_no_separate_drafter_catch_up(qwen3_dir):
    """After every draft is accepted the shadow misses two tokens (the last draft and the bonus); the chain's
    first forward takes both (a fixed shape on a GPU), so a steady step costs the drafter exactly k forwards."""
    k = 4
    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(qwen3_dir), num_draft_tokens=k, adaptive=False))
    params = SamplingParams(max_tokens=1 + 3 * (k + 1), temperature=0, ignore_eos=True)
    req = llm.engine.add_request(mixed_prompts(1)[0], params)
    llm.engine.step()  # prefill (no drafts yet: the request was not decoding)
    forwards = []
    while not req.finished:
        before = llm.engine.speculator.stats["draft_forwards"]
        llm.engine.step()
        forwards.append(llm.engine.speculator.stats["draft_forwards"] - before)
    assert req.num_accepted == req.num_drafted == 3 * k
    assert forwards == [1 + k, k, k]  # the first step catches up on the prompt, then k forwards each


@pytest.mark.parametrize("static_shapes", [False, True])
def test_drafter_chain_feeds_each_draft_from_the_device(qwen3_dir, drafter_dir, plain, static_shapes):
    """Forward i of the chain feeds draft i - 1 as a device tensor and the host reads the drafts once, after
    the chain, on the fixed-shape and the eager path, also when requests near max_tokens drop out of the chain
    early; outputs stay the plain ones."""
    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=6, adaptive=False),
                   static_shapes=static_shapes, max_graph_batch=8, max_graph_context=256)
    runner = llm.engine.speculator.runner
    forward, tolist, events = runner.forward, torch.Tensor.tolist, []  # (batch, fed ids) per forward; "read"

    def logged_forward(seqs, ids=None):
        events.append((len(seqs), None if ids is None else len(ids)))
        return forward(seqs, ids)
    runner.forward = logged_forward
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 9, 30, 13, 30, 30)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", lambda t: events.append("read") or tolist(t))
        outs = llm.generate(mixed_prompts(), params)
    assert [o.token_ids for o in outs] == [p[:len(o.token_ids)] for p, o in zip(plain, outs)]
    chained = [i for i, e in enumerate(events) if e != "read" and e[1] is not None]
    assert chained and all(events[i][0] == events[i][1] for i in chained)  # every sequence fed from the device
    assert all(events[i - 1] != "read" for i in chained)  # no host read between forwards of a chain
    assert any(events[i][0] < events[i - 1][0] for i in chained)  # a chain lost requests midway


def test_cost_model_can_switch_speculation_off(qwen3_dir, drafter_dir, plain):
    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=4, adaptive=False))
    compute_bound = StepCostTable({1: 1.0, 2: 2.0})  # every extra token costs as much as the first
    llm.engine.speculation.controller = KController(4, compute_bound, lambda b: 0.1, adaptive=True)
    llm.engine.trace = []
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    decode_steps = [r for r in llm.engine.trace if r.emitted and r.fed == r.sequences + r.drafts]
    assert decode_steps and decode_steps[0].k == 0  # the tables' verdict: plain decoding
    # only probes speculate, paid from PROBE_SHARE of the time (x 2: they are priced by estimates)
    spec_s = sum(r.seconds for r in decode_steps if r.k)
    assert spec_s <= 2 * KController.PROBE_SHARE * sum(r.seconds for r in decode_steps)


def test_a_queue_that_cannot_join_does_not_count_as_prefill(qwen3_dir, plain):
    """With every slot taken, waiting prompts cannot share the step: counted as its prefill, they made every
    step of a loaded engine look mixed, so the controller priced them with a prefill and learned nothing."""
    llm = spec_llm(qwen3_dir, SpecConfig("ngram", num_draft_tokens=4), max_num_seqs=1)
    others = []
    choose = llm.engine.controller.choose
    llm.engine.controller.choose = lambda ids, other: others.append(other) or choose(ids, other)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert others and others.count(0) >= len(others) - len(mixed_prompts())  # one mixed step per admission


def test_engine_tells_the_controller_what_was_drafted(qwen3_dir, plain):
    llm = spec_llm(qwen3_dir, SpecConfig("ngram", num_draft_tokens=4, adaptive=False))  # k whatever the clock says
    seen = []
    drafted = llm.engine.controller.drafted
    llm.engine.controller.drafted = lambda ids, counts: seen.append(counts) or drafted(ids, counts)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert seen and any(0 < sum(c) < 4 * len(c) for c in seen)  # some requests found fewer drafts than k


def test_ngram_draft_finds_the_longest_recent_suffix_and_stops_at_eos():
    assert ngram_draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert ngram_draft([5, 1, 2, 9, 7, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]  # suffix [1 2 3] beats [1 2]
    assert ngram_draft([1, 2, 3], 4) == []
    assert ngram_draft([1, 2, 0, 5, 6, 1, 2], 4, stop_ids={0}) == [0]


def _token2_counts(llm, prompt, n):
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    outs = llm.generate([prompt] * n, params)
    return np.bincount([o.token_ids[1] for o in outs], minlength=96), outs


def _sampled_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[N, V] float64 logits -> the distribution sampled at this temperature and top-p (the smallest set of
    most likely tokens, ties by token order, whose mass reaches top_p, renormalised)."""
    probs = (logits / temperature).softmax(-1)
    if top_p >= 1.0:
        return probs
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(probs).scatter(-1, order, ((ordered.cumsum(-1) - ordered) < top_p).double())
    return probs * keep / (probs * keep).sum(-1, keepdim=True)


def _exact_token2_marginal(model_dir, prompt, temperature: float = 1.0, top_p: float = 1.0):
    """P(second generated token) = sum_t p(t | prompt) p(. | prompt, t), from transformers, at these settings."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        p1 = _sampled_distribution(model(torch.tensor([prompt])).logits[0, -1:], temperature, top_p)[0]  # [V]
        batch = torch.tensor([prompt + [t] for t in range(96)])
        p2 = _sampled_distribution(model(batch).logits[:, -1], temperature, top_p)  # [V, V]
    return (p1[:, None] * p2).sum(0).numpy()


@pytest.fixture(scope="module")
def sampled_draft_llm(qwen3_dir, drafter_dir):
    return spec_llm(qwen3_dir, SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=2, adaptive=False),
                    max_num_seqs=512, kv_cache_tokens=16384)


def test_sampled_tokens_follow_the_target_distribution(qwen3_dir, sampled_draft_llm):
    prompt = [5, 17, 30, 2, 9]
    counts, outs = _token2_counts(sampled_draft_llm, prompt, 4000)
    assert sum(o.num_accepted for o in outs) > 300 and sum(o.num_drafted - o.num_accepted for o in outs) > 300
    assert chi_square_p(counts, _exact_token2_marginal(qwen3_dir, prompt)) > 1e-3


def test_negative_control_accept_everything_fails(qwen3_dir, sampled_draft_llm, monkeypatch):
    """A verifier that keeps every draft emits the drafter's distribution; the same test must catch it."""
    import specdec.engine.sampler as sampler

    monkeypatch.setattr(sampler, "accept_ragged", accept_everything)
    prompt = [5, 17, 30, 2, 9]
    counts, _ = _token2_counts(sampled_draft_llm, prompt, 4000)
    assert chi_square_p(counts, _exact_token2_marginal(qwen3_dir, prompt)) < 1e-6


def test_seeded_speculative_sampling_is_reproducible_whatever_the_batch(qwen3_dir, drafter_dir):
    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=3, adaptive=False))
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=42, ignore_eos=True)
    alone = llm.generate([5, 6, 7], params)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    batch = llm.generate([[9, 9, 9, 9], [5, 6, 7], [1, 2]], [others[0], params, others[1]])
    assert batch[1].token_ids == alone


def test_mismatched_drafters_and_bad_k_are_refused(qwen3_dir, tmp_path):
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        SpecConfig("ngram", num_draft_tokens=0)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        SpecConfig("ngram", num_draft_tokens=1000)
    with pytest.raises(ConfigError, match="drafter model"):
        SpecConfig("draft")
    with pytest.raises(ConfigError, match="unknown speculator"):
        SpecConfig("medusa")
    other_vocab = save_tiny(tmp_path / "v", "qwen3", vocab_size=128)
    shutil.copy(qwen3_dir / "tokenizer.json", other_vocab / "tokenizer.json")
    with pytest.raises(ConfigError, match="vocabulary"):
        spec_llm(qwen3_dir, SpecConfig("draft", model=str(other_vocab)))
    other_tok = shutil.copytree(qwen3_dir, tmp_path / "t")
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["A"], vocab["B"] = vocab["B"], vocab["A"]
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="different tokenizer"):
        spec_llm(qwen3_dir, SpecConfig("draft", model=str(other_tok)))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_fixed_shape_verify_steps_keep_outputs(qwen3_dir, drafter_dir, plain, method):
    model = str(drafter_dir) if method == "draft" else None
    llm = spec_llm(qwen3_dir, SpecConfig(method, model=model, num_draft_tokens=3, adaptive=False),
                   static_shapes=True, max_graph_batch=8)
    calls, accepted = [], []
    static = llm.engine.runner.static
    run, launch = static.run, static.acceptance.launch
    static.run = lambda seqs, *fed: calls.append(seqs[0].num_new) or run(seqs, *fed)
    static.acceptance.launch = lambda seqs, batch, q, logits: accepted.append(q) or launch(seqs, batch, q, logits)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert any(q > 1 for q in calls)  # verify steps took the fixed-shape path
    assert any(q > 1 for q in accepted)  # and were accepted on it


def test_seeded_sampled_replies_are_the_same_on_either_acceptance_path(qwen3_dir, drafter_dir, monkeypatch):
    """Seeded requests at T 1, at T 0.8 with top-p 0.9 and with top-k, and a greedy one, verifying a draft model's
    sampled drafts (its q) on fixed-shape steps: the replies with acceptance on the fixed shapes are those of the
    ragged path (the same forwards, the same draws from each request's generator)."""
    import specdec.engine.sampler as sampler

    settings = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=5), {}]
    params = [SamplingParams(max_tokens=16, seed=i, ignore_eos=True, **{"temperature": 0.0, **settings[i % 4]})
              for i in range(6)]
    spec = SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=3, adaptive=False)
    replies = []
    for fixed in (True, False):
        if not fixed:
            monkeypatch.setattr(sampler, "eligible", lambda seqs: False)
        llm = spec_llm(qwen3_dir, spec, static_shapes=True, max_graph_batch=8)
        replies.append([o.token_ids for o in llm.generate(mixed_prompts(), params)])
        assert (llm.engine.runner.static.acceptance.steps > 0) == fixed
        assert llm.engine.metrics()["accepted_tokens"] > 0
    assert replies[0] == replies[1]


def test_fixed_acceptance_is_on_without_graphs_and_switched_by_the_config(qwen3_dir, drafter_dir):
    """The default: acceptance on the fixed shapes wherever the fixed-shape runner runs (with CUDA graphs too:
    test_overlap_steps checks the defaults there); False keeps the sampler's ragged path."""
    spec = SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=3, adaptive=False)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    for setting, used in ((None, True), (False, False), (True, True)):
        llm = spec_llm(qwen3_dir, spec, static_shapes=True, max_graph_batch=8, fixed_acceptance=setting)
        llm.generate(mixed_prompts(2), params)
        assert (llm.engine.runner.static.acceptance.steps > 0) == used, setting


def test_frozen_shapes_keep_outputs_with_a_drafter(qwen3_dir, drafter_dir, plain):
    """As after start-up capture on a GPU: the target's and the drafter's shape sets are frozen, and every
    step outside them (prefills, the drafter's catch-ups) runs eagerly; outputs stay the plain ones."""
    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=3, adaptive=False),
                   static_shapes=True, max_graph_batch=8, max_graph_context=256)
    target, drafter = llm.engine.runner.static, llm.engine.speculator.runner.static
    assert drafter.max_context == target.max_context == 256  # the drafter's graphs follow the target's bound
    target.precapture([1, 4])
    drafter.precapture([1, 2])
    used = {id(target): [], id(drafter): []}
    for static in (target, drafter):
        forward = static._forward
        static._forward = lambda *shape, f=forward, s=static: used[id(s)].append(shape) or f(*shape)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    for static in (target, drafter):
        assert used[id(static)] and set(used[id(static)]) <= static.shapes


def test_verify_steps_with_fewer_drafts_round_up_to_a_captured_shape(qwen3_dir, plain):
    """An n-gram lookup finds drafts of any length up to k; after start-up capture a step whose longest draft
    is shorter than k runs as the next captured q (its extra rows padding) rather than eagerly, with the
    plain engine's outputs."""
    llm = spec_llm(qwen3_dir, SpecConfig("ngram", num_draft_tokens=4, adaptive=False), static_shapes=True,
                   max_graph_batch=8, max_graph_context=256)
    static = llm.engine.runner.static
    static.precapture([1, 5])
    fed, used = [], []
    run, forward = static.run, static._forward
    static.run = lambda seqs, *ids: fed.append(max(s.num_new for s in seqs)) or run(seqs, *ids)
    static._forward = lambda *shape: used.append(shape) or forward(*shape)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    assert {q for q in fed if 1 < q < 5}  # some steps fed 2..4 tokens per sequence ...
    assert {q for _, q, _ in used} == {1, 5}  # ... and ran as the q = 5 shape


def test_step_costs_are_measured_on_the_path_served_steps_take(qwen3_dir, drafter_dir, plain, monkeypatch):
    """After start-up (and its CUDA-graph capture on a GPU) the controller's cost tables come from decode-shaped
    steps through the fixed-shape runner up to its batch limit, larger ones eagerly, for target and drafter;
    and for the target from verify-shaped steps, B sequences of k + 1 tokens for every k it may choose.  The
    controller prices steps with exactly those measured tables (positive times), and the engine then serves the
    plain engine's tokens."""
    from specdec.speculate import build

    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(drafter_dir), num_draft_tokens=4), static_shapes=True,
                   max_graph_batch=8, max_graph_context=256, max_num_seqs=8)
    controller = llm.engine.controller
    assert controller.adaptive and controller.costs is not None
    assert not spec_llm(qwen3_dir, SpecConfig("ngram", num_draft_tokens=4, adaptive=False)).engine.controller.adaptive
    shapes = {"target": [], "drafter": []}  # (sequences, tokens fed by each) of every fixed-shape step
    runners = {"target": llm.engine.runner, "drafter": llm.engine.speculator.runner}
    for name, runner in runners.items():
        run = runner.static.run
        runner.static.run = lambda seqs, *ids, run=run, name=name: shapes[name].append(
            (len(seqs), max(s.num_new for s in seqs))) or run(seqs, *ids)
    eager = {name: runner.eager_forwards for name, runner in runners.items()}
    measured = []  # what measure_tables returned
    measure = build.measure_tables
    monkeypatch.setattr(build, "measure_tables", lambda *a: measured.append(measure(*a)) or measured[-1])
    build.calibrate(controller, llm.engine, llm.engine.speculator)
    assert {b for b, q in shapes["drafter"]} == {1, 2, 4, 8}  # n sequences of one token, n up to the graph batch
    assert {q for b, q in shapes["drafter"]} == {1}
    verify_shapes = {(b, k + 1) for k in controller.candidates() for b in (1, 2, 4, 8)}
    assert verify_shapes <= set(shapes["target"])  # decode (k = 0) and verify steps, all fixed-shape
    assert sorted(controller.costs.verify) == controller.candidates() == [0, 1, 2, 4]
    assert llm.engine.runner.eager_forwards > eager["target"]  # 16 tokens and more: eagerly
    assert_prices_steps_with(controller.costs, *measured[0])
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain  # the engine still serves


def assert_prices_steps_with(costs: CalibratedCosts, target: StepCostTable, draft: StepCostTable,
                             verify: dict[int, StepCostTable]) -> None:
    """The controller's costs are these measured tables, each a positive, finite time at every point."""
    assert costs.target is target and costs.draft is draft and costs.verify is verify
    for table in [target, draft, *verify.values()]:
        assert all(0 < t < float("inf") for t in table.seconds), table.seconds


def test_per_request_speculation_metrics(qwen3_dir):
    llm = spec_llm(qwen3_dir, SpecConfig("draft", model=str(qwen3_dir), num_draft_tokens=3, adaptive=False))
    out = llm.generate(mixed_prompts(1), GREEDY)[0]
    assert out.num_accepted == out.num_drafted > 0  # identical drafter
    assert out.accepted_per_position[0] >= out.accepted_per_position[-1] > 0
    assert sum(out.accepted_per_position) == out.num_accepted
    assert out.tokens_per_step == len(out.token_ids) / out.num_steps > 2.0


def _ngram_reference(tokens, k, max_n, min_n, stop_ids):
    """The lookup's definition, by brute force: for n from the longest down, the last window equal to the
    n-token suffix that leaves a continuation; its next k tokens, cut after a stop id."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        hits = [s for s in range(length - n) if tokens[s:s + n] == suffix]
        if hits:
            draft = tokens[hits[-1] + n:hits[-1] + n + k]
            cut = next((i + 1 for i, t in enumerate(draft) if t in stop_ids), len(draft))
            return draft[:cut]
    return []


def test_ngram_draft_matches_its_brute_force_definition():
    rng = np.random.default_rng(0)
    for trial in range(3000):
        tokens = rng.integers(0, int(rng.integers(2, 7)), int(rng.integers(1, 40))).tolist()
        k, max_n, min_n = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 3))
        stop = {int(rng.integers(0, 6))} if trial % 3 == 0 else set()
        assert ngram_draft(tokens, k, max_n, min_n, stop) == _ngram_reference(tokens, k, max_n, min_n, stop), \
            (tokens, k, max_n, min_n, stop)


def test_batched_ngram_lookup_equals_one_lookup_per_context():
    from specdec.speculate.ngram import ngram_draft_batch

    rng = np.random.default_rng(2)
    for trial in range(2000):
        count = int(rng.integers(1, 7))
        contexts = [rng.integers(0, int(rng.integers(2, 7)), int(rng.integers(0, 40))) for _ in range(count)]
        ks = [int(rng.integers(0, 9)) for _ in range(count)]
        max_n, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        stops = [{int(rng.integers(0, 6))} if rng.random() < 0.3 else set() for _ in range(count)]
        want = [_ngram_reference(c.tolist(), k, max_n, min_n, stop) if k else []
                for c, k, stop in zip(contexts, ks, stops)]
        assert ngram_draft_batch(contexts, ks, max_n, min_n, stops) == want, (contexts, ks, max_n, min_n, stops)


def test_ngram_speculator_drafts_a_batch_as_one_lookup_each_would():
    from specdec.engine.request import Request
    from specdec.speculate.ngram import NgramSpeculator

    spec = NgramSpeculator()
    rng = np.random.default_rng(3)
    reqs = [Request(rng.integers(0, 6, 20).tolist(), SamplingParams(max_tokens=50), torch.device("cpu"))
            for _ in range(2 * NgramSpeculator.BATCH_FROM)]
    for step in range(30):
        ks = [int(rng.integers(0, 6)) for _ in reqs]
        spec.propose(reqs, ks)
        assert [r.draft_token_ids for r in reqs] == [ngram_draft(r.all_token_ids, k) if k else []
                                                     for r, k in zip(reqs, ks)]
        for r in reqs:
            r.output_token_ids.append(int(rng.integers(0, 6)))


def test_ngram_speculator_keeps_each_requests_tokens_as_it_grows():
    from specdec.engine.request import Request
    from specdec.speculate.ngram import NgramSpeculator

    spec = NgramSpeculator()
    req = Request([1, 2, 3, 1], SamplingParams(max_tokens=50), torch.device("cpu"))
    rng = np.random.default_rng(1)
    for _ in range(300):  # past the first buffer's 256 tokens
        spec.propose([req], [4])
        assert req.draft_token_ids == ngram_draft(req.all_token_ids, 4)
        req.output_token_ids.append(int(rng.integers(0, 5)))
    spec.release(req)
    assert not spec.tokens.arrays
