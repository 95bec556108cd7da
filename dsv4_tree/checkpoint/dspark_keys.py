"""Every config key of a DeepSeek-V4 DSpark module that SGLang 0.5.23 reads, honoured or refused
by name (none ignored): what `DSparkSettings.from_config` applies besides the four core keys.

Honoured (beside `dspark_block_size`, `dspark_markov_rank`, `dspark_noise_token_id`,
`dspark_target_layer_ids`):

* `dspark_n_routed_experts`, `dspark_num_experts_per_tok`: the stages' MoE width, its top-k no
  larger than its expert count;
* `sample_from_anchor` (default true): false drafts from rows 1..gamma of a gamma + 1 row block;
* `confidence_head_with_markov` (default true): false makes the confidence head read h_k alone;
* `dspark_markov_head_type` / `markov_head_type` "vanilla" (the only head SGLang's V4 module
  builds), `dspark_use_dense_ffn` false (routed MoE stages), `enable_confidence_head` true,
  `hc_pre_from_prev_sublayer` false, `model_type` "deepseek_v4": the module this project builds.

Refused, naming the key: any other value of those; a V4.1-style module (`model_type`
"deepseek_v41" or `hc_pre_from_prev_sublayer` true: SGLang's V4.1 loop feeds DSpark the
*inputs* of its target layers and its stages carry no hc_head); `dspark_ffn_hidden_size` (a dense
FFN stage, not DeepSeek-V4's); the nested `dspark_config` / `dflash_config` objects and the
unprefixed `block_size` / `target_layer_ids` / `mask_token_id` / `markov_rank` when they differ
from the prefixed key (SGLang reads those only when the prefixed key is absent); any other
`dspark_*` key."""
from __future__ import annotations

from ..errors import CheckpointError

# the four keys every DSpark config carries (draft_weights.DSPARK_KEYS) and the two stage MoE keys
HONOURED = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids",
            "dspark_n_routed_experts", "dspark_num_experts_per_tok", "dspark_markov_head_type",
            "dspark_use_dense_ffn")
# what the module built here is; a key with another value asks for another module
FIXED = {"dspark_markov_head_type": "vanilla", "markov_head_type": "vanilla", "dspark_use_dense_ffn": False,
         "enable_confidence_head": True, "hc_pre_from_prev_sublayer": False, "model_type": "deepseek_v4"}
WHY = {
    "dspark_markov_head_type": "SGLang 0.5.23's DeepSeek-V4 DSpark builds the vanilla Markov head (W2 W1[prev]) only",
    "markov_head_type": "SGLang 0.5.23's DeepSeek-V4 DSpark builds the vanilla Markov head (W2 W1[prev]) only",
    "dspark_use_dense_ffn": "DeepSeek-V4's DSpark stages are routed-MoE layers (a dense FFN stage is MiniMax-M3's)",
    "enable_confidence_head": "SGLang 0.5.23's DeepSeek-V4 DSpark builds the confidence head whatever this key says, "
                              "so a module without one is not a V4 DSpark module",
    "hc_pre_from_prev_sublayer": "a V4.1-style module: SGLang's V4.1 loop feeds DSpark the inputs of its target layers "
                                 "and its stages carry no hc_head; only DeepSeek-V4 (layer outputs) is supported",
    "model_type": "only DeepSeek-V4's DSpark (model_type deepseek_v4: features on the target layers' outputs) is "
                  "supported; V4.1's loop reads layer inputs",
}
# unprefixed duplicates SGLang reads only when the prefixed key is absent
SHADOWED = {"block_size": "dspark_block_size", "target_layer_ids": "dspark_target_layer_ids",
            "mask_token_id": "dspark_noise_token_id", "markov_rank": "dspark_markov_rank"}
REFUSED = {
    "dspark_ffn_hidden_size": "a dense-FFN stage size (MiniMax-M3's DSpark); DeepSeek-V4's stages are routed MoE",
    "dspark_config": "DeepSeek-V4 DSpark configs carry flat dspark_* keys; the nested layout is not read",
    "dflash_config": "DeepSeek-V4 DSpark configs carry flat dspark_* keys; the nested DFlash layout is not read",
}


def _bool(cfg: dict, key: str, where: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise CheckpointError(f"{where}: {key} must be true or false, got {v!r}")
    return v


def check_keys(cfg: dict, where: str) -> dict:
    """Refuse what this project cannot draft as SGLang does; -> the honoured optional settings
    (sample_from_anchor, confidence_with_markov) as DSparkSettings keyword arguments."""
    for key in sorted(cfg):
        if key in REFUSED:
            raise CheckpointError(f"{where}: {key} is not supported: {REFUSED[key]}")
        if key.startswith("dspark_") and key not in HONOURED:
            raise CheckpointError(f"{where}: unknown DSpark config key {key} (known: {', '.join(HONOURED)}); "
                                  "it would change what the module drafts, so it is not ignored")
    for key, want in FIXED.items():
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(want, str) and isinstance(v, str):
            v = v.lower()
        if v != want:
            raise CheckpointError(f"{where}: {key} is {cfg[key]!r}, supported: {want!r} ({WHY[key]})")
    for key, prefixed in SHADOWED.items():
        if key in cfg and cfg[key] is not None and cfg[key] != cfg.get(prefixed):
            raise CheckpointError(f"{where}: {key} is {cfg[key]!r} but {prefixed} is {cfg.get(prefixed)!r}: SGLang "
                                  f"reads {prefixed}, so the two must agree (or drop {key})")
    return dict(sample_from_anchor=_bool(cfg, "sample_from_anchor", where, True),
                confidence_with_markov=_bool(cfg, "confidence_head_with_markov", where, True))
