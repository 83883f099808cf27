"""Build a speculator and its k controller for an LLM from a SpecConfig; refuse mismatched drafters."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from specdec.engine.kv_cache import BlockManager
from specdec.engine.runner import ModelRunner
from specdec.engine.scheduler import ScheduledSeq
from specdec.engine.request import Request
from specdec.errors import ConfigError, ModelLoadError
from specdec.models.config import ModelConfig
from specdec.models.loader import load_model
from specdec.sampling import SamplingParams
from specdec.speculate.base import Speculator
from specdec.speculate.config import SpecConfig
from specdec.speculate.controller import KController
from specdec.speculate.step_costs import StepCostTable, measure_forward_cost
from specdec.speculate.ngram import NgramSpeculator
from specdec.speculate.speculation import Speculation


CALIBRATION_MAX_TOKENS = 512  # cost-table points up to this many tokens; beyond, cost grows in proportion


def build_speculator(config: SpecConfig, llm) -> tuple[Speculator, KController]:
    if config.method == "ngram":
        spec: Speculator = NgramSpeculator(config.ngram_max, config.ngram_min)
    elif config.method == "draft":
        spec = _draft_speculator(config, llm)
    elif config.method == "eagle3":
        spec = _eagle3_speculator(config, llm)
    elif config.method == "mtp":
        spec = _mtp_speculator(config, llm)
    else:
        from specdec.speculate.remote import RemoteSpeculator

        spec = RemoteSpeculator(config.url, timeout_s=config.timeout_s, vocab_size=llm.model.config.vocab_size)
    # adaptive k needs step costs: measured by calibrate() once the engine's CUDA graphs are captured
    return spec, KController(config.num_draft_tokens, None, None, adaptive=False)


def speculation_for(engine, speculator: Speculator, controller) -> Speculation:
    """The Speculation the engine calls each step (Engine.set_speculation), sized by the engine's longest request
    and step token budget."""
    return Speculation(speculator, controller, engine.max_model_len, engine.config.max_num_batched_tokens)


def calibrate(controller: KController, engine, spec: Speculator) -> None:
    """Measure the target's (and a drafter's) step cost through the runners served steps take (CUDA graphs
    after start-up capture: eager forwards cost several times more at small batches, which made drafting look
    far cheaper or dearer than it is) and let the controller choose k from them.  The tables are read from
    the calibration cache when it holds this setup's (speculate/calibration_cache.py), else measured and
    written there."""
    from specdec.speculate import calibration_cache as cache

    key = cache.calibration_key(engine, spec, controller.candidates()) if cache.cache_enabled() else None
    tables = cache.load_tables(key) if key is not None else None
    if tables is None:
        tables = measure_tables(controller, engine, spec)
        if key is not None:
            cache.save_tables(key, *tables)
    controller.calibrate(*tables)


def measure_tables(controller: KController, engine, spec: Speculator):
    """(target step table, drafter step table or None, verify tables {k: table}), measured now."""
    budget = min(engine.config.max_num_batched_tokens, CALIBRATION_MAX_TOKENS)
    target = measure_step_cost(engine.runner, engine.blocks, engine.device, budget)
    verify = measure_verify_cost(engine.runner, engine.blocks, engine.device, engine.config.max_num_seqs,
                                 controller.candidates(), engine.config.max_num_batched_tokens, spec.tree_nodes)
    draft = None
    if spec.has_draft_model:
        draft = measure_step_cost(spec.runner, spec.blocks, spec.device,
                                  min(engine.config.max_num_seqs, CALIBRATION_MAX_TOKENS))
    return target, draft, verify


def _draft_speculator(config: SpecConfig, llm):
    from specdec.assets import resolve_model
    from specdec.speculate.draft_model import DraftModelSpeculator

    try:
        draft_dir = resolve_model(config.model)
    except FileNotFoundError as exc:
        raise ConfigError(f"drafter: {exc}") from exc
    check_same_tokenizer(llm.model_dir, draft_dir)
    drafter = load_model(draft_dir, llm.device, llm.model.lm_head.weight.dtype)
    if config.draft_twin:
        from specdec.models.twin import make_twin

        drafter = make_twin(drafter, config.draft_twin, noise=1e-6 if llm.device.type == "cuda" else 0.0)
    if drafter.config.vocab_size != llm.model.config.vocab_size:
        raise ConfigError(f"drafter {draft_dir} has a vocabulary of {drafter.config.vocab_size} tokens, the target "
                          f"{llm.model.config.vocab_size}: a drafter must share the target's tokenizer and vocabulary")
    tokens = config.draft_kv_cache_tokens or llm.engine.capacity_tokens
    if llm.device.type == "cuda" and config.draft_kv_cache_tokens is None:
        from specdec.engine.kv_cache import KVCache

        free, _ = torch.cuda.mem_get_info(llm.device)
        fits = int(free * 0.8) // KVCache.bytes_per_token(drafter.config, drafter.lm_head.weight.dtype)
        tokens = min(tokens, fits)
        if llm.tensor_parallel is not None:  # equal drafter caches on every rank
            from specdec.parallel.tensor_parallel import min_across_ranks

            tokens = min_across_ranks(tokens)
    static = llm.engine.runner.static is not None
    return DraftModelSpeculator(drafter, llm.model.config.vocab_size, tokens, llm.engine.config.block_size,
                                static_shapes=static, max_batch=min(llm.engine.config.max_num_seqs,
                                                                    llm.engine.config.max_graph_batch),
                                max_context=llm.engine.graph_context_bound,
                                piecewise=llm.engine.piecewise_graphs,
                                cuda_graphs=llm.engine.config.cuda_graphs)


def shared_kv_bytes_per_token(config: SpecConfig, dtype: torch.dtype, target: ModelConfig | None = None) -> int:
    """KV bytes per token of the speculator's cache on the target's block tables, which the target's KV budget
    must leave room for: an EAGLE-3 head's one-layer cache (of its twin's shape under draft_twin), an MTP head's
    one layer of the target's attention shape; 0 for the others (their caches, if any, are their own) and when
    the head's config cannot be read (loading says why)."""
    from specdec.engine.kv_cache import KVCache

    if config.method == "mtp" and target is not None:
        from specdec.models.mtp import MTPConfig

        return KVCache.bytes_per_token(MTPConfig.for_target(target).layer, dtype)
    if config.method != "eagle3":
        return 0
    from specdec.assets import resolve_model
    from specdec.models.eagle3 import Eagle3Config

    try:
        raw = json.loads((resolve_model(config.model) / "config.json").read_text())
        layer = Eagle3Config.from_dict(raw).layer
    except (FileNotFoundError, ValueError, ModelLoadError, ConfigError):
        return 0
    if config.draft_twin:
        from specdec.models.twin import SHAPES

        twin = config.draft_twin  # a shape's name or the shape itself
        shape = twin if isinstance(twin, dict) else SHAPES.get(twin, {})
        layer = dataclasses.replace(layer, head_dim=shape.get("head_dim", layer.head_dim),
                                    num_key_value_heads=shape.get("num_key_value_heads", layer.num_key_value_heads))
    return KVCache.bytes_per_token(layer, dtype)


