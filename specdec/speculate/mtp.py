"""MTP speculation: Qwen3.5's own multi-token-prediction head (models/mtp.py) drafts a chain of k tokens.

The head is run exactly as an EAGLE-3 head is (speculate/eagle3.py, whose machinery this reuses): a one-layer
paged KV cache indexed by the target's block tables; after every target step `observe` feeds it each position
the step committed, the embedding of token p + 1 beside the target's feature at p; `propose` draws draft 1
from its last output and chains k - 1 one-token forwards, each feeding the draft just drawn beside the head's
own previous output.  What differs is only the head: its feature is the target's final-normed hidden state (one
layer id, num_hidden_layers), it drafts over the target's whole vocabulary unless SpecConfig chooses a reduced one
(speculate/draft_vocab.py: then its LM head is those rows and target_ids() maps its drafts, as an EAGLE-3 head's
d2t does), its weights come from the target's own checkpoint, and it drafts chains only (the hybrid targets it
serves verify no trees).  With the target's
fixed-shape steps (CUDA graphs on a GPU) its forwards replay graphs too, as an EAGLE-3 head's do.  k = 1 is what
the head was trained for; k > 1 feeds it its own output, as vLLM does.
"""

from __future__ import annotations

from specdec.engine.kv_cache import BlockManager
from specdec.models.mtp import MTPHead
from specdec.speculate.eagle3 import Eagle3Speculator


class MTPSpeculator(Eagle3Speculator):
    name = "mtp"

    def __init__(self, head: MTPHead, blocks: BlockManager, **static):
        """static: Eagle3Speculator's static_shapes, max_batch, max_context and cuda_graphs."""
        config = head.config
        super().__init__(head, blocks, config.layer.vocab_size, feature_layers=(config.target_layers,),
                         tree_width=1, **static)
