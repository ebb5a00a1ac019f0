"""``output_scores`` and ``output_logits``, as transformers returns them: one ``[rows, vocab]`` float32
tensor per new token, the row that token was chosen from (after the logits processors / raw). mtprobe
takes them from the forward that verified each token, so they sit within rounding of greedy
``generate``'s own cached forwards (``CACHED_VS_FULL_BOUND``), and their argmax is the token exactly."""

from __future__ import annotations

import pytest
import torch
from transformers.utils import ModelOutput

import mtprobe
from conftest import CACHED_VS_FULL_BOUND, tiny_llama
from test_batch import CONFIGS, MASK, PAD, ROWS
from test_batch import IDS as BATCH

IDS = torch.tensor([[3, 7, 11, 5, 3, 7, 11, 5, 3, 7]])
N_NEW = 16
FLAGS = dict(output_scores=True, output_logits=True, return_dict_in_generate=True)


def run_mtprobe(model, ids, config=None, **kw):
    return mtprobe.generate(model, ids, config, **kw)


def run_hf(model, ids, config=None, **kw):
    return model.generate(ids, custom_generate=mtprobe.custom_generate, mtprobe_config=config, **kw)


ROUTES = {"mtprobe.generate": run_mtprobe, "model.generate": run_hf}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def assert_rows_close(mine: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> None:
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, atol=CACHED_VS_FULL_BOUND, rtol=0)  # -inf where HF has -inf


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_scores_and_logits_are_hfs(tiny, route, name):
    # A repetition penalty makes the scores differ from the raw logits.
    kw = dict(max_new_tokens=N_NEW, do_sample=False, repetition_penalty=1.3, **FLAGS)
    out = ROUTES[route](tiny, IDS, CONFIGS[name], **kw)
    ref = tiny.generate(IDS, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert_rows_close(out.scores, ref.scores)
    assert_rows_close(out.logits, ref.logits)
    new = out.sequences[0, IDS.shape[1] :]
    assert torch.equal(torch.cat(out.scores).argmax(-1), new)  # exactly the tokens chosen
    assert not torch.equal(torch.cat(out.scores), torch.cat(out.logits))
    mine = tiny.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    theirs = tiny.compute_transition_scores(ref.sequences, ref.scores, normalize_logits=True)
    torch.testing.assert_close(mine, theirs, atol=CACHED_VS_FULL_BOUND, rtol=0)


def test_without_the_flags_nothing_is_kept(tiny):
    out = mtprobe.generate(tiny, IDS, max_new_tokens=4, do_sample=False)
    assert out.scores is None and out.logits is None
    only = mtprobe.generate(tiny, IDS, max_new_tokens=4, do_sample=False, output_logits=True)
    assert only.scores is None and len(only.logits) == 4


@torch.no_grad()
def test_sampled_scores_are_the_warped_logits(tiny):
    # Under sampling the scores are what the token was drawn from: the raw logits through HF's
    # temperature and top-k; the raw logits are one forward's over the sampled sequence.
    torch.manual_seed(3)
    out = mtprobe.generate(
        tiny, IDS, max_new_tokens=N_NEW, do_sample=True, temperature=0.7, top_k=5, top_p=1.0, **FLAGS
    )
    new = out.sequences[0, IDS.shape[1] :]
    logits, scores = torch.cat(out.logits), torch.cat(out.scores)  # [new, vocab]
    full = tiny(out.sequences).logits[0, IDS.shape[1] - 1 : -1]  # [new, vocab]
    torch.testing.assert_close(logits, full, atol=CACHED_VS_FULL_BOUND, rtol=0)
    warped = logits / 0.7
    kth = warped.topk(5, dim=-1).values[:, -1:]  # [new, 1]
    torch.testing.assert_close(scores, warped.masked_fill(warped < kth, -torch.inf))
    assert (scores.isfinite().sum(-1) == 5).all()
    assert scores.gather(1, new[:, None]).isfinite().all()  # every token drawn from its own row


def test_a_batch_has_a_row_per_sequence_and_zeros_after_an_end(tiny):
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, output_scores=True, output_logits=True)
    singles = [mtprobe.generate(tiny, torch.tensor([r]), **kw) for r in ROWS]
    eos = int(singles[-1].sequences[0, len(ROWS[-1]) + 2])  # ends the last row after three tokens
    singles = [mtprobe.generate(tiny, torch.tensor([r]), eos_token_id=eos, **kw) for r in ROWS]
    assert [s.new_tokens for s in singles] == [12, 12, 3]
    out = mtprobe.generate(tiny, BATCH, attention_mask=MASK, eos_token_id=eos, **kw)
    for field in ("scores", "logits"):
        rows = getattr(out, field)
        assert len(rows) == 12 and all(r.shape == (3, tiny.config.vocab_size) for r in rows)
        for i, single in enumerate(singles):
            mine = torch.cat([r[i : i + 1] for r in rows])  # [12, vocab]
            theirs = torch.cat(getattr(single, field))  # [new_i, vocab]
            # Each row is its single call's: the batch's rows go through one C++ forward together
            # (mtprobe.decode.batch), whose linear layers over more rows may round differently.
            torch.testing.assert_close(mine[: len(theirs)], theirs, atol=1e-4, rtol=1e-4)
            assert (mine[len(theirs) :] == 0).all()
    assert out.batch == len(ROWS)


