"""The mask-token hooks: what a calibrated mask changes in the target's forward, at the mask inputs only.

A mask calibration (:mod:`mtprobe.target_model.mask_calibration`, learned by :mod:`mtprobe.offline.calibrate`)
may hold, beside its mask embeddings, layer offsets (:func:`layer_offsets`: one learned vector per decoder
layer, added to the masks' hidden state), a mask LoRA (:func:`mask_lora`: a low-rank change of the
layers' projections) and mask temperatures (:func:`scale_mask_logits`: the masks' logits divided by
them). The hooks act on a forward's inputs from ``start`` on (the mask tokens: a forward's embedding-only
inputs follow its token inputs) and on the forwards of the thread that made them only
(:func:`this_thread_only`). No draft or prompt token attends to a mask, so verification and the output
stay exactly the model's. Decoding sets them on its adapter (``HFAdapter.set_mask_layer_offsets``,
``set_mask_lora``, ``set_mask_temperature``, :mod:`mtprobe.target_model.adapter`); the calibration runs the
same hooks on forwards of masks only (``start`` 0). Imports nothing of mtprobe.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

__all__ = [
    "MASK_LORA_MODULES",
    "MaskLoRAFactors",
    "checked_layer_offsets",
    "checked_mask_lora",
    "checked_mask_temperature",
    "decoder_layers",
    "layer_offsets",
    "mask_input_hooks",
    "mask_lora",
    "mask_lora_factors",
    "mask_row_temperature",
    "prepared_layer_offsets",
    "prepared_mask_lora",
    "scale_mask_logits",
    "this_thread_only",
]


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The model's decoder layers, in order: the ``ModuleList`` of ``num_hidden_layers`` modules under
    ``model.get_decoder()`` (``model.model.layers`` in Llama-style models), or ValueError."""
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
        return layers
    for name, layers in model.named_modules():
        if name.split(".")[-1] in ("layers", "h", "blocks") and isinstance(layers, torch.nn.ModuleList):
            if len(layers) == n:
                return layers
    raise ValueError(
        f"{type(model).__name__}: found no list of its {n} decoder layers (model.get_decoder().layers, or a "
        "ModuleList named layers, h or blocks); calibrated layer offsets need it. Use a calibration "
        "without layer offsets (python -m mtprobe calibrate without --layer-offsets)"
    )


