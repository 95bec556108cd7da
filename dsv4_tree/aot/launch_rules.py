"""The gate's scenarios derived from the library's launch rules, not picked by hand.

    steps = rule_steps("flash")                 # every verify / prefill the rules give at V4-Flash dims
    steps = rule_steps("flash", sample=True)    # the coverage test's sample

What the library launches under its own defaults (`SpecConfig()`) on a GPU:

* pools: the default kv_cache_dtype "auto" (the model's dtype: bf16 at V4 dims, fp32 for the
  tiny test model) and "fp8_e4m3";
* verify: on CUDA every verify of at most cuda_graph_max_bs requests (None: max_requests, 16) is
  padded to its bucket (serving/buckets.py): 1, 2, 4, 8 or 16 requests of num_draft_tokens rows
  each, at a context rounded up to a power of two in pages. N: 1 (a root verified alone, the
  budget's floor), 2, 4 (SGLang's default MTP chain and a short chain), 8, 16 and 64 (the most a
  tree verifies);
* prefill (never bucketed): chunks of prefill_chunk (256) rows and their tails, one prompt or
  several at once (prefill_batch), and longer chunks;
* every step planned over SpecConfig's default max_requests (16): page-table rows and request
  tables are sized by it, and some launches read that size.

Why these values cover the specialisations: a launch's spec depends on the dtypes, on the
constexprs the launchers derive (tiles from min(pow2(rows per request), 16), head blocks, KP from
the model's top-k) and on each int argument being 1 or divisible by 16. Rows per request are
1, 2, 4, 8, 16 and above 16 (where every tile constexpr has saturated), and the counts of rows
and requests are 1, divisible by 16, or neither; prefill tails of 1-4 rows and 44 rows, chunks of
256 and 1024 rows, one and two prompts reach each class. A context's length reaches the specs
through the entry widths' divisibility (a ~4K and a 64K context) and through the blocks a row's
path closes: C4 blocks by its residue mod 4, C128 blocks near a multiple of 128, and with them
the branch-key counts the tables size (`_contexts`)."""
from __future__ import annotations

from .steps import Prefill, Verify

NODE_COUNTS = (1, 2, 4, 8, 16, 64)  # nodes per verified tree
BATCHES = (1, 2, 4, 8, 16)  # the buckets of SpecConfig's default max_requests (16)
POOLS = ("auto", "fp8_e4m3")
CONTEXT = {"tiny": 40, "flash": 4200, "pro": 8400}  # C4 entries past the top-k at V4 dims (KP = pow2(k + 1))
LONG_CONTEXT = 65549  # a 64K context at bs 1
CHUNK = 256  # SpecConfig.prefill_chunk
MAX_REQUESTS = 16  # SpecConfig.max_requests: the pools and page tables every step is planned over
TAILS = (1, 2, 3, 4, 44)  # rows in a prefill's last chunk


def _contexts(base: int, b: int) -> list:
    """Committed lengths for batches of b requests whose rows reach every class a step's tables
    and tile constexprs take from positions: each residue mod 4 (how many C4 blocks a row's path
    closes) as the batch's first row, requests at strides 1 and 2 (b = 2: every pair of residues),
    and a batch ending one short of a C128 block boundary."""
    out = [tuple(base + o + s * i for i in range(b)) for s in ((1, 2) if b == 2 else (1,)) for o in range(4)]
    edge = -(-base // 128) * 128 - 1
    return out + [tuple(edge + i for i in range(b))]


SAMPLE = ((4, 1), (8, 3))  # (N, requests) of the coverage sample: a chain alone, a tree in a padded bucket


def rule_steps(dims: str, sample: bool = False) -> tuple:
    """Every verify and prefill step the rules give at `dims`, each at every context class, and
    prefill in an engine of each N; sample: the nightly coverage test's subset (default "auto"
    pools; SAMPLE's N and batch sizes; a 256-row chunk with 3- and 4-row tails for one and two
    prompts)."""
    context = CONTEXT[dims]
    if sample:
        pairs, pools_all, tails, longs = SAMPLE, ("auto",), (3, 4), ()
    else:
        pairs = tuple((n, b) for n in NODE_COUNTS for b in BATCHES)
        pools_all, tails, longs = POOLS, TAILS, (LONG_CONTEXT,) if dims != "tiny" else ()
    steps = []
    r = MAX_REQUESTS
    for pools in pools_all:
        for n, b in pairs:
            steps += [Verify(n, c, pools, bucketed=True, max_requests=r) for c in _contexts(context, b)]
        steps += [Verify(n, (c,), pools, bucketed=True, max_requests=r) for n in NODE_COUNTS for c in longs]
        for n in sorted({n for n, _ in pairs}):  # prefill under each N's engine
            for prompts in (1, 2):
                steps += [Prefill(CHUNK + t, CHUNK, pools, prompts, r, n) for t in tails]
            if not sample:
                steps.append(Prefill(4 * CHUNK + 3, 4 * CHUNK, pools, 1, r, n))
    return tuple(steps)
