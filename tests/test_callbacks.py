"""What the loop hands HF's callbacks (csrc/runtime/callbacks.h): stopping criteria get the processed
scores their token was chosen from, and a broken logits processor is named."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
)

import mtprobe
from conftest import tiny_llama

PROMPT = torch.tensor([[5, 17, 9, 33, 17, 9, 2]])

CONFIGS = {
    "probe": mtprobe.ProbeConfig(block_complexity=10),
    "stand": mtprobe.StandConfig(block_complexity=10),
    "lookahead": mtprobe.LookaheadConfig.for_block_complexity(10),
}


class Recorder(StoppingCriteria):
    """Stops at the n-th call; keeps what it was given."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.calls.append((input_ids.clone(), scores))
        return torch.full((input_ids.shape[0],), len(self.calls) >= self.n, dtype=torch.bool)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stopping_criteria_get_the_scores_of_each_token(name):
    model = tiny_llama(seed=5)
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    rec = Recorder(n=9)
    out = mtprobe.generate(
        model,
        PROMPT,
        CONFIGS[name],
        max_new_tokens=30,
        repetition_penalty=1.3,
        stopping_criteria=[rec],
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out.stop_reason == "stopping_criteria" and out.sequences.shape[1] == PROMPT.shape[1] + 9
    assert len(rec.calls) == 9
    for ids, scores in rec.calls:
        assert isinstance(scores, torch.Tensor) and scores.shape == (1, model.config.vocab_size)
        # The scores are the processed distribution after ids[:, :-1]: its argmax is the last token.
        with torch.no_grad():
            logits = model(ids[:, :-1]).logits[:, -1].float()
        expected = penalty(ids[:, :-1], logits)
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)
        assert int(scores.argmax()) == int(ids[0, -1])


class ReturnsNone(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores[:, 0] = -float("inf")  # forgot to return


class DropsRows(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores[:1, :]


@pytest.mark.parametrize(
    "processor, message",
    [
        (ReturnsNone(), r"logits processor ReturnsNone returned NoneType; a logits processor must return"),
        (
            DropsRows(),
            r"logits processor DropsRows returned a tensor of shape \(1, 96\); .* shape \(\d+, 96\)",
        ),
    ],
)
def test_a_broken_logits_processor_is_named(processor, message):
    model = tiny_llama(seed=5)
    with pytest.raises(TypeError, match=message):
        mtprobe.generate(
            model,
            PROMPT,
            mtprobe.ProbeConfig(block_complexity=10),
            max_new_tokens=8,
            logits_processor=LogitsProcessorList([processor]),
            eos_token_id=None,
            pad_token_id=0,
        )


class DividesByZero(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores / 0.0 * 0.0  # NaN everywhere: 0 * inf


class MasksWithMinusInf(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 1:] = -float("inf")  # a legitimate processor: only token 0 may follow
        return scores


def test_a_processor_that_makes_the_scores_nan_is_named_not_the_model():
    # The model's logits are finite; the processor turns them into NaN. The error names the processor,
    # not "the target model's logits are NaN or +inf" (that stays for a model whose own logits are).
    model = tiny_llama(seed=5)
    kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    for cfg in (mtprobe.ProbeConfig(block_complexity=10), mtprobe.PlainConfig()):
        with pytest.raises(
            ValueError, match=r"logits processor DividesByZero turned the model's finite scores into NaN"
        ):
            mtprobe.generate(
                model, PROMPT, cfg, logits_processor=LogitsProcessorList([DividesByZero()]), **kw
            )
    # -inf is a processor's "never": not refused, and the output is the processor's greedy choice.
    out = mtprobe.generate(
        model,
        PROMPT,
        mtprobe.ProbeConfig(block_complexity=10),
        logits_processor=LogitsProcessorList([MasksWithMinusInf()]),
        **kw,
    )
    assert out.sequences[0, PROMPT.shape[1] :].tolist() == [0] * 6
