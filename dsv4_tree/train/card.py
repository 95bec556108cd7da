"""The model card of a trained checkpoint, written from its training.json."""
from __future__ import annotations

import json
from pathlib import Path


def write_model_card(out_dir) -> Path:
    out_dir = Path(out_dir)
    meta = json.loads((out_dir / "training.json").read_text())
    cfg = json.loads((out_dir / "config.json").read_text())
    tc = meta["train_config"]
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "mlp_layer_types", "compress_rates",
            "sliding_window", "num_attention_heads", "head_dim", "index_n_heads", "index_head_dim", "index_topk",
            "n_routed_experts", "num_experts_per_tok", "hc_mult")
    lines = [
        "# tiny-stdlib-bytes: a small trained DeepSeek-V4 with its MTP block",
        "",
        "Byte-level (ids 0-255 are bytes, 256 = BOS, 257 = EOS) `DeepseekV4ForCausalLM` trained jointly with",
        "its MTP block on the Python standard library's own top-level `.py` sources, on CPU, by",
        "`dsv4-tree train-tiny` (dsv4_tree/train/). Weights are bf16; `mtp.0.*` tensors use DeepSeek's naming.",
        "",
        "## Config",
        "",
        *[f"- `{k}`: {cfg.get(k)}" for k in keys],
        f"- parameters: {meta['params_main'] / 1e6:.2f}M main + {meta['params_mtp'] / 1e6:.2f}M MTP",
        "",
        "## Corpus",
        "",
        f"- Python {meta['python_version']} standard library, top-level `*.py`, sorted by name; every 10th file held out",
        f"- {len(meta['train_files'])} training files, {len(meta['val_files'])} validation files",
        f"- sha256 of the `name size` listing of all files: `{meta['file_list_sha256']}`",
        "- the exact lists are in `training.json`",
        "",
        "## Training",
        "",
        f"- {meta['steps_done']} steps of batch {tc['batch']} x {tc['seq_len']} bytes, AdamW (peak lr {tc['lr']}, "
        f"{tc['warmup']} warmup steps, cosine), seed {tc['seed']}, {meta['seconds'] / 60:.1f} min on 2 CPU cores",
        f"- loss: main next-byte cross-entropy + {tc['mtp_weight']} x MTP cross-entropy (from the main streams at t",
        "  and the embedding of byte t+1, predict byte t+2)",
        f"- final train loss: {meta['final_train_bpb']:.3f} bits per byte (last step); mean of the last 100 steps "
        f"{sum(meta['history']['train_bpb'][-100:]) / len(meta['history']['train_bpb'][-100:]):.3f}",
        f"- final validation loss: {meta['final_val_bpb']:.3f} bits per byte (main), "
        f"{meta['final_val_mtp_bpb']:.3f} (MTP)",
        "",
        "![loss curve](loss_curve.png)",
        "",
    ]
    retrain = meta.get("mtp_retrain")
    if retrain:
        rc = retrain["train_config"]
        lines += [
            "## MTP block (retrained)",
            "",
            f"- the shipped `mtp.0.*` block was retrained against this frozen target by `{retrain['command']}`,",
            "  starting from " + ("the joint run's block" if retrain.get("init") == "checkpoint" else "a fresh block") + ":",
            f"  {rc['steps']} steps of batch {rc['batch']} x {rc['seq_len']} bytes, the recipe above (peak lr {rc['lr']},",
            f"  {rc['warmup']} warmup steps, cosine, loss weight {rc['mtp_weight']}, seed {rc['seed']}), target frozen,",
            f"  {retrain['seconds'] / 60:.1f} min wall ({retrain['cpu_seconds'] / 60:.1f} min CPU, "
            f"{retrain['torch_threads']} torch threads)",
            f"- rows: {retrain['rows']} (the joint run above had one more row, x_0 with zero streams)",
            f"- final validation loss: {retrain['final_val_mtp_bpb']:.3f} bits per byte (MTP; the joint run's block: "
            f"{meta['final_val_mtp_bpb']:.3f})",
            "",
            "![MTP loss curve](mtp_loss_curve.png)",
            "",
        ]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines))
    return path
