"""SpecConfig: which speculator, with which drafter and how many draft tokens; and its CLI flags."""

from __future__ import annotations

import argparse
import dataclasses

from specdec.errors import ConfigError

METHODS = ("draft", "eagle3", "mtp", "ngram", "remote")
MAX_DRAFT_TOKENS = 32
MAX_TREE_WIDTH = 8


@dataclasses.dataclass
class SpecConfig:
    method: str  # "draft" | "eagle3" | "mtp" | "ngram" | "remote"
    model: str | None = None  # draft: the drafter's model directory (or short name, e.g. ref-draft); eagle3:
    #                           the head's directory in the published EAGLE-3 layout (docs/EAGLE3.md); mtp: none
    #                           (Qwen3.5's head comes from the target's own checkpoint)
    num_draft_tokens: int = 4  # k, the most drafts per request per step
    url: str | None = None  # remote: base URL of a /draft server
    adaptive: bool = True  # choose k per step from the cost model (0 = off when it does not pay)
    ngram_max: int = 4  # ngram: longest suffix to match
    ngram_min: int = 1  # ngram: shortest suffix to match
    draft_kv_cache_tokens: int | None = None  # draft: drafter KV size (default: the target's)
    timeout_s: float = 2.0  # remote: per-request timeout before falling back to no drafts
    draft_twin: str | None = None  # draft: run the drafter as a scaled twin of this shape (specdec.models.twin)
    tree_width: int = 1  # eagle3: candidates per depth, a draft tree of k * tree_width nodes (1: a chain)
    # mtp: draft over a reduced vocabulary (speculate/draft_vocab.py), at most one of: a JSON file listing the
    # target token ids, or the N most frequent ids of the target's tokenizer over the corpus text; None: all
    draft_token_map: str | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown speculator {self.method!r}: use one of {', '.join(METHODS)}")
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                              f"got {self.num_draft_tokens!r}")
        if self.method == "draft" and not self.model:
            raise ConfigError("the draft speculator needs a drafter model: SpecConfig(method='draft', model=DIR)"
                              " / --draft-model DIR")
        if self.method == "eagle3" and not self.model:
            raise ConfigError("the eagle3 speculator needs a draft head: SpecConfig(method='eagle3', model=DIR)"
                              " / --draft-model DIR (a directory in the published EAGLE-3 layout)")
        if self.method == "mtp" and self.model:
            raise ConfigError("the mtp speculator reads Qwen3.5's multi-token-prediction head from the target's own "
                              "checkpoint (its mtp.* weights): leave out model / --draft-model")
        if not isinstance(self.tree_width, int) or not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ConfigError(f"tree_width must be an integer in [1, {MAX_TREE_WIDTH}], got {self.tree_width!r}")
        if self.tree_width > 1 and self.method != "eagle3":
            raise ConfigError(f"draft trees (tree_width {self.tree_width}) are drafted by the eagle3 speculator only, "
                              f"not {self.method!r}: leave tree_width at 1")
        if self.num_draft_tokens * self.tree_width > MAX_DRAFT_TOKENS:
            raise ConfigError(f"a tree of num_draft_tokens x tree_width = {self.num_draft_tokens} x {self.tree_width} "
                              f"nodes is more than the {MAX_DRAFT_TOKENS} drafts a step verifies: lower either")
        self._validate_draft_vocab()
        if self.method == "remote" and not self.url:
            raise ConfigError("the remote speculator needs the /draft server's URL: --draft-url URL")
        if not self.timeout_s > 0:
            raise ConfigError(f"the remote drafter's timeout must be positive, got {self.timeout_s}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")

    def _validate_draft_vocab(self) -> None:
        """A reduced draft vocabulary is the mtp head's option: an EAGLE-3 head carries its own (d2t), and the
        other drafters' q spans the target's vocabulary."""
        chosen = [name for name, value in (("draft_token_map / --draft-token-map", self.draft_token_map),
                                           ("draft_vocab_size / --draft-vocab-size", self.draft_vocab_size))
                  if value is not None]
        if chosen and self.method != "mtp":
            raise ConfigError(f"{chosen[0]} sets the mtp speculator's draft vocabulary, not {self.method!r}'s (an "
                              "EAGLE-3 head carries its own, d2t): leave it out")
        if len(chosen) > 1:
            raise ConfigError("draft_token_map / --draft-token-map and draft_vocab_size / --draft-vocab-size both "
                              "choose the draft vocabulary: pass one")
        size = self.draft_vocab_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"draft_vocab_size / --draft-vocab-size must be a positive integer, got {size!r}")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculation")
    group.add_argument("--speculator", choices=METHODS, default=None, help="speculative decoding method (default: off)")
    group.add_argument("--draft-model", default=None,
                       help="drafter model directory or short name (draft); EAGLE-3 head directory (eagle3)")
    group.add_argument("--num-draft-tokens", type=int, default=4, help="k: most drafts per request per step")
    group.add_argument("--draft-url", default=None, help="base URL of a /draft server (remote)")
    group.add_argument("--fixed-k", action="store_true", help="always draft k tokens (no cost-model choice of k)")
    group.add_argument("--draft-timeout", type=float, default=2.0,
                       help="remote: seconds to wait for a /draft answer before going without drafts")
    group.add_argument("--draft-twin", default=None, help="run the drafter as a scaled twin: qwen3-0.6b, ...")
    group.add_argument("--tree-width", type=int, default=1,
                       help="eagle3: candidates per draft depth, verified as a tree of k x width tokens (default 1: "
                            "a chain)")
    group.add_argument("--draft-token-map", default=None, metavar="FILE",
                       help="mtp: draft over these target token ids only, a JSON list of distinct ids, e.g. "
                            "[0, 13, 198] (default: the whole vocabulary)")
    group.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                       help="mtp: draft over the N most frequent token ids of the target's tokenizer over the "
                            "bundled corpus's text (cached; default: the whole vocabulary)")


def spec_config_from_args(args: argparse.Namespace) -> SpecConfig | None:
    if args.speculator is None:
        return None
    return SpecConfig(method=args.speculator, model=args.draft_model, num_draft_tokens=args.num_draft_tokens,
                      url=args.draft_url, adaptive=not args.fixed_k, draft_twin=args.draft_twin,
                      timeout_s=args.draft_timeout, tree_width=args.tree_width,
                      draft_token_map=args.draft_token_map, draft_vocab_size=args.draft_vocab_size)
