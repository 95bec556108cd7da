"""The model adapter: a loaded DeepseekV4ForCausalLM whose weights we use in place."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, InputError
from ..hf_bindings import DeepseekV4CSACompressor, DeepseekV4ForCausalLM
from ..checkpoint.hf_load import QUANTIZED_MODES, load_hf_directory
from ..checkpoint.parallel import is_sharded


class Model:
    """Wraps a Hugging Face DeepseekV4ForCausalLM (no weight copies) for tree verify."""

    def __init__(self, hf_model: DeepseekV4ForCausalLM):
        if not isinstance(hf_model, DeepseekV4ForCausalLM):
            raise CheckpointError(f"expected a DeepseekV4ForCausalLM, got {type(hf_model).__name__}")
        self.hf = hf_model.eval()
        self.config = hf_model.config
        self.source: Path | None = None
        # the process group every rank of a sharded model runs in step with (dsv4_tree/ranks.py)
        self.ranks = torch.distributed.group.WORLD if is_sharded(hf_model) else None

    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def window(self) -> int:
        return self.config.sliding_window

    @property
    def rope_dim(self) -> int:
        """Channels of a head that carry RoPE (the trailing ones): 2 x the rotary table width."""
        rot = self.hf.model.rotary_emb
        return 2 * getattr(rot, "main_inv_freq").numel()

    def layer_shapes(self) -> list:
        """What the pools store per layer, as plain numbers (serving/pools.py: LayerShape)."""
        from ..serving.pools import CompressorShape, LayerShape

        out = []
        for layer in self.hf.model.layers:
            attn = layer.self_attn
            comp = attn.compressor
            main = indexer = None
            if comp is not None:
                overlap = isinstance(comp, DeepseekV4CSACompressor)
                main = CompressorShape(comp.compress_rate, overlap, comp.head_dim)
                if overlap:
                    indexer = CompressorShape(comp.compress_rate, True, comp.indexer.head_dim)
            out.append(LayerShape(attn.head_dim, main, indexer))
        return out

    def gate_biases(self) -> list:
        """Per layer, compressor name ("main", "indexer") -> its gate position bias [m, channels]."""
        out = []
        for layer in self.hf.model.layers:
            comp = layer.self_attn.compressor
            found = {}
            if comp is not None:
                found["main"] = comp.position_bias
                if getattr(comp, "indexer", None) is not None:
                    found["indexer"] = comp.indexer.position_bias
            out.append(found)
        return out

    @property
    def compressors(self) -> dict:
        """ratio -> True when that ratio's compressor uses overlapping windows (C4 / CSA)."""
        out = {}
        for layer in self.hf.model.layers:
            comp = layer.self_attn.compressor
            if comp is not None:
                out[comp.compress_rate] = isinstance(comp, DeepseekV4CSACompressor)
        return out


def check_device(device) -> torch.device:
    """device as a torch.device, or InputError naming the bad value (torch's own message kept) or a
    device this process cannot see (e.g. "cuda" without CUDA), checked before anything is loaded."""
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise InputError(f"device must be a torch.device, a device string ('cpu', 'cuda:0') or an index, "
                         f"got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InputError(f"device {device!r} is not a device torch knows ('cpu', 'cuda', 'cuda:0', 'meta', ...): "
                         f"{exc}") from exc
    backend = getattr(torch, dev.type, None) if dev.type not in ("cpu", "meta") else None
    if backend is not None and hasattr(backend, "is_available") and hasattr(backend, "device_count"):
        count = backend.device_count() if backend.is_available() else 0
        if (dev.index or 0) >= count:
            raise InputError(f"device {device!r}: this process sees {count} {dev.type} device(s)"
                             + (f" (indices 0 to {count - 1})" if count else f"; torch.{dev.type}.is_available() "
                                "is False") + "; nothing was loaded or moved")
    return dev


def load_model(source, device=None, dtype=None, quantized: str = "dequantize", distributed_config=None) -> Model:
    """Load a DeepSeek-V4 checkpoint directory (config.json + *.safetensors, dense Hugging Face
    layout or the release format, see hf_load.py) or wrap a built DeepseekV4ForCausalLM.
    Never touches the network, except quantized="keep", where transformers loads its FP8
    kernel build through the `kernels` package (its cache or the Hugging Face Hub).

    device / dtype: None keeps a wrapped module's own (a directory loads as fp32 on the CPU);
    given, a wrapped module is moved in place (nn.Module.to). quantized: for an FP8 / FP4
    release checkpoint, "dequantize" (default, any device) or "keep" (transformers' FP8 modules
    on CUDA; needs the `kernels` package, see hf_load.py). distributed_config: a
    transformers.DistributedConfig, in every process torchrun starts: transformers shards the
    model with its own tensor / expert plans and places each rank (device must be None; see
    checkpoint/parallel.py for what is accepted)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InputError(f"dtype must be a floating torch.dtype (torch.float32, torch.bfloat16, ...) or None, "
                         f"got {dtype!r}")
    if device is not None:
        check_device(device)
    if quantized not in QUANTIZED_MODES:
        raise InputError(f"quantized must be one of {QUANTIZED_MODES}, got {quantized!r}")
    if isinstance(source, (Model, DeepseekV4ForCausalLM)):
        if quantized != "dequantize":
            raise InputError("quantized applies when loading a checkpoint directory, not to a built model")
        if distributed_config is not None:
            raise InputError("distributed_config applies when loading a checkpoint directory (transformers shards "
                             "while loading), not to a built model")
        moves = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        if isinstance(source, Model):
            if moves:
                source.hf.to(**moves)
            return source
        return Model(source.to(**moves) if moves else source)
    if not isinstance(source, (str, Path)):
        raise CheckpointError(f"source must be a directory or a DeepseekV4ForCausalLM, got {type(source).__name__}")
    path = Path(source)
    model = Model(load_hf_directory(path, device if distributed_config is not None else device or "cpu",
                                    dtype or torch.float32, quantized, distributed_config))
    model.source = path
    return model
