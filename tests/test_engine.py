"""Plain generation through the paged, continuously batched engine reproduces the model exactly."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(2, 96, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model_dir, ids: list[int], n: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt generated on its own."""
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts(6)]


def test_greedy_equals_transformers_generate(qwen3_dir, llm):
    for ids in prompts(3, seed=5):
        assert llm.generate(ids, GREEDY)[0].token_ids == hf_greedy(qwen3_dir, ids, GREEDY.max_tokens)


def test_batch_equals_alone(llm, alone):
    outs = llm.generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)


def test_small_cache_forces_preemption_and_keeps_outputs(qwen3_dir, alone):
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=96, block_size=4)
    outs = llm.generate(prompts(6), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone


def test_chunked_prefill_and_small_batches_keep_outputs(qwen3_dir, alone):
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, max_num_batched_tokens=7,
              max_num_seqs=2)
    assert [o.token_ids for o in llm.generate(prompts(6), GREEDY)] == alone


def test_prefix_cache_hits_keep_outputs(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4)
    shared = prompts(1, seed=3)[0] + prompts(1, seed=4)[0]
    variants = [shared + [7, 8, 9], shared + [10], shared]
    first = [llm.generate(v, GREEDY)[0] for v in variants]
    again = llm.generate(variants, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert first[1].num_cached_prompt_tokens >= (len(shared) // 4) * 4 - 4
    assert all(o.num_cached_prompt_tokens > 0 for o in again)
    fresh = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4)
    assert [fresh.generate(v, GREEDY)[0].token_ids for v in variants] == [o.token_ids for o in first]


def test_requests_join_a_running_batch(llm, alone):
    """Continuous batching: a request added mid-flight joins and both finish as if alone."""
    ps = prompts(6)
    first = llm.engine.add_request(ps[0], GREEDY)
    for _ in range(5):
        llm.engine.step()
    second = llm.engine.add_request(ps[1], GREEDY)
    llm.engine.step()
    assert second in llm.engine.scheduler.running and first in llm.engine.scheduler.running
    llm.run_until_done([first, second])
    assert [first.output_token_ids, second.output_token_ids] == alone[:2]


def test_eos_and_stop_token_ids_end_generation(llm, alone):
    ids = prompts(6)[0]
    stop_at = alone[0][5]
    out = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == alone[0][:alone[0].index(stop_at) + 1]


@pytest.mark.parametrize("at", [6, 30])  # early, and beyond the decoded tail window of the first tokens
def test_stop_strings_cut_text(llm, at):
    text_prompt = "def add(a, b):"
    full = llm.generate(text_prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = full.text[at:at + 2]
    out = llm.generate(text_prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]


def test_logprobs_match_score(llm):
    ids = prompts(1, seed=9)[0]
    out = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3))[0]
    scored = llm.score([ids + out.token_ids])[0][len(ids) - 1:]
    assert len(out.logprobs) == 8
    for entry, ref in zip(out.logprobs, scored):
        assert abs(entry.logprob - ref) < 1e-4
        assert entry.top[0][0] == entry.token_id  # greedy picks the best token
        assert len(entry.top) == 3 and entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_score_matches_transformers(qwen3_dir, llm):
    import transformers

    ids = prompts(1, seed=11)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    ref = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(llm.score([ids])[0], ref)) < 1e-4


def test_text_prompts_and_chat_template(llm):
    out = llm.generate(["hello", "world"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out) == 2 and all(len(o.token_ids) == 4 for o in out)
    assert out[0].prompt_token_ids == llm.tokenizer.encode("hello")
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<user>hi\n<assistant>"


def test_fixed_shape_decode_steps_keep_outputs(qwen3_dir, alone):
    """The padded (CUDA-graph-shaped) decode path gives the same tokens; CPU runs it eagerly."""
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, static_shapes=True, max_graph_batch=8)
    assert [o.token_ids for o in llm.generate(prompts(6), GREEDY)] == alone
    assert llm.engine.runner.static is not None


def test_compiled_fixed_shape_steps_keep_outputs(qwen3_dir, alone):
    """compile_graphs traces each padded shape with torch.compile (the "eager" backend here: dynamo's
    capture of our forward, without a C++ toolchain) and keeps the tokens."""
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, static_shapes=True, max_graph_batch=8,
              compile_graphs="eager")
    assert llm.engine.runner.static._padded is not llm.engine.runner.static._padded_forward
    assert [o.token_ids for o in llm.generate(prompts(6), GREEDY)] == alone


def test_fixed_shape_short_prefills_keep_outputs(qwen3_dir):
    """A prompt of 2..33 tokens prefilled in one fixed-shape step samples after its last token only."""
    plain = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4)
    static = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, static_shapes=True)
    short = [p[:20] for p in prompts(4, seed=21)]
    assert all(len(p) <= 33 for p in short)
    for p in short:  # alone: the prefill step is the fixed-shape path
        assert static.generate(p, GREEDY)[0].token_ids == plain.generate(p, GREEDY)[0].token_ids
    assert [o.token_ids for o in static.generate(short, GREEDY)] == [o.token_ids for o in plain.generate(short, GREEDY)]


