"""Training a circuit head on the frozen backbone's features, once per model (minutes on a CPU; the
features can be cached and reused; ``python -m mtprobe heads train`` runs it).

Training (:func:`train_head`) minimises the discounted NLL of the windows that follow each position,
``-sum_j gamma^(j-1) log q(x_j | x_<j)`` (gamma 0.8, 0.9 for n > 8), with the conditionals read off the
prefix marginals (:func:`mtprobe.heads.circuit.window_log_marginals`); the backbone is frozen and its
features (:func:`compute_features`) are computed once.

With ``--lora-layers k`` (:mod:`mtprobe.heads.lora`, the paper's second axis of expressiveness) ``h`` is not
the backbone's last state but that of the draft's own LoRA-adapted copies of the last k layers, run
over the committed tokens with a cache of their own; the features are then the input of layer L - k,
and ``--init DIR`` continues a head trained without them, as the paper does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mtprobe.heads.circuit import CircuitHead, CircuitParams, default_gamma, window_loss
from mtprobe.ops import circuit_next_token_log_probs

__all__ = [
    "Features",
    "base_inputs",
    "compute_features",
    "evaluate_head",
    "features_at_layer",
    "head_inputs",
    "init_from",
    "text_sequences",
    "train_head",
    "window_token_counts",
]


@dataclass
class Features:
    """The frozen backbone's features of a set of token sequences, concatenated."""

    hidden: torch.Tensor  # [N, d] float32, the backbone's hidden_states[layer] at every position
    ids: torch.Tensor  # [N] int64, the token at every position
    starts: torch.Tensor  # [S] int64, where each sequence begins in the concatenation
    first: torch.Tensor  # [S] int64, per sequence: the first position whose window is trained on
    layer: int = -1  # -1: the last hidden state (final norm); else the input of LoRA draft layers
    last: torch.Tensor | None = None  # [N, d] float32: the last hidden state too when layer != -1

    def sequence_of(self, pos: torch.Tensor) -> torch.Tensor:
        """The sequence each position ``[M]`` belongs to ``[M]``."""
        return torch.searchsorted(self.starts, pos, right=True) - 1

    @property
    def ends(self) -> torch.Tensor:
        """[S] int64: where each sequence ends (exclusive) in the concatenation."""
        return torch.cat([self.starts[1:], torch.tensor([self.ids.numel()])])

    def windows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [M], windows [M, n]): every position p >= first of its sequence with n tokens after it."""
        anchors = [
            torch.arange(s + f, e - n)
            for s, f, e in zip(self.starts, self.first, self.ends, strict=True)
            if e - n > s + f
        ]
        if not anchors:
            raise ValueError(f"no sequence is long enough for a window of {n} tokens")
        pos = torch.cat(anchors)  # [M]
        return pos, self.ids[pos[:, None] + 1 + torch.arange(n)]  # [M, n]


def compute_features(
    model: Any,
    sequences: Sequence[tuple[torch.Tensor, int]],
    progress: Callable[[str], None] | None = None,
    layer: int = -1,
) -> Features:
    """The backbone's ``hidden_states[layer]`` (default: the last) over each ``(ids [L], first)``
    sequence; windows are trained from position ``first`` on (the prompt's last token for
    self-distillation, 0 for a corpus)."""
    hidden, last, ids, starts, first, at = [], [], [], [], [], 0
    device = next(model.parameters()).device
    for i, (seq, f) in enumerate(sequences):
        if progress is not None and (i % 10 == 0 or i + 1 == len(sequences)):
            progress(f"features {i + 1}/{len(sequences)}")
        with torch.no_grad():
            out = model(seq[None].to(device), output_hidden_states=True)
        hidden.append(out.hidden_states[layer][0].float().cpu())  # [L, d]
        if layer != -1:  # the target's logits at each anchor, for heads whose emissions build on them
            last.append(out.hidden_states[-1][0].float().cpu())  # [L, d]
        ids.append(seq.cpu())
        starts.append(at)
        first.append(f)
        at += seq.numel()
    return Features(
        torch.cat(hidden),
        torch.cat(ids),
        torch.tensor(starts),
        torch.tensor(first),
        layer,
        torch.cat(last) if last else None,
    )


def features_at_layer(
    model: Any, features: Features, layer: int, progress: Callable[[str], None] | None = None
) -> Features:
    """``features``'s sequences again, with the backbone's ``hidden_states[layer]`` and, for a layer
    other than the last, the last hidden state too (``features`` itself if it already holds them)."""
    if features.layer == layer and (layer == -1 or features.last is not None):
        return features
    seqs = [
        (features.ids[s:e], int(f))
        for s, e, f in zip(features.starts, features.ends, features.first, strict=True)
    ]
    return compute_features(model, seqs, progress, layer)


def head_inputs(head: CircuitHead, features: Features, pos: torch.Tensor) -> torch.Tensor:
    """What ``head`` reads at positions ``pos`` ``[M]`` -> ``[M, d]``: the cached features, or, with LoRA
    draft layers, their output over each anchor's sequence up to the anchor (differentiable)."""
    device = head.lm_head.device
    if head.draft is None:
        return features.hidden[pos].to(device)
    if features.layer != head.hidden_layer:
        raise ValueError(
            f"the features hold hidden_states[{features.layer}]; this head's LoRA draft layers read "
            f"hidden_states[{head.hidden_layer}] (features_at_layer makes them)"
        )
    seq = features.sequence_of(pos)
    rows = []
    for s in seq.unique().tolist():
        mine = (seq == s).nonzero().flatten()  # anchors in this sequence
        start = int(features.starts[s])
        end = int(pos[mine].max()) + 1  # causal: nothing after the last anchor matters
        h = features.hidden[start:end].to(device)[None]  # [1, T, d]
        h = head.draft(h, torch.arange(end - start, device=device)[None])[0]  # [T, d]
        rows.append((mine.to(device), h[pos[mine].to(device) - start]))
    order = torch.argsort(torch.cat([m for m, _ in rows]))  # back to the order of pos
    return torch.cat([r for _, r in rows])[order]  # [M, d]


