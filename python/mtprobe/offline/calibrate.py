"""Calibrated mask tokens: k mask embeddings learned once per model (beyond seed 001).

Seed 001 builds its mask tokens from the prompt (the mean of its embeddings) and nudges them toward
every generated token. Nothing in that choice is fitted to what a mask is for: its logits should
predict the token after next. Here the k mask embeddings (k x hidden numbers, nothing else; the
model's weights stay frozen) are learned by gradient descent so that, placed as in decoding, they
do exactly that:

    sequence  x_0 .. x_{n-1}        the model's own greedy continuation of a calibration prompt
    anchor p  a node of the sequence; mask j (1..k) sits at position p + j, attends to x_0..x_p
              and to masks 1..j-1 of the same anchor (the chained masks of csrc/drafters/mask_probe.h)
    loss      mean over anchors p and masks j of  -log softmax(logits(m_j at p))[x_{p+j+1}]

The model's own generations are the data because they are what verification compares against:
a draft is accepted iff it equals the model's greedy token (self-distillation). The sequences'
tokens run once per sequence without gradients (their keys and values do not depend on the
masks); each step forwards only the masks, a batch of anchors at a time, over that cached prefix.
The prompts are mtprobe's own set (or ``--prompts FILE``), and ``--corpus-prompts FILES`` adds
passages of local text files, each under an instruction (:func:`mtprobe.data.corpus_prompts`); those
go first, so the held-out prompts (the last ``--holdout``) stay the set's own.

``--layer-offsets`` also learns one vector per decoder layer, added to the masks' hidden state before
that layer (``[num_layers, hidden]``, 17 280 numbers for SmolLM2; :func:`mtprobe.target_model.mask_hooks.layer_offsets`;
with ``--num-masks`` k >= 2 one such set per mask, ``[k, num_layers, hidden]``).
A mask embedding only chooses the first layer's input; the offsets steer every layer's computation at
the mask, which a 576-number input cannot. The model's weights and every token input stay untouched
(no draft token attends to a mask), so verification, and the output, are unchanged.

The result is a :class:`~mtprobe.target_model.mask_calibration.MaskCalibration` file (safetensors: the masks,
the layer offsets if learned, and a JSON header naming the model it belongs to; decode time reads it with
:mod:`mtprobe.target_model.mask_calibration` and applies it with :mod:`mtprobe.target_model.mask_hooks`);
``ProbeConfig(mask_init="calibrated", mask_path=FILE)`` starts every generation's masks from it; they stay
fixed (``mask_lambda`` defaults to 0 for them), and a positive ``mask_lambda`` applies the paper's running
update on top. The greedy continuations and their KV caches come from :mod:`mtprobe.offline.calibration_data`.

    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2.safetensors
    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2.safetensors \
        --corpus-prompts /usr/share/games/fortunes/* --num-corpus-prompts 136 --gen-batch-size 16
    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2-offsets.safetensors --layer-offsets
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mtprobe.identity import model_identity
from mtprobe.offline.calibration_data import _continuations, _prefix_cache
from mtprobe.target_model import mask_hooks
from mtprobe.target_model.adapter import cache_argument
from mtprobe.target_model.mask_calibration import MaskCalibration

__all__ = [
    "calibrate_masks",
    "fit_mask_temperature",
    "mask_loss",
    "score_calibration",
]


def _mask_logits(
    model: Any,
    masks: torch.Tensor,  # [k, hidden]
    ids: torch.Tensor,  # [n]
    anchors: torch.Tensor,  # [a]
    cache: Any,
    layer_offsets: torch.Tensor | None,
    mask_lora: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits ``[a*k, vocab]`` float32, targets ``[a*k]``, valid ``[a*k]``) of the k chained masks on every
    anchor, input (p, j) predicting ``ids[p + j + 1]``: :func:`mask_loss`'s forward."""
    n = int(ids.shape[0])
    k = int(masks.shape[0])
    a = int(anchors.shape[0])
    if cache is None:
        cache = _prefix_cache(model, ids)
    j = torch.arange(1, k + 1)  # [k]
    pos = (anchors[:, None] + j[None, :]).reshape(-1)  # [a*k]
    target_pos = pos + 1  # [a*k]
    valid = target_pos < n  # [a*k]
    targets = ids[target_pos.clamp(max=n - 1)]  # [a*k]
    # Mask input (p, j) sees prefix keys 0..p and mask inputs (p, 1..j).
    q_anchor = anchors.repeat_interleave(k)  # [a*k]
    q_j = j.repeat(a)  # [a*k]
    see_prefix = torch.arange(n)[None, :] <= q_anchor[:, None]  # [a*k, n]
    same = q_anchor[:, None] == q_anchor[None, :]
    see_masks = same & (q_j[None, :] <= q_j[:, None])  # [a*k, a*k]
    allowed = torch.cat([see_prefix, see_masks], dim=1)  # [a*k, n + a*k]
    dtype = model.get_input_embeddings().weight.dtype
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    device = model.get_input_embeddings().weight.device
    embeds = masks.to(dtype).repeat(a, 1).unsqueeze(0).to(device)  # [1, a*k, hidden]
    offsets = contextlib.nullcontext()
    if layer_offsets is not None:  # every input of this forward is a mask: offsets from position 0
        offsets = mask_hooks.layer_offsets(mask_hooks.decoder_layers(model), layer_offsets.to(device), 0)
    lora = contextlib.nullcontext()
    if mask_lora is not None:  # every input of this forward is a mask: adapted from position 0
        lora = mask_hooks.mask_lora(mask_hooks.decoder_layers(model), mask_lora, 0)
    with offsets, lora:
        out = model(
            inputs_embeds=embeds,
            attention_mask=additive[None, None].to(device),
            position_ids=pos[None].to(device),
            use_cache=True,
            # The forward appends the masks' keys; keep the prefix's.
            **{cache_argument(model): copy.deepcopy(cache)},
        )
    return out.logits[0].float(), targets, valid  # [a*k, vocab], [a*k], [a*k]


