"""The plug-in inside SGLang 0.5.23: SGLang's own `load_plugins()` finds and runs the entry
point, every hook reports applied, and server-argument resolution (SGLang's own pipeline, on
tiny local configs) accepts DeepSeek-V4 with EAGLE topk 4 while every other case behaves as
without the plug-in."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dsv4_tree.sglang_plugin as plugin
from dsv4_tree.errors import ConfigError
from dsv4_tree.sglang_plugin.validate import TreeServeSettings, validate_tree_settings

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("plugin_probe.py")


def run_probe(tmp_path, plugins_on: bool) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    if not plugins_on:
        env["SGLANG_PLUGINS"] = "none-installed"  # SGLang's whitelist: skips every plug-in
    out = subprocess.run([sys.executable, str(PROBE), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE "):])


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")  # one folder: the resolved paths compare equal
    return run_probe(models, True), run_probe(models, False)


def test_load_plugins_applies_every_hook(probes):
    on, off = probes
    assert on["entry_points"] == ["dsv4_tree=dsv4_tree.sglang_plugin:register"]
    assert on["applied"] == sorted(plugin.HOOK_TARGETS) and len(plugin.HOOK_TARGETS) == 14
    assert off["applied"] == []
    assert on["move_kv_cache"] and not off["move_kv_cache"]  # set by register() (the registry cannot add it)


def test_dsv4_topk4_passes_resolution(probes):
    on, off = probes
    res = on["v4_topk4"]
    assert res["ok"], res
    r = res["resolved"]
    assert (r["speculative_eagle_topk"], r["speculative_num_draft_tokens"], r["page_size"]) == ("4", "8", "256")
    assert (r["attention_backend"], r["dsv4_attn_backend"]) == ("'dsv4'", "'flashmla'")
    assert not off["v4_topk4"]["ok"] and "topk == 1" in off["v4_topk4"]["error"]  # SGLang's own refusal


def test_tree_settings_outside_the_plugin_are_refused_by_name(probes):
    on, _ = probes
    graphs = on["v4_topk4_graphs"]  # CUDA graphs: accepted (the tree backends implement SGLang's protocol)
    assert graphs["ok"] and graphs["resolved"]["disable_cuda_graph"] == "False", graphs
    debug = on["v4_topk4_debug_graphs"]["error"]  # SGLang's breakable graphs: refused by name
    assert debug.startswith("ConfigError") and "--debug-cuda-graph" in debug, debug
    many = on["v4_topk4_many"]["error"]
    assert many.startswith("ConfigError") and "--speculative-num-draft-tokens must be in [2, 64]" in many, many
    assert "got 65" in many, many
    few = on["v4_topk2_one_step_n4"]  # SGLang's own resolution accepts it; the validator refuses it
    assert not few["ok"] and few["error"].startswith("ConfigError"), few
    assert "organize_draft_results" in few["error"] and "at most 3" in few["error"], few
    assert on["v4_topk2_one_step_n3"]["ok"], on["v4_topk2_one_step_n3"]
    # read from the resolved server arguments (settings_from_server_args), refused by name
    refused = on["v4_topk4_refused"]
    assert sorted(refused) == sorted(["pp_size=2", "--enable-multi-layer-eagle", "--enable-hisparse",
                                      "--enable-hierarchical-cache", "disaggregation_mode='decode'",
                                      "--speculative-accept-threshold-single / --speculative-accept-threshold-acc "
                                      "must stay 1.0"])
    for named, res in refused.items():
        assert res["error"].startswith("ConfigError") and named in res["error"], (named, res)


def test_other_models_and_topk1_unchanged(probes):
    on, off = probes
    # a non-DSV4 model with topk > 1 and page size 256: SGLang's gate still fires, word for word
    assert not on["llama_topk4_page256"]["ok"]
    assert on["llama_topk4_page256"] == off["llama_topk4_page256"]
    assert "page_size > 1" in on["llama_topk4_page256"]["error"]
    # topk 1 on DeepSeek-V4: the same resolved arguments as without the plug-in
    assert on["v4_topk1"]["ok"] and on["v4_topk1"] == off["v4_topk1"]


def test_dspark_topk4_resolves_with_graphs_on_and_off(probes):
    """DSPARK + topk 4 + 8 verify tokens on a DeepSeek-V4 config with a bundled DSpark (gamma 5):
    SGLang's _handle_dspark forces topk 1 and N = gamma + 1; with the plug-in the tree's topk and N
    stay, gamma is declared as the block size, one step; without it SGLang refuses N != gamma + 1."""
    on, off = probes
    for name, graphs_off in (("dspark_topk4", "False"), ("dspark_topk4_eager", "True")):
        res = on[name]
        assert res["ok"], (name, res)
        r = res["resolved"]
        assert (r["speculative_algorithm"], r["speculative_eagle_topk"], r["speculative_num_draft_tokens"],
                r["speculative_num_steps"], r["speculative_dspark_block_size"]) == ("'DSPARK'", "4", "8", "1", "5"), r
        assert (r["disable_cuda_graph"], r["dsv4_attn_backend"], r["page_size"]) == (graphs_off, "'flashmla'", "256")
        assert not off[name]["ok"] and "gamma + 1" in off[name]["error"], off[name]  # SGLang's own refusal
    default_n = on["dspark_topk4_default_n"]  # no --speculative-num-draft-tokens: gamma + 1
    assert default_n["ok"] and default_n["resolved"]["speculative_num_draft_tokens"] == "6", default_n


def test_sixteen_draft_tokens_resolve_for_trees(probes):
    """EAGLE and DSPARK trees of 16 verify rows (past SGLang's ring bound of 10) resolve with the
    plug-in, graphs on and off; without it SGLang refuses them (its topk / gamma + 1 gates)."""
    on, off = probes
    for name in ("v4_topk4_n16", "dspark_topk4_n16", "dspark_topk4_n16_eager"):
        res = on[name]
        assert res["ok"], (name, res)
        r = res["resolved"]
        assert (r["speculative_eagle_topk"], r["speculative_num_draft_tokens"]) == ("4", "16"), (name, r)
        assert not off[name]["ok"], (name, off[name])
    assert on["dspark_topk4_n16_eager"]["resolved"]["disable_cuda_graph"] == "True"
    assert on["v4_topk4_n16"]["resolved"]["disable_cuda_graph"] == "False"


def test_state_rings_sglangs_pool_configurator_reads(probes):
    """The C4 state ring SGLang's pool configurator sizes (its own imported
    resolve_compress_state_ring_size, reached by the plug-in's hook): SGLang's 16 rows for chains
    and trees of N <= 10, 32 for a tree of 16, 64 for 27; C128 stays 256; the configurator's own
    ring-capacity assertion passes for those trees. Chains get SGLang's rings and SGLang's
    refusal of N = 16 word for word, with the plug-in or without."""
    on, off = probes
    rings = on["rings"]
    want = {"v4_topk1_n4": 16, "v4_topk1_n16": 16, "v4_topk4_n10": 16, "v4_topk4_n16": 32, "v4_topk4_n27": 64,
            "dspark_topk1": 16, "dspark_topk4_n16": 32}
    assert {k: v.get("c4") for k, v in rings.items()} == want, rings
    assert all(v["c128"] == 256 for v in rings.values()), rings
    for name in ("v4_topk1_n4", "v4_topk4_n10", "v4_topk4_n16", "v4_topk4_n27", "dspark_topk1", "dspark_topk4_n16"):
        assert rings[name]["assert"] == "ok", (name, rings[name])
    chain16 = rings["v4_topk1_n16"]["assert"]
    assert "speculative_num_draft_tokens=16 exceeds" in chain16 and "serves at most 10" in chain16, chain16
    for name in ("v4_topk1_n4", "v4_topk1_n16", "dspark_topk1"):
        assert on["rings"][name] == off["rings"][name], name
    assert not off["rings"]["v4_topk4_n16"]["ok"]  # SGLang alone refuses the tree at resolution


def test_tree_c4_ring_is_the_smallest_that_serves_the_window():
    """For every N the validator accepts: the ring's write pad (SGLang's function) holds N, the
    ring divides the SWA page and is a multiple of 4 (c_plan.cuh's checks), it is SGLang's ring
    up to SGLang's bound and otherwise half of it would not serve N; past the SWA page, refused."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (get_compress_state_ring_size,
                                                              get_compress_state_write_pad as pad)

    from dsv4_tree.sglang_plugin.ring import tree_c4_ring_size, tree_draft_token_capacity

    stock = get_compress_state_ring_size(4, 1)
    assert stock == 16 and pad(4, stock) == 10 and tree_draft_token_capacity() == 64
    for n in range(2, tree_draft_token_capacity() + 1):
        ring = tree_c4_ring_size(n, stock)
        assert pad(4, ring) >= n and 256 % ring == 0 and ring % 4 == 0, (n, ring)
        assert ring == stock if n <= 10 else pad(4, ring // 2) < n, (n, ring)
    with pytest.raises(ConfigError, match="wider than the SWA page of 256 rows"):
        tree_c4_ring_size(251, stock)


def test_dspark_topk1_resolves_as_stock_sglang(probes):
    on, off = probes
    for name in ("dspark_topk1", "dspark_topk1_eager"):
        assert on[name]["ok"], on[name]
        assert on[name] == off[name]  # every resolved argument, repr for repr
        assert on[name]["resolved"]["speculative_eagle_topk"] == "1"
    assert on["dspark_topk1"]["resolved"]["disable_cuda_graph"] == "False"
    assert on["dspark_topk1_eager"]["resolved"]["disable_cuda_graph"] == "True"


def test_dspark_tree_settings_are_refused_by_name(probes):
    from plugin_probe import DSPARK_REFUSED

    on, off = probes
    assert sorted(on["dspark_refused"]) == sorted(DSPARK_REFUSED)
    for named, res in on["dspark_refused"].items():
        assert not res["ok"] and res["error"].startswith("ConfigError") and named in res["error"], (named, res)
    # a model that is not DeepSeek-V4: SGLang's DSPARK resolution alone, as without the plug-in
    assert on["llama_dspark_topk4"] == off["llama_dspark_topk4"]


def settings(**kw) -> TreeServeSettings:
    base = dict(model_arch="DeepseekV4ForCausalLM", speculative_algorithm="EAGLE", topk=4, num_steps=3,
                num_draft_tokens=8,
                dsv4_attn_backend="flashmla", disable_cuda_graph=True, attn_cp_size=1, dcp_size=1,
                enable_prefill_cp=False, encoder_swa_bounded_replay=False, unified_kv=False, online_compress=False,
                ragged_verify_mode="static", draft_token_capacity=64)
    base.update(kw)
    return TreeServeSettings(**base)


@pytest.mark.parametrize("change, named", [
    ({"dsv4_attn_backend": "trtllm"}, "--dsv4-attn-backend"),
    ({"dsv4_attn_backend": "flashmla_mega"}, "--dsv4-attn-backend"),
    ({"disable_cuda_graph": False, "debug_cuda_graph": True}, "--debug-cuda-graph"),
    ({"disable_cuda_graph": False, "metadata_glue": True}, "SGLANG_ENABLE_METADATA_GLUE_GRAPH=1 is not supported"),
    ({"metadata_glue": True}, "SGLANG_ENABLE_METADATA_GLUE_GRAPH=1 is not supported"),
    ({"attn_cp_size": 2}, "attn_cp_size"),
    ({"dcp_size": 2}, "dcp_size"),
    ({"enable_prefill_cp": True}, "--enable-prefill-cp"),
    ({"encoder_swa_bounded_replay": True}, "--enable-encoder-swa-bounded-replay"),
    ({"unified_kv": True}, "unified_kv_triton"),
    ({"online_compress": True}, "SGLANG_OPT_USE_ONLINE_COMPRESS"),
    ({"ragged_verify_mode": "dynamic"}, "SGLANG_RAGGED_VERIFY_MODE"),
    ({"num_draft_tokens": 65, "num_steps": 5}, "--speculative-num-draft-tokens must be in \\[2, 64\\].*got 65"),
    ({"model_arch": "LlamaForCausalLM"}, "LlamaForCausalLM"),
    ({"pp_size": 2}, "pp_size=2, must be 1"),
    ({"multi_layer_eagle": True}, "--enable-multi-layer-eagle"),
    ({"hisparse": True}, "--enable-hisparse"),
    ({"hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ({"disaggregation_mode": "decode"}, "disaggregation_mode='decode'"),
    ({"two_batch_overlap": True}, "--enable-two-batch-overlap is not supported"),
    ({"accept_threshold_single": 0.9}, "must stay 1.0 with trees \\(got 0.9 / 1.0\\).*no longer lossless"),
    ({"accept_threshold_acc": 0.5}, "must stay 1.0 with trees \\(got 1.0 / 0.5\\)"),
    ({"num_steps": 0}, "--speculative-num-steps must be >= 1"),
    # 3 candidates needed, SGLang's draft gives topk x 1 step = 2
    ({"topk": 2, "num_steps": 1, "num_draft_tokens": 4}, "needs 3 draft candidates.*organize_draft_results.*= 2"),
])
def test_validator_names_the_setting(change, named):
    validate_tree_settings(settings())  # the accepted configuration
    with pytest.raises(ConfigError, match=named.replace("-", r"\-")):
        validate_tree_settings(settings(**change))


def dspark_settings(**kw) -> TreeServeSettings:
    return settings(**dict(dict(speculative_algorithm="DSPARK", num_steps=1, gamma=5), **kw))


@pytest.mark.parametrize("change, named", [
    ({"model_type": "deepseek_v41"}, "model_type must be one of.*'deepseek_v41'"),
    ({"gamma": 0}, "block size \\(gamma\\) must be resolved"),
    ({"num_steps": 2}, "--speculative-num-steps must resolve to 1"),
    ({"num_draft_tokens": 4}, "must be >= the DSpark block size 5"),
    ({"topk": 2, "gamma": 1, "num_draft_tokens": 4}, "needs 3 draft candidates.*at most 3"),
    ({"attn_dp_size": 2}, "DP attention.*attn_dp_size=2"),
    ({"two_batch_overlap": True}, "--enable-two-batch-overlap"),
    ({"accept_threshold_single": 0.5}, "--speculative-accept-threshold-single"),
    ({"unsupported": ("SGLANG_DSPARK_FOLDED_PROPOSAL (must be 0: ...)",)}, "SGLANG_DSPARK_FOLDED_PROPOSAL"),
    ({"ragged_verify_mode": "compact"}, "SGLANG_RAGGED_VERIFY_MODE"),
    ({"ragged_verify_mode": "cap-accept"}, "SGLANG_RAGGED_VERIFY_MODE"),
    ({"disaggregation_mode": "prefill"}, "disaggregation_mode='prefill'"),
    ({"metadata_glue": True}, "SGLANG_ENABLE_METADATA_GLUE_GRAPH"),
    ({"num_draft_tokens": 65}, "--speculative-num-draft-tokens must be in \\[2, 64\\]"),
])
def test_dspark_validator_names_the_setting(change, named):
    validate_tree_settings(dspark_settings())  # the accepted configuration: topk 4, gamma 5, N 8
    with pytest.raises(ConfigError, match=named):
        validate_tree_settings(dspark_settings(**change))


def test_validator_accepts_exactly_the_trees_sglangs_draft_can_fill():
    """The candidate rule is SGLang's: for every topk / steps / N the validator accepts a tree iff
    SGLang's own select_top_k_tokens + organize_draft_results build its N - 1 candidates (the
    engine's rule, dsv4_tree.hooks.validate_spec, says the same)."""
    import torch
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    from dsv4_tree.config import SpecConfig
    from dsv4_tree.hooks import validate_spec
    from sgl_cases import sglang_draft_lists

    from transformers import DeepseekV4Config

    model = DeepseekV4Config()
    seen = {True: 0, False: 0}
    for topk in (2, 3, 4):
        for steps in (1, 2, 3):
            lists = sglang_draft_lists(2, topk, steps, torch.Generator().manual_seed(topk * 10 + steps))
            for n in range(2, 11):
                try:
                    organize_draft_results(*lists, n)
                    sglang_ok = True
                except RuntimeError:  # torch.topk: k larger than the candidates
                    sglang_ok = False
                try:
                    validate_tree_settings(settings(topk=topk, num_steps=steps, num_draft_tokens=n))
                    ours = True
                except ConfigError as exc:
                    assert "organize_draft_results" in str(exc), exc
                    ours = False
                try:
                    validate_spec(model, SpecConfig(eagle_topk=topk, num_steps=steps, num_draft_tokens=n))
                    engine = True
                except ConfigError as exc:
                    if "candidate pool" not in str(exc):
                        raise
                    engine = False
                assert ours == sglang_ok == engine, (topk, steps, n, ours, sglang_ok, engine)
                seen[ours] += 1
    assert seen[True] and seen[False], seen


def test_other_sglang_versions_get_no_hooks(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.24")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.register() is False
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    lines = [r for r in caplog.records if r.name == plugin.__name__]
    assert len(lines) == 1 and "0.5.23" in lines[0].getMessage() and "0.5.24" in lines[0].getMessage()


def test_factories_pick_the_tree_backend_only_for_topk_above_1(monkeypatch):
    from sglang.srt.layers.attention import deepseek_v4_trtllm_backend as trt

    from dsv4_tree.sglang_plugin import backend, hooks

    calls = []
    monkeypatch.setattr(trt, "is_dsv4_trtllm_attn_enabled", lambda: False)  # --dsv4-attn-backend flashmla
    monkeypatch.setattr(trt, "is_dsv4_mega_attn_enabled", lambda: False)
    monkeypatch.setattr(hooks, "_tree_topk", lambda runner: runner)
    monkeypatch.setattr(backend.TreeDeepseekV4AttnBackend, "__init__", lambda self, runner, **kw: calls.append(("tree", kw)))
    monkeypatch.setattr(backend.TreeDeepseekV4MultiStepBackend, "__init__",
                        lambda self, runner, topk, speculative_num_steps: calls.append(("tree-ms", topk)))
    orig = lambda runner, **kw: ("original", kw)  # noqa: E731
    assert hooks.around_create_deepseek_v4_attn_backend(orig, 1, skip_prefill=True) == ("original", {"skip_prefill": True})
    assert hooks.around_create_deepseek_v4_attn_backend(orig, 0) == ("original", {})
    assert isinstance(hooks.around_create_deepseek_v4_attn_backend(orig, 4, skip_prefill=True),
                      backend.TreeDeepseekV4AttnBackend)
    ms = lambda runner, topk, speculative_num_steps: ("original-ms", topk)  # noqa: E731
    assert hooks.around_create_deepseek_v4_multistep_backend(ms, None, 1, 3) == ("original-ms", 1)
    assert isinstance(hooks.around_create_deepseek_v4_multistep_backend(ms, None, 4, 3),
                      backend.TreeDeepseekV4MultiStepBackend)
    assert calls == [("tree", {"skip_prefill": True}), ("tree-ms", 4)]
    monkeypatch.setattr(trt, "is_dsv4_trtllm_attn_enabled", lambda: True)
    with pytest.raises(ConfigError, match="--dsv4-attn-backend"):
        hooks.around_create_deepseek_v4_attn_backend(orig, 4)


def test_backend_init_sees_topk_1_and_keeps_the_real_spec(monkeypatch):
    from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

    from dsv4_tree.sglang_plugin.backend import _topk_one_view

    class Spec:
        speculative_eagle_topk, speculative_num_draft_tokens = 4, 8

    monkeypatch.setattr(dsv4, "get_spec", lambda: Spec())
    real = dsv4.get_spec
    with _topk_one_view() as outer:
        assert dsv4.get_spec().speculative_eagle_topk == 1 and dsv4.get_spec().speculative_num_draft_tokens == 8
        with _topk_one_view() as inner:  # the multi-step backend builds step backends inside its __init__
            assert inner is outer is real and dsv4.get_spec().speculative_eagle_topk == 1
        assert dsv4.get_spec().speculative_eagle_topk == 1
    assert dsv4.get_spec is real and dsv4.get_spec().speculative_eagle_topk == 4


def test_tree_backend_builds_verify_metadata_from_the_batch_tree(monkeypatch, no_flashmla_schedule):
    """The tree backend's eager path: init_forward_metadata keeps the batch's tree for
    make_forward_metadata_from_raw_verify (SGLang's own call order), which builds tree rows;
    without a tree it refuses (the compressor writes on tree metadata: test_sglang_tree_commit.py)."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

    from dsv4_tree.errors import StateError
    from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
    from dsv4_tree.sglang_plugin.graph import tree_raw_verify
    from dsv4_tree.sglang_plugin.metadata import TreeDSV4Metadata, tree_verify_metadata
    from sgl_cases import StandIn, layout, sglang_tree

    gen = torch.Generator().manual_seed(5)
    lens, n = [250, 7], 8
    req_to_token, mapping = layout(lens, n, gen)
    stand_in = StandIn(req_to_token, mapping, n)
    be = object.__new__(TreeDeepseekV4AttnBackend)
    be.__dict__.update(stand_in.__dict__)
    be.topk, be._tree_links = 4, None
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    rpi = torch.tensor([1, 2], dtype=torch.int32)
    out_loc = torch.cat([req_to_token[r, p:p + n] for r, p in zip(rpi.tolist(), lens)]).to(torch.int64)
    _, rn, rs = sglang_tree(2, 4, 3, n, seq_lens, gen)
    raw = dsv4.DSV4RawVerifyMetadata(req_pool_indices=rpi, seq_lens=seq_lens, out_cache_loc=out_loc)

    def sglang_init(self, forward_batch):  # what SGLang's eager init does for TARGET_VERIFY (its raw record
        # comes from init_forward_metadata_target_verify, which the tree backend gives the batch's tree)
        self.forward_metadata = self.make_forward_metadata_from_raw_verify(tree_raw_verify(raw, self._tree_links))

    monkeypatch.setattr(dsv4.DeepseekV4AttnBackend, "init_forward_metadata", sglang_init)
    monkeypatch.setattr(dsv4, "_get_logical_forward_mode", lambda fb: fb.forward_mode)
    verify = SimpleNamespace(is_target_verify=lambda: True, is_decode=lambda: False)
    batch = SimpleNamespace(forward_mode=verify, out_cache_loc=out_loc, batch_size=2, seq_lens=seq_lens,
                            spec_info=SimpleNamespace(retrieve_next_token=rn, retrieve_next_sibling=rs))
    be.init_forward_metadata(batch)
    assert be._tree_links is None  # not kept past the call
    got, want = be.forward_metadata, tree_verify_metadata(stand_in, raw, rn, rs)
    assert isinstance(got, TreeDSV4Metadata)
    for f in ("swa_page_indices", "seq_lens_casual", "c4_out_loc", "c128_page_indices"):
        assert torch.equal(getattr(got.core_attn_metadata, f), getattr(want.core_attn_metadata, f)), f
    with pytest.raises(StateError, match="without the batch's tree"):
        be.make_forward_metadata_from_raw_verify(raw)  # a record without the tree


def test_an_eager_verify_without_the_tree_is_refused_by_name(monkeypatch):
    """No silent chain fallback: an eager target verify (or an out-of-graph prep outside capture)
    whose spec_info lacks the tree raises a StateError naming the missing fields; only SGLang's
    graph capture and its discarded autotune forwards (batches with no tree) verify chains."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers import logits_processor
    from sglang.srt.layers.attention import deepseek_v4_backend as dsv4

    from dsv4_tree.errors import StateError
    from dsv4_tree.sglang_plugin.backend import TreeDeepseekV4AttnBackend
    from dsv4_tree.sglang_plugin.graph import chain_links, verify_links

    be = object.__new__(TreeDeepseekV4AttnBackend)
    be.speculative_num_draft_tokens, be._tree_links, be._tree_draft_out_cache_loc = 8, None, None
    reached = []
    monkeypatch.setattr(dsv4.DeepseekV4AttnBackend, "init_forward_metadata", lambda self, fb: reached.append(fb))
    monkeypatch.setattr(dsv4.DeepseekV4AttnBackend, "init_forward_metadata_out_graph",
                        lambda self, fb, in_capture=False: reached.append(self._tree_links))
    monkeypatch.setattr(dsv4, "_get_logical_forward_mode", lambda fb: fb.forward_mode)
    verify = SimpleNamespace(is_target_verify=lambda: True, is_decode=lambda: False)
    seq = torch.tensor([30, 40])
    tree = torch.zeros(2, 8, dtype=torch.int64)
    for spec, missing in ((SimpleNamespace(), "retrieve_next_token and retrieve_next_sibling missing"),
                          (SimpleNamespace(retrieve_next_token=tree, retrieve_next_sibling=None),
                           r"\(retrieve_next_sibling missing\)"),
                          (None, "retrieve_next_token and retrieve_next_sibling missing")):
        batch = SimpleNamespace(forward_mode=verify, out_cache_loc=None, batch_size=2, seq_lens=seq, spec_info=spec)
        with pytest.raises(StateError, match=missing):
            be.init_forward_metadata(batch)
        with pytest.raises(StateError, match=missing):
            be.init_forward_metadata_out_graph(batch, in_capture=False)
    assert reached == [] and be._tree_links is None  # refused before SGLang's metadata build
    batch = SimpleNamespace(forward_mode=verify, out_cache_loc=None, batch_size=2, seq_lens=seq, spec_info=None)
    be.init_forward_metadata_out_graph(batch, in_capture=True)  # SGLang's capture batch: chains
    assert all(torch.equal(a, b) for a, b in zip(reached.pop(), chain_links(2, 8, "cpu")))
    with logits_processor.autotune_dummy_run_mode(run_lm_head=False):  # SGLang's discarded autotune forward
        assert all(torch.equal(a, b) for a, b in zip(verify_links(SimpleNamespace(), 2, 8, "cpu"),
                                                     chain_links(2, 8, "cpu")))
