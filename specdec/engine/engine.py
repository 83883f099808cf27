"""The engine loop: schedule -> propose -> verify -> accept -> commit, one step at a time."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import time

import torch

from specdec.engine.admission import AdmissionBatcher
from specdec.engine.eager_warm_up import warm_up_eager
from specdec.engine.kv_cache import BlockManager, KVCache, num_blocks_for
from specdec.engine.limits import RequestLimits
from specdec.engine.overlap import InFlight, hold_pending, plain_decode, release_pending, schedules_alike
from specdec.engine.request import Request, TokenLogprobs
from specdec.engine.runner import ModelRunner
from specdec.engine.sampler import sample_tokens
from specdec.engine.scheduler import ScheduledSeq, Scheduler
from specdec.engine.state_slots import StateSlots
from specdec.errors import ConfigError, InvalidRequestError
from specdec.models.attention import BACKENDS as ATTENTION_BACKENDS, kernel_device, set_attention_backend
from specdec.models.qwen3_5 import HybridCausalLM
from specdec.models.transformer import CausalLM
from specdec.models.weight_layout import lay_out_weights
from specdec.sampling import SamplingParams, top_logprobs
from specdec.transfer import upload
from specdec.verify_tree import Verdict


def default_attention_backend(device: torch.device) -> str:
    """The paged Triton kernel on a GPU with triton installed (it reads the blocks directly; the decode table
    in docs/BENCHMARKS.md), SDPA over the gathered keys everywhere else."""
    has_triton = importlib.util.find_spec("triton") is not None
    return "triton" if has_triton and kernel_device(device) else "sdpa"


@dataclasses.dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: from free device memory (GPU) or 32k tokens (CPU)
    gpu_memory_utilization: float = 0.9  # share of free memory after the weights; less the largest step's need
    # KV bytes per token of caches indexed by the target's block tables (an EAGLE-3 head's): a KV cache sized
    # from free memory leaves them room for as many blocks
    shared_kv_bytes_per_token: int = 0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # Admit waiting requests once this many sequence slots are free (while others decode), coalescing the
    # eager prefill steps (engine/scheduler.py); None: sized from the measured costs of eager and graph steps
    # (engine/admission.py; 1 where every step is eager, as on a CPU).  admission_max_wait bounds the steps a
    # request is held back (only ever while more requests wait than slots are free).
    admission_batch: int | None = None
    admission_max_wait: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    static_shapes: bool | None = None  # pad decode/verify steps to fixed shapes (default: on GPU only)
    cuda_graphs: bool = True  # capture fixed-shape steps as CUDA graphs (GPU only)
    precapture: bool = True  # capture every shape at start-up rather than at first use
    warm_up: bool = True  # with precapture on a GPU, run the eager steps once at start-up (engine/eager_warm_up.py)
    max_graph_batch: int = 256
    max_graph_context: int = 8192
    fused_kernels: bool | None = None  # compiled elementwise kernels (specdec.models.fused); None: on a GPU.
    # Once on, they stay on for the process (specdec.models.fused.Kernels is shared by every model).
    compile_graphs: str | None = None  # torch.compile backend for each fixed-shape step before capture
    # Projection weights stored column-major (models/weight_layout.py: cuBLAS's NN GEMMs, faster at decode's
    # few rows; docs/BENCHMARKS.md).  None: on a GPU with the fused kernels.
    column_major_weights: bool | None = None
    # Eager steps (prefills, mixed steps) replay everything but attention as CUDA graphs per token bucket
    # (engine/piecewise.py): 2-3x cheaper eager steps for the reference target on the H200.  None: on with
    # CUDA graphs on a GPU, unless tensor-parallel (not supported there yet) or a hybrid model (Qwen3.5:
    # engine/piecewise_hybrid.py, opt-in with True until it is measured on a GPU).
    piecewise_graphs: bool | None = None
    # Attention of decode / verify steps (specdec.models.attention): "triton" reads the paged KV in a kernel
    # (GPU only), "sdpa" gathers it for SDPA; None: default_attention_backend (the kernel on a GPU with triton).
    # The choice is the process's (like fused_kernels): the last engine built sets it for every engine's later
    # steps.
    attention_backend: str | None = None
    # Acceptance of decode / verify steps on their fixed shape (engine/fixed_acceptance.py: one graph replay and
    # one copy back where the sampler's path launches ~20-30 kernels).  None: on wherever the fixed-shape runner
    # runs (docs/BENCHMARKS.md: 0.6 ms of an 8B-twin EAGLE-3 step, ~0.2 GB of graph pool on the 27B twin); on a
    # CPU the same function runs eagerly.
    fixed_acceptance: bool | None = None
    # Overlapped steps (engine/overlap.py, issue 21): the host schedules and launches a plain decode step while the
    # one before it still runs on the device, feeding it that step's tokens from the device, and reads and commits
    # that step only then.  Needs the fixed-shape runner, fixed acceptance and a model that is not hybrid.  None:
    # on wherever those hold (docs/BENCHMARKS.md: the same tokens as without on a GPU, 2-5 % of an 8B-twin step
    # at batch 1-8); on a CPU the same path runs synchronously.
    overlap_steps: bool | None = None

    def validate(self) -> None:
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} (or unset for the "
                              f"default), got {self.attention_backend!r}")
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(f"kv_cache_tokens must be at least one block ({self.block_size}), "
                              f"got {self.kv_cache_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ConfigError(f"max_model_len must be at least 2 tokens, got {self.max_model_len}")
        if self.admission_batch is not None and self.admission_batch < 1 or self.admission_max_wait < 0:
            raise ConfigError(f"admission_batch must be at least 1 and admission_max_wait at least 0, got "
                              f"{self.admission_batch} and {self.admission_max_wait}")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclasses.dataclass
class StepRecord:
    """One engine step, for diagnosis (Engine.trace): what it fed and emitted, how long it took."""
    sequences: int  # scheduled sequences (decoding and prefilling)
    fed: int  # tokens fed to the target
    drafts: int  # draft tokens verified
    emitted: int  # tokens emitted
    k: int  # drafts per request the controller chose (0: plain)
    eager: bool  # the target's forward ran eagerly instead of replaying a CUDA graph
    seconds: float


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 detokenize=None):
        config.validate()
        self.model = model
        self.config = config
        self.device = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.piecewise_graphs = self._use_piecewise(model)
        if self._column_major_weights():
            # fused first (a fusion concatenates its layers row-major), and before the KV cache takes the free
            # memory and any graph is captured: each weight's moved copy is transient, and graphs keep addresses
            model.fuse_projections()
            lay_out_weights(model, column_major=True)
        step_bytes = 0
        if config.kv_cache_tokens is None and self.device.type == "cuda":  # warm up: measure the largest step
            from specdec.engine.memory import profile_step_bytes

            step_bytes = profile_step_bytes(model, config.max_num_batched_tokens, config.max_num_seqs,
                                            config.block_size, self.device)
            if self.piecewise_graphs:  # the pieces' private graph pool holds a widest step's temporaries too
                # (a hybrid model's pieces as a dense one's)
                step_bytes *= 2
        num_blocks = num_blocks_for(mc, config.block_size, dtype, self.device, config.kv_cache_tokens,
                                    config.gpu_memory_utilization, step_bytes, config.shared_kv_bytes_per_token)
        self.kv_cache = KVCache(mc, num_blocks, config.block_size, self.device, dtype)
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_caching=not mc.is_hybrid)
        # a hybrid model's linear layers keep a recurrent state per running sequence (engine/state_slots.py)
        self.states = StateSlots(mc, config.max_num_seqs, self.device, dtype) if mc.is_hybrid else None
        if config.fused_kernels is not False and self.device.type == "cuda":
            from specdec.models.fused import enable_fused_kernels

            enable_fused_kernels()
        self.attention_backend = self._choose_attention_backend()
        set_attention_backend(self.attention_backend)  # before any graph is captured: graphs keep their choice
        self.runner = ModelRunner(model, self.kv_cache, self.device, self._static_runner(), self._piecewise_runner(),
                                  self.states)
        self.fixed_acceptance = self._on_unless_set_off(config.fixed_acceptance)
        self.overlap_steps = self._use_overlap()
        self.in_flight: InFlight | None = None  # the step left in flight (engine/overlap.py), or None
        self.finished_early: list[Request] = []  # finished at a commit outside step(), for the next step() to return
        self._committed_at = 0.0  # time.perf_counter() at the last step's commit
        # coalesced admissions: a fixed batch, or one sized from measured step costs (engine/admission.py)
        self.admission = AdmissionBatcher(config.max_num_seqs) if config.admission_batch is None else None
        self.scheduler = Scheduler(self.blocks, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.admission_batch or 1, config.admission_max_wait)
        if self.states is not None:
            self.scheduler.on_release = self.states.release
        self.eos_token_ids = eos_token_ids
        self.speculation = None  # speculate.speculation.Speculation: everything speculative, one object
        self.detokenize = detokenize  # ids -> text, needed for stop strings
        self.stats = {"steps": 0, "tokens_fed": 0, "tokens_emitted": 0, "drafts": 0, "draft_tokens": 0,
                      "accepted_tokens": 0, "verify_steps": 0, "overlapped_steps": 0,
                      # committed steps' seconds (from their start, or the last commit, to their commit), and of
                      # those the steps with an eager forward: where a load's time goes
                      "step_seconds": 0.0, "eager_steps": 0, "eager_step_seconds": 0.0}
        self.accepted_per_position = [0] * 33  # [j]: drafts accepted at position j (0-based)
        # a list to record every step in (a StepRecord each; benches set it for a window, None: not recorded)
        self.trace: list[StepRecord] | None = None

    def _choose_attention_backend(self) -> str:
        if self.config.attention_backend == "triton":
            if not kernel_device(self.device):
                raise ConfigError(f"attention_backend 'triton' runs on a GPU, not on {self.device.type}: choose "
                                  "'sdpa' or leave it unset")
            if importlib.util.find_spec("triton") is None:
                raise ConfigError("attention_backend 'triton' needs the triton package: install it (it comes with "
                                  "CUDA builds of torch) or choose 'sdpa'")
        return self.config.attention_backend or default_attention_backend(self.device)

    def _on_unless_set_off(self, setting: bool | None) -> bool:
        """A fixed-shape runner's option measured to pay on a GPU: as set, else (None) on; off without the runner."""
        return self.runner.static is not None and setting is not False

    def _column_major_weights(self) -> bool:
        setting = self.config.column_major_weights
        if setting is None:
            return self.device.type == "cuda" and self.config.fused_kernels is not False
        return setting

    def _use_overlap(self) -> bool:
        setting = self.config.overlap_steps
        possible = self.fixed_acceptance and self.states is None
        if setting and not possible:
            raise ConfigError("overlap_steps needs static_shapes and fixed_acceptance on and a model that is not "
                              "hybrid (Qwen3.5): leave it unset")
        return possible and self._on_unless_set_off(setting)

    def _static_runner(self):
        from specdec.engine.static_runner import StaticRunner

        use = self.config.static_shapes if self.config.static_shapes is not None else self.device.type == "cuda"
        if not use:
            return None
        max_batch = min(self.config.max_graph_batch, self.config.max_num_seqs)
        if self.states is not None:  # a hybrid model: its recurrent-state slots ride in the fixed-shape steps
            from specdec.engine.static_hybrid import HybridStaticRunner

            if self.config.compile_graphs:
                raise ConfigError("compile_graphs does not run hybrid models (Qwen3.5) yet: leave it unset")
            return HybridStaticRunner(self.model, self.kv_cache, self.device, max_batch, max_q=33,
                                      max_context=self.graph_context_bound, capture=self.config.cuda_graphs,
                                      state_slots=self.states)
        return StaticRunner(self.model, self.kv_cache, self.device, max_batch, max_q=33,
                            max_context=self.graph_context_bound,
                            capture=self.config.cuda_graphs, compile_backend=self.config.compile_graphs)

    def _use_piecewise(self, model: CausalLM) -> bool:
        tensor_parallel = getattr(model, "tensor_parallel", None) is not None
        if self.config.piecewise_graphs is None:  # default: off for hybrids (opt-in until measured on a GPU)
            return self.device.type == "cuda" and self.config.cuda_graphs and not tensor_parallel and \
                not isinstance(model, HybridCausalLM)
        if self.config.piecewise_graphs and tensor_parallel:
            raise ConfigError("piecewise_graphs does not support tensor parallelism yet: leave it off with "
                              "tensor_parallel_size > 1")
        return self.config.piecewise_graphs

    def _piecewise_runner(self):
        if not self.piecewise_graphs:
            return None
        from specdec.engine.piecewise import PiecewiseRunner
        from specdec.engine.piecewise_hybrid import HybridPiecewiseRunner

        runner = HybridPiecewiseRunner if isinstance(self.model, HybridCausalLM) else PiecewiseRunner
        return runner(self.model, self.device, self.config.max_num_batched_tokens, self.config.cuda_graphs)

    @property
    def graph_context_bound(self) -> int:
        """The longest context a fixed-shape (CUDA-graph) step may have, for the target and its drafter."""
        return min(self.config.max_graph_context, self.max_model_len)

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Validate and queue a request; raises InvalidRequestError naming the problem."""
        self.validate_request(prompt_token_ids, params)
        req = Request(prompt_token_ids, params, self.device, request_id, self.eos_token_ids)
        self.scheduler.add(req)
        return req

    @property
    def limits(self) -> RequestLimits:
        """What a request must satisfy here (a picklable value: a server process checks requests with it)."""
        return RequestLimits(self.vocab_size, self.max_model_len, self.capacity_tokens, self.detokenize is not None)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.limits.validate(prompt_token_ids, params)

    def abort(self, req: Request) -> None:
        if not req.finished:
            self.scheduler.finish(req)
            req.finish("abort")
            self._on_finished(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None or bool(self.finished_early)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one engine step; return the requests that finished during it.

        With overlapped steps (engine/overlap.py) a plain decode step is left in flight, its tokens on the device:
        the next call launches the step behind it and then commits it, or, where that step cannot be scheduled
        ahead exactly, commits it first and runs as without overlap.  The requests returned finished at a commit
        made in this call."""
        finished, self.finished_early = self.finished_early, []
        if self.in_flight is not None:
            started = time.perf_counter()
            behind = self._schedule_behind()
            if behind is not None:
                return finished + self._step_behind(behind, started)
            flight, self.in_flight = self.in_flight, None
            finished += self._complete(flight)
        return finished + self._step()

    def _step(self) -> list[Request]:
        """A step as without overlap, but that a plain decode step may be left in flight (engine/overlap.py).

        A speculative step accepted on its fixed shape has the speculator's observe launched ahead where it can
        (Speculator.observe_ahead: an EAGLE-3 / MTP head's forward over the step's positions): queued once the
        acceptance is, before the host waits for it, so the device runs it while the host reads and commits;
        after_step then only settles it.  Behind it the next step's draft chain may be queued as well
        (Speculation.observe_ahead), which the next propose hands out instead of drafting again."""
        started = time.perf_counter()
        eager_before = self.runner.eager_forwards
        if self.speculation is not None:
            self.speculation.propose(self.scheduler)
        if self.admission is not None:
            self.scheduler.admission_batch = self.admission.batch()
        seqs = self.scheduler.schedule()
        if self.speculation is not None:
            self.speculation.scheduled(seqs)
        finished = list(self.scheduler.out_of_cache)
        self.scheduler.out_of_cache.clear()
        for req in finished:
            self._on_finished(req)
        if not seqs:
            return finished
        starts = [s.request.num_computed for s in seqs]
        logits = self.runner.forward(seqs)  # per seq [1 + drafts, V] or empty
        if self._may_fly(seqs):
            flight = InFlight(seqs, starts, logits, self.runner.static.launch_accept(seqs), started, overlapped=False,
                              plain=self._plain_step())
            if self._observe_in_flight(flight):
                self.in_flight = flight
                return finished
            return finished + self._complete(flight)
        verdicts = sample_tokens(seqs, logits, self.runner.static if self.runner.static_step and self.fixed_acceptance
                                 else None, on_launch=self._observe_ahead(seqs, starts))
        if self.states is not None:  # a verified sequence's state advances by exactly the tokens it kept
            self.states.commit([s.num_new - s.num_drafts + len(v.tokens) - 1 for s, v in zip(seqs, verdicts)])
        for i, (seq, rows, verdict) in enumerate(zip(seqs, logits, verdicts)):
            if seq.tree_parents is not None:  # the accepted path's keys and features go where a chain's would be
                self.runner.keep_path(i, seq, starts[i], verdict.rows)
            if self._commit(seq, rows, verdict):
                finished.append(seq.request)
        if self.speculation is not None:
            seconds = self.speculation.after_step(seqs, starts, self.runner, started)
        else:
            seconds = time.perf_counter() - started  # the tokens are on the host: the step's work is done
        self._account(seqs, sum(len(v.tokens) for v in verdicts), self.runner.eager_forwards > eager_before, seconds)
        return finished

    def _observe_ahead(self, seqs: list[ScheduledSeq], starts: list[int]):
        """What sample_tokens calls once the step's fixed-shape acceptance is queued (its on_launch): the
        speculator's observe of the step launched ahead of the host's read, and the next chain behind it
        (Speculation.observe_ahead), or None without a speculator."""
        if self.speculation is None:
            return None
        return functools.partial(self.speculation.observe_ahead, self.scheduler, seqs, starts, self.runner)

    def _account(self, seqs: list[ScheduledSeq], emitted: int, eager: bool, seconds: float,
                 k: int | None = None) -> None:
        """Count a committed step: the stats, the admission batcher's costs and the trace (k: the step's, default
        the speculation's last)."""
        fed = sum(s.num_new for s in seqs)
        self.stats["steps"] += 1
        self.stats["tokens_fed"] += fed
        self.stats["step_seconds"] += seconds
        if eager:
            self.stats["eager_steps"] += 1
            self.stats["eager_step_seconds"] += seconds
        if self.admission is not None:
            self.admission.observe_step(eager, seconds)
        if self.trace is not None:
            self.trace.append(StepRecord(
                sequences=len(seqs), fed=fed, drafts=sum(s.num_drafts for s in seqs), emitted=emitted,
                k=k if k is not None else self.speculation.last_k if self.speculation is not None else 0,
                eager=eager, seconds=seconds))
        self._committed_at = time.perf_counter()

    # ------------------------------------------------------------------ overlapped steps (engine/overlap.py)

    def _may_fly(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether this step may be left in flight: overlapped steps on, the fixed-shape runner, a plain decode
        and, with a speculator, the controller's k = 0."""
        return bool(self.overlap_steps and self.runner.static_step and plain_decode(seqs)
                    and (self.speculation is None or self.speculation.plain_step() is not None))

    def _plain_step(self):
        """How the speculation prices a step left in flight once committed (Speculation.plain_step); None
        without a speculator."""
        return self.speculation.plain_step() if self.speculation is not None else None

    def _observe_in_flight(self, flight: InFlight) -> bool:
        """Queue the speculator's observe of a step about to be left in flight (Speculation.observe_in_flight);
        False where it must be committed before any other forward runs."""
        if self.speculation is None:
            return True
        return self.speculation.observe_in_flight(flight.seqs, flight.starts, self.runner, flight.launched)

    def _schedule_behind(self) -> list[ScheduledSeq] | None:
        """The step behind the one in flight, scheduled with each request's token from it pending; None where
        that schedule is not sure to be a plain decode of the same requests, or the controller plans drafts for
        it (the step in flight is then committed first)."""
        reqs = self.in_flight.live()
        if not schedules_alike(self.scheduler, reqs):
            return None
        hold_pending(reqs)
        if (not self.runner.takes_static([ScheduledSeq(r, 1, 0, samples=True) for r in reqs])
                or self.speculation is not None and not self.speculation.plan_behind(reqs)):
            for req in reqs:
                release_pending(req)
            return None
        if self.admission is not None:
            self.scheduler.admission_batch = self.admission.batch()
        seqs = self.scheduler.schedule()
        if not plain_decode(seqs) or [s.request for s in seqs] != reqs:
            raise RuntimeError("the step behind the one in flight was not scheduled as overlap.schedules_alike "
                               "promised")
        return seqs

    def _step_behind(self, seqs: list[ScheduledSeq], started: float) -> list[Request]:
        """Launch the step behind the one in flight, fed its tokens from the device; then commit that one."""
        fed_ids = self.in_flight.tokens_for([s.request for s in seqs], self.device)  # [len(seqs)] on the device
        starts = [s.request.num_computed for s in seqs]  # each one past its pending token's position
        try:
            logits = self.runner.forward(seqs, fed_ids=fed_ids)  # per seq [1, V]
            behind = InFlight(seqs, starts, logits, self.runner.static.launch_accept(seqs), started, overlapped=True,
                              plain=self._plain_step())
        except BaseException:
            for seq in seqs:
                release_pending(seq.request)
            raise
        flight, self.in_flight = self.in_flight, behind
        finished = self._complete(flight, ahead=seqs)
        # its speculator's observe, queued once the commit has settled the one before (starts now num_computed)
        if not self._observe_in_flight(behind):
            self.in_flight = None
            finished += self._complete(behind)
        return finished

    def _complete(self, flight: InFlight, ahead: list[ScheduledSeq] = ()) -> list[Request]:
        """Read a step left in flight's tokens and commit them as a step without overlap would.  ahead: the step
        launched behind it, whose requests hold their token from it as a placeholder (overlap.hold_pending).
        Returns the requests that finished."""
        emitted = self.runner.static.acceptance.read(flight.launched)  # per sequence [1]
        pending = {id(s.request) for s in ahead}
        finished, committed = [], []
        for seq, rows, tokens in zip(flight.seqs, flight.logits, emitted):
            req = seq.request
            if req.finished:  # aborted, or finished at the step before: its token and KV slot are dropped
                continue
            behind = int(id(req) in pending)
            if behind:
                release_pending(req)
            if self._commit(seq, rows, Verdict(tokens, [0]), ahead=behind):
                finished.append(req)
            committed.append(seq)
        if committed:
            self.stats["overlapped_steps"] += flight.overlapped
            # a step's cost: from its start, or from the last commit when it ran behind that step
            started = max(flight.started, self._committed_at)
            if self.speculation is not None:
                seconds = self.speculation.after_step(flight.seqs, flight.starts, self.runner, started, flight.plain)
            else:
                seconds = time.perf_counter() - started
            self._account(committed, len(committed), False, seconds, k=0)
        return finished

    def drain(self) -> None:
        """Commit the step in flight, if any (its finished requests are returned by the next step())."""
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            with torch.inference_mode():
                self.finished_early += self._complete(flight)

    def set_speculation(self, speculation) -> None:
        """Speculate from now on (speculate/speculation.py's Speculation: a speculator and the controller of its
        k, built for this engine by speculate/build.py).  A speculator that reads the target's hidden states has
        the target capture them from here on."""
        self.drain()  # a speculator's steps start from committed tokens
        self.speculation = speculation
        speculator = speculation.speculator
        if speculator.tree_nodes(2) > 2:  # it drafts trees
            if self.states is not None:
                raise ConfigError("draft trees do not run on hybrid models (Qwen3.5): their linear layers read the "
                                  "fed tokens as one sequence; leave tree_width at 1")
            if self.runner.static is not None:
                self.runner.static.enable_tree_masks()
        if speculator.feature_layers:
            static = self.runner.static
            rows = max(self.config.max_num_batched_tokens, static.max_batch * static.max_q if static else 0)
            self.model.capture_features(speculator.feature_layers, rows)

    @property
    def speculator(self):
        return self.speculation.speculator if self.speculation is not None else None

    @property
    def controller(self):
        return self.speculation.controller if self.speculation is not None else None

    def precapture_graphs(self, eager: bool = False) -> int:
        """Capture the CUDA graphs of every decode / verify shape (and the drafter's) before serving.

        q values: 1 (decode) and k + 1 for each k the controller may choose; with piecewise_graphs, every token
        bucket's pieces too; with fixed acceptance, each shape's likeliest acceptance graphs (_precapture_acceptance).
        eager: where steps run without graphs (a CPU), run the target's shapes and their acceptance once all the
        same, freezing its shape set as a GPU's start-up does (how the tests check it; the drafter's and head's
        shapes are left).  Returns how many shapes, pieces and acceptance graphs were captured (or run)."""
        drafter_runner = getattr(self.speculator, "runner", None)
        runners = [r for r in (self.runner, drafter_runner) if r is not None and r.piecewise is not None]
        count = sum(r.piecewise.capture_all() for r in runners)
        static = self.runner.static
        if static is None or not (static.capture or eager):
            return count
        ks = self.controller.candidates() if self.controller is not None else [0]
        nodes = self.speculator.tree_nodes if self.speculator is not None else (lambda k: k)
        count += static.precapture([1 + nodes(k) for k in ks])
        if self.fixed_acceptance:
            count += self._precapture_acceptance()
        speculator_graphs = getattr(self.speculator, "precapture_graphs", None)
        if speculator_graphs is not None:  # a drafter's or a head's own fixed-shape forwards
            count += speculator_graphs(ks)
        return count

    def warm_up_eager(self, force: bool = False) -> int:
        """Run the steps that stay eager (prefills, mixed steps) once at start-up, on a GPU, so that the compiled
        pieces and Triton kernels they use are built before the first request (engine/eager_warm_up.py); on a
        CPU nothing is compiled on first use, so only when forced (the tests).  Returns the steps run."""
        return warm_up_eager(self) if force or (self.config.warm_up and self.device.type == "cuda") else 0

    def _precapture_acceptance(self) -> int:
        """The fixed-shape acceptance's graphs for every (batch, q) the static runner precaptured: greedy, and sampled
        without top-k / top-p cuts with the speculator's q rows (Speculator.q_width; none at q = 1).  A speculator
        that drafts trees verifies them elsewhere (verify_tree): its q > 1 steps are left out."""
        static, spec = self.runner.static, self.speculator
        width, mapped = spec.q_width() if spec is not None else (0, False)
        trees = spec is not None and spec.tree_nodes(2) > 2
        steps = [step for step in static.precaptured_steps() if step[1] == 1 or not trees]
        return static.acceptance.precapture(steps, width, mapped)

    def _on_finished(self, req: Request) -> None:
        if self.speculation is not None:
            self.speculation.release(req)

    def _commit(self, seq: ScheduledSeq, rows: torch.Tensor, verdict: Verdict, ahead: int = 0) -> bool:
        """Record what the step computed and produced (rows: its logits; verdict: the tokens emitted and the
        rows that predicted them); returns True when the request finished.  ahead: tokens a step already
        launched behind this one feeds for the request (overlapped steps: 1), whose blocks are kept."""
        req = seq.request
        req.num_computed += seq.num_new - seq.num_drafts
        if not seq.samples:
            self._register_full_blocks(req)
            return False
        tokens = verdict.tokens
        accepted = len(tokens) - 1
        req.num_computed += accepted  # keys/values of accepted drafts are valid; rejected ones are dropped
        req.num_steps += 1
        req.num_drafted += seq.num_drafts
        req.num_accepted += accepted
        if accepted > len(req.accepted_per_position):
            req.accepted_per_position += [0] * (accepted - len(req.accepted_per_position))
        for j in range(accepted):
            req.accepted_per_position[j] += 1
        self._count_speculation(seq.num_drafts, accepted)
        if self.speculation is not None:
            self.speculation.verified(req, seq.draft_depth, accepted)
        if req.params.logprobs is not None:
            self._record_logprobs(req, rows[upload(verdict.rows, rows.device)], tokens)
        for token in tokens:
            req.output_token_ids.append(token)
            self.stats["tokens_emitted"] += 1
            reason = self._finish_reason(req, token)
            if reason:
                del req.logprobs[len(req.output_token_ids):]
                req.finish(reason)
                break
        req.clear_drafts()
        self._trim_blocks(req, ahead)
        self._register_full_blocks(req)
        if req.finished:
            self.scheduler.finish(req)
            self._on_finished(req)
            if self.admission is not None:
                self.admission.observe_finished(req.num_steps)
        return req.finished

    def _count_speculation(self, num_drafts: int, accepted: int) -> None:
        self.stats["verify_steps"] += 1
        if num_drafts:
            self.stats["drafts"] += 1
            self.stats["draft_tokens"] += num_drafts
            self.stats["accepted_tokens"] += accepted
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    def metrics(self) -> dict:
        """A snapshot of engine-wide counters and gauges (for /metrics and reports)."""
        used = self.blocks.num_blocks - self.blocks.num_free
        return {
            **self.stats,
            "accepted_per_position": list(self.accepted_per_position),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_usage": used / self.blocks.num_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.blocks.prefix_hits,
            "prefix_cache_query_tokens": self.blocks.prefix_queries,
            "attention_backend": self.attention_backend,
            "speculator": None,
            "draft_k": 0,
            "eager_forwards": self.runner.eager_forwards,
            "admission_batch": self.scheduler.admission_batch,
            **(self.speculation.metrics() if self.speculation is not None else {}),
        }

    def _finish_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_ids:
            return "stop"
        if req.params.stop and self._hit_stop_string(req):
            return "stop"
        if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self, req: Request) -> bool:
        """Whether the output now contains a stop string; on a hit req.text is the output cut before it.

        Checked after every token, so a new hit ends in the newest tokens: only a tail window is decoded
        (a character takes at most 4 byte-level tokens), and the whole output only once, on a hit.
        """
        window = 4 * max(len(s) for s in req.params.stop) + 8
        tail = self.detokenize(req.output_token_ids[-window:])
        if not any(s in tail for s in req.params.stop):
            return False
        text = self.detokenize(req.output_token_ids)
        cut = min((i for i in (text.find(s) for s in req.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        req.text = text[:cut]
        return True

    def _record_logprobs(self, req: Request, rows: torch.Tensor, tokens: list[int]) -> None:
        ids = upload(tokens, rows.device)
        chosen, top_ids, top_vals = top_logprobs(rows, ids, req.params.logprobs)
        for t, lp, ti, tv in zip(tokens, chosen.tolist(), top_ids.tolist(), top_vals.tolist()):
            req.logprobs.append(TokenLogprobs(t, lp, list(zip(ti, tv))))

    def _trim_blocks(self, req: Request, ahead: int = 0) -> None:
        """Release blocks that only held rejected drafts (keeping those of `ahead` tokens past the committed ones,
        which a step launched behind this one writes)."""
        keep = self.blocks.blocks_for(req.num_computed + ahead)
        if len(req.block_ids) > keep:
            self.blocks.release(req.block_ids[keep:])
            del req.block_ids[keep:]

    def _register_full_blocks(self, req: Request) -> None:
        """Hash every newly full block of committed tokens so later prompts can reuse it."""
        self.blocks.register_full_blocks(req.all_token_ids, req.block_ids, req.block_hashes, req.num_computed)

    # ------------------------------------------------------------------ scoring

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probability of every token after the first, given its prefix."""
        if len(token_ids) < 2:
            return []
        logp = self.all_logits(token_ids[:-1]).float().log_softmax(-1)  # [n-1, V]
        targets = torch.tensor(token_ids[1:], device=self.device)
        return logp.gather(1, targets[:, None]).squeeze(1).tolist()

    @torch.inference_mode()
    def all_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, V] at every position, by chunked prefill (chunks of max_num_batched_tokens).

        Runs outside the scheduler on its own blocks: call it on an idle engine.
        """
        self.limits.check_prompt(token_ids[:-1] or token_ids)
        req = Request(list(token_ids), SamplingParams(max_tokens=1), self.device)
        req.block_ids = self.blocks.allocate(self.blocks.blocks_for(len(token_ids))) or []
        if not req.block_ids:
            raise InvalidRequestError(f"sequence of {len(token_ids)} tokens does not fit the free KV cache")
        chunks = []
        try:
            while req.num_computed < len(token_ids):  # (a hybrid model's state slot is taken at the first chunk)
                n = min(len(token_ids) - req.num_computed, self.config.max_num_batched_tokens)
                chunks.append(self.runner.forward_all_rows(ScheduledSeq(req, n, 0, samples=False)))  # [n, V]
                req.num_computed += n
        finally:
            self.blocks.release(req.block_ids)
            if self.states is not None:
                self.states.release(req)
        return torch.cat(chunks)