def checked_layer_offsets(offsets: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Layer offsets as ``[k, num_layers, hidden]`` (a ``[num_layers, hidden]`` set is k = 1), or a
    ValueError naming the shape a model of ``num_layers`` decoder layers wants."""
    shape = tuple(offsets.shape)
    if offsets.dim() == 2:
        offsets = offsets.unsqueeze(0)  # one set shared by every mask
    if offsets.dim() != 3 or offsets.shape[1] != num_layers:
        raise ValueError(
            f"layer offsets of shape {shape} for a model with {num_layers} decoder layers: "
            f"expected [{num_layers}, hidden] or [k, {num_layers}, hidden]"
        )
    return offsets


def this_thread_only(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` acting only on forwards run by the thread that made it, a no-op (None: nothing changed)
    elsewhere. mtprobe's hooks sit on the user's model, which other threads may be running at the same
    time (a server's workers, a notebook's background generation): their forwards must stay the model's."""
    owner = threading.get_ident()

    @functools.wraps(hook)
    def gated(*args: Any, **kwargs: Any) -> Any:
        return hook(*args, **kwargs) if threading.get_ident() == owner else None

    return gated


@contextlib.contextmanager
def layer_offsets(
    layers: torch.nn.ModuleList,
    offsets: torch.Tensor,  # [num_layers, hidden] or [k, num_layers, hidden]
    start: int,
) -> Iterator[None]:
    """While open, the input of decoder layer l gains ``offsets[l]`` at every position from ``start``
    on (the mask tokens: a forward's embedding-only inputs follow its token inputs).

    Calibrated mask tokens with layer offsets (mtprobe.offline.calibrate) are a mask embedding plus one learned
    vector per layer: more of the model's computation at the mask is fitted to predicting the token
    after next, while the model's weights and every token input's computation stay as they were (no
    draft token attends to a mask, so verification is untouched). Forward pre-hooks, removed on exit,
    acting on this thread's forwards only (:func:`this_thread_only`).

    ``[k, num_layers, hidden]`` offsets are one set per mask: the mask inputs come as runs of k
    chained masks m_1..m_k (csrc/drafters/mask_probe.cpp, mtprobe.offline.calibrate.mask_loss), so input
    ``start + i`` is mask ``i % k + 1`` and gains ``offsets[i % k, l]``.
    """
    offsets = checked_layer_offsets(offsets, len(layers))  # [k, num_layers, hidden]
    k = offsets.shape[0]
    # What each layer adds, built once per forward on the first layer's call (the mask count is the
    # forward's): [num_layers, hidden] for one set, [num_layers, n, hidden] for k sets, mask i % k + 1
    # at input start + i; each layer's hook then takes a view of it.
    per_layer: list[torch.Tensor] = []

    def hook(index: int) -> Callable[[torch.nn.Module, tuple, dict], tuple[tuple, dict]]:
        def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            h = args[0] if args else kwargs["hidden_states"]  # [batch, T, hidden]
            if not per_layer:
                if k == 1:
                    per_layer.append(offsets[0].to(h.dtype))
                else:
                    n = h.shape[1] - start
                    which = torch.arange(n, device=offsets.device) % k  # [n]
                    per_layer.append(offsets[which].transpose(0, 1).to(h.dtype))
            add = per_layer[0][index]  # [hidden] or [n, hidden]
            h = h + add if start == 0 else torch.cat([h[:, :start], h[:, start:] + add], dim=1)
            if args:
                return (h, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        return pre

    handles = [
        layer.register_forward_pre_hook(this_thread_only(hook(i)), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# The projections of a decoder layer a mask LoRA may adapt (Llama-style names: SmolLM2, Gemma 3, Qwen).
MASK_LORA_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def checked_mask_lora(lora: dict[str, torch.Tensor], layers: torch.nn.ModuleList) -> dict[str, torch.Tensor]:
    """``lora`` if every entry names a linear of ``layers`` with matching shapes, else a ValueError saying
    what is wrong. Keys ``"{layer}.{module}.A"`` (``[rank, in_features]``) and ``"...B"`` (``[out_features,
    rank]``), one pair per adapted linear, ``module`` one of :data:`MASK_LORA_MODULES`."""
    if not lora:
        raise ValueError("a mask LoRA needs at least one adapted linear (an A and a B matrix)")
    for key, t in lora.items():
        head, _, part = key.rpartition(".")
        index, _, name = head.partition(".")
        if part not in ("A", "B") or not index.isdigit() or name not in MASK_LORA_MODULES:
            raise ValueError(
                f"mask LoRA entry {key!r}: expected '<layer>.<module>.A' or '.B' with module one of "
                f"{', '.join(MASK_LORA_MODULES)}"
            )
        if int(index) >= len(layers):
            raise ValueError(
                f"mask LoRA entry {key!r} adapts decoder layer {index} but the model has {len(layers)} layers; "
                "learn one for this model with python -m mtprobe calibrate --mask-lora RANK"
            )
        linear = layers[int(index)].get_submodule(name)
        other = lora.get(f"{head}.{'B' if part == 'A' else 'A'}")
        if other is None:
            raise ValueError(f"mask LoRA entry {key!r} has no partner ({'B' if part == 'A' else 'A'} matrix)")
        a, b = (t, other) if part == "A" else (other, t)
        want_a = (a.shape[0], linear.in_features)
        want_b = (linear.out_features, a.shape[0])
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(
                f"mask LoRA {head}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the model's "
                f"{linear.in_features} -> {linear.out_features} linear: expected A [rank, {linear.in_features}] "
                f"and B [{linear.out_features}, rank]"
            )
    return lora


def checked_mask_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """``temperature`` as a ``[k]`` float32 tensor (1 <= k <= 4) if every entry is finite and > 0, else a
    ValueError saying what is wrong."""
    t = temperature
    if (
        not isinstance(t, torch.Tensor)
        or t.dim() != 1
        or not 1 <= t.shape[0] <= 4
        or not t.is_floating_point()
    ):
        raise ValueError(
            "a mask temperature is a floating [k] tensor, one per mask (1 <= k <= 4), got "
            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
        )
    if not (torch.isfinite(t).all() and (t > 0).all()):
        raise ValueError(f"mask temperatures must be finite and > 0, got {t.tolist()}")
    return t.detach().float()


def mask_row_temperature(temperature: torch.Tensor, n: int) -> torch.Tensor:
    """The temperature of each of ``n`` mask inputs ``[n]`` from the masks' ``temperature`` ``[k]``: runs of k
    chained masks m_1..m_k, so mask input i is mask ``i % k + 1``."""
    k = temperature.shape[0]
    return temperature.repeat(-(-n // k))[:n]  # [n]


def scale_mask_logits(
    logits: torch.Tensor,  # [T, vocab], modified in place
    row_temperature: torch.Tensor,  # [>= T - start], mask_row_temperature
    start: int,
) -> None:
    """Divide the logits of every mask input (rows ``start`` on) by its mask's temperature, in place.

    A calibrated mask's softmax is sharper than its hit rate warrants (SmolLM2's two-mask LoRA file:
    held-out loss 4.59 at T = 1, 4.15 at T = 1.4). The dynamic draft tree ranks candidates by path
    probability, products across depths, so miscalibrated depths misplace its nodes. Drafts only: no
    token's logits change, and so neither verification nor the output.
    """
    n = logits.shape[0] - start
    if n > 0:
        logits[start:].div_(row_temperature[:n, None])


# A mask LoRA ready to run: (decoder layer, module name, A.T [in, rank], B.T [rank, out]) per adapted linear.
MaskLoRAFactors = list[tuple[int, str, torch.Tensor, torch.Tensor]]


def mask_lora_factors(lora: Mapping[str, torch.Tensor]) -> MaskLoRAFactors:
    """``lora``'s ``"{layer}.{module}.A"`` / ``".B"`` pairs as the transposed factors the hooks of
    :func:`mask_lora` multiply by (views: gradients still reach ``lora``'s tensors)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in lora.items():
        head, _, part = key.rpartition(".")
        pairs.setdefault(head, {})[part] = t
    factors = []
    for head, ab in pairs.items():
        index, _, name = head.partition(".")
        factors.append((int(index), name, ab["A"].T, ab["B"].T))
    return factors


@contextlib.contextmanager
def mask_lora(
    layers: torch.nn.ModuleList,
    lora: Mapping[str, torch.Tensor] | MaskLoRAFactors,  # "{layer}.{module}.A": [rank, in], ".B": [out, rank]
    start: int,
) -> Iterator[None]:
    """While open, each adapted linear's output gains ``x @ A.T @ B.T`` at every input from ``start`` on
    (the mask tokens, after the forward's token inputs), and nothing elsewhere. ``lora``: the entries
    (:func:`checked_mask_lora`) or, prepared once for many forwards, their :func:`mask_lora_factors`.

    A mask LoRA (``python -m mtprobe calibrate --mask-lora RANK``) gives the model's computation at the
    masks more room than layer offsets do: a low-rank change of its projections, gated to the masks, as
    in "Your LLM Knows the Future" (Samragh et al., 2025). No draft or prompt token attends to a mask, so
    every token's computation, and so verification and the output, stay exactly as they were. Forward
    hooks (they fire whichever route runs the linear, :mod:`mtprobe.cpu.linear_routes`), removed on exit,
    acting on this thread's forwards only (:func:`this_thread_only`).
    """
    factors = mask_lora_factors(lora) if isinstance(lora, Mapping) else lora
    handles = []
    for index, name, a_t, b_t in factors:

        def hook(mod: torch.nn.Module, args: tuple, out: torch.Tensor, a_t=a_t, b_t=b_t) -> torch.Tensor:
            x = args[0]  # [batch, T, in]
            if a_t.dtype != x.dtype:
                a_t, b_t = a_t.to(x.dtype), b_t.to(x.dtype)
            if start == 0:  # calibration: every input a mask, and autograd through the sum
                return out + (x @ a_t) @ b_t
            # In place on the mask rows: decoding runs without autograd, and a copy of every row per
            # linear per forward would cost more than the rank-r product.
            out[:, start:] += (x[:, start:] @ a_t) @ b_t  # [batch, n_masks, out]
            return out

        handles.append(layers[index].get_submodule(name).register_forward_hook(this_thread_only(hook)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def mask_input_hooks(
    layers: torch.nn.ModuleList,
    offsets: torch.Tensor | None,  # [num_layers, hidden] or [k, num_layers, hidden]
    lora: Mapping[str, torch.Tensor] | MaskLoRAFactors | None,
    start: int,
) -> contextlib.AbstractContextManager[None] | None:
    """:func:`layer_offsets` and :func:`mask_lora` (either may be None) from input ``start`` on, as one
    context; None when there are neither."""
    if offsets is None and lora is None:
        return None
    return _mask_input_hooks(layers, offsets, lora, start)


@contextlib.contextmanager
def _mask_input_hooks(
    layers: torch.nn.ModuleList,
    offsets: torch.Tensor | None,
    lora: Mapping[str, torch.Tensor] | MaskLoRAFactors | None,
    start: int,
) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if offsets is not None:
            stack.enter_context(layer_offsets(layers, offsets, start))
        if lora is not None:
            stack.enter_context(mask_lora(layers, lora, start))
        yield


def prepared_layer_offsets(
    offsets: torch.Tensor, layers: torch.nn.ModuleList, like: torch.Tensor
) -> torch.Tensor:  # [k, num_layers, hidden]
    """``offsets`` checked against ``layers`` (:func:`checked_layer_offsets`) and cast once to ``like``'s
    device and dtype, not in every layer's hook of every forward."""
    return checked_layer_offsets(offsets, len(layers)).to(like.device, like.dtype)


def prepared_mask_lora(
    lora: dict[str, torch.Tensor], layers: torch.nn.ModuleList, like: torch.Tensor
) -> MaskLoRAFactors:
    """``lora`` checked against ``layers`` (:func:`checked_mask_lora`) as its :func:`mask_lora_factors`:
    transposed, contiguous and cast once to ``like``'s device and dtype, not in each of the hooks of
    every forward."""
    return [
        (i, name, a_t.to(like.device, like.dtype).contiguous(), b_t.to(like.device, like.dtype).contiguous())
        for i, name, a_t, b_t in mask_lora_factors(checked_mask_lora(lora, layers))
    ]
