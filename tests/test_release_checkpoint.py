"""Release-format checkpoints (DeepSeek names, FP8 128x128 block scales, FP4 experts, MTP block,
shards): transformers and load_model read them alike, dequantisation stays within the stated
bounds, tree verify equals per-path runs, MTP-drafted greedy equals plain greedy, clear errors."""
import functools
import json
import os
import shutil
import struct

import pytest
import torch

import dsv4_tree as dt
from cases import REL_TOL, engine_for, prompt, random_tree
from dsv4_tree.cli import main
from dsv4_tree.drafters import MtpDrafter, TreeShape
from dsv4_tree.checkpoint.files import INDEX_FILE, read_tensors
from dsv4_tree.hf_bindings import DeepseekV4ForCausalLM
from dsv4_tree.checkpoint.mtp import load_mtp, to_checkpoint_names
from dsv4_tree.checkpoint.quant import dequantize_weight, quantize_fp8_blocks
from dsv4_tree.checkpoint.release import write_release
from dsv4_tree.checkpoint.release_names import release_state_dict
from dsv4_tree.checkpoint.release_size import release_size
from dsv4_tree.checkpoint.tiny import RELEASE_TINY_OVERRIDES, random_model, random_mtp, tiny_config
from dsv4_tree.reference import per_path_logits, relative_error
from safetensors import safe_open
from test_generate import hf_greedy
from transformers.utils import is_kernels_available


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # these models are tiny: a second intra-op thread buys nothing and, on a busy machine,
    # spin-waiting threads made this module ~30x slower (measured: 12 s vs 0.4 s CPU for one greedy run)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def release_dir():
    return dt.tiny_checkpoint(format="release")


@functools.lru_cache(maxsize=None)
def release_model():
    return dt.load_model(release_dir())


