"""SGLang 0.5.23's CUDA-graph protocol on the CPU for the tree backends: a backend over the
stand-in state that runs SGLang's own `init_cuda_graph_state`, `init_forward_metadata_out_graph`
and `init_forward_metadata_in_graph`, the runner's static input buffers (SGLang's capture and
replay views), and the captured function run as a graph would record it.

A CUDA graph replays the kernels captured once, writing into the tensors of that capture; on the
CPU the captured function is run again on the replay's static inputs and its outputs must have
the capture's shapes (`shapes_of`), which is what a graph needs of it; the values it computes are
what the graph writes. The captured call runs under `forbid_host_sync` (no host read) and
`no_host_data` (no host value or pinned buffer enters it)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_tree.attention.backend import get_backend
from dsv4_tree.diagnostics import forbid_host_sync
from dsv4_tree.errors import StateError

HOST_DATA_OPS = ("aten.lift_fresh", "aten.lift_fresh_copy", "aten._pin_memory", "aten.is_pinned")


class no_host_data(TorchDispatchMode):
    """StateError at an op that brings host data into a captured region: `torch.tensor([...])` of
    Python values (`aten.lift_fresh` of more than one element; a 0-dim one is a constant such as
    `t[:, 0] = -1`), pinned staging buffers. A graph would bake such values in."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        lifted = name.startswith("aten.lift_fresh")
        if (lifted and args[0].numel() > 1) or (name in HOST_DATA_OPS and not lifted):
            raise StateError(f"host data inside a captured region: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def captured():
    """The rules of a captured region: no host read (`forbid_host_sync`, plus `Tensor.tolist` /
    `.numpy`, which read a CPU tensor's memory without dispatching an op), no host data."""
    def refuse(name):
        def read(self, *args, **kwargs):
            raise StateError(f"host read inside a captured region: Tensor.{name}()")
        return read

    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    try:
        for name in saved:
            setattr(torch.Tensor, name, refuse(name))
        with forbid_host_sync(), no_host_data():
            yield
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


class NoOnlineC128:
    """SGLANG_OPT_USE_ONLINE_COMPRESS off (the validator requires it): SGLang's controller is inert."""

    def prepare_forward(self, *args, **kwargs):
        return 0

    def state_slot_offset(self):
        return 0

    def enabled(self):
        return False

    def clear(self):
        pass


def graph_backend(cls, stand_in, *, topk: int, steps: int = 1, step: int = 0, draft: bool = False, pool=None):
    """A tree backend object (SGLang's methods, the plug-in's overrides) over a StandIn's state."""
    be = object.__new__(cls)
    be.__dict__.update(vars(stand_in))
    if pool is not None:
        be.token_to_kv_pool = pool
    pool = be.token_to_kv_pool
    if not hasattr(pool, "translate_loc_from_full_to_swa"):
        mapping = pool.full_to_swa_index_mapping
        pool.translate_loc_from_full_to_swa = lambda loc: mapping[loc]
    n = stand_in.speculative_num_draft_tokens
    rows = stand_in.req_to_token.shape[0]
    be.__dict__.update(
        topk=topk, speculative_num_steps=steps, speculative_step_id=step, mtp_enabled=True,
        online_c128_mtp=NoOnlineC128(), needs_cpu_seq_lens=False, is_draft_runner=draft, device=torch.device("cpu"),
        max_context_len=stand_in.req_to_token.shape[1], builds_verify_metadata_early=False,
        _early_verify_metadata_ids=set(), enable_decoder_swa_bounded_replay=False, tail_forward_metadata=None,
        cuda_graph_swa_out_cache_loc=None, hisparse_coordinator=None, _verify_mask=None,
        req_to_token_pool=SimpleNamespace(req_to_token=stand_in.req_to_token),
        extend_seq_lens_buffer=torch.full((rows,), n, dtype=torch.int32),
        extend_start_loc_buffer=torch.zeros(rows, dtype=torch.int32),
        _tree_links=None, _tree_draft_out_cache_loc=None, _tree_ops=get_backend("torch"))
    return be


class RunnerBuffers:
    """The graph runner's static inputs (SGLang's `buffers`): req_pool_indices, seq_lens [max_bs],
    out_cache_loc [max_tokens]; capture and replay hand the backend views of them."""

    def __init__(self, max_bs: int, max_tokens: int, fill: int = 1):
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int32)
        self.seq_lens = torch.full((max_bs,), fill, dtype=torch.int32)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.int64)
        self.fill = fill

    def load(self, rpi: torch.Tensor, seq_lens: torch.Tensor, bs: int, out_cache_loc: torch.Tensor):
        """The replay view of a batch padded to bs (SGLang's fill: request row 0, length 1, slot 0);
        the graph reads the write slots from the out_cache_loc buffer."""
        raw = rpi.shape[0]
        self.out_cache_loc.zero_()
        self.out_cache_loc[:out_cache_loc.shape[0]].copy_(out_cache_loc)
        self.req_pool_indices[:bs].zero_()
        self.seq_lens[:bs].fill_(self.fill)
        self.req_pool_indices[:raw].copy_(rpi)
        self.seq_lens[:raw].copy_(seq_lens)
        return self.req_pool_indices[:bs], self.seq_lens[:bs]


def verify_spec(rn, rs):
    """An EagleVerifyInput as the backend reads it (SGLang's capture batch has no tree: None)."""
    return SimpleNamespace(retrieve_next_token=rn, retrieve_next_sibling=rs, draft_token=None,
                           ragged_verify_layout=None)


def verify_batch(bs, rpi, seq_lens, out_cache_loc, spec_info):
    return SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, req_pool_indices=rpi,
                           seq_lens=seq_lens, seq_lens_cpu=None, seq_lens_sum=None, out_cache_loc=out_cache_loc,
                           spec_info=spec_info, positions=torch.zeros(out_cache_loc.shape[0], dtype=torch.int64),
                           max_seq_len_override=None, encoder_swa_replay=False, encoder_swa_row_floor=None)


def tensors_of(meta) -> dict:
    """name -> tensor of every tensor field of a (tree) verify / draft metadata, nested ones included."""
    out = {}

    def walk(prefix, obj):
        for k, v in vars(obj).items():
            if isinstance(v, torch.Tensor):
                out[prefix + k] = v
            elif hasattr(v, "__dataclass_fields__") and not isinstance(v, type):
                walk(prefix + k + ".", v)

    walk("", meta)
    return out


def shapes_of(meta) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors_of(meta).items()}


def ptrs_of(record) -> dict:
    return {k: v.data_ptr() for k, v in tensors_of(record).items()}
