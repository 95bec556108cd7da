"""The model adapter: a loaded DeepseekV4ForCausalLM whose weights we use in place."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..cache.state import CompressorState, LayerCache, RequestCache
from ..errors import CheckpointError, InputError
from .hf_bindings import DeepseekV4CSACompressor, DeepseekV4ForCausalLM


class Model:
    """Wraps a Hugging Face DeepseekV4ForCausalLM (no weight copies) for tree verify."""

    def __init__(self, hf_model: DeepseekV4ForCausalLM):
        if not isinstance(hf_model, DeepseekV4ForCausalLM):
            raise CheckpointError(f"expected a DeepseekV4ForCausalLM, got {type(hf_model).__name__}")
        self.hf = hf_model.eval()
        self.config = hf_model.config
        self.source: Path | None = None

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
    def ratios(self) -> tuple:
        """Compression ratios used by some layer (e.g. (4, 128))."""
        out = set()
        for layer in self.hf.model.layers:
            comp = layer.self_attn.compressor
            if comp is not None:
                out.add(comp.compress_rate)
        return tuple(sorted(out))

    def new_cache(self) -> RequestCache:
        """An empty committed cache (P = 0)."""
        dtype, device = self.dtype, self.device
        layers = []
        for layer in self.hf.model.layers:
            attn = layer.self_attn
            comp = attn.compressor
            lc = LayerCache(torch.empty(0, attn.head_dim, dtype=dtype, device=device))
            if comp is not None:
                overlap = isinstance(comp, DeepseekV4CSACompressor)
                lc.main = CompressorState.empty(comp.compress_rate, comp.head_dim, overlap, dtype, device)
                if overlap:
                    idx = comp.indexer
                    lc.indexer = CompressorState.empty(idx.compress_rate, idx.head_dim, True, dtype, device)
            layers.append(lc)
        return RequestCache(0, layers)


def load_model(source, device=None, dtype=None) -> Model:
    """Load a DeepSeek-V4 checkpoint directory (config.json + *.safetensors) or wrap a built
    DeepseekV4ForCausalLM. Never touches the network.

    device / dtype: None keeps a wrapped module's own (a directory loads as fp32 on the CPU);
    given, a wrapped module is moved in place (nn.Module.to)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    if isinstance(source, (Model, DeepseekV4ForCausalLM)):
        moves = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        if isinstance(source, Model):
            if moves:
                source.hf.to(**moves)
            return source
        return Model(source.to(**moves) if moves else source)
    if not isinstance(source, (str, Path)):
        raise CheckpointError(f"source must be a directory or a DeepseekV4ForCausalLM, got {type(source).__name__}")
    path = Path(source)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(f"{path} has no *.safetensors weights")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type != "deepseek_v4":
        raise CheckpointError(f"{cfg_file}: model_type is {model_type!r}, expected 'deepseek_v4'")
    hf = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, local_files_only=True)
    model = Model(hf.to(device or "cpu"))
    model.source = path
    return model
