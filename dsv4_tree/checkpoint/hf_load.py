"""Load a checkpoint directory into a DeepseekV4ForCausalLM through transformers.

Dense Hugging Face layout and the release format (DeepSeek names, FP8 block-scaled linears, FP4
experts, shards) both go through `from_pretrained`; transformers' conversion mapping renames
the release keys. A quantised checkpoint is dequantised while loading by default
(quantized="dequantize": FineGrainedFP8Config(dequantize=True), on any device). quantized="keep"
keeps transformers' FP8 modules on a CUDA device; their GEMMs come from transformers'
finegrained-fp8 kernel, which transformers loads through the `kernels` package from its cache
or the Hugging Face Hub (the one place loading may touch the network). "keep" loads that kernel
up front and is refused with CheckpointError if it cannot, instead of failing at the first
forward. "dequantize" builds the dense model on the host and then moves it to the device. Tensors the checkpoint stores in higher precision (bf16 norms,
embeddings, ...) are then cast to the requested dtype; kept FP8 / FP4 weights and their scales
are left as they are."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, InputError
from .files import quantization, read_config, shard_files
from ..hf_bindings import DeepseekV4ForCausalLM

QUANTIZED_MODES = ("dequantize", "keep")
QUANTIZED_STORAGE = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


def cast_dense(hf, dtype: torch.dtype) -> None:
    """Cast every floating parameter / buffer that is not quantised storage or a scale grid."""
    for module in hf.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or not t.is_floating_point() or t.dtype in QUANTIZED_STORAGE:
                    continue
                if name.endswith(("_scale_inv", "activation_scale")) or t.dtype == dtype:
                    continue
                t.data = t.data.to(dtype)


def check_keep_fp8(device) -> None:
    """quantized="keep" needs a CUDA device and transformers' FP8 kernel (the `kernels` package)."""
    from transformers.utils import is_kernels_available

    if torch.device(device).type != "cuda":
        raise InputError(f"quantized='keep' keeps FP8 modules on a CUDA device; device is {device!r} "
                         "(use quantized='dequantize')")
    if not is_kernels_available():
        raise CheckpointError("quantized='keep' runs transformers' FP8 modules, whose GEMMs need the `kernels` "
                              "package (transformers' finegrained-fp8 kernel build); it is not installed. "
                              "Install it, or load with quantized='dequantize'")
    from transformers.integrations import finegrained_fp8

    try:  # transformers loads the kernel build through `kernels` (its cache, or the Hugging Face Hub)
        finegrained_fp8.load_finegrained_fp8_kernel()
    except Exception as exc:  # noqa: BLE001 - any failure here means the modules cannot run
        raise CheckpointError(f"quantized='keep': transformers' finegrained-fp8 kernel could not be loaded "
                              f"({type(exc).__name__}: {exc}); load with quantized='dequantize'") from exc


def load_hf_directory(path: Path, device, dtype: torch.dtype, quantized: str = "dequantize") -> DeepseekV4ForCausalLM:
    """Checks the directory (naming the file or key at fault), then loads it with transformers.
    quantized: "dequantize" (FP8 / FP4 weights become `dtype`) or "keep" (see the module doc)."""
    if quantized not in QUANTIZED_MODES:
        raise InputError(f"quantized must be one of {QUANTIZED_MODES}, got {quantized!r}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    shard_files(path)  # every shard the index names exists
    model_type = read_config(path).get("model_type")
    if model_type != "deepseek_v4":
        raise CheckpointError(f"{cfg_file}: model_type is {model_type!r}, expected 'deepseek_v4'")
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"dtype must be a torch.dtype, got {dtype!r}")
    quant = quantization(path)
    if quant is None and quantized == "keep":
        raise InputError(f"quantized='keep' keeps FP8 modules, but {path} holds no quantised checkpoint "
                         "(config.json has no quantization_config)")
    kwargs = {}
    if quant is not None:
        from transformers import FineGrainedFP8Config

        keep = quantized == "keep"
        if keep:
            check_keep_fp8(device)
            kwargs["device_map"] = str(torch.device(device))
        kwargs["quantization_config"] = FineGrainedFP8Config(
            dequantize=not keep, modules_to_not_convert=quant.get("modules_to_not_convert"))
    hf = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True, **kwargs)
    if quant is not None:
        cast_dense(hf, dtype)
    return hf.to(device)
