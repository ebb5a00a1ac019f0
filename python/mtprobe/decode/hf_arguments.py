"""What each argument of transformers' ``generate`` does to an mtprobe generation.

mtprobe runs inside ``model.generate`` (``mtprobe.generate`` calls it with
``custom_generate=mtprobe.custom_generate``), so ``generate`` first merges the call's arguments
into the model's ``generation_config`` and builds its logits processors and stopping criteria;
mtprobe then applies what it prepared. Every ``GenerationConfig`` attribute of the installed
transformers and every named parameter of ``generate`` is in :data:`HF_ARGUMENTS` with one of:

- ``honoured``: ``generate`` turns it into logits processors, stopping criteria, special tokens,
  lengths or the streamer, and mtprobe applies them exactly as greedy/sample decoding does;
- ``mapped``: it selects a drafter mtprobe has (prompt lookup, a draft model, an early-exit
  self-draft) and becomes that configuration (:func:`mtprobe.drafters.from_hf.resolve_config`);
- ``refused``: another decoding method or one whose output mtprobe cannot reproduce; a clear
  error names it and what to use instead (:func:`check_refused`, and ``generate.py``'s checks);
- ``inert``: it cannot change the tokens of one decoder-only sequence decoded greedily or by
  sampling (cache and compile settings, beam-search-only and encoder-decoder-only options,
  metadata), so mtprobe, which runs its own KV cache, has nothing to apply.

An argument counts as *set* when its merged value is not ``None`` and differs from transformers'
own default (``GenerationConfig._get_default_generation_params()``), the value ``generate`` fills in
when nobody set it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from mtprobe.drafters.from_hf import is_set

HONOURED = "honoured"
MAPPED = "mapped"
REFUSED = "refused"
INERT = "inert"
HANDLINGS = (HONOURED, MAPPED, REFUSED, INERT)


@dataclass(frozen=True)
class HFArgument:
    """One argument of transformers' ``generate`` and what mtprobe does with it."""

    name: str
    handling: str
    reason: str

    def __post_init__(self) -> None:
        if self.handling not in HANDLINGS:
            raise ValueError(f"handling={self.handling!r} must be one of {HANDLINGS}")


def _table(handling: str, reason: str, *names: str) -> dict[str, HFArgument]:
    return {n: HFArgument(n, handling, reason) for n in names}


_PROCESSOR = "a logits processor generate builds; mtprobe applies it to every tree node's own prefix"
_BEAM_ONLY = "beam search only: no effect with num_beams=1, in model.generate as in mtprobe"
_CACHE = (
    "cache and compile settings of HF's own loop: mtprobe runs its own KV cache; the tokens do not change"
)
_DEPRECATED_METHOD = (
    "{} is another decoding method (moved out of transformers to a Hub repo); mtprobe reproduces greedy "
    "decoding and sampling only"
)

