"""Training data shared by the drafter and head pipelines: prompts, the held-out check, the target's continuations.

- ``load_prompt_sources``: prompts from corpus directories (prefixes of *train* split documents) or JSON-lines files.
- ``check_overlap``: no training prompt may equal, or be a prefix of / extend, a held-out prompt.
- ``corpus_windows``: windows of the corpus sources' train-split documents themselves (a head's extra data: the
  target's distribution along them is made by its forward at training time, no generation).
- ``load_or_make_heldout``: the held-out conversations (the target's greedy continuations of held-out prompts).
- ``generate_continuations``: the target's own continuations (engine), cached as JSON-lines shards; a rerun
  generates only what is missing.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from specdec.errors import ConfigError
from specdec.train.log import TrainLog

SHARD_PREFIX = "shard-"
TOPK_SUFFIX = ".topk.npz"


class HeldoutOverlapError(ConfigError):
    """Training prompts overlap the held-out set (a ConfigError: the command line says `specdec: error: ...`)."""


def load_prompt_sources(sources: Sequence[str], target_dir: Path, n_prompts: int, min_prompt: int,
                        max_prompt: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(prompts ``{"id", "source", "prompt": [ids]}``, one manifest row per source)."""
    from specdec.data.corpus import load_manifest
    from specdec.drafting.heldout import read_jsonl
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer(target_dir)
    prompts: list[dict] = []
    rows = []
    for number, source in enumerate(sources):
        path = Path(source)
        tag = f"s{number}"
        if is_corpus(path):
            docs = train_documents(str(path), str(target_dir))
            picked = sample_prompts(docs, n_prompts, min_prompt, max_prompt, seed + number)
            items = [[int(t) for t in p] for p in picked]
            manifest = load_manifest(path)
            how = (f"prefixes ({min_prompt}-{max_prompt} tokens, seed {seed + number}) of documents of the train "
                   f"split of the corpus built by `{manifest.get('command', 'specdec train corpus')}`")
            kind, split = "corpus", "train (split by package; the corpus's held-out packages are not read)"
        elif path.is_file():
            items = [tok.encode(r["prompt"], add_special_tokens=False) if isinstance(r["prompt"], str)
                     else list(r["prompt"]) for r in read_jsonl(path)]
            how = "JSON-lines prompt file given on the command line, all of its prompts"
            kind, split = "jsonl", "train"
        else:
            raise ConfigError(_not_a_prompt_source(path))
        items = [p for p in items if p]
        prompts.extend({"id": f"{tag}-{i:06d}", "source": str(path), "prompt": p} for i, p in enumerate(items))
        rows.append({"source": str(path), "kind": kind, "split": split, "prompts": len(items), "how": how})
    return prompts, rows


def is_corpus(path: Path) -> bool:
    """A corpus directory built by specdec.data.corpus (else a prompt source is a JSON-lines file)."""
    return path.is_dir() and (path / "manifest.json").is_file()


@functools.lru_cache(maxsize=2)
def train_documents(corpus_dir: str, target_dir: str) -> tuple[np.ndarray, ...]:
    """The token ids of each train-split document of a corpus, tokenised once per run (prompts and windows
    are both cut from them)."""
    from specdec.data.bpe import load_tokenizer
    from specdec.train.lm import load_corpus_tokens

    return tuple(load_corpus_tokens(Path(corpus_dir), load_tokenizer(Path(target_dir)), "train", progress=False))


def corpus_windows(sources: Sequence[str], target_dir: Path, count: int, length: int, seed: int,
                   min_length: int = 32) -> tuple[list[dict], list[dict]]:
    """(at most ``count`` windows ``{"id", "source", "window": ids, "opening": bool}``, one manifest row per
    corpus source): the train-split documents of the corpus sources cut into consecutive pieces of ``length``
    tokens (a last piece shorter than ``min_length`` is left out), a seeded random choice of them when there
    are more.  JSON-lines prompt sources have no documents and give none.

    E.g. length 4: a document of 10 tokens gives [0:4], [4:8] and [8:10] (kept when min_length <= 2); the
    first is its opening, the only one a held-out prompt can begin (check_overlap is run on those)."""
    windows: list[dict] = []
    rows = []
    for number, source in enumerate(sources):
        path = Path(source)
        if not is_corpus(path):
            continue
        before = len(windows)
        for d, doc in enumerate(train_documents(str(path), str(target_dir))):
            for start in range(0, len(doc), length):
                piece = doc[start:start + length]
                if len(piece) >= min_length:
                    windows.append({"id": f"w{number}-{d:06d}-{start}", "source": str(path), "window": piece,
                                    "opening": start == 0})
        rows.append({"source": str(path), "windows": len(windows) - before})
    if len(windows) > count:
        picked = np.sort(np.random.default_rng(seed).choice(len(windows), size=count, replace=False))
        windows = [windows[i] for i in picked]
    for row in rows:
        row["picked"] = sum(w["source"] == row["source"] for w in windows)
        row["tokens"] = sum(len(w["window"]) for w in windows if w["source"] == row["source"])
    return windows, rows


