"""transformers' own greedy `model.generate` against the same call with
`custom_generate=dsv4_tree.custom_generate`, side by side in one process, on the shipped trained
checkpoint loaded with plain `DeepseekV4ForCausalLM.from_pretrained` (fp32, greedy, held-out
stdlib prompts, 1 torch thread by default).

Single prompts: tokens/s of whole generate calls (prefill included) for each, the ratio, and
whether the outputs are identical. Batch: one left-padded batch of --batch prompts through
custom_generate (one engine batch) and through transformers' own padded batch; the reference
for custom_generate's rows is each prompt's own unpadded transformers run (transformers' padded
batch is timed only: its padded rows need not equal their unpadded runs). Every case runs
--repeats times, the cases taking turns, the fastest run of each counting (the first
custom_generate call builds the engine and reads the MTP block; one untimed warm-up call does
that). Human table first, one JSON line last."""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import DeepseekV4ForCausalLM

import dsv4_tree as dt
from dsv4_tree.train.corpus import heldout_prompt


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def single(model, prompts, new, custom) -> list:
    kw = {"custom_generate": dt.custom_generate} if custom else {}
    return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, **kw)[0, len(p):].tolist()
            for p in prompts]


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def batch(model, prompts, new, custom) -> list:
    ids, mask = left_padded(prompts)
    kw = {"custom_generate": dt.custom_generate} if custom else {}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:].tolist()


def new_tokens(rows, eos) -> int:
    """Tokens generated, up to and including each row's EOS (padding after it not counted)."""
    total = 0
    for row in rows:
        total += next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts, one generate call each")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4, help="prompts in the left-padded batch (0: no batch case)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = DeepseekV4ForCausalLM.from_pretrained(str(dt.trained_checkpoint()), dtype=torch.float32).eval()
    eos = {model.generation_config.eos_token_id}
    prompts = [heldout_prompt(args.prompt_len, seed) for seed in range(args.prompts)]
    # prompt lengths differ in the batch so rows carry different padding
    bprompts = [heldout_prompt(args.prompt_len - 24 * i, 100 + i) for i in range(args.batch)]
    single(model, prompts[:1], 4, True)  # warm-up: builds the engine, reads the MTP block
    jobs = [("HF generate", single, False), ("custom_generate", single, True)]
    if args.batch:
        jobs += [(f"HF generate, padded batch x{args.batch}", batch, False),
                 (f"custom_generate, padded batch x{args.batch}", batch, True)]
    best, outs = {}, {}
    for _ in range(args.repeats):
        for label, fn, custom in jobs:
            data = prompts if fn is single else bprompts
            t0 = time.perf_counter()
            got = fn(model, data, args.new_tokens, custom)
            secs = time.perf_counter() - t0
            if label in outs and outs[label] != got:
                raise RuntimeError(f"{label}: repeated runs gave different outputs")
            outs[label], best[label] = got, min(best.get(label, secs), secs)
    refs = {"HF generate": outs["HF generate"]}
    if args.batch:
        alone = single(model, bprompts, args.new_tokens, False)
        refs["batch"] = [a + [0] * (len(g) - len(a)) for a, g in zip(alone, outs[jobs[3][0]])]
    print(f"machine: {cpu_name()} ({platform.machine()}), {torch.get_num_threads()} torch threads; torch "
          f"{torch.__version__}; trained checkpoint, fp32, greedy; {args.prompts} prompts x {args.new_tokens} "
          f"new tokens; batch x{args.batch}; fastest of {args.repeats}")
    print(f"{'case':<36} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'x HF':>6}  output")
    records, base = [], {}
    for label, fn, custom in jobs:
        tokens = new_tokens(outs[label], eos)
        rate = tokens / best[label]
        kind = "single" if fn is single else "batch"
        base.setdefault(kind, rate)
        if fn is single:
            same = outs[label] == refs["HF generate"]
            note = "identical to HF generate" if same else "DIFFERS FROM HF generate"
        elif custom:
            same = outs[label] == refs["batch"]
            note = "rows identical to HF's unpadded runs" if same else "ROWS DIFFER FROM HF's unpadded runs"
        else:
            same = outs[label] == refs["batch"]
            note = "(timing only) rows " + ("equal" if same else "differ from") + " their unpadded runs"
        records.append({"case": label, "tokens": tokens, "seconds": best[label], "tokens_per_s": rate,
                        "x_hf": rate / base[kind], "output_identical": same})
        print(f"{label:<36} {tokens:>7} {best[label]:>8.3f} {rate:>9.1f} {rate / base[kind]:>6.2f}  {note}")
    print(json.dumps({"bench": "hf_generate", "cpu": cpu_name(), "threads": torch.get_num_threads(),
                      "repeats": args.repeats, "records": records}))


if __name__ == "__main__":
    main()
