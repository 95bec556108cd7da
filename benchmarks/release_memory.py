"""Memory of a full-size DeepSeek-V4 checkpoint in the release format and once loaded, from its
config alone (parameters x bytes; the model is built on the meta device, nothing allocated).

Default config: transformers' DeepseekV4Config() defaults, which are DeepSeek-V4-Flash's
dimensions; pass --config path/to/config.json for another. Human table first, one JSON line last."""
from __future__ import annotations

import argparse
import json

import torch

from dsv4_tree.hf_bindings import DeepseekV4Config
from dsv4_tree.checkpoint.release_size import release_size

FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
          "o_groups", "o_lora_rank", "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "hc_mult",
          "index_n_heads", "index_head_dim", "num_nextn_predict_layers")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=None, help="a config.json (default: DeepseekV4Config() = V4-Flash)")
    args = ap.parse_args(argv)
    cfg = DeepseekV4Config.from_json_file(args.config) if args.config else DeepseekV4Config()
    main_only, full = release_size(cfg, with_mtp=False), release_size(cfg, with_mtp=True)
    ue8m0 = release_size(cfg, with_mtp=False, scale_bytes=1), release_size(cfg, with_mtp=True, scale_bytes=1)
    gib = 2**30
    print("config: " + ", ".join(f"{k}={getattr(cfg, k)}" for k in FIELDS))
    print(f"{'':34} {'main model':>12} {'+ MTP block':>12}")
    rows = [
        ("parameters (B)", main_only.params / 1e9, full.params / 1e9),
        ("  FP4 experts (B)", main_only.fp4_params / 1e9, full.fp4_params / 1e9),
        ("  FP8 linears (B)", main_only.fp8_params / 1e9, full.fp8_params / 1e9),
        ("  bf16 / int kept (B)", main_only.kept_params / 1e9, full.kept_params / 1e9),
        ("release files, fp32 scales (GiB)", main_only.file_bytes / gib, full.file_bytes / gib),
        ("release files, ue8m0 scales (GiB)", ue8m0[0].file_bytes / gib, ue8m0[1].file_bytes / gib),
        ("dequantised bf16 (GiB)", main_only.dense_bytes(torch.bfloat16) / gib, full.dense_bytes(torch.bfloat16) / gib),
        ("dequantised fp32 (GiB)", main_only.dense_bytes(torch.float32) / gib, full.dense_bytes(torch.float32) / gib),
    ]
    for label, a, b in rows:
        print(f"{label:34} {a:12.2f} {b:12.2f}")
    print(json.dumps({"config": {k: getattr(cfg, k) for k in FIELDS},
                      **{label.strip(): [round(a, 3), round(b, 3)] for label, a, b in rows}}))


if __name__ == "__main__":
    main()