def _eagle3_speculator(config: SpecConfig, llm):
    from specdec.assets import resolve_model
    from specdec.models.eagle3 import feature_layers, load_eagle3_head
    from specdec.speculate.eagle3 import Eagle3Speculator

    try:
        head_dir = resolve_model(config.model)
    except FileNotFoundError as exc:
        raise ConfigError(f"draft head: {exc}") from exc
    dtype = llm.model.lm_head.weight.dtype
    if config.draft_twin:  # the head drafts for the small target: load it so, then pad it to the twin's shapes
        from specdec.models.twin_head import make_head_twin

        small = load_model(llm.model_dir, llm.device, dtype)
        if small.config == llm.model.config:
            raise ConfigError("draft_twin / --draft-twin with an EAGLE-3 head needs the target run as a twin "
                              "(twin= / --twin): the head twin reads the twin target's features")
        head = load_eagle3_head(head_dir, small, llm.device, dtype)
        head = make_head_twin(head, llm.model, config.draft_twin, noise=1e-6 if llm.device.type == "cuda" else 0.0,
                              small_target=small)
        del small
    else:
        head = load_eagle3_head(head_dir, llm.model, llm.device, dtype)
    layers = feature_layers(head.config, llm.model.config.num_hidden_layers)
    return Eagle3Speculator(head, llm.engine.blocks, llm.model.config.vocab_size, layers,
                            tree_width=config.tree_width, **_head_graph_options(llm.engine))


def _head_graph_options(engine) -> dict:
    """A head's fixed-shape forwards (CUDA graphs on a GPU) follow the target's."""
    return dict(static_shapes=engine.runner.static is not None,
                max_batch=min(engine.config.max_num_seqs, engine.config.max_graph_batch),
                max_context=engine.graph_context_bound, cuda_graphs=engine.config.cuda_graphs)