def base_inputs(head: CircuitHead, features: Features, pos: torch.Tensor) -> torch.Tensor | None:
    """The backbone's last hidden states ``[M, d]`` at positions ``pos`` ``[M]`` when ``head``'s emissions
    build on the target's logits and it reads another layer (LoRA draft layers); None otherwise (the
    head computes its base from what it reads, or has none)."""
    if head.draft is None or not head.target_base:
        return None
    if features.last is None:
        raise ValueError(
            "this LoRA head's emissions build on the target's logits (lora_base='target'), but the features "
            "hold no last hidden state: make them with compute_features(..., layer=head.hidden_layer)"
        )
    return features.last[pos].to(head.lm_head.device)


def _head_params(head: CircuitHead, hidden: torch.Tensor, base_hidden: torch.Tensor | None) -> CircuitParams:
    return head(hidden, None if base_hidden is None else head.base_logits(base_hidden))


def text_sequences(
    tokenizer: Any,
    paths: Sequence[str],
    length: int,
    *,
    holdout: float = 0.0,
    max_tokens: int | None = None,
) -> list[tuple[torch.Tensor, int]]:
    """Chunks of ``length`` tokens of local text files (a corpus installable offline), without the last
    ``holdout`` of each file's characters (what a byte LM trained by :mod:`mtprobe.offline.bytelm` held out),
    at most ``max_tokens`` tokens in all (yet one chunk of every file at least), evenly spaced chunks
    of every file."""
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout={holdout} must be in [0, 1)")
    if max_tokens is not None and max_tokens < length:
        raise ValueError(f"max_tokens={max_tokens} must be >= the sequence length {length}")
    per_file = None if max_tokens is None else max(length, max_tokens // len(paths))
    out = []
    for p in paths:
        text = Path(p).read_text(encoding="utf-8", errors="replace")
        text = text[: len(text) - int(holdout * len(text))]
        ids = tokenizer(text, return_tensors="pt").input_ids[0]  # [T]
        starts = list(range(0, ids.numel() - length // 2, length))
        if per_file is not None and len(starts) * length > per_file:  # evenly spaced chunks of the file
            keep = per_file // length
            starts = [starts[i * len(starts) // keep] for i in range(keep)]
        out += [(ids[s : s + length], 0) for s in starts]
    return out


def window_token_counts(features: Features, window: int, vocab_size: int) -> torch.Tensor:
    """``[V]`` int32: how often each token occurs in ``features``'s windows of ``window`` tokens (what
    a head trained on them records in ``token_counts``, to rank its vocabulary)."""
    _, win = features.windows(window)  # [M, n]
    if int(win.max()) >= vocab_size:
        raise ValueError(
            f"the features hold token id {int(win.max())}, outside the head's vocabulary of {vocab_size}: "
            "they come from another tokenizer"
        )
    return torch.bincount(win.flatten(), minlength=vocab_size).to(torch.int32)  # half the bytes of int64


def train_head(
    head: CircuitHead,
    features: Features,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-4,
    gamma: float | None = None,
    seed: int = 0,
    holdout: float = 0.1,
    progress: bool = False,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """Adam on the discounted window NLL over ``features``'s windows; returns the training stats
    (train and held-out loss, held-out top-1 of the first draft position, time). The head trains on
    the device it is on (the features move there a batch at a time).

    ``max_seconds``: a wall-clock budget for the training loop; it stops after the step that crosses
    it, and the stats record the steps run (``steps_run``) and whether the budget stopped it
    (``stopped_by_budget``)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if max_seconds is not None and not max_seconds > 0:  # `not >`: NaN is refused too
        raise ValueError(f"max_seconds={max_seconds} must be > 0 (None: no time budget)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    gamma = default_gamma(head.spec.window) if gamma is None else gamma
    pos, win = features.windows(head.spec.window)
    head.token_counts.copy_(window_token_counts(features, head.spec.window, head.spec.vocab_size))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pos.numel(), generator=g)
    n_hold = int(holdout * pos.numel()) if pos.numel() >= 10 else 0
    hold, train = perm[:n_hold], perm[n_hold:]
    device = head.lm_head.device
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    head.train()
    bar = None
    if progress:
        bar = tqdm(total=steps, desc="train head", unit="step")
    start, losses = time.perf_counter(), []
    if head.draft is not None:
        # LoRA draft layers run over whole sequences: a few sequences per step, several anchors each.
        train_seq = features.sequence_of(pos[train])  # [M_train]
        seqs = train_seq.unique()
        of_seq = {int(s): train[(train_seq == s).nonzero().flatten()] for s in seqs}  # its anchors
        per_seq = min(8, batch_size)
    run = 0
    for _ in range(steps):
        if head.draft is None:
            idx = train[torch.randint(train.numel(), (batch_size,), generator=g)]
        else:
            chosen = seqs[torch.randint(seqs.numel(), (max(1, batch_size // per_seq),), generator=g)]
            idx = torch.cat(
                [
                    of_seq[s][torch.randint(of_seq[s].numel(), (per_seq,), generator=g)]
                    for s in chosen.tolist()
                ]
            )
        hidden, target = head_inputs(head, features, pos[idx]), win[idx].to(device)
        loss = window_loss(_head_params(head, hidden, base_inputs(head, features, pos[idx])), target, gamma)
        opt.zero_grad()
        loss.backward()
        opt.step()
        head.trained_steps += 1
        losses.append(loss.item())
        if bar is not None:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            bar.update()
        run += 1
        # loss.item() above waits for the device, so the clock covers the step's work.
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            break
    if bar is not None:
        bar.close()
    head.eval()
    stats: dict[str, Any] = {
        "steps": int(head.trained_steps),
        "train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "windows": int(pos.numel()),
        "seconds": round(time.perf_counter() - start, 1),
        "gamma": gamma,
        "lr": lr,
        "batch_size": batch_size,
        "steps_run": run,  # in this call; "steps" counts an --init head's steps too
    }
    if max_seconds is not None:
        stats.update(max_seconds=max_seconds, steps_asked=steps, stopped_by_budget=run < steps)
    if n_hold:
        with torch.no_grad():
            held = head_inputs(head, features, pos[hold])
        stats.update(evaluate_head(head, held, win[hold], gamma, base_inputs(head, features, pos[hold])))
    return stats


def init_from(head: CircuitHead, trained: CircuitHead) -> None:
    """Copy ``trained``'s circuit parameters into ``head`` (same spec but for the LoRA layers, whose
    adapters stay as they are); ValueError naming the difference otherwise."""
    lora = ("lora_layers", "lora_rank", "lora_base")
    mine = {k: v for k, v in asdict(head.spec).items() if k not in lora}
    theirs = {k: v for k, v in asdict(trained.spec).items() if k not in lora}
    if mine != theirs:
        differs = [k for k in mine if mine[k] != theirs[k]]
        raise ValueError(f"--init head differs in {', '.join(differs)}: {theirs} against {mine}")
    state = {k: v for k, v in trained.state_dict().items() if not k.startswith("draft.")}
    missing, unexpected = head.load_state_dict(state, strict=False)  # token_counts: train_head's own
    if unexpected or any(not k.startswith("draft.") for k in missing):
        raise ValueError(f"--init head does not fit: missing {missing}, unexpected {unexpected}")


def evaluate_head(
    head: CircuitHead,
    hidden: torch.Tensor,
    windows: torch.Tensor,
    gamma: float,
    base_hidden: torch.Tensor | None = None,
) -> dict[str, float]:
    """Held-out discounted NLL, and how often the most probable second token given the true first is
    the true second (what a one-draft greedy tree accepts); ``base_hidden``: :func:`base_inputs`'s."""
    losses, hits = 0.0, 0
    with torch.no_grad():
        for s in range(0, hidden.shape[0], 256):
            device = head.lm_head.device
            b = None if base_hidden is None else base_hidden[s : s + 256].to(device)
            params, w = _head_params(head, hidden[s : s + 256].to(device), b), windows[s : s + 256].to(device)
            losses += float(window_loss(params, w, gamma)) * w.shape[0]
            core = (None if x is None else x.cpu() for x in params.core_batch())  # the ops run on the CPU
            nxt = circuit_next_token_log_probs(params.circuit, *core, w[:, :1].cpu())  # [b, V]
            hits += int((nxt.argmax(-1) == w[:, 1].cpu()).sum())
    return {"heldout_loss": losses / hidden.shape[0], "heldout_top1_next": hits / hidden.shape[0]}
