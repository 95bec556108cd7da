"""SpecConfig: the speculative-verify settings of one engine (frozen; TOML at the edges)."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

MASK_MODES = ("FULL_MASK", "QLEN_ONLY", "QLEN_ONLY_BITPACKING")
ATTENTION_BACKENDS = ("torch", "triton")
ACCEPT_ALGORITHMS = ("greedy", "sampling")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")
DRAFT_DEPTHS = ("adaptive", "fixed")


def check_topk_vocab(topk: int, vocab_size: int, what: str = "SpecConfig.eagle_topk") -> None:
    """A draft node's children are distinct tokens, so at most vocab_size of them: a larger
    topk cannot be drafted (the MTP drafter's top-k over the vocabulary would fail)."""
    if topk > vocab_size:
        raise ConfigError(f"{what}={topk} exceeds the model's vocabulary size {vocab_size}: a draft node has "
                          f"at most {vocab_size} distinct children; use eagle_topk <= {vocab_size}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings. Defaults give the chain path (eagle_topk = 1).

    eagle_topk:        children per expanded draft node; > 1 turns tree verify on; at most
                       the model's vocabulary size (the Engine checks: check_topk_vocab).
    num_steps:         draft depth (edges from the root to the deepest node).
    num_draft_tokens:  nodes per verify tree, root included. None: num_steps + 1 for a
                       chain; for a tree it must be given (SGLang's default is 8 at topk 4).
    mask_mode:         tree-mask layout produced by build_tree (name of TreeMaskMode).
    attention_backend: implementation of the verify attention for the whole run.
    accept:            "greedy" or "sampling".
    prefill_chunk:     prompt tokens per forward during prefill (bounds memory).
    kv_cache_dtype:    storage of K=V rows and compressed entries in the pools: "auto" (the
                       model's dtype, exact), "bfloat16", "fp8_e4m3" (DeepSeek-V4's record).
    page_size:         slots per page of every pool (SGLang's 256); a power of two.
    max_requests:      live requests the pools are sized for (every pool is allocated when the
                       engine is built: ~35 MB for the tiny checkpoints at the defaults).
    max_total_tokens:  committed + draft positions over all live requests the pools hold
                       (None: min(max_requests * max_position_embeddings, 2**18)).
    cuda_graph_max_bs: verify batches of at most this many requests are padded to static-shape
                       buckets (requests to a power of two, nodes to num_draft_tokens, context
                       to a power of two in pages) and, on CUDA, the table build and forward
                       replayed from one captured graph per bucket; 0 = eager, unpadded;
                       None (default) = max_requests on CUDA, 0 elsewhere.
    draft_depth:       "adaptive": num_steps is a maximum and the MTP drafter decides per round
                       whether one more draft step pays (measured costs, calibrated acceptance;
                       design_notes/adaptive-depth.md); "fixed": every round drafts num_steps
                       steps. None: adaptive for a tree (eagle_topk > 1), fixed for a chain.
                       Both are exact (greedy output is the same); seeded sampling repeats
                       draw for draw only with "fixed" (adaptive trees follow the clock).
                       It steers the drafter that drafts in steps (MTP: by name, or an
                       MtpDrafter built with depth=None; one built with an explicit depth that
                       contradicts an explicit draft_depth is refused); a DSpark tree
                       (eagle_topk > 1) is its block deep, and "adaptive" there sizes it: the
                       size policy picks each round's node count (design_notes/dspark-trees.md);
                       the n-gram, planted and user drafters build their trees in one go and
                       ignore it.
    """

    eagle_topk: int = 1
    num_steps: int = 3
    num_draft_tokens: int | None = None
    mask_mode: str = "QLEN_ONLY"
    attention_backend: str = "torch"
    accept: str = "greedy"
    prefill_chunk: int = 256
    kv_cache_dtype: str = "auto"
    page_size: int = 256
    max_requests: int = 16
    max_total_tokens: int | None = None
    cuda_graph_max_bs: int | None = None
    draft_depth: str | None = None

    def __post_init__(self) -> None:
        for name in ("eagle_topk", "num_steps", "prefill_chunk", "page_size", "max_requests",
                     "cuda_graph_max_bs"):
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool)) and not (name == "cuda_graph_max_bs"
                                                                                and value is None):
                raise ConfigError(f"SpecConfig.{name} must be an int, got {value!r}")
        if self.num_draft_tokens is None and self.eagle_topk == 1:
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        if self.num_draft_tokens is not None and (
            not isinstance(self.num_draft_tokens, int) or isinstance(self.num_draft_tokens, bool)
        ):
            raise ConfigError(f"SpecConfig.num_draft_tokens must be an int, got {self.num_draft_tokens!r}")
        if self.max_total_tokens is not None and (
            not isinstance(self.max_total_tokens, int) or isinstance(self.max_total_tokens, bool)
        ):
            raise ConfigError(f"SpecConfig.max_total_tokens must be an int or None, got {self.max_total_tokens!r}")
        if self.draft_depth is not None and self.draft_depth not in DRAFT_DEPTHS:
            raise ConfigError(f"SpecConfig.draft_depth must be one of {DRAFT_DEPTHS} or None, got {self.draft_depth!r}")
        for name in ("mask_mode", "attention_backend", "accept", "kv_cache_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"SpecConfig.{name} must be a string, got {getattr(self, name)!r}")

    @classmethod
    def from_file(cls, path: str | Path) -> "SpecConfig":
        """Read a TOML preset; keys are SpecConfig fields, either at top level or under [spec]."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"spec config file not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:  # a directory, unreadable, not UTF-8 (as TOML is)
            raise ConfigError(f"{path}: not a readable UTF-8 TOML file: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        data = data.get("spec", data)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: 'spec' must be a table of SpecConfig fields ([spec]), "
                              f"got {type(data).__name__} {data!r:.60}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown SpecConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    @property
    def depth_mode(self) -> str:
        """draft_depth resolved: None -> "adaptive" for a tree, "fixed" for a chain."""
        if self.draft_depth is not None:
            return self.draft_depth
        return "adaptive" if self.eagle_topk > 1 else "fixed"

    def replace(self, **changes) -> "SpecConfig":
        """A copy with `changes`, checked as SpecConfig(**fields) is. A chain's node count is
        derived (num_steps + 1), so when num_steps or eagle_topk changes and the copy or the
        original is a chain, the count is derived again as SpecConfig(**fields) would: a chain
        turned into a tree then has none until given (the engine asks for it, as for
        SpecConfig(eagle_topk=K)) instead of silently keeping the chain's."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"SpecConfig has no field(s) {unknown}")
        chain_then, chain_now = self.eagle_topk == 1, changes.get("eagle_topk", self.eagle_topk) == 1
        if ("num_steps" in changes or "eagle_topk" in changes) and "num_draft_tokens" not in changes \
                and (chain_then or chain_now):
            changes["num_draft_tokens"] = None
        return dataclasses.replace(self, **changes)
