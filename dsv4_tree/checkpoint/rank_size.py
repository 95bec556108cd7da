"""Bytes each rank holds after a sharded load (load_model(..., distributed_config=...)), from the
config alone.

The model is built on the meta device and transformers' own plans are applied to it exactly as
`from_pretrained` does (`_resolve_parallel_plans`, `apply_tensor_parallelism`,
`apply_expert_parallelism`) over a fake process group of N ranks (torch's own testing backend,
`torch.testing._internal.distributed.fake_pg`: an internal module, checked by
tests/test_ranks.py against the pinned torch), so the local shard shapes are transformers'
own (nothing is allocated, nothing is communicated). Rank 0's shards are taken:
where a dimension does not divide evenly the first ranks hold the larger piece. The shards are
then named and priced as the release stores them (release_size.py). The MTP block is built by
dsv4_tree outside transformers and loaded whole on every rank (replicated)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import InputError, StateError
from .release_names import release_state_dict
from .release_size import ReleaseSize, mtp_tensors, price, release_tensors, size_of

PARTS = ("experts", "embed+head", "rest")


@contextlib.contextmanager
def _fake_ranks(n: int):
    """A fake process group of n ranks (this process is rank 0) and a 1-D "tp" mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise StateError("per-rank sizes are computed over a fake process group; a process group already runs here")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        yield init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def sharded_tensors(config, tp: int, ep: int = 1) -> dict:
    """Rank 0's main-model tensors, release names, meta device, after DistributedConfig(tp_size=tp,
    ep_size=ep) (ep 1, or ep == tp: expert parallelism over the ranks of the tensor plan)."""
    from torch.distributed.tensor import DTensor
    from transformers import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from ..hf_bindings import DeepseekV4ForCausalLM

    if tp < 2 or ep not in (1, tp):
        raise InputError(f"tp must be >= 2 and ep 1 or tp (transformers runs EP over the TP ranks), got tp={tp} ep={ep}")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    tp_plan, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp, ep_size=ep))
    with _fake_ranks(tp) as mesh:
        apply_tensor_parallelism(model, mesh, tp_plan)
        if ep > 1:
            apply_expert_parallelism(model, mesh, mesh, ep_plan, ep_implementation="auto")
        state = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return release_state_dict(state)


def part_of(name: str) -> str:
    if ".experts." in name:
        return "experts"
    return "embed+head" if name in ("embed.weight", "head.weight") else "rest"


@dataclass(frozen=True)
class RankSize:
    """Bytes on one rank: the main model by part (release storage), its MTP block (replicated)."""
    parts: dict  # part name (PARTS) -> bytes in release storage
    main: ReleaseSize
    mtp: ReleaseSize

    @property
    def total(self) -> int:
        return self.main.file_bytes


def rank_size(config, tp: int = 1, ep: int = 1, scale_bytes: int = 1) -> RankSize:
    """Per-rank bytes for tp ranks (tp=1: one process, unsharded). scale_bytes: 1 for UE8M0
    scales (DeepSeek's release), 4 for fp32 ones."""
    main = release_tensors(config, with_mtp=False) if tp == 1 else sharded_tensors(config, tp, ep)
    mtp = mtp_tensors(config)
    parts = dict.fromkeys(PARTS, 0)
    for name, t in main.items():
        parts[part_of(name)] += price(name, t, scale_bytes)[1]
    return RankSize(parts, size_of(main, scale_bytes), size_of(mtp, scale_bytes))