def test_smollm2_scores_are_greedys(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "List three uses of copper."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    kw = dict(max_new_tokens=24, do_sample=False, **FLAGS)
    out = mtprobe.generate(model, ids, mtprobe.ProbeConfig(), **kw)
    ref = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert_rows_close(out.scores, ref.scores)
    assert_rows_close(out.logits, ref.logits)


@pytest.mark.parametrize(
    "flags",
    [
        dict(return_dict_in_generate=True),
        dict(return_dict_in_generate=True, output_scores=True),
        dict(return_dict_in_generate=True, output_logits=True),
        FLAGS,
    ],
    ids=["plain", "scores", "logits", "both"],
)
def test_the_output_reads_as_hfs_generate_output(tiny, flags):
    kw = dict(max_new_tokens=6, do_sample=False, **flags)
    out = run_hf(tiny, IDS, mtprobe.PromptLookupConfig(), **kw)
    ref = tiny.generate(IDS, **kw)
    # HF's keys are its set fields; mtprobe has them all but the cache (``cache``, ``past_key_values``
    # before transformers 5.2x), in HF's order.
    assert isinstance(out, ModelOutput)
    assert list(out.keys()) == [k for k in ref.keys() if k not in ("cache", "past_key_values")]
    assert (
        list(out) == list(out.keys()) and dict(out).keys() == set(out.keys()) and len(out) == len(out.keys())
    )
    for key in out.keys():
        assert key in out
        assert len(out.to_tuple()) == len(out.keys())
    assert torch.equal(out["sequences"], ref["sequences"]) and torch.equal(out[0], ref[0])
    assert torch.equal(out.to_tuple()[0], ref.to_tuple()[0])
    if "scores" in ref:
        assert_rows_close(out["scores"], ref["scores"])
    if "logits" in ref:
        assert_rows_close(out["logits"], ref["logits"])
    assert out.attentions is None and out.hidden_states is None  # as HF's without those flags
    assert out.past_key_values is None and out.cache is None
    for key in ("cache", "past_key_values"):
        with pytest.raises(KeyError, match="mtprobe returns no cache"):
            out[key]
    with pytest.raises(KeyError, match=r"'tau' is not in this GenerateOutput.*out\.tau"):
        out["tau"]
    if "scores" not in ref:
        with pytest.raises(KeyError, match="output_scores=True"):
            out["scores"]


def test_the_pipeline_reads_the_output_as_hfs(smollm2):
    # transformers' text-generation pipeline takes a ModelOutput's sequences and its per-token scores.
    from transformers import pipeline

    model, tok = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    theirs = pipe("The capital of Italy is", **kw)[0]
    mine = pipe("The capital of Italy is", custom_generate=mtprobe.custom_generate, **kw)[0]
    assert mine["generated_text"] == theirs["generated_text"]
    mine_scores, their_scores = (
        torch.tensor(mine["scores"]),
        torch.tensor(theirs["scores"]),
    )  # lists in its output
    assert mine_scores.shape == their_scores.shape == (6, model.config.vocab_size)  # [new tokens, vocab]
    torch.testing.assert_close(mine_scores, their_scores, atol=CACHED_VS_FULL_BOUND, rtol=0)