def headers(directory):
    """{tensor name: (dtype, shape, file)} read from the safetensors headers themselves."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        for name, meta in json.loads(raw[8 : 8 + n]).items():
            if name != "__metadata__":
                out[name] = (meta["dtype"], meta["shape"], f.name)
    return out


def stored(directory, names):
    index = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for name in names:
        with safe_open(str(directory / index[name]), framework="pt") as fh:
            out[name] = fh.get_tensor(name)
    return out


def test_shards_hold_deepseek_names_fp8_blocks_and_fp4_experts():
    d = release_dir()
    h = headers(d)
    index = json.loads((d / INDEX_FILE).read_text())
    shards = sorted({f for _, _, f in h.values()})
    assert len(shards) >= 2 and set(index["weight_map"].values()) == set(shards)
    assert {k: v[2] for k, v in h.items()} == index["weight_map"]
    assert not any(k.startswith(("model.", "lm_head")) for k in h), "Hugging Face names leaked into the release"
    for name in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.1.attn.compressor.ape",
                 "layers.1.attn.indexer.compressor.wkv.weight", "layers.0.ffn.gate.tid2eid", "mtp.0.enorm.weight"):
        assert name in h, name
    assert h["embed.weight"][0] == "BF16" and h["layers.1.attn.compressor.wkv.weight"][0] == "BF16"
    fp8 = sorted(k for k, v in h.items() if v[0] == "F8_E4M3")
    assert "layers.0.attn.wq_a.weight" in fp8 and "mtp.0.attn.wo_b.weight" in fp8 and "mtp.0.e_proj.weight" in fp8
    for name in fp8:
        grid = h[name + "_scale_inv"][1]
        assert h[name + "_scale_inv"][0] == "F32" and grid == [s // 128 for s in h[name][1]], name
        assert grid[0] * grid[1] >= 2, f"{name}: {grid} -- one block would not exercise block scales"
    assert sum(h[k + "_scale_inv"][1][0] * h[k + "_scale_inv"][1][1] for k in fp8) / len(fp8) >= 3
    w1 = h["layers.2.ffn.experts.3.w1.weight"]
    assert w1[0] == "I8" and w1[1] == [128, 128]  # [moe_intermediate, hidden / 2]: two FP4 per byte
    assert h["layers.2.ffn.experts.3.w1.weight_scale_inv"][1] == [128, 256 // 32]
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128] and q["expert_dtype"] == "fp4"
    assert release_size(tiny_config(**RELEASE_TINY_OVERRIDES)).file_bytes == index["metadata"]["total_size"]


@functools.lru_cache(maxsize=None)
def plain_model():
    plain, info = DeepseekV4ForCausalLM.from_pretrained(str(release_dir()), dtype=torch.float32,
                                                        output_loading_info=True, local_files_only=True)
    assert not any(info.values()), info  # every release name maps onto a model tensor, and back
    return plain.float().eval()  # bf16-stored tensors stay bf16 in a pre-quantised load


def test_plain_transformers_and_load_model_give_identical_logits():
    plain, ours = plain_model(), release_model()
    assert type(ours.hf.model.layers[0].self_attn.q_b_proj) is torch.nn.Linear  # dequantised on CPU
    assert {p.dtype for p in ours.hf.parameters()} == {torch.float32}
    ids = prompt(40, 3).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(ours.hf(ids, use_cache=False).logits, plain(ids, use_cache=False).logits)


def within_bounds(name, orig, deq, q, scale):
    """FP8: |err| <= |w|/16 + s*2^-10; FP4: |err| <= max(|w|, s)/4 (quant.py); s per element."""
    rows, cols = orig.shape
    s = scale.float().repeat_interleave(rows // scale.shape[0], 0).repeat_interleave(cols // scale.shape[1], 1)
    err = (deq - orig).abs()
    bound = orig.abs() / 16 + s * 2**-10 if q.dtype == torch.float8_e4m3fn else torch.maximum(orig.abs(), s) / 4
    worst = float((err - bound).max())
    assert worst <= 1e-7, f"{name} ({q.dtype}): error exceeds the bound by {worst:.3e}"
    assert float(err.max()) > 0, f"{name}: no quantisation error at all -- was it quantised?"


def test_dequantised_weights_within_stated_bounds():
    config = tiny_config(**RELEASE_TINY_OVERRIDES)
    model = release_model()
    orig = release_state_dict(random_model(config).state_dict())
    orig.update(to_checkpoint_names(random_mtp(config)))
    loaded = release_state_dict(model.hf.state_dict())
    loaded.update(to_checkpoint_names(load_mtp(model)))
    assert set(orig) == set(loaded)
    h = headers(release_dir())
    quantised = sorted(k for k in orig if h[k][0] in ("F8_E4M3", "I8"))
    assert len(quantised) > 50
    raw = stored(release_dir(), quantised + [k + "_scale_inv" for k in quantised])
    for name in quantised:
        q, scale = raw[name], raw[name + "_scale_inv"]
        within_bounds(name, orig[name], loaded[name], q, scale)
        # transformers' dequantisation (main model) and ours (MTP) are the same product
        assert torch.equal(loaded[name], dequantize_weight(name, q, scale)), name
    for name in sorted(set(orig) - set(quantised)):  # kept in bf16: rounding only
        a, b = orig[name].float(), loaded[name].float()
        assert torch.allclose(a, b, rtol=2**-8, atol=0), name


def test_reader_accepts_ue8m0_scales_named_scale_and_refuses_a_missing_scale(tmp_path):
    """V4-Flash's own files name the block scales `x.scale` and store them as UE8M0 (powers of two)."""
    from safetensors.torch import save_file

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(3))
    q, scale = quantize_fp8_blocks(w)
    pow2 = torch.exp2(torch.ceil(torch.log2(scale)))  # UE8M0 holds powers of two only
    q = (w.reshape(2, 128, 3, 128) / pow2[:, None, :, None]).reshape(256, 384).to(torch.float8_e4m3fn)
    save_file({"mtp.0.e_proj.weight": q, "mtp.0.e_proj.scale": pow2.to(torch.float8_e8m0fnu),
               "mtp.0.h_proj.weight": q.clone()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(dt.CheckpointError, match=r"mtp\.0\.h_proj\.weight is stored as torch\.float8_e4m3fn without a scale"):
        read_tensors(tmp_path, "mtp.0.")
    save_file({"mtp.0.e_proj.weight": q, "mtp.0.e_proj.scale": pow2.to(torch.float8_e8m0fnu)},
              str(tmp_path / "model.safetensors"))
    got = read_tensors(tmp_path, "mtp.0.")
    assert list(got) == ["mtp.0.e_proj.weight"]
    within_bounds("e_proj", w, got["mtp.0.e_proj.weight"], q, pow2)


def test_tree_verify_equals_per_path_runs():
    """The oracle is the model plain transformers loaded, independently of load_model."""
    model, plain = release_model(), plain_model()
    eng = engine_for(model, topk=3, steps=6, nodes=14)
    prompts = [prompt(45, 11), prompt(38, 12)]
    trees = [random_tree(int(p[-1]), 14, 6, 3, seed=20 + i) for i, p in enumerate(prompts)]
    out = eng.verify([eng.prefill(p) for p in prompts], trees)
    assert out.topk_ties == 0
    for b, (p, tree) in enumerate(zip(prompts, trees)):
        err = relative_error(out.logits[b], per_path_logits(plain, p[:-1], tree, apply_tie_rule=False))
        assert err < REL_TOL, f"request {b}: P={p.numel() - 1} N={tree.num_nodes} rel_err={err:.3e}"


def test_mtp_drafted_greedy_equals_plain_greedy(tmp_path):
    # the random tiny model's MTP block rarely agrees with it; the shipped trained checkpoint,
    # rewritten in the release format (FP4 experts, its linears too small for 128x128 blocks so
    # named in modules_to_not_convert), drafts well, so multi-token commits are exercised too
    trained = dt.load_model(dt.trained_checkpoint())
    d = write_release(tmp_path / "trained-release", trained.hf, load_mtp(trained))
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    assert "head" in q["modules_to_not_convert"] and "layers.0.attn.wq_b" in q["modules_to_not_convert"]
    for model, ids in ((dt.load_model(d), torch.tensor(list(b"def main(argv):\n    parser = argparse."))),
                       (release_model(), prompt(12, 5).repeat(2))):
        want = hf_greedy(model, ids, 20)
        # fixed depth: an adaptive depth decides on measured seconds, so under a loaded machine it
        # may stop early, and the multi-token check below would then depend on the clock
        eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=3, num_draft_tokens=6, draft_depth="fixed"))
        res = eng.generate(ids, 20, drafter=MtpDrafter(model, TreeShape(2, 3, 6)), progress=False)
        assert res.tokens == want
        if model.source == d:
            assert max(res.stats.accept_lengths) >= 3, res.stats.accept_lengths


