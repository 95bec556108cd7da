"""How many bytes a model takes in the release format and once loaded, from its config alone.

Builds the model and its MTP block on the meta device (no memory), names the tensors as the
release does and applies the writer's storage rule to each: FP8 linears (1 byte per weight plus
one scale per 128x128 block), FP4 experts (half a byte per weight plus one scale per 32),
everything else at its stored width (bf16; integer tables as stored)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import FP4_GROUP, FP8_BLOCK
from .release import KEEP_DTYPE, storage_kind
from .release_names import release_state_dict


@dataclass(frozen=True)
class ReleaseSize:
    fp8_params: int  # linear weights stored FP8 e4m3
    fp4_params: int  # routed-expert weights stored FP4
    kept_params: int  # stored at full width (bf16 floats, integer tables)
    file_bytes: int  # bytes of all stored tensors (weights + scale grids), = the index's total_size
    int_params: int  # of kept_params: integer tables (hash routing), kept as is after loading
    int_bytes: int

    @property
    def params(self) -> int:
        return self.fp8_params + self.fp4_params + self.kept_params

    def dense_bytes(self, dtype: torch.dtype) -> int:
        """Bytes after dequantising every float weight to `dtype` (the CPU path)."""
        return (self.params - self.int_params) * torch.empty(0, dtype=dtype).element_size() + self.int_bytes


def release_size(config, with_mtp: bool = True, scale_bytes: int = 4) -> ReleaseSize:
    """scale_bytes: 4 for fp32 scales (what write_release stores, scale_fmt="float"), 1 for
    UE8M0 power-of-two scales (scale_fmt="ue8m0")."""
    from ..hf_bindings import DeepseekV4ForCausalLM
    from .mtp import MtpBlock, to_checkpoint_names

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
        tensors = release_state_dict(dict(model.state_dict()))
        if with_mtp:
            tensors.update(to_checkpoint_names(MtpBlock(config)))
    fp8 = fp4 = kept = nbytes = ints = int_bytes = 0
    for name, t in tensors.items():
        kind, n = storage_kind(name, t), t.numel()
        if kind == "fp8":
            fp8 += n
            nbytes += n + scale_bytes * (t.shape[0] // FP8_BLOCK) * (t.shape[1] // FP8_BLOCK)
        elif kind == "fp4":
            fp4 += n
            nbytes += n // 2 + scale_bytes * (n // FP4_GROUP)
        else:
            kept += n
            width = KEEP_DTYPE.itemsize if t.is_floating_point() else t.element_size()
            nbytes += n * width
            if not t.is_floating_point():
                ints, int_bytes = ints + n, int_bytes + n * t.element_size()
    return ReleaseSize(fp8, fp4, kept, nbytes, ints, int_bytes)
