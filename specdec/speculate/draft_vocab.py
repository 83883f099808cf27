"""Which target ids the MTP head drafts over: a reduced draft vocabulary (FR-Spec; SGLang's speculative token map).

The head's LM head is the target's, V rows; drafting over V_d << V of them costs a V_d-row GEMV a draft token
instead (models/mtp.py MTPHead.restrict_vocab).  Verification stays exact: q is 0 outside the draft vocabulary
and rejection sampling takes the residual there (verify.py).  What a smaller vocabulary costs is acceptance:
a target token outside it is never drafted.  Two ways to choose the ids (SpecConfig):

* draft_token_map / --draft-token-map FILE: a JSON list of distinct target token ids, any order, e.g.
  ``[0, 13, 198, 220]`` (ids you counted on your own traffic, say).
* draft_vocab_size / --draft-vocab-size N: the N ids the target's own tokenizer produces most often over the
  text its reference models were trained on.  No corpus ships with the package: the reference models
  (specdec/assets/DATA_MANIFEST.md) were trained on the train split of the installed Python packages' sources
  (specdec/data/corpus.py), so this reads that split the same way (same filters, same split by whole package:
  the held-out packages are never read), a bounded CORPUS_CHARS of it spread over the packages, and counts.
  The counts are cached under $SPECDEC_CACHE_DIR/draft-vocab (default ~/.cache/specdec), keyed by the model
  directory's tokenizer.json, so later starts read them.  Python source is not every model's traffic: for a
  general chat model a map counted on its own replies will be accepted more often.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from specdec.errors import ConfigError
from specdec.speculate.calibration_cache import cache_root, write_json_atomically

TOKEN_MAP_FORMAT = "a JSON list of distinct target token ids, e.g. [0, 13, 198]"
CORPUS_CHARS = 4_000_000  # characters of corpus text counted: a few seconds of tokenizing
CACHE_VERSION = 1  # bump when what is counted changes


def draft_token_ids(token_map: str | None, size: int | None, model_dir: Path, vocab: int) -> list[int] | None:
    """The sorted target ids of the draft vocabulary a SpecConfig's draft_token_map / draft_vocab_size chooses,
    within a target vocabulary of `vocab` ids; None: the whole vocabulary."""
    if token_map is not None:
        return read_token_map(token_map, vocab)
    if size is not None:
        if size > vocab:
            raise ConfigError(f"draft_vocab_size / --draft-vocab-size {size} is larger than the target's vocabulary "
                              f"of {vocab} tokens")
        return most_frequent(corpus_token_counts(model_dir, vocab), size)
    return None


# ---------------------------------------------------------------------------------------------- a token map file


def read_token_map(path: str | Path, vocab: int) -> list[int]:
    """The ids a --draft-token-map file lists, sorted; refused, naming the file and what is wrong."""
    where = f"draft token map {path}"
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not JSON ({exc}): write {TOKEN_MAP_FORMAT}") from exc
    return check_token_ids(raw, vocab, where)


def check_token_ids(raw, vocab: int, where: str) -> list[int]:
    """raw (parsed JSON) as sorted distinct token ids in [0, vocab), or a ConfigError starting with `where`."""
    if not isinstance(raw, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in raw):
        raise ConfigError(f"{where}: not a list of integer token ids: write {TOKEN_MAP_FORMAT}")
    if not raw:
        raise ConfigError(f"{where}: the list is empty: it needs at least one token id")
    if len(raw) > vocab:
        raise ConfigError(f"{where}: {len(raw)} ids, more than the target's vocabulary of {vocab} tokens")
    outside = [t for t in raw if not 0 <= t < vocab]
    if outside:
        raise ConfigError(f"{where}: ids out of range [0, {vocab}) of the target's vocabulary: {outside[:5]}")
    repeated = sorted(t for t, n in Counter(raw).items() if n > 1)
    if repeated:
        raise ConfigError(f"{where}: ids listed more than once: {repeated[:5]}")
    return sorted(raw)


# ---------------------------------------------------------------------------------------------- the most frequent


def most_frequent(counts: np.ndarray, size: int) -> list[int]:
    """The `size` ids with the largest counts [V], sorted; ties go to the lower id, so an id never counted comes
    after every counted one."""
    order = np.argsort(-counts, kind="stable")  # by count, descending; equal counts keep id order
    return sorted(order[:size].tolist())


def token_counts(texts: Iterable[str], tokenizer, vocab: int) -> np.ndarray:
    """[vocab] how often the tokenizer produces each id over the texts (no special tokens added; ids at or past
    vocab, if a tokenizer has them, are not counted)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for text in texts:
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        counts += np.bincount(ids[ids < vocab], minlength=vocab)
    return counts


def corpus_token_counts(model_dir: Path, vocab: int) -> np.ndarray:
    """token_counts over corpus_texts() with the model directory's tokenizer, read from or written to the cache."""
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"draft_vocab_size / --draft-vocab-size counts tokens with the target's tokenizer, and "
                          f"{model_dir} has no tokenizer.json: pass draft_token_map / --draft-token-map FILE instead")
    key = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()[:16]
    path = cache_root() / "draft-vocab" / f"{Path(model_dir).name}-{key}-v{vocab}-c{CORPUS_CHARS}-{CACHE_VERSION}.json"
    counts = _read_counts(path, vocab)
    if counts is None:
        from specdec.tokenizer import Tokenizer

        counts = token_counts(corpus_texts(CORPUS_CHARS), Tokenizer(model_dir), vocab)
        write_json_atomically(path, {str(t): int(counts[t]) for t in np.flatnonzero(counts)})
    return counts


def corpus_texts(max_chars: int, seed: int = 0, heldout_fraction: float = 0.03) -> Iterator[str]:
    """Up to about max_chars of the corpus's train text: the installed packages' *.py files as
    specdec.data.corpus keeps them, the held-out packages left out (its split, seed and fraction), each train
    package giving at most an equal share (so no one large package is the sample), files in path order."""
    from specdec.data.corpus import list_packages, read_source, split_packages

    packages = list_packages()
    heldout = split_packages(packages, heldout_fraction, seed)
    train = sorted((p for p in packages if p.name not in heldout), key=lambda p: p.name)
    share = max_chars // max(len(train), 1)
    for package in train:
        taken = 0
        for path, rel, size in sorted(package.files, key=lambda f: f[1]):
            if taken >= share:
                break
            text, _ = read_source(path, rel, size)
            if text is not None:
                text = text[:share - taken]
                taken += len(text)
                yield text


def _read_counts(path: Path, vocab: int) -> np.ndarray | None:
    """Cached counts ({"id": count} of the ids counted), or None when absent or unreadable (then recounted)."""
    try:
        raw = json.loads(path.read_text())
        counts = np.zeros(vocab, dtype=np.int64)
        counts[[int(t) for t in raw]] = [int(n) for n in raw.values()]
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return None
    return counts