HF_ARGUMENTS: dict[str, HFArgument] = {
    # Lengths, stopping, special tokens and outputs: prepared by generate, applied by mtprobe.
    **_table(
        HONOURED,
        "a length or stopping criterion generate prepares; mtprobe stops exactly where generate would",
        "max_length",
        "max_new_tokens",
        "max_time",
        "stop_strings",
        "stopping_criteria",
        "is_assistant",  # with assistant_confidence_threshold: HF's ConfidenceCriteria, a stopping criterion
    ),
    **_table(
        HONOURED,
        _PROCESSOR,
        "min_length",
        "min_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "top_h",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "repetition_penalty",
        "encoder_repetition_penalty",
        "no_repeat_ngram_size",
        "bad_words_ids",
        "renormalize_logits",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "sequence_bias",
        "logits_processor",
        "prefix_allowed_tokens_fn",
        "watermarking_config",  # WatermarkingConfig; SynthID's stateful processor is refused (check_refused)
    ),
    **_table(
        HONOURED,
        "greedy when False or unset, sampling when True: the merged value, as model.generate uses it "
        "(a model whose generation_config says do_sample=True samples unless the call passes do_sample=False)",
        "do_sample",
    ),
    **_table(
        HONOURED,
        "special tokens generate prepares (EOS stops the loop; pad/bos as generate sets them)",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
    ),
    **_table(
        HONOURED,
        "generate edits the prompt (token healing) before mtprobe sees it",
        "token_healing",
        "tokenizer",
    ),
    **_table(
        HONOURED, "return_dict_in_generate=True returns mtprobe.GenerateOutput", "return_dict_in_generate"
    ),
    **_table(HONOURED, "the streamer receives the prompt, then every accepted token", "streamer"),
    **_table(
        HONOURED,
        "GenerateOutput.scores / .logits: one [rows, vocab] float32 tensor per new token, the row it was chosen "
        "from, after the logits processors / raw (from the verifying forward: within rounding of HF's)",
        "output_scores",
        "output_logits",
    ),
    **_table(
        HONOURED,
        "with do_sample=True, that many sequences sampled in turn, each by its own loop, padded as HF pads "
        "them (greedy decoding refuses it, as model.generate does)",
        "num_return_sequences",
    ),
    **_table(HONOURED, "generate merges it with the model's generation_config first", "generation_config"),
    **_table(HONOURED, "mtprobe.custom_generate is this decoding method", "custom_generate"),
    # Drafters mtprobe has.
    **_table(
        MAPPED,
        "prompt lookup decoding: PromptLookupConfig(num_tokens=prompt_lookup_num_tokens, "
        "max_ngram_size=max_matching_ngram_size or 2)",
        "prompt_lookup_num_tokens",
        "max_matching_ngram_size",
    ),
    **_table(
        MAPPED,
        "draft-model speculative decoding: DraftModelConfig(draft_model=assistant_model, "
        "num_tokens=num_assistant_tokens)",
        "assistant_model",
        "num_assistant_tokens",
    ),
    **_table(
        MAPPED,
        "the target's first assistant_early_exit layers draft: DraftModelConfig(draft_model=None, "
        "num_draft_layers=assistant_early_exit, num_tokens=num_assistant_tokens)",
        "assistant_early_exit",
    ),
    # Refused: other methods, or outputs mtprobe cannot reproduce.
    **_table(
        REFUSED,
        "beam search: mtprobe decodes one sequence greedily or by sampling",
        "num_beams",
    ),
    **_table(
        REFUSED,
        "per-step attentions and hidden states are not collected by mtprobe's loop (a step's forward holds a "
        "whole draft tree)",
        "output_attentions",
        "output_hidden_states",
    ),
    **_table(REFUSED, "multi-GPU lockstep generation is not supported", "synced_gpus"),
    **_table(
        REFUSED,
        "the model's own multi-token-prediction heads: mtprobe does not run them; use a ProbeConfig "
        "(mask-token probing needs no extra heads) or a DraftModelConfig",
        "use_mtp",
    ),
    **_table(
        REFUSED,
        "a DFlash assistant (speculation_type='dflash') is not one of mtprobe's drafters; use a DraftModelConfig "
        "with a causal-LM draft model",
        "speculation_type",
    ),
    **_table(
        REFUSED,
        "ensemble verification accepts drafts against a mix of the target and the draft: lossy, and mtprobe "
        "is lossless; leave it unset",
        "assistant_ensemble_weight",
    ),
    **_table(
        REFUSED,
        "HF's adaptive draft length; mtprobe's draft model drafts num_tokens every step; "
        "use num_assistant_tokens_schedule='constant' and set num_assistant_tokens",
        "num_assistant_tokens_schedule",
    ),
    **_table(
        REFUSED,
        "HF's assistant stops drafting below this confidence; mtprobe's draft model drafts num_tokens every "
        "step; leave it unset and lower num_assistant_tokens instead",
        "assistant_confidence_threshold",
    ),
    **_table(
        REFUSED,
        "universal assisted decoding with another tokenizer: an mtprobe draft model must share the target's "
        "tokenizer; leave it unset and use a draft model with the target's vocabulary",
        "assistant_tokenizer",
        "assistant_lookbehind",
        "target_lookbehind",
    ),
    **_table(
        REFUSED,
        "classifier-free guidance runs the model on the negative prompt one token at a time in a stateful "
        "logits processor, which cannot score tree nodes; leave guidance_scale at 1",
        "guidance_scale",
        "negative_prompt_ids",
        "negative_prompt_attention_mask",
    ),
    **_table(REFUSED, _DEPRECATED_METHOD.format("contrastive search (penalty_alpha)"), "penalty_alpha"),
    **_table(REFUSED, _DEPRECATED_METHOD.format("DoLa (dola_layers)"), "dola_layers"),
    **_table(
        REFUSED,
        _DEPRECATED_METHOD.format("group beam search (num_beam_groups, diversity_penalty)"),
        "num_beam_groups",
        "diversity_penalty",
    ),
    **_table(
        REFUSED,
        _DEPRECATED_METHOD.format("constrained beam search (constraints, force_words_ids)"),
        "constraints",
        "force_words_ids",
    ),
    # Inert for the tokens of one decoder-only sequence.
    **_table(INERT, _BEAM_ONLY, "early_stopping", "length_penalty", "low_memory"),
    **_table(
        INERT,
        _CACHE,
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "prefill_chunk_size",
        "continuous_batching_config",
    ),
    **_table(
        INERT,
        "encoder-decoder models only; mtprobe decodes causal LMs",
        "encoder_no_repeat_ngram_size",
        "decoder_start_token_id",
    ),
    **_table(INERT, "metadata", "transformers_version"),
}