def copy_release(tmp_path):
    d = tmp_path / "release"
    shutil.copytree(release_dir(), d)
    return d


def test_unknown_quantization_method_names_the_key(tmp_path):
    d = copy_release(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "awq"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dt.CheckpointError, match=r"config\.json: quantization_config\.quant_method is 'awq'"):
        dt.load_model(d)


def test_missing_shard_names_the_file(tmp_path):
    d = copy_release(tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(dt.CheckpointError, match=r"model-00002-of-00003\.safetensors.*missing"):
        dt.load_model(d)


def test_mtp_drafter_without_mtp_tensors_names_the_prefix(tmp_path):
    d = copy_release(tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (d / INDEX_FILE).write_text(json.dumps(index))
    (d / "model-00003-of-00003.safetensors").unlink()
    model = dt.load_model(d)  # the target model alone loads fine
    with pytest.raises(dt.CheckpointError, match=r"no MTP weights: no tensor named mtp\.0\.\*"):
        MtpDrafter(model, TreeShape(2, 3, 6))


def test_release_checkpoint_is_deterministic(tmp_path):
    again = dt.tiny_checkpoint(tmp_path / "again", format="release")
    for f in sorted(release_dir().iterdir()):
        assert f.read_bytes() == (again / f.name).read_bytes(), f.name


def test_cli_generate_and_demo_accept_the_release_checkpoint(capsys):
    d = str(release_dir())
    assert main(["generate", "--checkpoint", d, "--drafter", "mtp", "--max-new-tokens", "8", "--topk", "2",
                 "--num-steps", "3"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]) == 8
    assert main(["demo", "--checkpoint", d, "--rounds", "1", "--prompt-len", "30", "--topk", "2",
                 "--num-steps", "3"]) == 0
    assert "PASS" in capsys.readouterr().out


GPU = torch.cuda.is_available() and os.environ.get("DSV4_TREE_GPU") == "1"


def test_quantized_mode_is_checked_before_loading(monkeypatch):
    import transformers.utils

    with pytest.raises(dt.InputError, match=r"quantized must be one of \('dequantize', 'keep'\), got 'fp8'"):
        dt.load_model(release_dir(), quantized="fp8")
    with pytest.raises(dt.InputError, match=r"quantized='keep' keeps FP8 modules on a CUDA device; device is 'cpu'"):
        dt.load_model(release_dir(), device="cpu", quantized="keep")
    with pytest.raises(dt.InputError, match="quantized applies when loading a checkpoint directory"):
        dt.load_model(release_model(), quantized="keep")
    # past the device check as on a CUDA machine: what follows is refused before anything touches a device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(dt.InputError, match="holds no quantised checkpoint"):
        dt.load_model(dt.tiny_checkpoint(), device="cuda", quantized="keep")
    # no CUDA device is needed to reach the kernel checks: naming "cuda" is enough
    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda: False)
    with pytest.raises(dt.CheckpointError, match=r"need the `kernels` package"):
        dt.load_model(release_dir(), device="cuda", quantized="keep")
    from transformers.integrations import finegrained_fp8

    def offline():
        raise OSError("no connection to the Hub and no cached build")

    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda: True)
    monkeypatch.setattr(finegrained_fp8, "load_finegrained_fp8_kernel", offline)
    with pytest.raises(dt.CheckpointError, match="finegrained-fp8 kernel could not be loaded .OSError: no connection"):
        dt.load_model(release_dir(), device="cuda", quantized="keep")


