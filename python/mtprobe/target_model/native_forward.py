"""The target's own forward in C++ for Llama-family models on the CPU, decided exactly (issue 67).

Through transformers' eager modules a one-token forward of SmolLM2-135M in float32 costs about three times
what streaming its weights does: torch's float32 GEMV reads at a third of the memory's pace, and module
calls and small tensor ops add the rest. :class:`mtprobe._C.TargetForward` (``csrc/decode/target_forward.h``)
runs a verification block of T inputs through the same decoder layers in one C++ call: every linear layer
reads its weights once for all of the block's inputs, from a copy packed in panels of 32 output features
(``csrc/core/panel_linear.h``: one contiguous stream per thread, no horizontal sums; the copy costs as many
bytes as the weights, ``TargetForward.panel_bytes``), and a layer's other work is a few loops over the
block's rows. The prompt's prefill runs through it too (on an AVX2 or AVX-512 CPU through the same panels,
which beat oneDNN's float32 GEMM at every length measured, :data:`SMALL_ROWS_PANELS`; without the panels
oneDNN's GEMM past :data:`SMALL_ROWS` inputs, where HF's linears take MKL's, at half oneDNN's rate on an AMD
CPU), and it writes the KV layout HF's forward reads, so either can run any step. Where the weights are 4- or
8-bit values already, blocks of a few inputs read those codes instead (:mod:`~mtprobe.target_model.weight_codes`).

**Exactly HF's tokens.** The C++ forward sums in another order than HF's, so its logits differ from HF's
by rounding (float32: about 1e-5 of their size; measured in ``benchmarks/results/native_forward/``). Under
greedy decoding the decode loop reads, with each step's verdict, the top-2 score margin of every row that
chose a token (the accepted path's nodes); where one is below :data:`MARGIN_BOUND`, far above any
difference measured, the step runs again through HF's own forward, which decides it (``out.exact_steps``).
The margin is read on the processed scores, so logits processors that move scores by at most a few times
the rounding (repetition penalties, masks, biases) keep the guarantee; the prefill's first token too. Under
sampling the distributions differ by that rounding only, as HF's batched and one-token forwards differ.

**bfloat16 models** (:data:`DTYPES`): the weights are read as bfloat16 (half float32's bytes) and widened,
and the forward computes in float32, so its logits sit nearer the float32 model's than HF's bfloat16 forward
does; they depart from HF's bfloat16 greedy where HF's bfloat16 rounding decides a near-tie (measured with
their margins in ``benchmarks/results/native_forward/``), as HF's own verification forwards in bfloat16 do.
No step is sent back to HF's forward there.

Where it does not apply, HF's forward runs and :func:`why_not_native` says why (logged once per model, and
in ``out.target_forward``): another architecture, a dtype other than float32 and bfloat16, a model off the
CPU, hooks on the model's modules (LoRA, user hooks), a plan, calibrated masks with layer offsets or a mask
LoRA, a drafter that reads another layer's hidden states. Sliding attention windows (Mistral's, Gemma 3's
sliding layers) are applied by the C++ forward itself, as HF's ``sliding_window_overlay`` applies them.
``MTPROBE_NATIVE_FORWARD=0`` turns it off; ``=1`` (forced) makes an unsupported model an error.
``MTPROBE_NATIVE_PANELS=0`` keeps no packed copy of the weights (:data:`PANELS_ENV`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from mtprobe import _C
from mtprobe._env import switch
from mtprobe.state import state_of
from mtprobe.target_model import weight_codes
from mtprobe.target_model.sliding import sliding_window
from mtprobe.tree_attention import NAME as TREE_ATTENTION

logger = logging.getLogger("mtprobe")

__all__ = [
    "DTYPES",
    "ENV",
    "PANELS_ENV",
    "STATIC_ROPE",
    "MARGIN_BOUND",
    "MODEL_TYPES",
    "VERSION",
    "native_forward",
    "version",
    "panels",
    "setting",
    "why_not_native",
]

DTYPES = (torch.float32, torch.bfloat16)
"""The models' dtypes the C++ forward runs. A bfloat16 model's weights are widened to float32 as they are read
and the forward computes in float32 (its cache holds bfloat16, as HF's): its tokens are HF's float32
model's up to rounding, which HF's own bfloat16 forward is not, so no step is sent back to HF's forward."""

STATIC_ROPE = ("default", "linear", "llama3", "yarn")
"""RoPE types whose frequencies do not change with the length: what the C++ forwards compute."""

ENV = "MTPROBE_NATIVE_FORWARD"
"""``0``: HF's forward always; ``1``: the C++ forward, an unsupported model an error; unset: where it applies."""

VERSION = "native v3"
"""The forward's version, part of a forward profile's key (a profile of HF's forward is not this one's). v2
(2026-11-29): blocks of more than :data:`SMALL_ROWS` inputs through oneDNN's float32 GEMM, the layers of one
input (q, k, v; gate, up) in one parallel region. v3 (2026-12-01): the linear layers from a copy of their
weights packed in panels (``csrc/core/panel_linear.h``), every block of a float32 model on an AVX-512 CPU
(:func:`small_rows`)."""

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
"""Architectures the C++ forward computes: pre-norm RMSNorm decoder layers, rotate-half RoPE, grouped-query
attention (Qwen2's q/k/v biases, Qwen3's per-head q/k norms), a SiLU-gated MLP; sliding attention windows
(Mistral's, Qwen2's, Gemma 3's layers). Gemma 3 (text): the embedding scaled by sqrt(hidden), RMSNorm's
weights as 1 + w, norms over the attention's and the MLP's outputs too, per-head q/k norms, a GELU-gated MLP
(tanh form), its own attention scale, and RoPE's base per layer type (sliding layers 10k, full ones 1M)."""

GEMMA = "gemma3_text"

MARGIN_BOUND = 1e-2
"""A greedy step is decided by the C++ forward only where every row that chose a token has a top-2 score
margin of at least this; below it, HF's forward decides the step. The C++ forward's logits differ from HF
greedy's own (one-token forwards on its own cache) by at most 9.2e-5 over 2,079 positions of 35 Spec-Bench
dev answers of SmolLM2-135M with forward v3 (the panels, their sums in blocks of 64, the prefill's too; 99.9th
percentile 7.4e-5; v2 with oneDNN's GEMM: 1.14e-4; the panels summed in one run of fused multiply-adds, not
landed: 3.9e-4), plain decoding and AutoConfig alike, and by at most 1e-4 on the tiny random models of the
tests: the bound leaves a factor of 109. 0.53 % of those positions had a margin below it
(benchmarks/results/native_forward/margins-panels.md, margins-onednn.md, margins.md)."""

SMALL_ROWS = 40
"""Without the panels (``MTPROBE_NATIVE_PANELS=0``), blocks of up to this many inputs run the small-batch kernel
(weights read once); larger ones a GEMM:
oneDNN's float32 matmul where torch has it (``csrc/runtime/onednn_linear.h``; on an AMD CPU twice the rate of
the MKL GEMM at::mm takes), else at::mm. On a 2-core AMD EPYC Zen 5, SmolLM2's 211 linear layers: the kernel
33.0 against oneDNN's 36.5 ms at 24 inputs, even from 32 to 48, oneDNN 74.4 against 80.4 at 64
(benchmarks/results/native_forward/kernels-onednn.md; against MKL's GEMM the kernel had won up to 64,
kernels.md)."""

SMALL_ROWS_PANELS = 1 << 30
"""A float32 model with its panels on an AVX-512 or AVX2 CPU: every block, the prefill's too, runs the panel kernel
(AVX-512: its 13 inputs a pass keep 26 accumulators in the 32 registers). On a 2-core AMD EPYC (Zen 4)
SmolLM2-135M's 211 linear layers took 84.7 against oneDNN's 112.5 ms at 64 inputs, 167.9 against 188.1 at 128,
960 against 1,013 at 700; a prefill of 64 tokens 79 against 110 ms, 300 tokens 381 against 409, 700 tokens 922
against 952 (benchmarks/results/native_forward/panels-kernels.md, panels-prefill.md). On a 2-core AMD EPYC with
AVX2 only (family 25 model 1), two runs: 64 tokens 123 / 101 against oneDNN's 174 / 147 ms, 128 tokens 227 / 202
against 262 / 255, 300 tokens 530 / 472 against 569 / 524, 700 tokens 1,275 / 1,205 against 1,403 / 1,283
(benchmarks/results/native_forward/panels-prefill-avx2.md; before 2026-12-01 12:00 such a CPU took oneDNN's
GEMM past 40 inputs)."""


SMALL_ROWS_BF16 = 16
"""The same for a bfloat16 model, whose larger blocks take bfloat16 GEMM (its rows rounded to bfloat16, as HF's
bfloat16 forward rounds them): the small-batch kernel widens each weight before its float32 multiply-adds, which
costs more than bfloat16's dot-product instructions once a block is compute-bound
(benchmarks/results/native_forward/curve-bf16.md)."""


def setting() -> str:
    """``MTPROBE_NATIVE_FORWARD`` as ``"off"``, ``"forced"`` or ``"auto"``; ValueError for another value."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("0", "false", "off", "no"):
        return "off"
    if raw in ("1", "true", "on", "yes", "force", "forced"):
        return "forced"
    raise ValueError(
        f"{ENV}={raw!r}: use 0 (HF's forward), 1 (the C++ forward, or an error) or leave it unset"
    )


PANELS_ENV = "MTPROBE_NATIVE_PANELS"
"""``0``: the C++ forward keeps no packed copy of the linear weights (it saves their bytes; blocks of more than 6
inputs then run the small-batch kernel on the model's own weights, past :data:`SMALL_ROWS` a GEMM); unset or
``1``: it keeps one (``csrc/core/panel_linear.h``)."""


def panels() -> bool:
    """Whether the C++ forward packs its linear weights in panels (``MTPROBE_NATIVE_PANELS``, on by default);
    ValueError for a value other than 0/1."""
    return switch(
        PANELS_ENV,
        "use 0 (no packed copy of the weights: less memory, slower blocks of 7 or more inputs), 1 or leave it "
        "unset (the copy)",
    )


def _linears(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    names = [*(f"self_attn.{n}_proj" for n in "qkvo"), *(f"mlp.{n}_proj" for n in ("gate", "up", "down"))]
    out = []
    for i, layer in enumerate(model.model.layers):
        out += [(f"model.layers.{i}.{n}", layer.get_submodule(n)) for n in names]
    return [*out, ("lm_head", model.get_output_embeddings())]


def layer_reason(cfg: Any) -> str:
    """Why a Llama-family config's layers are not what mtprobe's C++ decoders compute (a SiLU MLP, static
    RoPE, no tensor-parallel split), or ``""``."""
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} is not 'silu'"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope_type {rope!r} changes its frequencies with the length (static ones: {STATIC_ROPE})"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return f"pretraining_tp={cfg.pretraining_tp}"
    return ""


def gemma_reason(cfg: Any) -> str:
    """Why a Gemma 3 text config's layers are not what the C++ forward computes, or ``""``."""
    act = getattr(cfg, "hidden_activation", None)
    if act != "gelu_pytorch_tanh":
        return f"hidden_activation {act!r} is not 'gelu_pytorch_tanh'"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            return f"{name}={getattr(cfg, name)} (the C++ forward caps no logits)"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True (the C++ forward attends causally)"
    for layer_type, params in (getattr(cfg, "rope_parameters", None) or {}).items():
        rope = (params or {}).get("rope_type", "default")
        if rope not in STATIC_ROPE:
            return f"{layer_type}'s rope_type {rope!r} changes its frequencies with the length (static ones: {STATIC_ROPE})"
    return ""


def architecture_reason(model: PreTrainedModel) -> str:
    """Why ``model``'s layers are not what mtprobe's C++ decoders (this forward, the quantized self-draft's
    step) compute, or ``""``: its type, its layers' configuration, attention layer kinds other than full and
    sliding, a module layout other than ``model.layers`` and ``model.rotary_emb``, missing q/k norms."""
    cfg = model.config.get_text_config(decoder=True)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {MODEL_TYPES}"
    reason = gemma_reason(cfg) if model_type == GEMMA else layer_reason(cfg)
    if reason:
        return reason
    try:
        sliding_window(model)
    except NotImplementedError as e:  # chunked or linear attention layers
        return str(e)
    inner = getattr(model, "model", None)
    if getattr(inner, "layers", None) is None or getattr(inner, "rotary_emb", None) is None:
        return f"{type(model).__name__} has no model.layers and model.rotary_emb"
    if model_type in ("qwen3", GEMMA) and not all(
        hasattr(layer.self_attn, "q_norm") for layer in inner.layers
    ):
        return f"a {model_type} layer without q_norm and k_norm"
    return ""


def why_not_native(model: PreTrainedModel) -> str:
    """Why the C++ forward cannot run ``model``, or ``""`` where it can. Cheap: read at every generation."""
    if setting() == "off":
        return f"{ENV}=0"
    model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {MODEL_TYPES}"
    if model.device.type != "cpu" or model.dtype not in DTYPES:
        return f"the C++ forward runs float32 and bfloat16 models on the CPU; this one is {model.dtype} on {model.device}"
    reason = architecture_reason(model)
    if reason:
        return reason
    if getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION:
        return f"the model runs the {TREE_ATTENTION!r} attention, whose masks are ancestor bits (the C++ forward reads additive masks)"
    for name, module in _linears(model):
        if type(module) is not torch.nn.Linear:
            return f"{name} is a {type(module).__name__}, not a plain torch.nn.Linear (an adapter or a quantized layer)"
    hooked = next((n or "the model" for n, m in model.named_modules() if _hooks(m)), None)
    if hooked is not None:
        return f"{hooked} has forward hooks (LoRA, adapters or user hooks run only in HF's forward)"
    return ""


# transformers' own hooks that record outputs for output_hidden_states/output_attentions (installed on first
# use, kept): they change nothing the forward computes.
_RECORDING_HOOKS = "transformers.utils.output_capturing"


def _hooks(module: torch.nn.Module) -> bool:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return any(getattr(h, "__module__", None) != _RECORDING_HOOKS for h in hooks)


def native_forward(model: PreTrainedModel) -> _C.TargetForward | None:
    """The C++ forward of ``model``, or ``None`` where HF's runs (:func:`why_not_native`, logged once per
    model and reason). Built once per model and kept in its state; rebuilt when a parameter was replaced or
    written in place: torch's version counter (``copy_``, ``load_state_dict``, an optimizer's step) or, for a
    write through ``.data``, which torch does not count (PEFT's ``merge_and_unload`` adds to ``weight.data``),
    a change in any of :data:`SAMPLES` values spread over each parameter (:func:`sampled_bits`). ValueError
    where ``MTPROBE_NATIVE_FORWARD=1`` and it cannot run."""
    reason = why_not_native(model)
    state = state_of(model)
    if reason:
        if setting() == "forced":
            raise ValueError(f"{ENV}=1, but the C++ forward cannot run {type(model).__name__}: {reason}")
        if state.native_reason != reason:
            logger.info("mtprobe: the target's forwards run through HF's modules (%s)", reason)
        state.native, state.native_reason = None, reason
        return None
    # Replaced parameters (load_state_dict(assign=True)) and parameters written in place rebuild: the forward
    # reads its own copies of some (the panels; a bfloat16 model's norms and biases widened).
    params = [t.detach() for t in model.parameters()]
    key = (panels(), *((t.data_ptr(), t._version) for t in params))
    bits = sampled_bits(params)
    if state.native is None or state.native_key != key or not torch.equal(state.native_bits, bits):
        if state.native is not None:  # rewritten weights: a write through .data keeps the codes' stamps
            state.unsearched_codes.clear()
        state.native, state.native_key, state.native_reason = _build(model, _weights(model)), key, ""
        state.native_bits = bits
    # MTPROBE_NATIVE_CODES read at every generation: the codes found at the build used or not.
    state.native.quantized_rows = weight_codes.quantized_rows() if weight_codes.enabled() else 0
    return state.native


SAMPLES = 16
"""Values of each parameter :func:`native_forward` compares between calls (:func:`sampled_bits`)."""

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sampled_bits(tensors: list[torch.Tensor]) -> torch.Tensor:
    """About :data:`SAMPLES` values of each tensor, evenly spaced over it, as their bits (so that a NaN equals
    itself): [~SAMPLES * len(tensors)] int64. Why: a write through ``.data`` leaves torch's version counter
    as it was; one that rewrites a whole tensor (loading or merging weights) changes these values too. A write
    to a few elements between them goes unseen. Costs about a millisecond for SmolLM2's 272 tensors."""
    parts = []
    for t in tensors:
        flat = t.reshape(-1)
        part = flat[:: max(1, flat.numel() // SAMPLES)]
        parts.append(part.view(_SAME_SIZE_INT[part.element_size()]).long())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in _linears(model):
        out[f"{name}.weight"] = module.weight
        if module.bias is not None:
            out[f"{name}.bias"] = module.bias
    return out


def _build(model: PreTrainedModel, weights: dict[str, torch.Tensor]) -> _C.TargetForward:
    non_contiguous = [n for n, t in weights.items() if not t.is_contiguous()]
    if non_contiguous:
        # The embedding, norms and the GEMM path read the model's tensors in place (and the panels are packed
        # from them): a transposed or strided weight would need a copy of its own first.
        raise ValueError(
            f"the C++ forward reads the model's weights in place, and {non_contiguous[0]} is not contiguous; "
            f"call .contiguous() on it or set {ENV}=0"
        )
    args, kwargs = arguments(model)
    return _C.TargetForward(*args, **kwargs)


def arguments(model: PreTrainedModel) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What :class:`mtprobe._C.TargetForward` is built from: the model's own tensors (the embedding, each
    layer's norms and linear weights by name, the final norm, the head, RoPE's frequencies), shared, and
    its sizes."""

    # The weights' own 4- or 8-bit codes where the weights are such values (a float32 model's only).
    found = weight_codes.weight_codes(model, _linears(model)) if model.dtype == torch.float32 else {}
    codes = {id(module): found[name] for name, module in _linears(model) if name in found}

    def linear(module: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
        out = {f"{name}.weight": module.weight.detach()}
        if module.bias is not None:
            out[f"{name}.bias"] = module.bias.detach()
        q = codes.get(id(module))
        if q is not None:
            out |= {f"{name}.codes": q.codes, f"{name}.scale": q.scale}
            out |= {f"{name}.min": q.min} if q.min is not None else {}
        return out

    args, kwargs = model_layout(model, linear)
    packed = panels()
    return args, kwargs | {
        "small_rows": small_rows(model.dtype, packed),
        "panels": packed,
        "quantized_rows": weight_codes.quantized_rows() if codes else 0,
    }


def small_rows(dtype: torch.dtype, packed: bool = True) -> int:
    """Blocks of up to this many inputs take the small-batch or panel kernels, larger ones a GEMM (TargetForward's
    ``small_rows``): :data:`SMALL_ROWS_BF16` for a bfloat16 model, :data:`SMALL_ROWS_PANELS` for a float32 one
    with its panels (``packed``) where the CPU has AVX2 or AVX-512, else :data:`SMALL_ROWS`; 0 (GEMM always) without
    AVX2."""
    if not _C.small_batch_linear_simd():
        return 0
    if dtype == torch.bfloat16:
        return SMALL_ROWS_BF16
    return SMALL_ROWS_PANELS if packed and _C.panel_linear_isa() in ("avx512", "avx2") else SMALL_ROWS


def model_layout(
    model: PreTrainedModel, linear: Callable[[torch.nn.Module, str], dict[str, torch.Tensor]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What mtprobe's C++ decoders (this forward, the quantized self-draft's step) take of a model of
    :data:`MODEL_TYPES`: :func:`gemma_layout` or :func:`decoder_layout`, and each layer's sliding window."""
    gemma = model.config.get_text_config(decoder=True).model_type == GEMMA
    args, kwargs = gemma_layout(model, linear) if gemma else decoder_layout(model, linear)
    return args, kwargs | {"windows": windows(model)}


def windows(model: PreTrainedModel) -> list[int]:
    """Each layer's sliding window (0: full attention), as :func:`~mtprobe.target_model.sliding.sliding_window`
    reads the model's config."""
    cfg = model.config.get_text_config(decoder=True)
    window = sliding_window(model)
    if window is None:
        return [0] * cfg.num_hidden_layers
    if not window.per_layer_type:
        return [window.window] * cfg.num_hidden_layers
    return [window.window if t == "sliding_attention" else 0 for t in cfg.layer_types]


def gemma_layout(
    model: PreTrainedModel, linear: Callable[[torch.nn.Module, str], dict[str, torch.Tensor]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A Gemma 3 text model as :func:`decoder_layout` lays out a Llama: its RMSNorms' weights as the 1 + w they
    multiply by (float32 copies, as HF computes them), its sandwich norms as ``attn_out_norm`` and
    ``mlp_out_norm``, each sliding layer's RoPE frequencies as its ``inv_freq``; ``embed_scale`` and the
    GELU activation. ValueError where the layer types' RoPE scalings differ (the C++ forward takes one)."""
    cfg = model.config.get_text_config(decoder=True)
    rotary = model.model.rotary_emb

    def norm(module: torch.nn.Module) -> torch.Tensor:
        return (1.0 + module.weight.detach().float()).contiguous()

    scalings = {float(getattr(rotary, f"{t}_attention_scaling")) for t in set(cfg.layer_types)}
    if len(scalings) != 1:
        raise ValueError(f"Gemma 3's layer types scale RoPE differently ({sorted(scalings)}); set {ENV}=0")
    # The forward's own frequencies: the full-attention layers'; each other layer passes its own table.
    base = "full_attention" if "full_attention" in cfg.layer_types else cfg.layer_types[0]
    layers = []
    for layer, layer_type in zip(model.model.layers, cfg.layer_types, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        tensors = {
            "input_norm": norm(layer.input_layernorm),
            "post_norm": norm(layer.pre_feedforward_layernorm),
            "attn_out_norm": norm(layer.post_attention_layernorm),
            "mlp_out_norm": norm(layer.post_feedforward_layernorm),
            "q_norm": norm(attn.q_norm),
            "k_norm": norm(attn.k_norm),
        }
        if layer_type != base:
            tensors["inv_freq"] = getattr(rotary, f"{layer_type}_inv_freq").detach().float().contiguous()
        for n in "qkvo":
            tensors |= linear(attn.get_submodule(f"{n}_proj"), n)
        for n in ("gate", "up", "down"):
            tensors |= linear(mlp.get_submodule(f"{n}_proj"), n)
        layers.append(tensors)
    embedding = model.get_input_embeddings()
    args = (
        embedding.weight.detach(),
        layers,
        norm(model.model.norm),
        linear(model.get_output_embeddings(), "head"),
        getattr(rotary, f"{base}_inv_freq").detach().float().contiguous(),
    )
    kwargs = {
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "eps": float(cfg.rms_norm_eps),
        "scale": float(model.model.layers[0].self_attn.scaling),
        "rope_scaling": scalings.pop(),
        # HF multiplies by the scale in the weights' dtype (bfloat16: 25.25 for Gemma 3 270M's sqrt(640)).
        "embed_scale": float(embedding.embed_scale.to(embedding.weight.dtype)),
        "activation": "gelu_tanh",
    }
    return args, kwargs


def decoder_layout(
    model: PreTrainedModel, linear: Callable[[torch.nn.Module, str], dict[str, torch.Tensor]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A Llama-family model as mtprobe's C++ decoders take it (this forward and the quantized self-draft's
    step): ``(embed, layers, final_norm, head, inv_freq)`` and ``heads``, ``kv_heads``, ``eps``, ``scale``,
    ``rope_scaling``; each layer a dict of its norms (``input_norm``, ``post_norm``, ``q_norm`` and
    ``k_norm`` where the layer has them) and of what ``linear(module, name)`` makes of its projections
    (``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``; the output layer as ``head``)."""
    cfg = model.config.get_text_config(decoder=True)
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        tensors = {
            "input_norm": layer.input_layernorm.weight.detach(),
            "post_norm": layer.post_attention_layernorm.weight.detach(),
        }
        if hasattr(attn, "q_norm"):
            tensors |= {"q_norm": attn.q_norm.weight.detach(), "k_norm": attn.k_norm.weight.detach()}
        for n in "qkvo":
            tensors |= linear(attn.get_submodule(f"{n}_proj"), n)
        for n in ("gate", "up", "down"):
            tensors |= linear(mlp.get_submodule(f"{n}_proj"), n)
        layers.append(tensors)
    rotary = model.model.rotary_emb
    args = (
        model.get_input_embeddings().weight.detach(),
        layers,
        model.model.norm.weight.detach(),
        linear(model.get_output_embeddings(), "head"),
        rotary.inv_freq.detach().float().contiguous(),
    )
    kwargs = {
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "eps": float(cfg.rms_norm_eps),
        "scale": float(model.model.layers[0].self_attn.scaling),
        "rope_scaling": float(getattr(rotary, "attention_scaling", 1.0)),
    }
    return args, kwargs


def allocate(native: _C.TargetForward, layers: list[Any]) -> None:
    """The cache's layers (TreeKVLayer) allocated at their capacity, as HF's first update allocates them,
    unless they are already."""
    if not layers[0].is_initialized:
        empty = torch.empty(1, native.kv_heads, 0, native.head_dim, dtype=getattr(torch, native.dtype))
        for layer in layers:
            layer.lazy_initialization(empty, empty)


def forward_block(
    native: _C.TargetForward,
    layers: list[Any],  # the cache's layers (TreeKVLayer): buffers [1, kv_heads, capacity, head_dim]
    tokens: torch.Tensor,  # [n_tok] int64
    embeds: torch.Tensor | None,  # [n_emb, hidden]
    position_ids: torch.Tensor,  # [1, T]
    mask: torch.Tensor | None,  # [1, 1, T, P + T] additive, None for a causal chain
    prefix_len: int,
    want_hidden: bool,
    logits_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block (a prefill or a decode step) through ``native`` on the cache's buffers (room for it reserved
    by the caller; allocated here at a prefill): ``(logits [T, vocab], hidden [T, hidden] or None)``, rows
    before ``logits_from`` zeros, the layers' lengths advanced as HF's update advances them."""
    allocate(native, layers)
    keys = [layer.keys for layer in layers]
    values = [layer.values for layer in layers]
    block_mask = mask[0, 0].float() if mask is not None else None  # [T, P + T]; 0 and finfo.min stay apart
    logits, hidden = native.forward(
        tokens, embeds, position_ids[0], block_mask, prefix_len, keys, values, want_hidden, logits_from
    )
    T = position_ids.shape[-1]
    for layer in layers:
        layer.length = prefix_len + T
    # Hidden states in the model's dtype, as drafters' heads read HF's; the logits stay float32 (HF's
    # generate widens them to float32 before choosing too).
    return logits, (hidden.to(layers[0].keys.dtype) if hidden is not None else None)


CODES = " + codes"
"""Added to :data:`VERSION` where the forward runs small blocks on the weights' own codes
(:mod:`mtprobe.target_model.weight_codes`): a forward profile of one is not the other's."""


def version(native: _C.TargetForward) -> str:
    """``native``'s :data:`VERSION`, with :data:`CODES` where it holds the weights' codes and uses them."""
    return VERSION + (CODES if native.quantized_bytes > 0 and native.quantized_rows > 0 else "")


def describe(model: PreTrainedModel) -> str:
    """What ran the target's forwards: the C++ forward's :func:`version`, or HF's and why."""
    state = state_of(model)
    if state.native is not None:
        return version(state.native)
    return f"HF ({state.native_reason})" if state.native_reason else "HF"
