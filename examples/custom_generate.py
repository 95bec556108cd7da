"""Tree speculation inside transformers' own `model.generate`.

    python examples/custom_generate.py

Loads the shipped trained byte-level checkpoint with plain `from_pretrained`, then runs
`model.generate(..., custom_generate=dsv4_tree.custom_generate)`: greedy with a streamer
(identical to transformers' own greedy output, checked here), sampling, and a left-padded
batch. The checkpoint's DSpark module drafts chains by default (it ships one); the batch asks for
the MTP block's trees (dsv4_drafter="mtp")."""
import torch
from transformers import DeepseekV4ForCausalLM
from transformers.generation.streamers import BaseStreamer

import dsv4_tree as dt


class ByteStreamer(BaseStreamer):
    """Prints new bytes as they arrive (the checkpoint's vocabulary is bytes 0-255 + specials)."""

    def __init__(self):
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:  # generate puts the prompt first
            self.prompt_seen = True
            return
        print(bytes(t for t in value.tolist() if t < 256).decode("utf-8", "replace"), end="", flush=True)

    def end(self):
        print()


def encode(text: str) -> list:
    return list(text.encode())


def main():
    torch.set_num_threads(1)  # fastest for this tiny model (design_notes/generation.md)
    model = DeepseekV4ForCausalLM.from_pretrained(str(dt.trained_checkpoint()), dtype=torch.float32)
    ids = torch.tensor([encode("def read_config(path):\n    \"\"\"Read a config file.\"\"\"\n    with open(")])

    print("greedy, streamed:")
    ours = model.generate(ids, max_new_tokens=80, custom_generate=dt.custom_generate, streamer=ByteStreamer())
    theirs = model.generate(ids, max_new_tokens=80)
    print("identical to transformers' own greedy generate:", torch.equal(ours, theirs))

    print("\nsampling (temperature 0.8, top_k 20), lossless acceptance:")
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=80, do_sample=True, temperature=0.8, top_k=20,
                         custom_generate=dt.custom_generate)
    print(bytes(t for t in out[0, ids.shape[1]:].tolist() if t < 256).decode("utf-8", "replace"))

    print("\na left-padded batch, one engine batch:")
    texts = ["import os\n", "class Parser:\n    def __init__(self"]
    rows = [encode(t) for t in texts]
    width = max(map(len, rows))
    batch = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=40, pad_token_id=0,
                         custom_generate=dt.custom_generate, dsv4_drafter="mtp", dsv4_eagle_topk=4, dsv4_num_steps=2,
                         dsv4_num_draft_tokens=8)
    for text, row in zip(texts, out[:, width:].tolist()):
        print(repr(text), "->", repr(bytes(t for t in row if t < 256).decode("utf-8", "replace")))


if __name__ == "__main__":
    main()