def cuda_verify_error(model) -> float:
    """Tree verify of a 14-node tree on cuda against per-path runs of the same model."""
    eng = engine_for(model, topk=3, steps=6, nodes=14)
    p = prompt(45, 11).cuda()
    tree = random_tree(int(p[-1]), 14, 6, 3, seed=20)
    tree = dt.DraftTree(tree.tokens.cuda(), tree.parents.cuda())
    out = eng.verify([eng.prefill(p)], [tree])
    return relative_error(out.logits[0], per_path_logits(model, p[:-1], tree, apply_tie_rule=False))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA and DSV4_TREE_GPU=1")
def test_gpu_dequantized_release_verify_matches_per_path():
    model = dt.load_model(release_dir(), device="cuda", dtype=torch.float32)
    layer = model.hf.model.layers[1]
    assert type(layer.self_attn.q_b_proj) is torch.nn.Linear and layer.self_attn.q_b_proj.weight.is_cuda
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float32
    assert cuda_verify_error(model) < REL_TOL


KERNELS = is_kernels_available()  # transformers' FP8 modules need the `kernels` package


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or KERNELS, reason="needs CUDA and DSV4_TREE_GPU=1, without the `kernels` package")
def test_gpu_keep_is_refused_without_the_kernels_package():
    with pytest.raises(dt.CheckpointError, match=r"need the `kernels` package"):
        dt.load_model(release_dir(), device="cuda", dtype=torch.float32, quantized="keep")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or not KERNELS, reason="needs CUDA and DSV4_TREE_GPU=1, and the `kernels` package")
def test_gpu_keep_fp8_modules_and_verify_matches_per_path():
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    model = dt.load_model(release_dir(), device="cuda", dtype=torch.float32, quantized="keep")
    layer = model.hf.model.layers[1]
    assert isinstance(layer.self_attn.q_b_proj, FP8Linear)
    assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn and layer.self_attn.q_b_proj.weight.is_cuda
    assert isinstance(layer.mlp.experts, FP8Experts) and layer.mlp.experts.gate_up_proj.dtype == torch.int8
    assert model.hf.lm_head.weight.dtype == torch.float32  # stored bf16, cast to the dtype asked
    # FP8 GEMMs quantise activations per row (1 x 128 groups) on both sides, so rows are
    # independent, but an upstream 1e-6 difference can flip one activation's FP8 rounding
    assert cuda_verify_error(model) < 1e-2
