"""What a transformers `generate` call asks for, read from the arguments transformers hands a
callable `custom_generate`, or refused with InputError when tree speculation cannot give
exactly what transformers' own decoding loop would."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import GenerationMode
from transformers.generation.logits_process import (
    LogitNormalization, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..errors import InputError

# Processors whose output row depends on that row's scores alone: applied to all tree nodes in
# one call, they give each node exactly what transformers computes for it.
ROW_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, LogitNormalization)
# Processors that read the scores and input_ids.shape[-1] only (EOS masked below a length):
# applied per node at the length transformers' input_ids would have there.
LENGTH_PROCESSORS = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)
# model kwargs transformers' generate adds itself; they change nothing we compute (the mask and
# positions are checked below, an empty cache is ignored)
OWN_MODEL_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "past_key_values", "use_cache"}
OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# generate's own arguments that a callable custom_generate never receives (read from its frame)
CALLER_ARGS = ("assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask")


@dataclass(frozen=True)
class HFRequest:
    """One `generate` call as our engine runs it."""

    prompts: list  # per row, the unpadded prompt (1-D int64 CPU tensors)
    budget: int  # new tokens per row: max_length - input_ids.shape[1]
    eos: tuple  # token ids that end a row (EosTokenCriteria's)
    pad: int | None  # what a finished row holds after its EOS
    do_sample: bool
    processors: tuple  # the LogitsProcessorList's items, all ROW_ or LENGTH_PROCESSORS
    return_dict: bool


def _refuse(what: str, why: str) -> InputError:
    return InputError(f"custom_generate=dsv4_tree.custom_generate cannot honour {what} exactly: {why}")


def check_config(gc) -> None:
    """The generation mode and output flags."""
    mode = gc.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise _refuse(f"generation mode {mode.value} (num_beams={gc.num_beams}, penalty_alpha={gc.penalty_alpha}, "
                      f"prompt_lookup_num_tokens={gc.prompt_lookup_num_tokens})",
                      "only greedy search (do_sample=False) and sampling (do_sample=True, num_beams=1) "
                      "are tree-verified")
    if gc.return_dict_in_generate:
        asked = [f for f in OUTPUT_FLAGS if getattr(gc, f, False)]
        if asked:
            raise _refuse(", ".join(f"{f}=True" for f in asked),
                          "speculation computes each token's logits in a tree verify, equal to transformers' only "
                          "to rounding, and no attentions or hidden states per step; return_dict_in_generate "
                          "returns sequences only")


def check_processors(logits_processor) -> tuple:
    known = ROW_PROCESSORS + LENGTH_PROCESSORS
    for proc in logits_processor:
        if type(proc) not in known:  # exact classes: a subclass may read more
            raise _refuse(f"the logits processor {type(proc).__name__}",
                          f"lossless acceptance applies processors that read only a row's scores or its length "
                          f"({', '.join(sorted(c.__name__ for c in known))}); unset the generation_config field "
                          "that adds it "
                          "(repetition_penalty, bad_words_ids, no_repeat_ngram_size, sequence_bias, ...) or "
                          "drop it from logits_processor")
    return tuple(logits_processor)



def stop_rules(stopping_criteria, width: int) -> tuple[int, tuple]:
    """(new tokens per row, EOS ids) from MaxLengthCriteria / EosTokenCriteria; others refused."""
    max_length, eos = None, set()
    for crit in stopping_criteria:
        if type(crit) is MaxLengthCriteria:
            max_length = crit.max_length if max_length is None else min(max_length, crit.max_length)
        elif type(crit) is EosTokenCriteria:
            eos |= set(torch.as_tensor(crit.eos_token_id).reshape(-1).tolist())
        else:
            raise _refuse(f"the stopping criterion {type(crit).__name__}",
                          "rounds stop on max_length / max_new_tokens and eos_token_id only "
                          "(max_time, stop_strings and custom criteria are not checked per token)")
    if max_length is None:
        raise _refuse("generation without max_length", "set max_new_tokens or max_length")
    budget = max_length - width
    if budget < 1:
        raise InputError(f"max_length={max_length} leaves no new token after input_ids of length {width}")
    return budget, tuple(sorted(eos))


def strip_padding(input_ids: torch.Tensor, attention_mask) -> list:
    """Per row, the prompt without its left padding."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InputError("custom_generate needs input_ids [batch, length] (inputs_embeds are not supported)")
    ids = input_ids.detach().cpu().long()
    if attention_mask is None:
        return list(ids)
    mask = attention_mask.detach().cpu()
    if tuple(mask.shape) != tuple(ids.shape):
        raise InputError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise InputError("attention_mask must hold only 0 and 1")
    keep = mask.long()
    real = keep.sum(1)
    prompts = []
    for b in range(ids.shape[0]):
        n = int(real[b])
        if n == 0:
            raise InputError(f"attention_mask row {b} masks every token: a row needs at least one")
        pad = ids.shape[1] - n
        if bool(keep[b, :pad].any()) or not bool(keep[b, pad:].all()):
            raise InputError(f"attention_mask row {b} is not left padding (zeros, then ones): decoder-only "
                             "batches must be left-padded")
        prompts.append(ids[b, pad:])
    return prompts


def check_model_kwargs(model_kwargs: dict, attention_mask) -> None:
    extra = sorted(set(model_kwargs) - OWN_MODEL_KWARGS)
    if extra:
        raise _refuse(f"model kwargs {extra}", "a tree verify runs the model on token ids only")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
        raise _refuse("past_key_values", "generation continues from a prompt, not from a filled cache "
                      "(pass the whole sequence as input_ids)")
    pos = model_kwargs.get("position_ids")
    if pos is not None and attention_mask is not None:
        mask = attention_mask.to(pos.device)
        want = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if pos.shape != want.shape or not bool((pos == want).all()):
            raise _refuse("position_ids", "positions are 0.. over each row's unpadded tokens")
    elif pos is not None:
        want = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
        if not bool((pos == want).all()):
            raise _refuse("position_ids", "positions are 0.. over each row's tokens")


def check_caller(caller: dict) -> None:
    """generate's own arguments that never reach a callable custom_generate."""
    for name in CALLER_ARGS:
        if caller.get(name) is not None:
            raise _refuse(f"{name}", "tree speculation drafts with the model's own MTP block or n-grams")
    if caller.get("synced_gpus"):
        raise _refuse("synced_gpus=True", "it is for DeepSpeed ZeRO-3 / FSDP models, whose weights are gathered per "
                      "forward; the engine runs an unsharded model or one sharded by transformers' TP / EP, whose "
                      "ranks it keeps in step itself (dsv4_tree/ranks.py)")


def read_request(input_ids, logits_processor, stopping_criteria, gc, model_kwargs: dict, caller: dict) -> HFRequest:
    check_config(gc)
    check_caller(caller)
    mask = model_kwargs.get("attention_mask")
    check_model_kwargs(model_kwargs, mask)
    processors = check_processors(logits_processor if logits_processor is not None else [])
    budget, eos = stop_rules(stopping_criteria if stopping_criteria is not None else [], input_ids.shape[1])
    prompts = strip_padding(input_ids, mask)
    # generate sets _pad_token_tensor (eos_token_id[0] when pad_token_id is None and there is an EOS)
    pad = getattr(gc, "_pad_token_tensor", None)
    pad = gc.pad_token_id if pad is None else pad
    pad = None if pad is None else int(torch.as_tensor(pad).reshape(-1)[0])
    return HFRequest(prompts, budget, eos, pad, bool(gc.do_sample), processors, bool(gc.return_dict_in_generate))