def check_prompt_sources(sources: Sequence[str]) -> None:
    """Refuse, before any work is done, a prompt source that load_prompt_sources cannot read."""
    for source in sources:
        path = Path(source)
        if not (is_corpus(path) or path.is_file()):
            raise ConfigError(_not_a_prompt_source(path))


def _not_a_prompt_source(path: Path) -> str:
    what = ("a directory without manifest.json" if path.is_dir() else "no such file or directory")
    return (f"prompt source {path}: {what}; give a corpus directory (as `python -m specdec.data.corpus --out DIR` "
            f"writes) or a JSON-lines file of {{\"prompt\": ...}} rows")


def add_data_arguments(parser, n_prompts: int, n_prompts_help: str) -> None:
    """The flags every continuation-trained job takes: prompt sources, run directory, held-out set, generation."""
    parser.add_argument("--prompts", nargs="+", required=True,
                        help="prompt sources: corpus directories (train split) or JSON-lines files {id, prompt}")
    parser.add_argument("--out", required=True, help="run directory (rerun with the same one to resume)")
    parser.add_argument("--heldout", default=None, help="held-out set or prompts (default: the bundled prompts)")
    parser.add_argument("--heldout-limit", type=int, default=None)
    parser.add_argument("--n-prompts", type=int, default=n_prompts, help=n_prompts_help)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=384)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gen-batch-size", type=int, default=256)


def check_overlap(prompts: Sequence[dict], heldout: Sequence[dict], drop: bool = False) -> list[dict]:
    """The training prompts, checked against the held-out set: a prompt that equals a held-out prompt or is
    a prefix of it or extends it (the same document's opening) raises ``HeldoutOverlapError`` (with
    ``drop``: is left out instead)."""
    key_len = 16
    by_key: dict[tuple, list[list[int]]] = {}
    for row in heldout:
        by_key.setdefault(tuple(row["prompt"][:key_len]), []).append(list(row["prompt"]))
    clashes = []
    for p in prompts:
        ids = list(p["prompt"])
        for h in by_key.get(tuple(ids[:key_len]), []):
            n = min(len(ids), len(h))
            if ids[:n] == h[:n]:
                clashes.append(p["id"])
                break
    if clashes and drop:
        return [p for p in prompts if p["id"] not in set(clashes)]
    if clashes:
        raise HeldoutOverlapError(f"{len(clashes)} training prompt(s) overlap the held-out set (equal to, or a "
                                  f"prefix of / extending, a held-out prompt), e.g. {clashes[:5]}: the held-out "
                                  "set is never trained on; remove them from the prompt sources (or pass "
                                  "--drop-overlap)")
    return list(prompts)


def load_or_make_heldout(run, llm_factory, log: TrainLog) -> tuple[list[dict], dict]:
    """The held-out conversations and how they were obtained (made by the engine when only prompts are given).

    run: a pipeline's settings with ``heldout``, ``heldout_limit``, ``heldout_max_tokens`` and ``out``."""
    from specdec.assets import heldout_prompts_path
    from specdec.data.corpus import write_jsonl
    from specdec.drafting.heldout import load_heldout, make_heldout, read_jsonl
    from specdec.models.provenance import file_sha256

    source = Path(run.heldout) if run.heldout else heldout_prompts_path()
    rows = read_jsonl(source)[:run.heldout_limit]
    cached = Path(run.out) / "heldout.jsonl"
    if rows and all("continuation" in r for r in rows):
        conversations = load_heldout(source, run.heldout_limit)
        how = "given: a held-out set with the target's continuations (`specdec draft heldout`)"
    elif cached.is_file():
        conversations = load_heldout(cached)
        how = f"the target's greedy continuations (engine, max {run.heldout_max_tokens} tokens) of {source}, cached"
    else:
        conversations = make_heldout(llm_factory(), rows, run.heldout_max_tokens, use_tqdm=False)
        write_jsonl(cached, conversations)
        how = f"the target's greedy continuations (engine, max {run.heldout_max_tokens} tokens) of {source}"
        log("heldout", conversations=len(conversations), path=str(cached))
    info = {"source": str(source), "sha256": file_sha256(source), "conversations": len(conversations),
            "tokens": sum(len(c["continuation"]) for c in conversations), "how": how}
    return conversations, info