def test_memory_budget_leaves_room_for_the_largest_step(qwen3_dir):
    from specdec.engine.kv_cache import GRAPH_RESERVE_BYTES, kv_budget_bytes
    from specdec.engine.memory import profile_step_bytes

    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=256)
    step = profile_step_bytes(llm.model, 64, 4, 16, llm.device)  # runs the step; a CPU measures only logits
    assert step == 3 * 64 * llm.model.config.vocab_size * 4
    assert kv_budget_bytes(10 << 30, 0.9, step) == int((10 << 30) * 0.9) - step - GRAPH_RESERVE_BYTES
    assert kv_budget_bytes(1 << 20, 0.9, step) == 0
    assert llm.generate([5, 6, 7], GREEDY)[0].token_ids  # the throw-away cache left the engine intact


def test_precapturing_every_shape_touches_no_sequence(qwen3_dir, alone):
    """Start-up capture runs each (batch, q, context) shape on padding rows only (here eagerly, on CPU)."""
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, static_shapes=True, max_graph_batch=8,
              max_graph_context=256)
    static = llm.engine.runner.static
    before = [k.clone() for k, _ in llm.engine.kv_cache.layers]
    assert static.precapture([1, 3]) == 2 * 4 * 1  # q in {1, 3} x batch {8, 4, 2, 1} x context {256}
    scratch = static.kv_cache.scratch_block * static.block_size
    for old, (new, _) in zip(before, llm.engine.kv_cache.layers):
        assert torch.equal(old[:scratch], new[:scratch])  # only the scratch block was written
    assert llm.engine.precapture_graphs() == 0  # nothing to capture on a CPU
    used = []
    run_shape = static._forward
    static._forward = lambda *shape: used.append(shape) or run_shape(*shape)
    assert [o.token_ids for o in llm.generate(prompts(6), GREEDY)] == alone
    assert static.frozen and used and set(used) <= static.shapes  # other shapes ran eagerly, none was captured


def test_fixed_shape_steps_share_one_logits_buffer():
    """Captured graphs write their logits into one buffer, grown to the largest shape, instead of each keeping
    its own [batch * q, V] output (GBs over a verify ladder at 8B)."""
    from specdec.engine.static_runner import StaticRunner

    class Cache:
        block_size, scratch_block, layers = 16, 0, []

    runner = StaticRunner(None, Cache(), torch.device("cpu"), max_batch=8, max_q=5, max_context=256, capture=False)
    like = torch.zeros(1, 11)
    small = runner._logits_buffer(4, like)
    again = runner._logits_buffer(2, like)
    assert small.shape == (4, 11) and again.data_ptr() == small.data_ptr()  # a smaller shape reuses it
    bigger = runner._logits_buffer(10, like)
    assert bigger.shape == (10, 11) and runner.logits.shape[0] == 10
    runner.logits, runner.logits_rows_wanted = None, 40  # precapture asks for its largest shape at once
    assert runner._logits_buffer(3, like).shape == (3, 11) and runner.logits.shape[0] == 40


def test_coalesced_admissions_wait_for_free_slots_and_keep_outputs(qwen3_dir, alone):
    """admission_batch 3: while others decode, waiting requests join once 3 slots are free (or all that wait
    fit), or after admission_max_wait held steps; outputs are those of each prompt alone."""
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, max_num_seqs=4, admission_batch=3,
              admission_max_wait=1000)
    sched = llm.engine.scheduler
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ps = prompts(6)
    reqs = [llm.engine.add_request(p, short if i == 0 else GREEDY) for i, p in enumerate(ps)]
    llm.engine.step()  # nothing decoding: four admitted at once
    assert [r in sched.running for r in reqs] == [True] * 4 + [False] * 2
    while not reqs[0].finished:
        llm.engine.step()
    for _ in range(5):  # one slot free, two waiting: held back
        llm.engine.step()
        assert len(sched.running) == 3 and sched.held_steps > 0
    sched.admission_max_wait = sched.held_steps + 1  # the wait limit admits them
    llm.engine.step()
    llm.engine.step()
    assert reqs[4] in sched.running and sched.held_steps == 0
    llm.run_until_done(reqs)
    assert [r.output_token_ids for r in reqs[1:]] == alone[1:]
    for batch in (1, 2, 6):
        llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, max_num_seqs=3,
                  admission_batch=batch)
        assert [o.token_ids for o in llm.generate(prompts(6), GREEDY)] == alone


