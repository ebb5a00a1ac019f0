"""The real Gemma-3-270M (Q4_K_M-dequantized, fp32): a second architecture, with sliding-window layers.

The set-up step fetches it (scripts/setup.sh), so these tests run rather than skip. One prompt is
longer than the model's 512-token window, so its 15 sliding layers hide keys from the tree's queries
that its 3 global layers still see: token-identical output there exercises the windowed tree mask on
real weights. Kept short (a 270M model with a 262144-token vocabulary is slow on a CPU): two prompts,
24 new tokens, block complexity 10, the tree-shaped methods past the window.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma3ForCausalLM

import mtprobe
from conftest import chat_ids
from mtprobe import models
from mtprobe.data import load_prompts
from mtprobe.target_model.sliding import SlidingWindow, sliding_window

SPEC = models.KNOWN_MODELS["gemma3-270m"]
NEW_TOKENS = 24
NEAR_TIE = 1e-5  # fp32 top-2 logit margin below which batched vs single-token arithmetic may flip argmax


@pytest.fixture(scope="module")
def gemma3():
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tok = models.load("gemma3-270m", dtype=torch.float32)
    return model, tok


def _prompt(tok, prompt_id: str) -> torch.Tensor:
    prompt = next(p for p in load_prompts() if p["id"] == prompt_id)
    return chat_ids(tok, prompt["messages"])  # [1, L]


def _assert_greedy(model, out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if torch.equal(out, ref):
        return
    n = min(out.shape[1], ref.shape[1])
    diff = (out[0, :n] != ref[0, :n]).nonzero()
    i = int(diff[0]) if len(diff) else n
    with torch.no_grad():
        top2 = model(ref[:, :i]).logits[0, -1].double().topk(2).values
    margin = float(top2[0] - top2[1])
    if margin < NEAR_TIE:
        pytest.xfail(f"{what}: first difference at token {i} is a float32 near-tie (margin {margin:.2e})")
    raise AssertionError(f"{what}: differs from greedy at token {i} (top-2 margin {margin:.3e})")


def test_real_gemma3_model(gemma3) -> None:
    model, tok = gemma3
    assert isinstance(model, Gemma3ForCausalLM)
    cfg = model.config
    assert cfg.num_hidden_layers == 18 and len(model.model.layers) == 18
    assert cfg.layer_types.count("sliding_attention") == 15 and cfg.layer_types.count("full_attention") == 3
    assert cfg.vocab_size == 262144 and cfg.sliding_window == 512
    assert model.dtype == torch.float32 and not model.training
    assert sliding_window(model) == SlidingWindow(512, per_layer_type=True)
    marker = json.loads((models.model_dir("gemma3-270m") / models.MARKER_FILE).read_text())
    assert marker["sha256"] == SPEC.sha256
    assert marker["members"] == [p.member for p in SPEC.parts]
    # Gemma 3's chat format, and the end of a model turn stops generation.
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert model.generation_config.eos_token_id == [1, tok.convert_tokens_to_ids("<end_of_turn>")]
    # Sensible text: the dequantized weights still know Python.
    ids = tok("def fibonacci(n):\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=24)
    completion = tok.decode(out[0, ids.shape[1] :])
    assert "return" in completion and "n" in completion, completion


@pytest.mark.parametrize(
    ("prompt_id", "methods"),
    [
        ("factual-mountain-boiling", ("hybrid",)),
        ("long-policy-taxi-claim", ("probe", "stand")),  # 582 tokens: past the 512 window
    ],
)
def test_real_gemma3_lossless(gemma3, prompt_id: str, methods: tuple[str, ...]) -> None:
    model, tok = gemma3
    ids = _prompt(tok, prompt_id)
    if prompt_id.startswith("long"):
        assert ids.shape[1] > model.config.sliding_window  # the window is exercised, not just configured
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)  # [1, L + new]
    configs = {
        "probe": mtprobe.ProbeConfig(block_complexity=10),
        "stand": mtprobe.StandConfig(block_complexity=10),
        "hybrid": mtprobe.HybridConfig(block_complexity=10),
    }
    for name in methods:
        out = mtprobe.generate(model, ids, configs[name], max_new_tokens=NEW_TOKENS)
        _assert_greedy(model, out.sequences, ref, f"gemma3-270m {name} on {prompt_id}")
        assert len(out.accept_lengths) == out.forward_calls - 1