def read_shards(cache_dir: Path, topk: int = 0) -> list[dict]:
    """The cached records; with ``topk``, each record of a shard that has its ``.topk.npz`` with K = ``topk``
    also gets ``top_ids`` (int32) and ``top_logprobs`` (float16), arrays ``[len(continuation), K]``."""
    from specdec.drafting.heldout import read_jsonl

    records: list[dict] = []
    for shard in sorted(cache_dir.glob(f"{SHARD_PREFIX}*.jsonl")):
        rows = read_jsonl(shard)
        top = shard.with_suffix(TOPK_SUFFIX)
        if topk and top.is_file():
            with np.load(top) as arrays:
                if arrays["ids"].shape[1] == topk:
                    bounds = arrays["offsets"]
                    for n, row in enumerate(rows):
                        row["top_ids"] = arrays["ids"][bounds[n]:bounds[n + 1]]
                        row["top_logprobs"] = arrays["logprobs"][bounds[n]:bounds[n + 1]]
        records.extend(rows)
    return records


def write_topk(path: Path, completions) -> None:
    """The target's top-K of each continuation token of ``completions`` (engine ``Completion`` with
    ``logprobs``), concatenated: ``ids`` int32 and ``logprobs`` float16 ``[tokens, K]``, ``offsets`` per
    completion ``[n + 1]``; written atomically."""
    tops = [step.top for c in completions for step in c.logprobs]
    lengths = [len(c.logprobs) for c in completions]
    if lengths != [len(c.token_ids) for c in completions]:
        raise RuntimeError("the engine returned log-probs for other tokens than the continuation's")
    ids = np.array([[t for t, _ in top] for top in tops], dtype=np.int32).reshape(len(tops), -1)
    logprobs = np.array([[lp for _, lp in top] for top in tops], dtype=np.float32).reshape(len(tops), -1)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, ids=ids, logprobs=np.clip(logprobs, -6e4, 0).astype(np.float16),
             offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    os.replace(tmp, path)


def generate_continuations(llm_factory, prompts: Sequence[dict], cache_dir: Path, max_new_tokens: int,
                           batch_size: int, log: TrainLog | None = None, topk: int = 0,
                           temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """``{"id", "source", "prompt", "continuation"}`` for every prompt, generated by the engine in batches;
    each batch is written as one shard (atomically), and prompts already in a shard are not generated again.
    With ``topk``: the target's top-``topk`` log-probs too (``write_topk``, written before its shard).  With
    ``temperature`` > 0 the continuations are sampled, prompt i from seed ``seed + i`` (reproducible)."""
    from specdec.sampling import SamplingParams

    cache_dir.mkdir(parents=True, exist_ok=True)
    done = {r["id"]: r for r in read_shards(cache_dir, topk) if not topk or "top_ids" in r}
    todo = [p for p in prompts if p["id"] not in done]
    shards = sorted(cache_dir.glob(f"{SHARD_PREFIX}*.jsonl"))
    shard_number = int(shards[-1].stem[len(SHARD_PREFIX):]) + 1 if shards else 0  # after the last, never over one
    if log:
        log("continuations", cached=len(prompts) - len(todo), to_generate=len(todo))
    llm = llm_factory() if todo else None
    index = {p["id"]: i for i, p in enumerate(prompts)}
    for first in range(0, len(todo), batch_size):
        batch = todo[first:first + batch_size]
        params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, logprobs=topk or None,
                                 seed=seed + index[p["id"]] if temperature > 0 else None) for p in batch]
        outs = llm.generate([p["prompt"] for p in batch], params)
        records = [{**p, "continuation": list(o.token_ids)} for p, o in zip(batch, outs)]
        shard = cache_dir / f"{SHARD_PREFIX}{shard_number:05d}.jsonl"
        if topk:
            write_topk(shard.with_suffix(TOPK_SUFFIX), outs)
        tmp = shard.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, shard)
        shard_number += 1
        done.update((r["id"], r) for r in records)
        if log:
            log("continuations-shard", shard=shard.name, prompts=len(records),
                tokens=sum(len(r["continuation"]) for r in records))
    if topk and todo:
        done = {r["id"]: r for r in read_shards(cache_dir, topk)}
    return [done[p["id"]] for p in prompts]


def sample_prompts(docs: Sequence[np.ndarray], n: int, min_len: int = 32, max_len: int = 384,
                   seed: int = 0) -> list[np.ndarray]:
    """``n`` prompts: prefixes of random documents (with more than ``min_len`` tokens) of a random
    length in ``[min_len, min(max_len, len(doc) - 1)]`` tokens."""
    rng = np.random.default_rng(seed)
    eligible = [d for d in docs if len(d) > min_len + 1]
    if not eligible:
        raise ValueError(f"no document is longer than {min_len + 1} tokens")
    prompts = []
    for i in rng.integers(0, len(eligible), size=n):
        doc = eligible[i]
        prompts.append(doc[: int(rng.integers(min_len, min(max_len, len(doc) - 1) + 1))])
    return prompts