def test_a_step_that_prefills_admits_at_once(qwen3_dir):
    """A running request still prefilling makes the step eager anyway: waiting ones join it."""
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, max_num_seqs=4, admission_batch=4,
              max_num_batched_tokens=8)
    first = llm.engine.add_request(list(range(2, 14)), GREEDY)  # 12 tokens: chunks of 8 and 4
    llm.engine.step()
    second, *others = [llm.engine.add_request(list(range(20 + i, 30 + i)), GREEDY) for i in range(4)]
    llm.engine.step()  # first's last 4 prompt tokens, and 4 of second's (3 free slots < 4 waiting)
    assert first.output_token_ids and second in llm.engine.scheduler.running and second.is_prefilling


def test_admission_batch_follows_measured_step_costs(qwen3_dir):
    """The economic order quantity m = C sqrt(2 E / S): C slots, eager steps E graph steps dearer, S steps a
    request, each the median of recent samples; 1 until each has three samples, and on a CPU, where every step
    is eager."""
    from specdec.engine.admission import AdmissionBatcher

    def batcher(slots, eager_s, graph_s, steps, samples=3):
        b = AdmissionBatcher(slots)
        for _ in range(samples):
            b.observe_step(eager=True, seconds=eager_s)
            b.observe_step(eager=False, seconds=graph_s)
            b.observe_finished(steps)
        return b

    assert batcher(16, 0.024, 0.001, 67, samples=2).batch() == 1  # too few samples yet
    measured = batcher(16, 0.024, 0.001, 67)
    assert measured.batch() == 13  # 16 * sqrt(2 * 23 / 67)
    measured.observe_step(eager=True, seconds=5.0)  # a one-off (a first compile): the median holds
    assert measured.batch() == 13
    assert batcher(64, 0.0011, 0.001, 100).batch() == 3  # 64 * sqrt(2 * 0.1 / 100) = 2.9
    assert batcher(8, 1.0, 0.001, 2).batch() == 8  # never more than the slots
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, max_num_seqs=64)
    llm.generate(prompts(6), GREEDY)
    assert llm.engine.scheduler.admission_batch == 1 and llm.engine.admission.graph_s.value is None
    with pytest.raises(Exception, match="admission_batch"):
        LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, admission_batch=0)


def test_measured_admission_batch_keeps_outputs(qwen3_dir, alone):
    """Fixed-shape steps (as a GPU's graph steps) and eager prefills: the engine measures both and sizes the
    admission batch from them; outputs stay those of each prompt alone."""
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, max_num_seqs=3, static_shapes=True)
    for _ in range(8):  # as if measured before: eager steps far dearer than fixed ones
        llm.engine.admission.observe_finished(20)
        llm.engine.admission.observe_step(eager=True, seconds=1.0)
    assert [o.token_ids for o in llm.generate(prompts(6), GREEDY)] == alone
    assert llm.engine.admission.graph_s.value is not None and llm.engine.scheduler.admission_batch > 1


def test_piecewise_eager_steps_keep_outputs_and_logits(qwen3_dir, alone):
    """Eager steps through the piecewise runner (all but attention on static, bucket-padded buffers; on a CPU
    the pieces run eagerly) give the plain path's logits and outputs: prefills, chunked prefills, mixed steps."""
    from specdec.engine.engine import Engine, EngineConfig
    from specdec.engine.scheduler import ScheduledSeq
    from specdec.errors import ConfigError
    from specdec.models.loader import load_model

    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4, max_num_seqs=3,
              max_num_batched_tokens=40, piecewise_graphs=True)
    piecewise = llm.engine.runner.piecewise
    assert piecewise.buckets == [16, 32, 64]
    assert [o.token_ids for o in llm.generate(prompts(6), GREEDY)] == alone
    assert piecewise.forwards > 0
    ids = prompts(1, seed=6)[0]  # 36 rows in the 64-token bucket: rows 36..63 are padding
    assert len(ids) == 36
    reference = LLM(qwen3_dir, device="cpu", kv_cache_tokens=2048, block_size=4).engine.all_logits(ids)
    req = llm.engine.add_request(ids, GREEDY)
    llm.engine.scheduler.waiting.remove(req)
    req.block_ids = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(len(ids)))
    rows = llm.engine.runner.forward([ScheduledSeq(req, len(ids), 0, samples=True)])[0]
    assert torch.allclose(rows, reference[-1:], atol=1e-5)
    model = load_model(qwen3_dir, "cpu")
    model.tensor_parallel = (0, 2)
    with pytest.raises(ConfigError, match="tensor parallelism"):
        Engine(model, EngineConfig(kv_cache_tokens=256, piecewise_graphs=True))
    assert Engine(model, EngineConfig(kv_cache_tokens=256)).piecewise_graphs is False  # the default: off here
    assert LLM(qwen3_dir, device="cpu", kv_cache_tokens=256).engine.runner.piecewise is None  # CPU: no graphs
