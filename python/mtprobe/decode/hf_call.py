"""What transformers' ``generate`` hands a ``custom_generate``, read as mtprobe needs it: the prompts of
HF's batch without their padding, the stopping criteria split into what the C++ loop checks itself and
what it calls back, the call's own arguments (from ``generate``'s frame), the decoding mode, and HF's
logits processors applied with their results checked."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

logger = logging.getLogger("mtprobe.decode.generate")  # the one logger of a call: hf_call, call, sequence


@dataclass(frozen=True)
class Prompt:
    """One prompt of a batch: its tokens without the left padding, and that padding as given."""

    ids: torch.Tensor  # [1, L_b]
    padding: torch.Tensor  # [1, L - L_b]

    def padded(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[n, L_b + t]`` (rows of this prompt and what follows it) after the padding: ``[n, L + t]``."""
        if self.padding.shape[1] == 0:
            return ids
        return torch.cat([self.padding.to(ids.device).expand(ids.shape[0], -1), ids], dim=1)


def prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, count: int) -> list[Prompt]:
    """The prompts of HF's batch ``[batch * count, L]``, which repeated each row ``count`` times for
    ``num_return_sequences``, each without its left padding (the mask is checked already)."""
    if input_ids.shape[0] % count:
        raise ValueError(
            f"input_ids has {input_ids.shape[0]} rows, not a multiple of num_return_sequences={count}: "
            "transformers' generate repeats each prompt that many times before mtprobe decodes them"
        )
    prompts = []
    for row in range(0, input_ids.shape[0], count):
        group = input_ids[row : row + count]  # [count, L]
        if not bool((group == group[:1]).all()):
            raise ValueError(
                f"rows {row}..{row + count - 1} of input_ids should be copies of one prompt (transformers' generate "
                f"repeats each prompt num_return_sequences={count} times): call model.generate with the prompts, "
                "not with copies of them"
            )
        start = 0 if attention_mask is None else int((attention_mask[row] == 0).sum())
        prompts.append(Prompt(ids=input_ids[row : row + 1, start:], padding=input_ids[row : row + 1, :start]))
    return prompts


def split_stopping_criteria(
    criteria: StoppingCriteriaList, cfg: GenerationConfig
) -> tuple[int, list[int], StoppingCriteriaList]:
    """Length and EOS are checked natively in C++; anything else is called from the loop."""
    max_length = cfg.max_length
    eos: list[int] = []
    others = StoppingCriteriaList()
    for c in criteria:
        if isinstance(c, MaxLengthCriteria):
            max_length = min(max_length, c.max_length) if max_length is not None else c.max_length
        elif isinstance(c, EosTokenCriteria):
            eos += [int(t) for t in torch.as_tensor(c.eos_token_id).flatten().tolist()]
        else:
            others.append(c)
    return int(max_length), sorted(set(eos)), others


def hf_caller_locals() -> dict[str, Any]:
    """The local variables of transformers' ``generate`` when it called ``custom_generate`` (else {}).

    transformers 5.x hands a callable custom_generate only its own extra kwargs, dropping
    generate()'s ``streamer`` (after putting the prompt into it) and ``assistant_model``; its frame
    still holds them, and ``kwargs``: the call's generation arguments as the caller passed them.
    """
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    if caller is not None and caller.f_code.co_name == "generate":
        return dict(caller.f_locals)
    return {}


def call_arguments(caller: dict[str, Any]) -> dict[str, Any]:
    """generate()'s named arguments and keyword arguments as its caller passed them."""
    kwargs = caller.get("kwargs")
    args = dict(kwargs) if isinstance(kwargs, dict) else {}
    for name in ("negative_prompt_ids", "negative_prompt_attention_mask", "assistant_model"):
        if caller.get(name) is not None:
            args[name] = caller[name]
    return args


def decoding_mode(generation_config: GenerationConfig) -> str:
    """``"sample"`` or ``"greedy"``: what a generation with this (merged) generation config does.

    transformers' rule (``GenerationConfig.get_generation_mode``): sampling exactly when
    ``do_sample is True``; ``None`` and ``False`` decode greedily.
    """
    return "sample" if generation_config.do_sample is True else "greedy"


def log_decoding_mode(
    model: PreTrainedModel, generation_config: GenerationConfig, caller: dict[str, Any]
) -> None:
    """INFO when sampling comes from the model's generation_config rather than from the call."""
    if decoding_mode(generation_config) != "sample":
        return
    call = call_arguments(caller)
    model_samples = getattr(getattr(model, "generation_config", None), "do_sample", None) is True
    if model_samples and "do_sample" not in call:
        logger.info(
            "sampling (do_sample=True) because %s's generation_config says do_sample=True, as model.generate does "
            "with it; the output is a sample, not the greedy text. Pass do_sample=False for greedy decoding "
            "(token-identical to model.generate(do_sample=False))",
            type(model).__name__,
        )


def apply_processors(
    processors: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """HF's processors one by one, as ``LogitsProcessorList`` chains them, with each result checked:
    a processor that returns None or another shape is named instead of failing deep in the loop."""
    for proc in processors:
        out = proc(ids, scores)
        if not isinstance(out, torch.Tensor) or out.shape != scores.shape:
            got = (
                type(out).__name__
                if not isinstance(out, torch.Tensor)
                else f"a tensor of shape {tuple(out.shape)}"
            )
            raise TypeError(
                f"logits processor {type(proc).__name__} returned {got}; a logits processor must return the "
                f"processed scores, a tensor of shape {tuple(scores.shape)} like the scores it was given"
            )
        # -inf is a processor's "never this token"; NaN and +inf are no score to choose from.
        if not bool(torch.isfinite(out).all()):
            broken = torch.isnan(out) | torch.isposinf(out)
            if bool((broken & ~(torch.isnan(scores) | torch.isposinf(scores))).any()):
                raise ValueError(
                    f"logits processor {type(proc).__name__} turned the model's finite scores into NaN or +inf: "
                    "no token can be chosen from them (the model's own logits are finite); fix the processor, "
                    "e.g. mask tokens with -inf rather than dividing by zero"
                )
        scores = out
    return scores