def mask_loss(
    model: Any,
    masks: torch.Tensor,  # [k, hidden]
    ids: torch.Tensor,  # [n] the sequence
    anchors: torch.Tensor,  # [a] node positions p, each with p + 2 <= n - 1 (mask 1 has a target)
    cache: Any = None,
    *,
    layer_offsets: torch.Tensor | None = None,  # [num_layers, hidden] or [k, num_layers, hidden]
    mask_lora: dict[str, torch.Tensor] | None = None,
    temperature: torch.Tensor | None = None,  # [k]
    return_hits: bool = False,
    per_mask: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, number of targets) of the k chained masks on every anchor, predicting
    ``ids[p + j + 1]`` from mask j; with ``return_hits`` also the number of targets the mask's top-1 hits.
    ``per_mask``: the three as ``[k]`` tensors, one entry per mask (summed cross-entropy, not the mean).

    One forward over the a * k mask inputs on the cached prefix ``ids`` (``cache``: the sequence's own,
    left unchanged: the forward runs on a copy): mask j of anchor p sits at position p + j and attends to ids[0..p] and to
    masks 1..j-1 of its own anchor. ``layer_offsets`` (or None) are added to every mask's hidden state
    before each decoder layer, as in decoding; ``mask_lora`` (or None) adapts the projections at the
    masks (:func:`mtprobe.target_model.mask_hooks.mask_lora`); mask j's logits are divided by ``temperature[j - 1]`` (or
    not, None), as decoding does with a calibration's ``mask_temperature``.
    """
    a, k = int(anchors.shape[0]), int(masks.shape[0])
    logits, targets, valid = _mask_logits(model, masks, ids, anchors, cache, layer_offsets, mask_lora)
    device = logits.device
    if temperature is not None:
        logits = logits / temperature.to(device).repeat(a)[:, None]  # [a*k, vocab]
    ce = torch.nn.functional.cross_entropy(logits, targets.to(device), reduction="none")  # [a*k]
    count = valid.sum()
    loss = (ce * valid.to(device)).sum() / count.clamp(min=1)
    if per_mask:
        by_mask = lambda x: x.reshape(a, k).sum(0)  # noqa: E731  [a*k] -> [k]
        hits = (logits.argmax(-1).cpu() == targets) & valid
        return by_mask((ce * valid.to(device)).detach().cpu()), by_mask(valid.long()), by_mask(hits.long())
    if return_hits:
        hits = ((logits.argmax(-1).cpu() == targets) & valid).sum()
        return loss, count, hits
    return loss, count


def _anchors(n: int, start: int) -> torch.Tensor:
    """Every node from the last prompt token (the first decode root) on whose mask 1 has a target."""
    return torch.arange(max(0, start - 1), n - 2)  # [a]


def _evaluate(
    model: Any,
    masks: torch.Tensor | None,
    data: Sequence[tuple[torch.Tensor, int, Any]],
    k: int = 1,
    layer_offsets: torch.Tensor | None = None,  # [num_layers, hidden] or [k, num_layers, hidden]
    mask_lora: dict[str, torch.Tensor] | None = None,
    temperature: torch.Tensor | None = None,  # [k]
) -> dict[str, Any]:
    """Held-out loss and top-1 of ``masks`` ([k, hidden]; ``None``: seed 001's soft initialisation,
    the mean of each prompt's embeddings, the baseline calibration has to beat), pooled over the k
    masks, and with k >= 2 also per mask (``by_mask``: mask j predicts the token j + 1 after its node)."""
    if masks is not None:
        k = int(masks.shape[0])
    total = torch.zeros(k, dtype=torch.float64)  # [k]
    hits = torch.zeros(k, dtype=torch.long)  # [k]
    count = torch.zeros(k, dtype=torch.long)  # [k]
    table = model.get_input_embeddings().weight
    with torch.no_grad():
        for ids, start, cache in data:
            anchors = _anchors(int(ids.shape[0]), start)
            if anchors.numel() == 0:
                continue
            if masks is None:
                m = table[ids[:start].to(table.device)].float().mean(0).repeat(k, 1).cpu()  # [k, hidden]
            else:
                m = masks
            ce, c, h = mask_loss(
                model, m, ids, anchors, cache, layer_offsets=layer_offsets, mask_lora=mask_lora,
                temperature=temperature, per_mask=True,
            )  # fmt: skip
            total += ce.double()
            count += c
            hits += h
    n = max(int(count.sum()), 1)
    out: dict[str, Any] = {
        "loss": float(total.sum()) / n,
        "top1": int(hits.sum()) / n,
        "targets": int(count.sum()),
    }
    if k > 1:
        out["by_mask"] = [
            {"loss": float(total[j]) / max(int(count[j]), 1), "top1": int(hits[j]) / max(int(count[j]), 1)}
            for j in range(k)
        ]
    return out


def _fit_temperature(
    model: Any,
    masks: torch.Tensor,  # [k, hidden]
    data: Sequence[tuple[torch.Tensor, int, Any]],
    layer_offsets: torch.Tensor | None,
    mask_lora: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """(temperatures ``[k]``, :func:`_evaluate`'s scores with them) on ``data``: per mask, the T that
    minimises the cross-entropy of softmax(logits / T) on ``data``'s targets (temperature scaling, Guo et
    al. 2017), a search over log T in [1/16, 16] (the bounds where masks predict nothing better than
    uniform or never miss)."""
    k = int(masks.shape[0])
    by_mask: list[list[torch.Tensor]] = [[] for _ in range(k)]
    picked: list[list[torch.Tensor]] = [[] for _ in range(k)]
    with torch.no_grad():
        for ids, start, cache in data:
            anchors = _anchors(int(ids.shape[0]), start)
            if anchors.numel() == 0:
                continue
            logits, targets, valid = _mask_logits(model, masks, ids, anchors, cache, layer_offsets, mask_lora)
            j = torch.arange(logits.shape[0]) % k  # [a*k]
            for m in range(k):
                rows = (j == m) & valid
                by_mask[m].append(logits[rows.to(logits.device)].cpu())  # [a_m, vocab]
                picked[m].append(targets[rows])
    out = torch.ones(k)
    for m in range(k):
        if not by_mask[m]:
            continue
        logits, targets = torch.cat(by_mask[m]), torch.cat(picked[m])  # [N, vocab], [N]

        def loss(log_t: float, logits=logits, targets=targets) -> float:
            return float(torch.nn.functional.cross_entropy(logits / math.exp(log_t), targets))

        lo, hi = math.log(1 / 16), math.log(16)
        for _ in range(40):  # golden-section search: the loss is convex in 1 / T, so unimodal in log T
            a, b = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
            if loss(a) < loss(b):
                hi = b
            else:
                lo = a
        out[m] = math.exp((lo + hi) / 2)
    return out, _evaluate(
        model, masks, data, layer_offsets=layer_offsets, mask_lora=mask_lora, temperature=out
    )


def score_calibration(
    model: Any,
    cal: MaskCalibration | None,
    prompts: Sequence[torch.Tensor],
    *,
    num_masks: int | None = None,
    max_new_tokens: int = 128,
    gen_batch_size: int = 1,
) -> dict[str, Any]:
    """Loss and top-1 of ``cal``'s first ``num_masks`` masks (all by default; with its layer offsets and
    mask LoRA) on the model's greedy continuations of ``prompts`` (token tensors ``[1, L]``), as
    :func:`calibrate_masks` scores its held-out prompts; ``cal`` None scores seed 001's soft start (each
    prompt's mean embedding) for ``num_masks`` masks. ValueError if ``cal`` does not belong to the model."""
    k = num_masks if num_masks is not None else (cal.num_masks if cal is not None else 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 4:
        raise ValueError(f"num_masks={k!r} must be an int between 1 and 4")
    if cal is not None:
        cal.check(model, k)
    data = _continuations(model, prompts, max_new_tokens, gen_batch_size)
    if cal is None:
        return _evaluate(model, None, data, k)
    return _evaluate(
        model, cal.masks[:k], data, layer_offsets=cal.offsets_for(k), mask_lora=cal.mask_lora,
        temperature=cal.temperature_for(k),
    )  # fmt: skip


def fit_mask_temperature(
    model: Any,
    cal: MaskCalibration,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 128,
    gen_batch_size: int = 1,
) -> MaskCalibration:
    """``cal`` with a ``mask_temperature`` fitted on the model's greedy continuations of ``prompts``
    (token tensors ``[1, L]``, prompts it did not learn from: the held-out ones), the rest unchanged; its
    stats gain ``temperature_fit`` (the prompts' count and the scores before and after). ValueError if
    ``cal`` does not belong to the model."""
    cal.check(model)
    data = _continuations(model, prompts, max_new_tokens, gen_batch_size)
    offsets, lora = cal.offsets_for(cal.num_masks), cal.mask_lora
    before = _evaluate(model, cal.masks, data, layer_offsets=offsets, mask_lora=lora)
    t, after = _fit_temperature(model, cal.masks, data, offsets, lora)
    fit = {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "loss_before": before,
        "loss_after": after,
    }
    return dataclasses.replace(cal, stats={**cal.stats, "temperature_fit": fit}, mask_temperature=t)


def calibrate_masks(
    model: Any,
    prompts: Sequence[torch.Tensor],
    *,
    num_masks: int = 1,
    max_new_tokens: int = 128,
    epochs: int = 4,
    anchors_per_step: int = 64,
    lr: float = 0.05,
    holdout: int = 4,
    seed: int = 0,
    gen_batch_size: int = 1,
    layer_offsets: bool = False,
    mask_lora_rank: int = 0,
    lora_lr: float = 1e-3,
    fit_temperature: bool = True,
    init: MaskCalibration | None = None,
    sources: dict[str, Any] | None = None,
    continuations: str | os.PathLike[str] | None = None,
    cache_gib: float = 8.0,
    progress: Callable[[str], None] | None = None,
) -> MaskCalibration:
    """Learn ``num_masks`` mask embeddings for ``model`` on its greedy continuations of ``prompts``
    (token tensors ``[1, L]``). The last ``holdout`` prompts are kept out of training and scored
    before and after (loss and top-1 accuracy of mask 1..k on their true next tokens).

    Adam on the masks only; they start from the mean of the training sequences' embeddings (the
    paper's soft initialisation over the whole data), ``lr`` is relative to the embedding table's
    RMS deviation, so it means the same for every model. ``gen_batch_size`` prompts are generated at
    once (see :func:`~mtprobe.offline.calibration_data.calibration_sequences`); ``sources`` (where the
    prompts came from) is recorded in the result's stats.

    ``layer_offsets``: also learn one vector per decoder layer, added to the masks' hidden state
    before that layer (``[num_layers, hidden]``, starting at zero, with the same step size): 30 x 576
    more numbers for SmolLM2, still nothing of the model's own. They shape the model's computation at
    the mask, not only its input, and token inputs never see them. With ``num_masks`` >= 2 every mask
    gets its own set (``[k, num_layers, hidden]``).

    ``mask_lora_rank`` > 0: also learn a rank-``mask_lora_rank`` LoRA of every decoder layer's projections
    (:data:`mtprobe.target_model.mask_hooks.MASK_LORA_MODULES`), applied at the masks only
    (:func:`mtprobe.target_model.mask_hooks.mask_lora`), shared by the k masks, with Adam step ``lora_lr``; B
    starts at zero, so training starts from the masks as they are. ``fit_temperature`` (with held-out prompts): fit each mask's temperature on them at the end,
    as :func:`fit_mask_temperature` does (stats: ``holdout_after`` stays the scores at T = 1,
    ``temperature_fit["loss_after"]`` those with the temperatures). ``init``: start from that calibration's
    first ``num_masks`` masks (and its layer offsets and mask LoRA, where it has them and this run learns
    them) instead of the data's mean embedding. ``continuations``: a file that keeps the greedy continuations
    between runs on the same prompts (:func:`~mtprobe.offline.calibration_data.calibration_sequences`'
    ``path``). ``cache_gib``: the GiB of the sequences' KV caches kept in memory
    (:class:`~mtprobe.offline.calibration_data.Continuations`); past it, a step rebuilds its sequence's
    cache (a step of the two-mask LoRA calibration on SmolLM2 then takes about 1.5x as long:
    ``benchmarks/bench_calibrate_cache.py``)."""
    if not 1 <= num_masks <= 4:
        raise ValueError(f"num_masks={num_masks} must be between 1 and 4")
    for name, v, low in (
        ("epochs", epochs, 1),
        ("anchors_per_step", anchors_per_step, 1),
        ("holdout", holdout, 0),
        ("gen_batch_size", gen_batch_size, 1),
        ("mask_lora_rank", mask_lora_rank, 0),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r} must be an int >= {low}")
    if len(prompts) <= holdout:
        raise ValueError(f"{len(prompts)} prompt(s) leave none to train on with holdout={holdout}")
    if isinstance(cache_gib, bool) or not isinstance(cache_gib, (int, float)) or not cache_gib >= 0:
        raise ValueError(f"cache_gib={cache_gib!r} must be a number >= 0 (GiB of KV caches kept)")
    if not lr > 0:
        raise ValueError(f"lr={lr} must be > 0")
    if not lora_lr > 0:
        raise ValueError(f"lora_lr={lora_lr} must be > 0")
    if init is not None:
        init.check(model, num_masks)
    started = time.perf_counter()
    say = progress or (lambda _msg: None)
    was_training = model.training
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # frozen: only the masks learn
    try:
        say(f"generating {len(prompts)} greedy continuations of {max_new_tokens} tokens")
        data = _continuations(
            model,
            prompts,
            max_new_tokens,
            gen_batch_size,
            say,
            continuations,
            cache_gib * 2**30,
            first=range(len(prompts) - holdout, len(prompts)),  # scored ~5 times: kept first
        )
        if data.num_kept < len(data):
            say(
                f"kept the KV caches of {data.num_kept} of {len(data)} sequences (cache_gib={cache_gib:g}); "
                "the others are built again at every step that reads them"
            )
        train, held = data[: len(data) - holdout], data[len(data) - holdout :]
        table = model.get_input_embeddings().weight.detach().float()  # [vocab, hidden]
        sigma = float((table - table.mean(0)).pow(2).mean().sqrt())
        tokens = torch.cat([ids for ids, _ in train.sequences])  # [total]
        first = table[tokens.to(table.device)].mean(0).cpu()  # [hidden]
        masks = first.repeat(num_masks, 1)  # [k, hidden]
        if init is not None:
            masks = init.masks[:num_masks]
        masks = masks.clone().requires_grad_(True)
        learned = [masks]
        offsets = None
        if layer_offsets:
            num_layers = len(mask_hooks.decoder_layers(model))
            # One set per mask from k = 2 on: mask j predicts depth j + 1, a different job for every layer.
            shape = (
                (num_layers, masks.shape[1]) if num_masks == 1 else (num_masks, num_layers, masks.shape[1])
            )
            offsets = torch.zeros(shape)  # [num_layers, hidden] or [k, num_layers, hidden]
            start_offsets = init.offsets_for(num_masks) if init is not None else None
            if start_offsets is not None:
                if start_offsets.shape != offsets.shape:
                    raise ValueError(
                        f"init's layer offsets are {tuple(start_offsets.shape)}, this run learns {tuple(shape)}"
                    )
                offsets = start_offsets.clone()
            offsets.requires_grad_(True)
            learned.append(offsets)
        lora: dict[str, torch.Tensor] | None = None
        if mask_lora_rank > 0:
            lora = _initial_lora(model, mask_lora_rank, seed)
            if init is not None and init.mask_lora is not None:
                if {k: t.shape for k, t in init.mask_lora.items()} != {k: t.shape for k, t in lora.items()}:
                    raise ValueError(
                        f"init's mask LoRA is not of rank {mask_lora_rank} over every projection"
                    )
                lora = {k: t.clone() for k, t in init.mask_lora.items()}
            for t in lora.values():
                t.requires_grad_(True)
        paper = _evaluate(model, None, held, num_masks) if held else {}
        before = (
            _evaluate(model, masks.detach(), held, layer_offsets=_detached(offsets), mask_lora=lora)
            if held
            else {}
        )
        if held:
            say(
                f"held out, prompt-mean masks (seed 001): loss {paper['loss']:.3f}, top-1 {paper['top1']:.3f}; "
                f"calibration's start: loss {before['loss']:.3f}, top-1 {before['top1']:.3f}"
            )
        groups: list[dict[str, Any]] = [{"params": learned, "lr": lr * sigma}]
        if lora is not None:
            groups.append({"params": list(lora.values()), "lr": lora_lr})
        opt = torch.optim.Adam(groups)
        gen = torch.Generator().manual_seed(seed)
        batches = []
        for i, (ids, start) in enumerate(train.sequences):
            anchors = _anchors(int(ids.shape[0]), start)
            for chunk in anchors.split(anchors_per_step):
                batches.append((i, chunk))
        total_steps = epochs * len(batches)
        step = 0
        for epoch in range(epochs):
            order = torch.randperm(len(batches), generator=gen).tolist()
            run = 0.0
            for b in order:
                i, chunk = batches[b]
                ids, _, cache = train[i]
                loss, _ = mask_loss(model, masks, ids, chunk, cache, layer_offsets=offsets, mask_lora=lora)
                opt.zero_grad()
                loss.backward()
                opt.step()
                value = loss.item()  # a plain float: float() on a tensor that requires grad warns
                run += value
                step += 1
                if step % max(1, total_steps // 20) == 0 or step == total_steps:
                    say(f"step {step}/{total_steps} (epoch {epoch + 1}) loss {value:.3f}")
            say(f"epoch {epoch + 1}/{epochs}: mean training loss {run / max(1, len(order)):.3f}")
        offsets = offsets.detach() if offsets is not None else None
        lora = {k: t.detach() for k, t in lora.items()} if lora is not None else None
        after = _evaluate(model, masks.detach(), held, layer_offsets=offsets, mask_lora=lora) if held else {}
        temperature, tempered = None, {}
        if held and fit_temperature:
            temperature, tempered = _fit_temperature(model, masks.detach(), held, offsets, lora)
        if held:
            say(f"held out after: loss {after['loss']:.3f}, top-1 {after['top1']:.3f}")
            if temperature is not None:
                say(
                    f"  temperatures {[round(float(t), 3) for t in temperature]}: loss {tempered['loss']:.3f}"
                )
            for j, row in enumerate(after.get("by_mask", [])):
                say(
                    f"  mask {j + 1} (the token {j + 2} after its node): loss {row['loss']:.3f}, top-1 {row['top1']:.3f}"
                )
    finally:
        for p in params:
            p.requires_grad_(True)
        model.train(was_training)
    return MaskCalibration(
        masks.detach(),
        model_identity(model),
        {
            "data": "greedy self-continuations",
            "sources": dict(sources or {}),
            "prompts": len(prompts) - holdout,
            "holdout_prompts": holdout,
            "max_new_tokens": max_new_tokens,
            "gen_batch_size": gen_batch_size,
            "layer_offsets": bool(layer_offsets),
            "mask_lora_rank": mask_lora_rank,
            "lora_lr": lora_lr if mask_lora_rank else None,
            "init": dict(init.stats.get("sources", {}), steps=init.stats.get("steps"))
            if init is not None
            else None,
            "epochs": epochs,
            "steps": total_steps,
            "anchors_per_step": anchors_per_step,
            "lr": lr,
            "seed": seed,
            "holdout_prompt_mean": paper,
            "holdout_before": before,
            "holdout_after": after,
            # The scores before the fit are holdout_after's: the same prompts at T = 1.
            "temperature_fit": {"prompts": holdout, "max_new_tokens": max_new_tokens, "loss_after": tempered}
            if temperature is not None
            else None,
            "seconds": time.perf_counter() - started,
            "torch": torch.__version__,
        },
        offsets,
        lora,
        temperature,
    )


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.detach() if t is not None else None


def _initial_lora(model: Any, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A rank-``rank`` mask LoRA of every decoder layer's projections that changes nothing yet: A
    ``[rank, in]`` random (scaled by 1 / sqrt(in)), B ``[out, rank]`` zero."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for index, layer in enumerate(mask_hooks.decoder_layers(model)):
        for name in mask_hooks.MASK_LORA_MODULES:
            try:
                linear = layer.get_submodule(name)
            except AttributeError:
                continue  # a model without this projection
            lora[f"{index}.{name}.A"] = (
                torch.randn(rank, linear.in_features, generator=gen) / linear.in_features**0.5
            )
            lora[f"{index}.{name}.B"] = torch.zeros(linear.out_features, rank)
    if not lora:
        raise ValueError(
            f"{type(model).__name__} has none of the projections a mask LoRA adapts "
            f"({', '.join(mask_hooks.MASK_LORA_MODULES)})"
        )
    return lora
