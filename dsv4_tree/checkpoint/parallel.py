"""Loading one model across several ranks with transformers' own tensor / expert parallelism.

`load_model(path, distributed_config=DistributedConfig(...))`, in every process `torchrun`
starts, hands the config to `from_pretrained`. transformers starts the process group (gloo on
the CPU, NCCL on CUDA), binds each rank to its device (cuda:LOCAL_RANK, or the CPU) and shards
what DeepseekV4Config's plans name: routed experts (TP: gate-up column-split, down row-split,
a sum across ranks after; EP: whole experts per rank), embedding and LM head split by
vocabulary. Attention, norms, router, shared expert and mHC stay replicated. We place nothing
ourselves after such a load, and run the same engine on every rank (see dsv4_tree/ranks.py).

Only the combinations this SPMD engine can run are accepted: every rank holds the same batch,
so no data parallelism (FSDP / HSDP) or pipeline stages; TP over all ranks, optionally with EP
over the same ranks (transformers needs ep_size == tp_size then); the model's own plans, since
our attention reads its replicated weights directly."""
from __future__ import annotations

import os

import torch

from ..errors import InputError

EP_IMPLEMENTATIONS = ("auto", "all_reduce", "all_to_all")


def world_size() -> int:
    """Ranks of the running process group, else torchrun's WORLD_SIZE, else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_device() -> torch.device:
    """The device transformers binds this rank to: cuda:LOCAL_RANK with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def distributed_config_for(tp: int | None = None, ep: int | None = None, ep_implementation: str = "auto"):
    """The DistributedConfig of `--tp N` / `--ep N` (EP means tp_size = ep_size = N: the expert
    plan over the ranks of the tensor plan), checked first so a bad pair is an InputError."""
    from transformers import DistributedConfig

    for name, value in (("tp", tp), ("ep", ep)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
            raise InputError(f"{name} must be an int >= 2 (ranks to shard over), got {value!r}")
    if tp is None and ep is None:
        raise InputError("give tp or ep (the number of ranks)")
    if tp is not None and ep is not None and tp != ep:
        raise InputError(f"ep={ep} needs tp={ep}: transformers' expert parallelism runs over the ranks of the "
                         f"tensor plan (ep_size == tp_size), got tp={tp}")
    if ep_implementation not in EP_IMPLEMENTATIONS:
        raise InputError(f"ep_implementation must be one of {EP_IMPLEMENTATIONS}, got {ep_implementation!r}")
    if ep is None:
        if ep_implementation != "auto":
            raise InputError(f"ep_implementation={ep_implementation!r} applies to expert parallelism (ep); "
                             "tensor parallelism alone (tp) has no token dispatch")
        return DistributedConfig(tp_size=tp)
    return DistributedConfig(tp_size=ep, ep_size=ep, ep_implementation=ep_implementation)


def check_distributed_config(cfg, device) -> None:
    """Refuse (InputError) what transformers cannot do, or this engine cannot run, before loading."""
    from transformers import DistributedConfig

    if not isinstance(cfg, DistributedConfig):
        raise InputError(f"distributed_config must be a transformers.DistributedConfig, got {type(cfg).__name__}")
    if "WORLD_SIZE" not in os.environ and not torch.distributed.is_initialized():
        raise InputError("distributed_config needs one process per rank, started by torchrun (WORLD_SIZE, RANK "
                         "and LOCAL_RANK are unset): torchrun --nproc-per-node N -m dsv4_tree.cli generate --tp N")
    world = world_size()
    if device is not None:
        raise InputError(f"device={device!r} with distributed_config: transformers places each rank itself "
                         f"({rank_device()} here); pass device=None")
    for field in ("pp_size", "fsdp_size", "dp_replicate_size"):
        if getattr(cfg, field) != 1:
            raise InputError(f"distributed_config.{field}={getattr(cfg, field)}: every rank runs the same batch "
                             "(tensor / expert parallelism only); it must be 1")
    if cfg.enable_sequence_parallel:
        raise InputError("distributed_config.enable_sequence_parallel is not supported (transformers has not "
                         "wired it up either)")
    if cfg.tp_size != world or world < 2:
        raise InputError(f"distributed_config.tp_size={cfg.tp_size} must equal the number of ranks ({world}), "
                         "at least 2: the tensor plan spans all ranks")
    if cfg.ep_size not in (1, cfg.tp_size):
        raise InputError(f"distributed_config.ep_size={cfg.ep_size} must be 1 or tp_size={cfg.tp_size}: "
                         "expert parallelism runs over the ranks of the tensor plan")
    if cfg.tp_plan not in (None, "auto"):
        raise InputError(f"distributed_config.tp_plan={cfg.tp_plan!r}: only the model's own plan (None or 'auto') "
                         "is supported; our attention reads its replicated weights directly, and transformers "
                         "refuses tp_size > 1 with no rules")
    if cfg.ep_plan is not None:
        raise InputError(f"distributed_config.ep_plan={cfg.ep_plan!r}: only the model's own plan (None) is supported")
    if cfg.ep_implementation not in EP_IMPLEMENTATIONS:
        raise InputError(f"distributed_config.ep_implementation={cfg.ep_implementation!r}: tested are "
                         f"{EP_IMPLEMENTATIONS}")


def is_sharded(hf) -> bool:
    """Whether transformers sharded this module across ranks (a TP or EP plan applied)."""
    return (getattr(hf, "_tp_size", None) or 1) > 1


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (a shard of a distributed load); False where torch has no
    distributed support."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def cast_sharded(t, dtype: torch.dtype):
    """A DTensor with its local shard cast to `dtype` (same mesh, placements, global shape).
    Setting `.data` on a DTensor relabels its dtype but leaves the shard as it was."""
    from torch.distributed.tensor import DTensor

    local = t.to_local().to(dtype)
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