def _mtp_speculator(config: SpecConfig, llm):
    """The target checkpoint's own MTP head (refused, saying why, when it has none); on a twin target, its twin;
    over the draft vocabulary config chooses, if any (speculate/draft_vocab.py)."""
    from specdec.models.mtp import load_mtp_head, read_required_mtp_head
    from specdec.speculate.draft_vocab import draft_token_ids
    from specdec.speculate.mtp import MTPSpeculator

    dtype = llm.model.lm_head.weight.dtype
    if getattr(llm, "twin", None) is not None:
        from specdec.models.twin_qwen3_5 import make_mtp_twin

        small = read_required_mtp_head(llm.model_dir, ModelConfig.from_dir(llm.model_dir), llm.device, dtype)
        head = make_mtp_twin(small, llm.model)
    else:
        head = load_mtp_head(llm.model_dir, llm.model, llm.device, dtype)
    # a twin's vocabulary is its padded one: ids past the model's own are padding, masked (MTPHead.restrict_vocab)
    ids = draft_token_ids(config.draft_token_map, config.draft_vocab_size, llm.model_dir, llm.model.config.vocab_size)
    if ids is not None:
        head.restrict_vocab(torch.tensor(ids))
    return MTPSpeculator(head, llm.engine.blocks, **_head_graph_options(llm.engine))


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Refuse a drafter whose tokenizer.json vocabulary differs from the target's."""
    vocabs = []
    for d in (target_dir, draft_dir):
        path = Path(d) / "tokenizer.json"
        vocabs.append(json.loads(path.read_text()).get("model", {}).get("vocab") if path.is_file() else None)
    if vocabs[0] is not None and vocabs[1] is not None and vocabs[0] != vocabs[1]:
        raise ConfigError(f"drafter {draft_dir} has a different tokenizer from the target {target_dir}: "
                          "speculation needs both to share one tokenizer")


@torch.inference_mode()
def measure_step_cost(runner: ModelRunner, blocks: BlockManager, device: torch.device,
                      max_tokens: int) -> StepCostTable:
    """Step time against tokens fed, on scratch sequences with short contexts: n sequences of one new token
    (a decode step's shape, a CUDA graph after start-up capture) up to the runner's fixed-shape batch limit,
    beyond it sequences of 16 tokens (an eager forward, as such steps are served)."""
    graph_batch = runner.static.max_batch if runner.static is not None else 0

    def layout(n: int) -> tuple[int, int]:  # (sequences, tokens each)
        per_seq = 1 if n <= graph_batch else min(16, n)
        return math.ceil(n / per_seq), per_seq

    sizes = [n for n in _powers_of_two(max_tokens) if _fits(runner, blocks, *layout(n))] or [1]
    return measure_forward_cost(lambda n: _scratch_forward(runner, blocks, *layout(n)), sizes, device)


@torch.inference_mode()
def measure_verify_cost(runner: ModelRunner, blocks: BlockManager, device: torch.device, max_batch: int,
                        ks: list[int], max_tokens: int, nodes=lambda k: k) -> dict[int, StepCostTable]:
    """k -> step time against the batch B of a verify step (B sequences of nodes(k) + 1 new tokens, nodes(k) the
    drafts a speculator feeds at k: a decode step for k = 0), B = 1, 2, 4, ... up to max_batch and the token
    budget, through the runner as served steps go
    (CUDA graphs after start-up capture).  The tokens-only table priced B (k + 1) verify tokens as B (k + 1)
    decode rows, and past the graph batch as an eager forward, while a verify step of that size is one
    captured graph: with 16 requests, every k > 0 was priced as an eager step."""
    tables = {}
    for k in ks:
        n = nodes(k)
        sizes = [b for b in _powers_of_two(max_batch) if b * (n + 1) <= max_tokens and _fits(runner, blocks, b, n + 1)]
        if sizes:
            tables[k] = measure_forward_cost(lambda b, n=n: _scratch_forward(runner, blocks, b, n + 1, drafts=n),
                                             sizes, device)
    return tables


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def _fits(runner: ModelRunner, blocks: BlockManager, count: int, per_seq: int) -> bool:
    """Whether `count` scratch sequences of `per_seq` tokens get their blocks, and on a hybrid model each its
    recurrent-state slot (there are max_num_seqs of them)."""
    states = getattr(runner, "states", None)
    slots_fit = states is None or count <= len(states.free)
    return slots_fit and count * blocks.blocks_for(per_seq) <= blocks.num_free


def _scratch_forward(runner: ModelRunner, blocks: BlockManager, count: int, per_seq: int, drafts: int = 0) -> None:
    """One forward of `count` scratch sequences of `per_seq` new tokens each, the last `drafts` of them drafts
    (a verify step's shape: 1 + drafts rows scored), their blocks released after."""
    held = []
    states = getattr(runner, "states", None)  # a hybrid model's recurrent-state slots (a head's runner has none)
    try:
        for _ in range(count):
            req = Request([1] * (per_seq - drafts), SamplingParams(max_tokens=1), runner.device)
            req.draft_token_ids = [1] * drafts
            req.block_ids = blocks.allocate(blocks.blocks_for(per_seq)) or []
            held.append(req)
        runner.forward([ScheduledSeq(req, per_seq, drafts, samples=True) for req in held])
    finally:
        for req in held:
            blocks.release(req.block_ids)
            if states is not None:  # the slot the forward took
                states.release(req)
