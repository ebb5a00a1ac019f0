"""Inputs checked at the door (issue 16, item 4): every bad input is refused before decoding starts,
with an error that names the argument, what is wrong with it and what would be right. Tiny random
models of real transformers classes; both routes (mtprobe.generate and model.generate with
custom_generate=mtprobe.custom_generate) where both reach mtprobe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import mtprobe
from conftest import tiny_llama
from mtprobe.drafters import make_drafter
from mtprobe.drafters.base import SEED_MAX
from mtprobe.target_model import adapter
from mtprobe.target_model.adapter import check_causal_lm
from mtprobe.target_model.draft_checks import check_draft_model

VOCAB = 96  # tiny_llama's vocabulary
IDS = torch.tensor([[1, 5, 9, 13]])


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _hf(model, ids, **kwargs):
    return model.generate(ids, custom_generate=mtprobe.custom_generate, **kwargs)


def _mt(model, ids, **kwargs):
    return mtprobe.generate(model, ids, **kwargs)


ROUTES = {"mtprobe": _mt, "hf": _hf}


# --- a. token ids outside the vocabulary ---------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1])
def test_token_id_outside_vocabulary(model, route, bad):
    ids = torch.tensor([[1, 5, bad, 13]])
    msg = rf"input_ids holds token id {bad} at position 2, outside the model's vocabulary: token ids must be in \[0, {VOCAB}\)"
    with pytest.raises(ValueError, match=msg):
        ROUTES[route](model, ids, max_new_tokens=2)


def test_token_ids_at_the_vocabulary_edges_pass(model):
    ids = torch.tensor([[0, VOCAB - 1]])
    out = mtprobe.generate(model, ids, max_new_tokens=2)
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=2))


# --- b. attention_mask of another shape ----------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("length", [2, 7])
def test_attention_mask_of_another_length(model, route, length):
    mask = torch.ones(1, length, dtype=torch.long)
    with pytest.raises(
        ValueError, match=f"attention_mask has (shape \\(1, {length}\\)|length {length}) but input_ids"
    ):
        ROUTES[route](model, IDS, attention_mask=mask, max_new_tokens=2)


@pytest.mark.parametrize("route", ROUTES)
def test_attention_mask_shape_is_named_before_padding(model, route):
    # A mask of another length that also holds zeros: the shape is the first thing wrong with it.
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    with pytest.raises(
        ValueError, match=r"attention_mask has shape \(1, 6\) but input_ids has shape \(1, 4\)"
    ):
        ROUTES[route](model, IDS, attention_mask=mask, max_new_tokens=2)


def test_attention_mask_one_dimensional(model):
    with pytest.raises(ValueError, match=r"attention_mask has shape \(4,\) but input_ids has shape \(1, 4\)"):
        mtprobe.generate(model, IDS, attention_mask=torch.ones(4, dtype=torch.long), max_new_tokens=2)


# --- c. the meta device --------------------------------------------------------------------------


def test_input_ids_on_meta_device(model):
    with pytest.raises(ValueError, match="input_ids is on the meta device"):
        mtprobe.generate(model, IDS.to("meta"), max_new_tokens=2)


@pytest.mark.parametrize("route", ROUTES)
def test_model_on_meta_device(route):
    with torch.device("meta"):
        meta_model = tiny_llama()
    with pytest.raises(ValueError, match="LlamaForCausalLM has tensors on the meta device .*never loaded"):
        ROUTES[route](meta_model, IDS, max_new_tokens=2)


def test_offloaded_modules_may_be_meta():
    # accelerate's offloading leaves a hooked module's weights on the meta device and loads them at
    # every forward: not an unloaded model.
    m = tiny_llama()
    layer = m.model.layers[1]
    layer.to_empty(device="meta")
    with pytest.raises(ValueError, match="'model.layers.1."):
        check_causal_lm(m)
    layer._hf_hook = object()
    check_causal_lm(m)


def test_meta_parameters_named_before_meta_buffers():
    # The first meta tensor in named_parameters order, else in named_buffers order, as the message says.
    m = tiny_llama()
    m.model.embed_tokens.register_buffer("probe", torch.empty(1, device="meta"))
    with pytest.raises(ValueError, match="'model.embed_tokens.probe'"):
        check_causal_lm(m)
    m.model.layers[1].mlp.to_empty(device="meta")
    with pytest.raises(ValueError, match="'model.layers.1.mlp.gate_proj.weight'"):
        check_causal_lm(m)


@pytest.mark.parametrize("route", ROUTES)
def test_model_checked_once_per_call(route, model, monkeypatch):
    # The check walks the whole module tree: once per call, not again in custom_generate and HFAdapter.
    calls = []
    monkeypatch.setattr(adapter, "_first_meta_tensor", lambda m: calls.append(m))
    ROUTES[route](model, IDS, max_new_tokens=2)
    assert calls == [model]


# --- d. inputs_embeds ----------------------------------------------------------------------------


def test_inputs_embeds_on_hf_route(model):
    embeds = model.get_input_embeddings()(IDS)
    for ids in (None, IDS):
        with pytest.raises(NotImplementedError, match="inputs_embeds is not supported.*pass input_ids"):
            model.generate(
                ids, inputs_embeds=embeds, custom_generate=mtprobe.custom_generate, max_new_tokens=2
            )


def test_inputs_embeds_on_mtprobe_route(model):
    embeds = model.get_input_embeddings()(IDS)
    with pytest.raises(NotImplementedError, match="inputs_embeds is not supported"):
        mtprobe.generate(model, None, inputs_embeds=embeds, max_new_tokens=2)


# --- e. max_new_tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [3.5, "10", True, False, torch.tensor(True), np.float64(3.0), torch.tensor([3, 4])]
)
def test_max_new_tokens_not_an_int(model, value):
    with pytest.raises(TypeError, match=r"max_new_tokens must be an int >= 1 \(a number of tokens\), got"):
        mtprobe.generate(model, IDS, max_new_tokens=value)


@pytest.mark.parametrize("value", [3.5, True])
def test_max_new_tokens_not_an_int_hf_route(model, value):
    # (model.generate itself refuses a str before mtprobe sees it)
    with pytest.raises(TypeError, match="max_new_tokens must be an int >= 1"):
        _hf(model, IDS, max_new_tokens=value)


@pytest.mark.parametrize("value", [0, -3])
def test_max_new_tokens_below_one(model, value):
    with pytest.raises(ValueError, match=f"max_new_tokens={value} must be >= 1"):
        mtprobe.generate(model, IDS, max_new_tokens=value)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), torch.tensor(3)])
def test_max_new_tokens_integer_scalars_pass(model, route, value):
    ref = model.generate(IDS, do_sample=False, max_new_tokens=3)
    out = ROUTES[route](model, IDS, max_new_tokens=value)
    assert torch.equal(out.sequences if route == "mtprobe" else out, ref)


# --- f. a draft model with a shorter context -----------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_draft_model_context_too_short(model, route):
    draft = tiny_llama(seed=1, num_hidden_layers=1, max_position_embeddings=16)
    cfg = mtprobe.DraftModelConfig(draft_model=draft, num_tokens=3)
    msg = (
        r"the draft model's context is 16 positions, but this generation needs 24: prompt \(4 tokens\) \+ "
        r"max_new_tokens \(20\); the target's context is 256\. .*lower max_new_tokens to at most 12"
    )
    with pytest.raises(ValueError, match=msg):
        ROUTES[route](
            model, IDS, **{"config" if route == "mtprobe" else "mtprobe_config": cfg}, max_new_tokens=20
        )


def test_draft_model_context_enough_for_this_generation(model):
    # Shorter than the target's context, but long enough for what this call generates: accepted.
    draft = tiny_llama(seed=1, num_hidden_layers=1, max_position_embeddings=16)
    cfg = mtprobe.DraftModelConfig(draft_model=draft, num_tokens=3)
    out = mtprobe.generate(model, IDS, cfg, max_new_tokens=12)
    assert torch.equal(out.sequences, model.generate(IDS, do_sample=False, max_new_tokens=12))


def test_check_draft_model_names_a_prompt_longer_than_the_draft(model):
    draft = tiny_llama(seed=1, num_hidden_layers=1, max_position_embeddings=16)
    with pytest.raises(
        ValueError, match=r"context is 16 positions, but this generation needs 21.*shorten the prompt"
    ):
        check_draft_model(model, draft, prompt_len=20, max_new_tokens=1)
    check_draft_model(model, draft, prompt_len=10, max_new_tokens=6)


# --- g. seeds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [mtprobe.ProbeConfig, mtprobe.HybridConfig])
@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, 2**64, -(2**63)])
def test_seed_outside_its_range(config, seed):
    with pytest.raises(
        ValueError, match=rf"seed={seed} is out of range: a seed must be an int in \[0, 2\*\*63 - 1\]"
    ):
        config(seed=seed)


def test_seed_not_an_int():
    for seed in (True, 1.0, "1"):
        with pytest.raises(TypeError, match="seed must be an int"):
            mtprobe.ProbeConfig(seed=seed)


@pytest.mark.parametrize("config", [mtprobe.ProbeConfig, mtprobe.HybridConfig])
def test_largest_seed_reaches_the_cpp_drafter(model, config):
    # The whole accepted range crosses the binding (an int64 there).
    for seed in (0, SEED_MAX):
        make_drafter(model, config(mask_init="gaussian", seed=seed))


# --- h. bidirectional models ---------------------------------------------------------------------

_BERT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def _bert_lm_head(is_decoder: bool):
    return transformers.BertLMHeadModel(transformers.BertConfig(**_BERT, is_decoder=is_decoder)).eval()


@pytest.mark.parametrize(
    "build, setting",
    [
        (
            lambda: transformers.BertForMaskedLM(transformers.BertConfig(**_BERT)).eval(),
            "config.is_decoder=False",
        ),
        (lambda: _bert_lm_head(False), "config.is_decoder=False"),
        (
            lambda: transformers.RobertaForCausalLM(transformers.RobertaConfig(**_BERT)).eval(),
            "config.is_decoder=False",
        ),
        (
            lambda: transformers.Gemma3ForCausalLM(
                transformers.Gemma3TextConfig(
                    **_BERT, num_key_value_heads=1, head_dim=16, use_bidirectional_attention=True
                )
            ).eval(),
            "config.use_bidirectional_attention=True",
        ),
    ],
)
def test_bidirectional_model_is_refused(build, setting):
    m = build()
    msg = rf"{type(m).__name__} attends bidirectionally \({setting}\), so it is not a causal LM"
    with pytest.raises(TypeError, match=msg):
        mtprobe.generate(m, torch.tensor([[1, 2, 3]]), max_new_tokens=2)


def test_bidirectional_model_is_refused_on_hf_route():
    m = _bert_lm_head(False)
    with pytest.raises(TypeError, match=r"attends bidirectionally \(config.is_decoder=False\)"):
        _hf(m, torch.tensor([[1, 2, 3]]), max_new_tokens=2)


def test_causal_models_with_decoder_flags_pass():
    # BERT as a decoder is causal; GPT-NeoX carries is_decoder=False but always attends causally.
    check_causal_lm(_bert_lm_head(True))
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**_BERT))
    assert neox.config.is_decoder is False
    check_causal_lm(neox)


def test_block_complexity_beyond_the_context_is_refused():
    model = tiny_llama(max_position_embeddings=64)
    cfg = mtprobe.ProbeConfig(block_complexity=100)
    with pytest.raises(ValueError, match=r"block_complexity=100 exceeds the model's context of 64 positions"):
        mtprobe.generate(model, torch.tensor([[1, 2, 3]]), cfg, max_new_tokens=4)
