"""The Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.devices import parse_dtype, pick_device
from specdec.engine.engine import Engine, EngineConfig
from specdec.engine.request import Request, TokenLogprobs
from specdec.errors import ConfigError, InvalidRequestError, ModelLoadError
from specdec.models.loader import load_model
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer, eos_token_ids

# what the start-up did and how long it took, a line per phase (specdec serve and generate show them): on a GPU
# the start-up takes tens of seconds before the first request (graph capture, eager warm-up, calibration)
startup_log = logging.getLogger("specdec.startup")


@contextlib.contextmanager
def _phase(done: str):
    """Log `done`, formatted with the phase's seconds and with the counts the phase sets in the yielded dict;
    nothing where a count is 0 (a CPU captures no CUDA graphs and runs no eager warm-up)."""
    started, found = time.perf_counter(), {}
    yield found
    if all(found.values()):
        startup_log.info(done.format(seconds=time.perf_counter() - started, **found))


@dataclasses.dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None
    num_steps: int = 0  # target forward passes that produced tokens
    num_drafted: int = 0
    num_accepted: int = 0
    num_cached_prompt_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [j]: steps accepting draft j

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per target step that produced tokens (1.0 without speculation)."""
        return len(self.token_ids) / max(1, self.num_steps)


def encode_prompt(tokenizer: Tokenizer | None, prompt: str | Sequence[int]) -> list[int]:
    """A prompt's token ids: text through the tokenizer, token ids as they are."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model directory has no tokenizer.json: pass token ids")
        return tokenizer.encode(prompt)
    return list(prompt)


class LLM:
    def __init__(self, model: str | Path, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, kv_cache_tokens: int | None = None,
                 speculator=None, twin: str | dict | None = None, tensor_parallel_size: int = 1,
                 **engine_options):
        """tensor_parallel_size > 1: this process is one rank of a torchrun launch; every rank runs this
        same LLM on the same requests (SPMD, specdec.parallel.tensor_parallel) and rank 0 reports."""
        from specdec.assets import resolve_model

        try:
            self.model_dir = resolve_model(model)
        except FileNotFoundError as exc:
            raise ModelLoadError(str(exc)) from exc
        self.tensor_parallel = None
        if tensor_parallel_size != 1:
            from specdec.parallel.tensor_parallel import init_tensor_parallel, rank_device

            self.tensor_parallel = init_tensor_parallel(tensor_parallel_size, device)
            device = rank_device(device, self.tensor_parallel)
        self.device = pick_device(device)
        as_twin = f" as the {twin} twin" if isinstance(twin, str) else " as a twin" if twin is not None else ""
        with _phase(f"loaded {self.model_dir.name}{as_twin} on {self.device} in {{seconds:.1f}} s"):
            self.model = load_model(self.model_dir, self.device, parse_dtype(dtype))
            self.twin = twin  # the shape the model runs at, if a twin (an MTP speculator pads its head to it)
            if twin is not None:  # the same function at a large model's shapes (specdec.models.twin)
                from specdec.models.twin import make_twin

                self.model = make_twin(self.model, twin, noise=1e-6 if self.device.type == "cuda" else 0.0)
        if self.tensor_parallel is not None:
            from specdec.parallel.tensor_parallel import shard_model

            shard_model(self.model, self.tensor_parallel.rank, self.tensor_parallel.world_size)
        self.tokenizer = Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        self.eos_token_ids = eos_token_ids(self.model_dir, self.model.config.eos_token_ids)
        if speculator is not None:  # a speculator's cache on the target's block tables shares its KV budget
            from specdec.speculate.build import shared_kv_bytes_per_token

            engine_options.setdefault("shared_kv_bytes_per_token",
                                      shared_kv_bytes_per_token(speculator, self.model.lm_head.weight.dtype,
                                                                self.model.config))
        config = EngineConfig(kv_cache_tokens=kv_cache_tokens, **engine_options)
        if self.tensor_parallel is not None:  # equal KV caches, so every rank schedules alike
            from specdec.parallel.tensor_parallel import agreed_kv_cache_tokens

            config.kv_cache_tokens = agreed_kv_cache_tokens(self.model, config, self.device)
        self.engine = Engine(self.model, config, self.eos_token_ids,
                             detokenize=self.tokenizer.decode if self.tokenizer else None)
        startup_log.info(f"KV cache: {self.engine.capacity_tokens} tokens ({self.engine.blocks.num_blocks} blocks "
                         f"of {self.engine.blocks.block_size}, {self.engine.kv_cache.data.nbytes / 2**30:.2f} GiB); "
                         f"requests up to {self.engine.max_model_len} tokens")
        self.spec_config = speculator
        if speculator is not None:
            from specdec.speculate.build import build_speculator, speculation_for

            if self.tensor_parallel is not None and speculator.method in ("remote", "eagle3", "mtp"):
                raise ConfigError(f"the {speculator.method} speculator does not run under tensor parallelism yet: "
                                  "use draft or ngram")

            spec, controller = build_speculator(speculator, self)
            if self.tensor_parallel is not None:  # k from rank 0's timings on every rank
                from specdec.parallel.tensor_parallel import RankZeroController

                controller = RankZeroController(controller)
            self.engine.set_speculation(speculation_for(self.engine, spec, controller))
        if self.engine.config.precapture:  # what a served step would otherwise build on first use
            with _phase("captured {graphs} CUDA graphs in {seconds:.1f} s") as found:
                found["graphs"] = self.engine.precapture_graphs()
            with _phase("ran {steps} eager warm-up steps in {seconds:.1f} s") as found:
                found["steps"] = self.engine.warm_up_eager()
        if speculator is not None and speculator.adaptive:  # costs of the steps as served: after the capture
            from specdec.speculate.build import calibrate

            with _phase(f"measured the {speculator.method} speculator's step costs in {{seconds:.1f}} s"):
                calibrate(self.engine.controller, self.engine, self.engine.speculator)

    @property
    def is_main_rank(self) -> bool:
        """False on tensor-parallel ranks other than 0 (which compute but do not report)."""
        return self.tensor_parallel is None or self.tensor_parallel.rank == 0

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[Completion]:
        """One completion per prompt, in order.  A single prompt (str or token list) is one prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(param_list)} SamplingParams")
        encoded = [self.encode(p) for p in prompts]
        for ids, sp in zip(encoded, param_list):  # all or nothing: a bad prompt queues none
            self.engine.validate_request(ids, sp)
        requests = [self.engine.add_request(ids, sp) for ids, sp in zip(encoded, param_list)]
        self.run_until_done(requests, use_tqdm)
        return [self.completion(r) for r in requests]

    def run_until_done(self, requests: list[Request], use_tqdm: bool = False) -> None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm)
        while self.engine.has_work():
            bar.update(len(self.engine.step()))
        bar.close()

    def completion(self, req: Request) -> Completion:
        text = req.text
        if text is None:
            text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else ""
        return Completion(req.request_id, req.prompt_token_ids, list(req.output_token_ids), text,
                          req.finish_reason or "abort", req.logprobs if req.params.logprobs is not None else None,
                          req.num_steps, req.num_drafted, req.num_accepted, req.num_cached_prefix,
                          list(req.accepted_per_position))

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each token list, log p(token_i | tokens_<i) for i >= 1."""
        if self.engine.has_work():
            raise InvalidRequestError("score() needs an idle engine")
        return [self.engine.score(list(seq)) for seq in sequences]