def _refuse(name: str, value: Any) -> ValueError:
    arg = HF_ARGUMENTS[name]
    return ValueError(f"{name}={value!r} is not supported by mtprobe: {arg.reason}")


def check_refused(generation_config: GenerationConfig) -> None:
    """ValueError for a refused argument that is set in the merged generation config
    (``num_beams``, ``output_*`` and ``synced_gpus`` are checked by
    generate.py, with NotImplementedError)."""
    gc = generation_config
    checks = {
        "use_mtp": bool(gc.use_mtp),
        "speculation_type": gc.speculation_type is not None,
        "assistant_ensemble_weight": gc.assistant_ensemble_weight is not None,
        "num_assistant_tokens_schedule": is_set(gc, "num_assistant_tokens_schedule"),
        # With is_assistant=True the threshold is HF's ConfidenceCriteria, a stopping criterion mtprobe applies.
        "assistant_confidence_threshold": is_set(gc, "assistant_confidence_threshold")
        and not gc.is_assistant,
        "assistant_lookbehind": is_set(gc, "assistant_lookbehind"),
        "target_lookbehind": is_set(gc, "target_lookbehind"),
        "guidance_scale": gc.guidance_scale is not None and gc.guidance_scale != 1,
        "penalty_alpha": gc.penalty_alpha is not None and gc.penalty_alpha > 0,
        "dola_layers": gc.dola_layers is not None,
        "num_beam_groups": is_set(gc, "num_beam_groups"),
        "diversity_penalty": is_set(gc, "diversity_penalty"),
        "constraints": gc.constraints is not None,
        "force_words_ids": gc.force_words_ids is not None,
    }
    for name, refused in checks.items():
        if refused:
            raise _refuse(name, getattr(gc, name))
    if type(gc.watermarking_config).__name__ == "SynthIDTextWatermarkingConfig":
        raise ValueError(
            "watermarking_config=SynthIDTextWatermarkingConfig is not supported by mtprobe: SynthID's logits "
            "processor keeps per-step state, which cannot score tree nodes; use WatermarkingConfig (stateless) or "
            "no watermark"
        )


def check_call_arguments(call_kwargs: dict[str, Any]) -> None:
    """ValueError for a refused argument of ``generate`` itself (not a GenerationConfig attribute)."""
    for name in ("assistant_tokenizer", "negative_prompt_ids", "negative_prompt_attention_mask"):
        if call_kwargs.get(name) is not None:
            raise ValueError(f"{name} is not supported by mtprobe: {HF_ARGUMENTS[name].reason}")
