"""A batch of prompts, left-padded as transformers pads them for generation. Each prompt is decoded on its
own, without its padding, by the single-prompt loop: token-identical to greedy on that prompt alone, and
under sampling the same loop whose exactness the sampling tests prove. The output is laid out as HF's
batched generate returns it: ``[batch * n, L + longest]``, each row after its padding, the shorter ones
padded after their end; HF's processors and criteria see each row after its padding, as HF shows it."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import mtprobe
from conftest import NullStreamer, greedy_by_one_forward, tiny_llama
from mtprobe.data import load_prompts

PAD = 0
ROWS = [[3, 7, 11, 5, 3, 7], [9, 4, 2], [5, 5, 5, 5, 5, 5, 5, 1]]  # prompts of 6, 3 and 8 tokens
WIDTH = max(len(r) for r in ROWS)
IDS = torch.tensor([[PAD] * (WIDTH - len(r)) + r for r in ROWS])  # [3, WIDTH], left-padded
MASK = torch.tensor([[0] * (WIDTH - len(r)) + [1] * len(r) for r in ROWS])  # [3, WIDTH]
N_NEW = 12


def run_mtprobe(model, ids, config=None, **kw):
    return mtprobe.generate(model, ids, config, **kw).sequences


def run_hf(model, ids, config=None, **kw):
    return model.generate(ids, custom_generate=mtprobe.custom_generate, mtprobe_config=config, **kw)


ROUTES = {"mtprobe.generate": run_mtprobe, "model.generate": run_hf}
CONFIGS = {
    "probe": mtprobe.ProbeConfig(block_complexity=6),
    "stand": mtprobe.StandConfig(block_complexity=6),
    "pld": mtprobe.PromptLookupConfig(num_tokens=3),
    "hybrid": mtprobe.HybridConfig(block_complexity=8),
    "quantized-self-draft": mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=3),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def laid_out(singles: list[torch.Tensor], paddings: list[torch.Tensor]) -> torch.Tensor:
    """HF's batched layout of per-prompt outputs ``[1, L_b + new_b]``: each after its padding, the shorter
    ones padded with PAD after their end."""
    rows = [torch.cat([p, s[0]]) for s, p in zip(singles, paddings, strict=True)]
    width = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=PAD) for r in rows])


def paddings() -> list[torch.Tensor]:
    return [IDS[i, : WIDTH - len(r)] for i, r in enumerate(ROWS)]


def alone(model, **kw) -> list[torch.Tensor]:
    """Greedy ``model.generate`` on each prompt alone, without padding: ``[1, L_b + new_b]`` each."""
    return [model.generate(torch.tensor([r]), do_sample=False, max_new_tokens=N_NEW, **kw) for r in ROWS]


def eos_ending_one_row_early(model, row: int = -1) -> int:
    """A token greedy emits third in prompt ``row``'s continuation and nowhere in the others': as EOS it
    ends that row early, so the rows differ in length."""
    outs = alone(model)
    token = int(outs[row][0, len(ROWS[row]) + 2])
    others = [
        o[0, len(r) :].tolist() for i, (o, r) in enumerate(zip(outs, ROWS, strict=True)) if i != row % 3
    ]
    assert all(token not in o for o in others)
    return token


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", CONFIGS)
def test_each_row_is_greedy_on_its_prompt_alone(tiny, route, name):
    eos = eos_ending_one_row_early(tiny)
    kw = dict(attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    out = ROUTES[route](tiny, IDS, CONFIGS[name], **kw)
    expected = laid_out(alone(tiny, eos_token_id=eos, pad_token_id=PAD), paddings())
    assert (expected[-1] == PAD).sum() > (IDS[-1] == PAD).sum()  # the last row ended early
    assert torch.equal(out, expected)


def test_the_layout_is_hf_batched_generates(tiny):
    # HF's own batched greedy over the padded batch: the same tokens on this fp32 model (its padded
    # attention could in principle flip a near-tie; no margin here is that close).
    eos = eos_ending_one_row_early(tiny)
    kw = dict(attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(run_mtprobe(tiny, IDS, **kw), tiny.generate(IDS, **kw))


def test_the_output_keeps_count_of_every_row(tiny):
    out = mtprobe.generate(
        tiny, IDS, attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False, pad_token_id=PAD
    )
    assert len(out.sequence_outputs) == len(ROWS)
    for one, row in zip(out.sequence_outputs, ROWS, strict=True):
        assert one.sequences[0, : len(row)].tolist() == row  # each row's own output has no padding
    assert out.new_tokens == sum(o.new_tokens for o in out.sequence_outputs) == len(ROWS) * N_NEW
    assert out.accept_lengths == [a for o in out.sequence_outputs for a in o.accept_lengths]


def test_one_padded_prompt_keeps_its_padding(tiny):
    row = ROWS[1]
    out = run_mtprobe(tiny, IDS[1:2], attention_mask=MASK[1:2], max_new_tokens=N_NEW, do_sample=False)
    assert torch.equal(out, laid_out(alone(tiny)[1:2], paddings()[1:2]))
    assert out.shape == (1, WIDTH + N_NEW) and out[0, WIDTH - len(row) : WIDTH].tolist() == row


@pytest.mark.parametrize("pad", [False, True])
def test_a_forward_plan_serves_every_row(tiny, pad):
    # One plan (its fixed KV buffer, eager on the CPU) for the whole batch, each row in turn.
    out = mtprobe.generate(
        tiny, IDS, CONFIGS["probe"], attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False,
        pad_token_id=PAD, plan=mtprobe.PlanConfig(pad=pad),
    )  # fmt: skip
    assert torch.equal(out.sequences, laid_out(alone(tiny), paddings()))


class ForceAtWidth(LogitsProcessor):
    """Forces token 42 where a row reaches ``width`` tokens, and records the ids of each call."""

    def __init__(self, width: int):
        self.width = width
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.seen.append(input_ids.clone())
        at = input_ids.shape[1] == self.width
        return (
            torch.where(torch.arange(scores.shape[1]) == 42, 0.0, -torch.inf).expand_as(scores)
            if at
            else scores
        )


@pytest.mark.parametrize("route", ROUTES)
def test_processors_and_criteria_see_each_row_after_its_padding(tiny, route):
    # As HF's batched generate shows them: after the row's padding. A processor that reads the row's
    # length (min_new_tokens counts new tokens from the padded prompt's) acts at the same new token in
    # every row; handed a row without its padding, it would act later in the padded rows.
    force = ForceAtWidth(WIDTH + 2)
    kw = dict(
        attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False, pad_token_id=PAD, min_new_tokens=5,
        logits_processor=LogitsProcessorList([force]),
    )  # fmt: skip
    out = ROUTES[route](tiny, IDS, **kw)
    seen = list(force.seen)
    assert (out[:, WIDTH + 2] == 42).all()  # the third new token of every row
    assert torch.equal(out, tiny.generate(IDS, **kw))
    for ids in seen:
        assert any(torch.equal(ids[:, :WIDTH], IDS[i].expand(ids.shape[0], -1)) for i in range(len(ROWS)))


def test_sampled_rows_are_single_calls_in_order(tiny):
    # Each prompt's num_return_sequences copies together, as HF orders them; under one seed the batch
    # draws what single calls on the unpadded prompts draw, one after another.
    kw = dict(max_new_tokens=N_NEW, do_sample=True, num_return_sequences=2, pad_token_id=PAD)
    torch.manual_seed(7)
    out = run_hf(tiny, IDS, mtprobe.ProbeConfig(block_complexity=6), attention_mask=MASK, **kw)
    torch.manual_seed(7)
    singles = [
        mtprobe.generate(
            tiny, torch.tensor([r]), mtprobe.ProbeConfig(block_complexity=6), **kw
        ).sequence_outputs
        for r in ROWS
    ]
    expected = laid_out(
        [o.sequences for outs in singles for o in outs], [p for p in paddings() for _ in range(2)]
    )
    assert out.shape[0] == 2 * len(ROWS) and torch.equal(out, expected)


@pytest.mark.parametrize("route", ROUTES)
def test_bad_batches_are_named(tiny, route):
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    right = torch.tensor([r + [PAD] * (WIDTH - len(r)) for r in ROWS])
    right_mask = torch.tensor([[1] * len(r) + [0] * (WIDTH - len(r)) for r in ROWS])
    with pytest.raises(
        NotImplementedError, match=r"padding after the prompt \(row 0, position 6 on\).*padding_side"
    ):
        ROUTES[route](tiny, right, attention_mask=right_mask, **kw)
    hole = MASK.clone()
    hole[2, 4] = 0
    with pytest.raises(NotImplementedError, match=r"between real ones \(row 2, position 4\)"):
        ROUTES[route](tiny, IDS, attention_mask=hole, **kw)
    empty = MASK.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="every token of row 1 as padding"):
        ROUTES[route](tiny, IDS, attention_mask=empty, **kw)
    with pytest.raises(ValueError, match=r"holds 2: an attention mask marks each prompt token 1"):
        ROUTES[route](tiny, IDS, attention_mask=MASK * 2, **kw)
    bad = IDS.clone()
    bad[1, 7] = 96  # tiny_llama's vocabulary is 96 tokens
    with pytest.raises(ValueError, match=r"token id 96 at row 1, position 7"):
        ROUTES[route](tiny, bad, attention_mask=MASK, **kw)

    with pytest.raises(ValueError, match="streamer takes one sequence"):
        ROUTES[route](tiny, IDS, attention_mask=MASK, streamer=NullStreamer(), **kw)


@pytest.mark.parametrize("name", ["probe", "stand"])
def test_a_tokenized_batch_of_chat_prompts(smollm2, greedy, name):
    # What a notebook does: the tokenizer pads a batch of chat prompts on the left, model.generate decodes it.
    model, tok = smollm2
    texts = [
        tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
        for p in load_prompts()[:3]
    ]
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    assert len(set(enc["attention_mask"].sum(1).tolist())) == 3  # three lengths: every row but one padded
    config = mtprobe.ProbeConfig() if name == "probe" else mtprobe.StandConfig()
    out = model.generate(
        **enc,
        custom_generate=mtprobe.custom_generate,
        mtprobe_config=config,
        max_new_tokens=16,
        do_sample=False,
    )
    for row, mask, seq in zip(enc["input_ids"], enc["attention_mask"], out, strict=True):
        start = int((mask == 0).sum())
        ids, mine = row[None, start:], seq[None, start:]  # [1, L_b], [1, L_b + 16 or fewer, then padding]
        new = mine[:, ids.shape[1] :]
        ends = (new[0] == tok.eos_token_id).nonzero()
        mine = mine[:, : ids.shape[1] + (int(ends[0, 0]) + 1 if len(ends) else new.shape[1])]
        assert torch.equal(seq[:start], row[:start])
        assert greedy_by_one_forward(model, ids, mine, 16) or torch.equal(mine, greedy(model, ids, 16))


def test_the_text_generation_pipeline_batches(smollm2, monkeypatch):
    # transformers' pipeline pads each batch on the left and calls model.generate with the arguments it is
    # given: with custom_generate, every answer is greedy's on its prompt alone.
    import sys

    from transformers import pipeline

    module = sys.modules["mtprobe.decode.call"]  # where a call cuts its batch into prompts
    batches = []

    def prompts(input_ids, attention_mask, count):
        batches.append(None if attention_mask is None else attention_mask.sum(1).tolist())
        return split(input_ids, attention_mask, count)

    split = module.prompts
    monkeypatch.setattr(module, "prompts", prompts)
    model, tok = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    chats = [[{"role": "user", "content": p["messages"][0]["content"]}] for p in load_prompts()[3:6]]
    kw = dict(max_new_tokens=12, do_sample=False)
    alone = pipe(chats, **kw)  # HF greedy, one prompt at a time
    batched = pipe(chats, batch_size=3, custom_generate=mtprobe.custom_generate, **kw)
    assert [a[0]["generated_text"] for a in alone] == [b[0]["generated_text"] for b in batched]
    assert len(batches) == 1 and len(set(batches[0])) == 3  # one call, three prompts of three lengths
