"""SGLang's DSpark draft heads as the Markov expansion reads them (`drafters/dspark_tree.py`'s
`expand_markov` calls `module.markov_bias(prev)` and `module.confidence_of(hidden, prev)`).

* `markov_bias(prev)`: SGLang's `step_bias` of the V4 Markov head (W2 W1[prev], the dtype of its W2),
  over the whole vocabulary: with the W2 vocab-sharded over TP (`SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD`)
  each rank's slice is gathered by the head's own vocab gather, as SGLang's Markov step gathers its
  step logits. Added to the base logits in fp32 by `expand_markov`, as SGLang's step does (V4's step
  dtype is fp32).
* `confidence_of`: zeros. The SGLang tree is ranked by path probability (the engine's fixed-size
  rule): under SGLang's static verify the width N is the captured bucket's, so no size is chosen
  per round, and SGLang does not build V4's confidence head in static mode.
* `full_vocab(base)`: the draft's base logits (`compute_base_logits`, sharded like the Markov
  head when the W2 is) over the whole vocabulary."""
from __future__ import annotations

import torch

from ..errors import ConfigError


class SGLangMarkovHeads:
    def __init__(self, draft_model):
        from sglang.srt.models.deepseek_v4_dspark import DSparkV4MarkovHead

        head = getattr(draft_model, "markov_head", None)
        if not isinstance(head, DSparkV4MarkovHead):
            raise ConfigError(f"dsv4_tree DSPARK tree: the draft's Markov head must be DeepSeek-V4's vanilla "
                              f"head (DSparkV4MarkovHead: a child's distribution depends on its parent's token "
                              f"only), got {type(head).__name__}")
        self.head = head
        self.vocab_size = int(head.vocab_size)

    def _whole(self, local: torch.Tensor) -> torch.Tensor:
        shard = getattr(self.head, "vocab_shard", None)
        if shard is None:
            return local[:, : self.vocab_size]
        return shard.gather(local)[:, : self.vocab_size]

    def full_vocab(self, base: torch.Tensor) -> torch.Tensor:
        """base [rows, local vocab] -> [rows, vocab]."""
        return self._whole(base)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] token ids -> the Markov bias [..., vocab] (float32)."""
        flat = prev.reshape(-1).long()
        bias, _ = self.head.step_bias(flat, hidden_states=None, state=None)
        bias = bias.float()
        geometry = getattr(self.head, "_tp_shard", None)
        if getattr(self.head, "vocab_shard", None) is not None and geometry is not None:
            pad = int(geometry.num_embeddings_per_partition) - bias.shape[1]
            bias = torch.nn.functional.pad(bias, (0, pad))  # the shard's padding columns, as SGLang's step pads
        return self._whole(bias).view(*prev.shape, self.vocab_size)

    @staticmethod
    def confidence_of(hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return torch.zeros(prev.shape, dtype=torch.float32, device=prev.device)
