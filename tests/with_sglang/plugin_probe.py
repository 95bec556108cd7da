"""Run in a fresh interpreter by test_sglang_plugin.py (SGLang applies plug-ins once per
process): load SGLang's plug-ins as SGLang does, then resolve server arguments for tiny local
configs and print one JSON line of what happened. argv[1]: a scratch folder."""
import json
import os
import sys
import tempfile

from transformers import DeepseekV4Config, LlamaConfig


def dsv4_dir(root: str) -> str:
    d = os.path.join(root, "dsv4")
    c = DeepseekV4Config(num_hidden_layers=4, hidden_size=256, vocab_size=1000, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, q_lora_rank=64, o_lora_rank=64,
                         index_n_heads=4, num_attention_heads=8)
    c.architectures = ["DeepseekV4ForCausalLM"]
    c.save_pretrained(d)
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg["compress_ratios"] = [0, 4, 128, 4, 0]  # the release config's per-layer list SGLang reads
    json.dump(cfg, open(path, "w"))
    return d


def dspark_dir(root: str) -> str:
    """The DeepSeek-V4 config with a bundled DSpark draft (its dspark_* keys: SGLang then drafts from
    the target's own checkpoint), gamma 5."""
    d = dsv4_dir(os.path.join(root, "with_dspark"))
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(dspark_block_size=5, dspark_markov_rank=8, dspark_noise_token_id=990, dspark_target_layer_ids=[1, 2, 3])
    json.dump(cfg, open(path, "w"))
    return d


def llama_dir(root: str) -> str:
    d = os.path.join(root, "llama")
    c = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1000)
    c.architectures = ["LlamaForCausalLM"]
    c.save_pretrained(d)
    return d


REFUSED = {"pp_size=2": dict(pp_size=2), "--enable-multi-layer-eagle": dict(enable_multi_layer_eagle=True),
           "--enable-hisparse": dict(enable_hisparse=True),
           "--enable-hierarchical-cache": dict(enable_hierarchical_cache=True),
           "disaggregation_mode='decode'": dict(disaggregation_mode="decode"),
           "--speculative-accept-threshold-single / --speculative-accept-threshold-acc must stay 1.0":
               dict(speculative_accept_threshold_single=0.8)}


# DSPARK resolution needs a CUDA, NPU or XPU device name (SGLang refuses "cpu"); nothing is allocated
DSPARK = dict(speculative_algorithm="DSPARK", speculative_num_steps=None, device="cuda")
DSPARK_TREE = dict(DSPARK, speculative_eagle_topk=4, speculative_num_draft_tokens=8)  # SGLang's default grammar backend
TREE_ENV = {"SGLANG_DSPARK_FOLDED_PROPOSAL": "0"}  # SGLang's default folds a chain proposal into the draft graph
DSPARK_REFUSED = {"SGLANG_DSPARK_FOLDED_PROPOSAL": (DSPARK_TREE, {}),
                  "SGLANG_RAGGED_VERIFY_MODE must be 'static'": (DSPARK_TREE, dict(TREE_ENV, SGLANG_RAGGED_VERIFY_MODE="compact")),
                  "SGLANG_ENABLE_METADATA_GLUE_GRAPH": (DSPARK_TREE, dict(TREE_ENV, SGLANG_ENABLE_METADATA_GLUE_GRAPH="1")),
                  "disaggregation_mode='decode'": (dict(DSPARK_TREE, disaggregation_mode="decode"), TREE_ENV),
                  "--speculative-use-rejection-sampling": (dict(DSPARK_TREE, speculative_use_rejection_sampling=True), TREE_ENV),
                  "must be >= the DSpark block size 5": (dict(DSPARK_TREE, speculative_num_draft_tokens=4), TREE_ENV),
                  "--speculative-num-draft-tokens must be in [2, 64]": (dict(DSPARK_TREE, speculative_num_draft_tokens=65),
                                                                        TREE_ENV)}


