"""The alignment analysis tools on a tiny model, checked against facts that must hold."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from mtprobe.analysis import lemma_check, mask_alignment


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, max_position_embeddings=128
    )
    prompt = torch.randint(0, 64, (1, 6))
    seq = model.generate(prompt, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    return model, seq, prompt.shape[1]


def test_one_record_per_decode_position(tiny):
    model, seq, p = tiny
    records = mask_alignment(model, seq, p, top_k=4)
    assert [r.position for r in records] == list(range(p, seq.shape[1] - 1))
    assert all(r.cos_per_layer.shape == (model.config.num_hidden_layers + 1,) for r in records)


def test_layer_zero_is_the_embedding_cosine(tiny):
    # Before any layer the two states are the token's embedding and the mask embedding itself,
    # which starts as the prompt mean and moves by lambda towards each generated token.
    model, seq, p = tiny
    lam = 0.1
    records = mask_alignment(model, seq, p, top_k=4, mask_lambda=lam)
    e = model.get_input_embeddings().weight[seq[0]].float()  # [L, hidden]
    mask = e[:p].mean(0)
    for r in records:
        if r.position > p:
            mask = mask + lam * (e[r.position - 1] - mask)
        expected = torch.nn.functional.cosine_similarity(e[r.position], mask, dim=0)
        assert r.cos_per_layer[0].item() == pytest.approx(expected.item(), abs=1e-5)


def test_top1_hit_implies_topk_hit_and_lemma_direct_form_never_fails(tiny):
    model, seq, p = tiny
    records = mask_alignment(model, seq, p, top_k=4)
    assert all(r.topk_hit for r in records if r.top1_hit)
    report = lemma_check(model, records, top_k=4)
    assert report.n == len(records)
    assert report.violations_direct == 0  # a theorem for any norms
    assert 0 <= report.premise_paper <= report.n


def test_bad_arguments_are_named(tiny):
    model, seq, p = tiny
    with pytest.raises(ValueError, match="prompt_len"):
        mask_alignment(model, seq, seq.shape[1])
    with pytest.raises(ValueError, match=r"\[1, L\]"):
        mask_alignment(model, seq[0], p)