def resolve(model_path: str, env=None, **kw):
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path=model_path, speculative_algorithm="EAGLE", speculative_num_steps=3,
                skip_tokenizer_init=True, device="cpu", random_seed=0)
    args.update(kw)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        a = ServerArgs(**args)
        a.resolve_once()
        return {"ok": True, "resolved": {k: repr(v) for k, v in a.resolved_dict().items()}}
    except BaseException as exc:  # what SGLang's launcher would report
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def rings(model_path: str, env=None, **kw):
    """Resolve, publish the result as SGLang's scheduler does, then the C4 / C128 state ring sizes
    SGLang's pool configurator reads (its own imported `resolve_compress_state_ring_size`, which
    the plug-in's hook must reach) and its ring-capacity assertion for the resolved N."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.model_executor import pool_configurator as pc
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path=model_path, speculative_algorithm="EAGLE", speculative_num_steps=3,
                skip_tokenizer_init=True, device="cpu", random_seed=0)
    args.update(kw)
    saved_env = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    saved = rc.snapshot_context()
    try:
        a = ServerArgs(**args)
        a.resolve_once()
        rc.publish(a, role="scheduler")
        ring = pc.resolve_compress_state_ring_size
        out = {"ok": True, "c4": ring(4), "c128": ring(128)}
        conf = object.__new__(pc.DSV4PoolConfigurator)  # the two fields _assert_ring_serves_draft_tokens reads
        conf.stage_owner_layers, conf.ring_sizes = {4: [1, 3], 128: [2]}, {4: out["c4"], 128: out["c128"]}
        try:
            conf._assert_ring_serves_draft_tokens(pc.max_speculative_num_draft_tokens() or 0)  # SGLang's call
            out["assert"] = "ok"
        except AssertionError as exc:
            out["assert"] = str(exc)
        return out
    except BaseException as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        rc.restore_context(saved)
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    import importlib.metadata as md

    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugins.load_plugins()
    from dsv4_tree.sglang_plugin import HOOK_TARGETS

    out = {"entry_points": sorted(f"{e.name}={e.value}" for e in md.entry_points(group="sglang.srt.plugins")),
           "applied": sorted(t for t in HOOK_TARGETS if t in HookRegistry._patched)}
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    out["move_kv_cache"] = getattr(DeepSeekV4TokenToKVPool, "move_kv_cache", None) is not None
    v4, llama = dsv4_dir(root), llama_dir(root)
    out["v4_topk4"] = resolve(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=8, disable_cuda_graph=True)
    out["v4_topk4_graphs"] = resolve(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    out["v4_topk4_debug_graphs"] = resolve(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                                           debug_cuda_graph=True)
    out["v4_topk4_n16"] = resolve(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=16)
    out["v4_topk4_many"] = resolve(v4, speculative_eagle_topk=4, speculative_num_steps=5,
                                   speculative_num_draft_tokens=65, disable_cuda_graph=True)
    # a tree needing more candidates than topk x 1 step gives, and the largest that fits
    for n in (3, 4):
        out[f"v4_topk2_one_step_n{n}"] = resolve(v4, speculative_eagle_topk=2, speculative_num_steps=1,
                                                 speculative_num_draft_tokens=n, disable_cuda_graph=True)
    # settings outside the tree path, through SGLang's resolution (each reaches the validator)
    out["v4_topk4_refused"] = {
        name: resolve(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=8, disable_cuda_graph=True, **kw)
        for name, kw in REFUSED.items()}
    out["v4_topk1"] = resolve(v4, speculative_eagle_topk=1, speculative_num_draft_tokens=4, disable_cuda_graph=True)
    out["llama_topk4_page256"] = resolve(llama, speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                                         page_size=256, disable_cuda_graph=True,
                                         speculative_draft_model_path=llama)
    ds = dspark_dir(root)
    out["dspark_topk1"] = resolve(ds, **DSPARK)
    out["dspark_topk1_eager"] = resolve(ds, disable_cuda_graph=True, **DSPARK)
    out["dspark_topk4"] = resolve(ds, env=TREE_ENV, **DSPARK_TREE)
    out["dspark_topk4_eager"] = resolve(ds, env=TREE_ENV, disable_cuda_graph=True, **DSPARK_TREE)
    out["dspark_topk4_default_n"] = resolve(ds, env=TREE_ENV, **dict(DSPARK_TREE, speculative_num_draft_tokens=None))
    out["dspark_refused"] = {name: resolve(ds, env=env, **kw) for name, (kw, env) in DSPARK_REFUSED.items()}
    out["llama_dspark_topk4"] = resolve(llama, **DSPARK_TREE)
    out["dspark_topk4_n16"] = resolve(ds, env=TREE_ENV, **dict(DSPARK_TREE, speculative_num_draft_tokens=16))
    out["dspark_topk4_n16_eager"] = resolve(ds, env=TREE_ENV, disable_cuda_graph=True,
                                            **dict(DSPARK_TREE, speculative_num_draft_tokens=16))
    # the state rings SGLang's pool configurator sizes, for chains and trees
    out["rings"] = {
        "v4_topk1_n4": rings(v4, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
        "v4_topk1_n16": rings(v4, speculative_eagle_topk=1, speculative_num_steps=15, speculative_num_draft_tokens=16),
        "v4_topk4_n10": rings(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=10),
        "v4_topk4_n16": rings(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=16),
        "v4_topk4_n27": rings(v4, speculative_eagle_topk=4, speculative_num_draft_tokens=27),
        "dspark_topk1": rings(ds, **DSPARK),
        "dspark_topk4_n16": rings(ds, env=TREE_ENV, **dict(DSPARK_TREE, speculative_num_draft_tokens=16))}
    print("PROBE " + json.dumps(out))


if __name__ == "__main__":
    main()
