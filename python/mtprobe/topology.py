"""EntMTP (seed 002) for mask-token probing and circuit heads: a bank of static draft trees, the
offline frontiers that choose it, and the policies that switch between its trees every step.

A tree is a tuple of rank paths (the root is implicit): ``(0,)`` is the best depth-1 candidate,
``(1,)`` the second, ``(0, 0)`` the best depth-2 candidate below the best depth-1 one
(csrc/core/topology.h; the reference is :mod:`mtprobe.reference.topology`). For probing, depth d's
candidates are the d-th mask's top tokens; for a circuit head (``drafter="heads"``) the children of a
node are the head's most probable next tokens given the node's path (csrc/drafters/heads.h).

Building a bank for a model (:func:`build_bank`, ``python -m mtprobe.topology``):

1. **Self-rollouts.** Greedy generation on calibration prompts with the drafter, recording at every
   step the true continuation's child ranks (probing: from its candidates of each depth; a head:
   computed in C++ from its circuit) and the features the policies read. Under greedy decoding the
   accepted path is the true continuation, so the candidates at a root position do not depend on
   the tree that ran; the rollout's tree only decides which positions are step starts.
2. **Acceptance frontier** (seed 002, section 3.1): from the root alone, add one node at a time,
   the one-node augmentation with the highest mean accepted length over the recorded steps (ties:
   smaller rank sum, then shallower): a nested sequence of trees, one per size.
3. **Debiasing** (App. B): the one-step estimate scores every tree on the step starts of the
   rollout's tree; each kept tree is re-run with its own topology and its τ measured.
4. **Throughput frontier** (section 3.2): predicted tokens/s = τ / (t(T) + c) with t from the
   measured forward profile (:func:`mtprobe.profile_forward`), T = (k + 1) × nodes (k = 0 for a
   head: its drafts need no extra inputs) and c the drafter's own time per step (everything outside
   the model's forwards, measured in the tree's rollout: a head's call, the tree's fill); the bank
   keeps the trees that raise τ over every cheaper tree, and ``best`` is the throughput-optimal one
   (EntMTP*).
5. **Policy calibration** (section 4): thresholds for the ladder and the hysteretic rule from a
   sweep that replays the recorded steps (which tree the policy would choose, what it would accept,
   what it would cost), per feature.

The banks are JSON files that record the model (and head) they were built for and refuse another.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtprobe._jsonl import read_json, write_json

BANK_FORMAT = 1
DRAFTERS = ("probe", "heads")
POLICIES = ("static", "ladder", "hysteretic")
FEATURES = ("path_value", "top1", "entropy", "accept")
_FEATURE_COLUMN = {"top1": 0, "path_value": 1, "entropy": 2, "accept": 3}  # of the drafter's step log

Tree = tuple[tuple[int, ...], ...]


def chain_tree(branches: Sequence[int]) -> Tree:
    """The static tree ``[K_1, ..., K_k]`` with Top-1 expansion (seed 001, App. D) as rank paths.

    >>> chain_tree([3, 1])
    ((0,), (1,), (2,), (0, 0))
    """
    paths: list[tuple[int, ...]] = []
    for d, k in enumerate(branches):
        paths += [(0,) * d + (r,) for r in range(k)]
    return tuple(paths)


def model_fingerprint(model: Any) -> str:
    """Architecture hash and a hash of the input embedding table's first rows: acceptance depends on
    the weights, so a bank belongs to one checkpoint (``LlamaForCausalLM:0123...:abcd...``)."""
    from mtprobe.profile import _architecture

    rows = model.get_input_embeddings().weight[:64].detach().to("cpu", torch.float32).contiguous()
    return f"{_architecture(model)}:{hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:12]}"


@dataclass(frozen=True)
class TopologyBank:
    """Static draft trees for mask-token probing or a circuit head, the drafter settings they were
    built with, and what was measured when they were built.

    Attributes:
        trees: each tree's non-root nodes as rank paths, cheapest tree first.
        drafter: ``"probe"`` (mask-token probing) or ``"heads"`` (a circuit head, :class:`mtprobe.HeadsConfig`).
        num_masks, prune, mask_init, mask_lambda: the probing drafter the trees are for (k mask
            tokens draft depths 1..k; every node carries k masks, so a tree of N nodes costs a
            forward over T = (k + 1) N inputs). A head's bank has ``num_masks=0``: T = N.
        head, window, vocab_top_k: a head's bank: :meth:`mtprobe.heads.CircuitHead.fingerprint` of
            the head it was built for (``None``: any head), its window n (trees reach depth n - 1 at
            most) and the ``vocab_top_k`` its ranks were counted with.
        model: :func:`model_fingerprint` of the model it was built for, ``None`` for a bank that
            fits any model (the uncalibrated :func:`default_bank`).
        device, dtype: where its throughput frontier was measured (``None`` for the default bank).
        best: EntMTP*: the index of the throughput-optimal tree, or ``None`` (not measured).
        policies: calibrated settings per policy name: ``{"trees": [...], "thresholds": [...],
            "feature": ...}``.
        stats: how the bank was built (prompts, one-step and debiased τ per tree, predicted rates).

    >>> bank = TopologyBank(trees=((), ((0,),), chain_tree([4])))
    >>> [bank.block_size(i) for i in range(len(bank.trees))]
    [2, 4, 10]
    >>> TopologyBank(trees=((), ((0, 0),)))
    Traceback (most recent call last):
    ...
    ValueError: tree 1 of the bank: topology: path (0, 0) has no parent node (0,); every prefix of a path must be a node too
    >>> heads = TopologyBank(trees=(((0,), (1,), (0, 0)),), drafter="heads", num_masks=0, window=4)
    >>> heads.block_size(0)
    4
    """

    trees: tuple[Tree, ...]
    num_masks: int = 1
    prune: bool = True
    mask_init: str = "prompt_mean"
    mask_lambda: float = 0.1
    drafter: str = "probe"
    head: str | None = None
    window: int | None = None
    vocab_top_k: int | None = None
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    best: int | None = None
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from mtprobe import _C

        trees = tuple(tuple(tuple(int(r) for r in p) for p in t) for t in self.trees)
        object.__setattr__(self, "trees", trees)
        if not trees:
            raise ValueError("the topology bank is empty: give at least one tree (a tuple of rank paths)")
        if self.drafter not in DRAFTERS:
            raise ValueError(
                f"drafter={self.drafter!r}: a bank holds trees for mask-token probing ('probe') or a circuit "
                "head ('heads')"
            )
        heads = self.drafter == "heads"
        lo, hi = (0, 0) if heads else (1, 4)
        if (
            isinstance(self.num_masks, bool)
            or not isinstance(self.num_masks, int)
            or not lo <= self.num_masks <= hi
        ):
            want = "0 for a head's bank (its drafts need no mask inputs)" if heads else "an int in [1, 4]"
            raise ValueError(f"num_masks={self.num_masks!r} must be {want}")
        if heads:
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 2:
                raise ValueError(
                    f"window={self.window!r}: a head's bank needs the head's window, an int >= 2"
                )
            k = self.vocab_top_k
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
                raise ValueError(f"vocab_top_k={k!r} must be an int >= 1 or None")
        elif (self.head, self.window, self.vocab_top_k) != (None, None, None):
            raise ValueError("head, window and vocab_top_k describe a circuit head's bank (drafter='heads')")
        max_depth = self.window - 1 if heads else self.num_masks
        compiled = []
        for i, t in enumerate(trees):
            try:
                compiled.append(_C.Topology([list(p) for p in t]))
            except ValueError as e:
                raise ValueError(f"tree {i} of the bank: {e}") from None
            if compiled[-1].max_depth > max_depth:
                why = (
                    f"a head of window {self.window} drafts depths 1..{max_depth}"
                    if heads
                    else f"{self.num_masks} mask token(s) draft depths 1..{self.num_masks}"
                )
                raise ValueError(
                    f"tree {i} of the bank reaches depth {compiled[-1].max_depth}, but {why} only"
                )
        object.__setattr__(self, "_compiled", tuple(compiled))
        if self.best is not None and not 0 <= self.best < len(trees):
            raise ValueError(f"best={self.best} is not a tree of the bank (0..{len(trees) - 1})")
        for name, p in self.policies.items():
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r} in the bank (one of {', '.join(POLICIES)})")
            check_policy(name, tuple(p.get("trees", ())), tuple(p.get("thresholds", ())), len(trees))

    def topology(self, i: int) -> Any:
        """Tree ``i`` compiled (``mtprobe._C.Topology``: parents, depths, ranks)."""
        return self._compiled[i]  # type: ignore[attr-defined]

    def nodes(self, i: int) -> int:
        """Nodes of tree ``i``, root included."""
        return len(self.trees[i]) + 1

    def block_size(self, i: int) -> int:
        """T = (k + 1) × nodes: the inputs of one forward with tree ``i``."""
        return (self.num_masks + 1) * self.nodes(i)

    @property
    def block_complexity(self) -> int:
        """The largest tree's T: the budget a bank needs."""
        return max(self.block_size(i) for i in range(len(self.trees)))

    def check(self, model: Any, head: Any = None, vocab_top_k: int | None = None) -> None:
        """Raise ValueError when the bank was built for another model, device or dtype than ``model``'s,
        or (a head's bank) for another head than ``head`` (a :class:`~mtprobe.heads.CircuitHead`) or
        another ``vocab_top_k``."""
        if self.drafter == "heads":
            if head is None:
                raise ValueError(
                    "this topology bank holds a circuit head's trees: use it with HeadsConfig(bank=...)"
                )
            if self.window != head.spec.window:
                raise ValueError(
                    f"this topology bank is for a head of window {self.window}, not {head.spec.window}"
                )
            if self.head is not None and self.head != head.fingerprint():
                raise ValueError(
                    f"this topology bank was built for another circuit head ({self.head}, this one is "
                    f"{head.fingerprint()}); build one for it with `python -m mtprobe.topology --head DIR ...`"
                )
            if self.head is not None and self.vocab_top_k != vocab_top_k:
                raise ValueError(
                    f"this topology bank was built with vocab_top_k={self.vocab_top_k}, not {vocab_top_k}: its "
                    "trees' ranks were counted over that vocabulary; use the same setting or build a bank for this one"
                )
        elif head is not None:
            raise ValueError(
                "this topology bank holds mask-probing trees, not a circuit head's: use EntMTPConfig"
            )
        if self.model is None:
            return
        from mtprobe.profile import ProfileKey

        key = ProfileKey.of(model)
        bad = []
        if self.model != model_fingerprint(model):
            bad.append(f"model: bank {self.model!r} vs now {model_fingerprint(model)!r}")
        if self.device is not None and self.device != key.device:
            bad.append(f"device: bank {self.device!r} vs now {key.device!r}")
        if self.dtype is not None and self.dtype != key.dtype:
            bad.append(f"dtype: bank {self.dtype!r} vs now {key.dtype!r}")
        if bad:
            raise ValueError(
                "this topology bank was built for another setting ("
                + "; ".join(bad)
                + "); build one for this "
                "model with `python -m mtprobe.topology --model ... --out FILE` or mtprobe.topology.build_bank"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": BANK_FORMAT,
            "trees": [[list(p) for p in t] for t in self.trees],
            "num_masks": self.num_masks,
            "prune": self.prune,
            "mask_init": self.mask_init,
            "mask_lambda": self.mask_lambda,
            "drafter": self.drafter,
            "head": self.head,
            "window": self.window,
            "vocab_top_k": self.vocab_top_k,
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "best": self.best,
            "policies": {k: dict(v) for k, v in self.policies.items()},
            "stats": dict(self.stats),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TopologyBank:
        if not isinstance(data, Mapping) or data.get("format") != BANK_FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"not a topology bank of format {BANK_FORMAT} (format {got!r})")
        values = {k: v for k, v in data.items() if k != "format"}
        try:
            return cls(**values)
        except TypeError as e:
            raise ValueError(f"malformed topology bank: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TopologyBank:
        data = read_json(
            path, "topology bank", f"build one with `python -m mtprobe.topology --model ... --out {path}`"
        )
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def check_policy(policy: str, trees: Sequence[int], thresholds: Sequence[float], bank_size: int) -> None:
    """ValueError naming what is wrong with a policy's trees and thresholds for a bank of ``bank_size``."""
    from mtprobe import _C

    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {', '.join(POLICIES)}")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in trees):
        raise TypeError(f"trees={list(trees)} must be bank indices (ints)")
    if any(isinstance(h, bool) or not isinstance(h, (int, float)) for h in thresholds):
        raise TypeError(f"thresholds={list(thresholds)} must be numbers")
    _C.TopologyPolicy(policy, list(trees), [float(h) for h in thresholds], bank_size=bank_size)


def default_bank(num_masks: int = 1, block_complexity: int = 30) -> TopologyBank:
    """An uncalibrated bank that fits any model: Top-1-expansion trees of about 0, 1, 2, 4, 8 and
    the most drafts ``block_complexity`` allows (seed 001's static shapes). Build a calibrated bank
    for your model with :func:`build_bank` for the frontier and the thresholds.

    >>> [len(t) for t in default_bank().trees]
    [0, 1, 2, 4, 8, 14]
    """
    from mtprobe.config import _default_branches

    most = block_complexity // (num_masks + 1) - 1
    if most < 1:
        raise ValueError(f"block_complexity={block_complexity} leaves no draft for {num_masks} mask token(s)")
    sizes = sorted({0, *(n for n in (1, 2, 4, 8) if n < most), most})
    trees = [
        chain_tree(_default_branches(n, num_masks)) if n >= num_masks else chain_tree([n]) for n in sizes
    ]
    return TopologyBank(trees=tuple(trees), num_masks=num_masks)


# --- Offline: rollouts, frontiers, calibration ---------------------------------------------------------


@dataclass
class StepRecord:
    """One recorded decode step of a rollout: the true tokens' child ranks per depth (-1: absent or
    past the end), the features the policy read, and the rollout it belongs to."""

    rollout: int
    ranks: tuple[int, ...]  # [k]
    features: tuple[float, float, float, float]  # top1, path_value, entropy_ema, accept_ema


@dataclass(frozen=True)
class Rollout:
    """What :func:`rollout` measured over its prompts."""

    records: list[StepRecord]  # every decode step's record, prompt by prompt
    tau: float  # tokens gained per decode step
    context: int  # the median context length at the middle of the generations
    overhead_s: float  # seconds per forward outside the model's forwards: the drafter's and the loop's


def true_ranks(
    candidates: Sequence[Sequence[int]], sequence: Sequence[int], pos: int, prune: bool
) -> list[int]:
    """Child ranks of the true continuation below root ``sequence[pos]``: at depth d, the rank of
    ``sequence[pos + d]`` among depth d's candidates without its parent's and the root's token
    (-1 when it is not a candidate, or past the end of the sequence, or below a miss).

    >>> true_ranks([[5, 7, 9], [4, 5, 8]], [7, 9, 4], pos=0, prune=True)
    [1, 0]
    """
    out = []
    for d, cands in enumerate(candidates, start=1):
        if pos + d >= len(sequence) or (out and out[-1] < 0):
            out.append(-1)
            continue
        parent, root, want = sequence[pos + d - 1], sequence[pos], sequence[pos + d]
        allowed = [t for t in cands if not (prune and t in (parent, root))]
        out.append(allowed.index(want) if want in allowed else -1)
    return out


def _bank_config(bank: TopologyBank, tree: int, head: Any = None) -> Any:
    """The configuration that runs bank tree ``tree`` every step and records: EntMTP for a probing bank,
    ``head`` (a HeadsConfig) with the bank for a head's."""
    import mtprobe

    if bank.drafter == "heads":
        return dataclasses.replace(
            head,
            bank=bank,
            policy="static",
            trees=(tree,),
            thresholds=None,
            feature=None,
            record_steps=True,
            block_complexity=max(head.block_complexity, bank.block_complexity),
        )
    return mtprobe.EntMTPConfig(bank=bank, policy="static", trees=(tree,), record_steps=True)


def rollout(
    model: Any,
    prompts: Sequence[torch.Tensor],
    bank: TopologyBank,
    tree: int,
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
    head: Any = None,
) -> Rollout:
    """Greedy generation of every prompt with bank tree ``tree`` every step (``head``: the HeadsConfig of
    a head's bank), recording every step."""
    import mtprobe

    config = _bank_config(bank, tree, head)
    records: list[StepRecord] = []
    gained = steps = forwards = 0
    outside = 0.0
    contexts = []
    for r, ids in enumerate(prompts):
        out = mtprobe.generate(model, ids, config, max_new_tokens=max_new_tokens, do_sample=False)
        seq = out.sequences[0].tolist()
        log = out.topology_log
        if "ranks" in log:  # a head's: ranked in C++ from its circuit
            ranks = log["ranks"]
        else:
            ranks = [
                true_ranks(c, seq, pos, bank.prune)
                for pos, c in zip(log["positions"], log["candidates"].tolist(), strict=True)
            ]
        for pos, rk, feats in zip(log["positions"], ranks, log["features"], strict=True):
            if pos < len(seq):
                records.append(StepRecord(r, tuple(rk), tuple(feats)))
        gained += sum(out.accept_lengths)
        steps += out.steps
        forwards += out.forward_calls
        outside += out.timings["total_s"] - out.timings["forward_s"]
        contexts.append(ids.shape[-1] + out.new_tokens // 2)
        if progress:
            progress(f"tree {tree}: prompt {r + 1}/{len(prompts)}, tau so far {gained / max(1, steps):.3f}")
    context = int(sorted(contexts)[len(contexts) // 2]) if contexts else 0
    return Rollout(records, gained / max(1, steps), context, outside / max(1, forwards))


def acceptance_frontier(
    records: Sequence[StepRecord], depth: int, max_nodes: int, max_rank: int = 15
) -> list[Tree]:
    """Seed 002's greedy acceptance frontier: trees of 1, 2, ..., ``max_nodes`` - 1 drafts, each the
    previous plus the one node that raises the mean accepted depth over ``records`` most (ties:
    smaller rank sum, then shallower). A node is reached by exactly the steps whose true ranks start
    with its path, so its gain is the share of such steps.

    >>> recs = [StepRecord(0, (0, 0), (0, 0, 0, 0))] * 3 + [StepRecord(0, (1, -1), (0, 0, 0, 0))]
    >>> acceptance_frontier(recs, depth=2, max_nodes=4)
    [((0,),), ((0,), (0, 0)), ((0,), (0, 0), (1,))]
    """
    reach: dict[tuple[int, ...], int] = {}
    for rec in records:
        for d in range(1, depth + 1):
            if rec.ranks[d - 1] < 0:
                break
            reach[rec.ranks[:d]] = reach.get(rec.ranks[:d], 0) + 1
    tree: list[tuple[int, ...]] = []
    frontier: list[Tree] = []
    children: dict[tuple[int, ...], int] = {(): 0}  # node -> children so far (the next child's rank)
    while len(tree) + 1 < max_nodes:
        options = [node + (n,) for node, n in children.items() if len(node) < depth and n <= max_rank]
        if not options:
            break
        best = max(options, key=lambda c: (reach.get(c, 0), -sum(c), -len(c)))
        tree.append(best)
        children[best[:-1]] += 1
        children[best] = 0
        frontier.append(tuple(tree))
    return frontier


def replay_policy(
    records: Sequence[StepRecord],
    accepted: Sequence[Sequence[int]],
    policy: str,
    trees: Sequence[int],
    thresholds: Sequence[float],
    feature: str,
    ema: float = 0.5,
) -> list[int]:
    """The tree a policy picks at every step of ``records`` (``accepted[s][i]``: drafts tree ``i``
    accepts at step ``s``), as the drafters pick it: record ``s``'s features (read where its
    candidates were made) choose the tree step ``s`` drafts. The accept feature is re-derived from the
    replayed choices (it starts at the prefill's 0 accepted drafts); the others are as recorded."""
    from mtprobe.reference.topology import choose

    col = _FEATURE_COLUMN[feature]
    chosen: list[int] = []
    current, rollout_id, accept_ema = trees[0], -1, 0.0
    for s, rec in enumerate(records):
        if rec.rollout != rollout_id:  # a new generation: the policy starts over
            rollout_id, current, accept_ema = rec.rollout, trees[0], 0.0
        if feature == "accept":
            score = accept_ema
        elif feature == "entropy":
            score = math.exp(-rec.features[col])
        else:
            score = rec.features[col]
        current = choose(policy, trees, thresholds, score, current)
        chosen.append(current)
        accept_ema = ema * accepted[s][current] + (1 - ema) * accept_ema
    return chosen


def simulate_policy(
    records: Sequence[StepRecord],
    accepted: Sequence[Sequence[int]],
    costs: Sequence[float],
    policy: str,
    trees: Sequence[int],
    thresholds: Sequence[float],
    feature: str,
    ema: float = 0.5,
) -> float:
    """Tokens per second a policy would reach replaying ``records`` (:func:`replay_policy`).

    ``costs[i]`` is the seconds of one step with tree ``i``: its forward t(T) plus the drafter's own
    time per step, as :func:`build_bank` passes them."""
    chosen = replay_policy(records, accepted, policy, trees, thresholds, feature, ema)
    tokens = sum(accepted[s][t] + 1 for s, t in enumerate(chosen))
    seconds = sum(costs[t] for t in chosen)
    return tokens / seconds if seconds else 0.0


def _scores(records: Sequence[StepRecord], feature: str) -> list[float]:
    col = _FEATURE_COLUMN[feature]
    if feature == "entropy":
        return [math.exp(-r.features[col]) for r in records]
    return [r.features[col] for r in records]


def _quantiles(values: Sequence[float], qs: Iterable[float]) -> list[float]:
    v = sorted(values)
    return [v[min(len(v) - 1, max(0, int(q * len(v))))] for q in qs] if v else []


def policy_trees(bank: TopologyBank, feature: str) -> list[int]:
    """The bank's trees a policy on ``feature`` may switch between: all of them, except that on the
    root alone nothing is ever accepted, so a policy on the accept EMA that reached it would never
    leave it; that feature gets the trees with drafts only.

    >>> policy_trees(TopologyBank(trees=((), ((0,),), chain_tree([3]))), "accept")
    [1, 2]
    """
    return [i for i, t in enumerate(bank.trees) if feature != "accept" or t]


def calibrate_policies(
    records: Sequence[StepRecord], bank: TopologyBank, costs: Sequence[float]
) -> dict[str, dict[str, Any]]:
    """Seed 002's one-dimensional sweeps, replayed on ``records``: for each policy the trees,
    thresholds and feature with the most simulated tokens per second."""
    n = len(bank.trees)
    topo = [bank.topology(i) for i in range(n)]
    accepted = [[t.accepted_depth(list(r.ranks)) for t in topo] for r in records]
    grid = [q / 20 for q in range(1, 20)]
    best: dict[str, dict[str, Any]] = {}

    def keep(name: str, rate: float, **settings: Any) -> None:
        if name not in best or rate > best[name]["simulated_tokens_per_s"]:
            best[name] = {**settings, "simulated_tokens_per_s": rate}

    for i in range(n):
        keep(
            "static",
            simulate_policy(records, accepted, costs, "static", [i], [], "path_value"),
            trees=[i],
            thresholds=[],
            feature="path_value",
        )
    for feature in FEATURES:
        qs = _quantiles(_scores(records, feature), grid)
        usable = policy_trees(bank, feature)
        if feature == "accept":
            qs = sorted(set(qs) | {0.25, 0.5, 1.0, 1.5, 2.0})
        for lo, hi in itertools.combinations(usable, 2):
            for a in range(len(qs)):
                for b in range(a, len(qs)):
                    th = [qs[a], qs[b]]
                    rate = simulate_policy(records, accepted, costs, "hysteretic", [lo, hi], th, feature)
                    keep("hysteretic", rate, trees=[lo, hi], thresholds=th, feature=feature)
        # The ladder over the usable trees: thresholds at evenly spaced quantiles, shifted by the sweep.
        m = len(usable)
        for shift in [s / 20 for s in range(-8, 9)] if m else []:
            cuts = [min(0.99, max(0.01, j / m + shift)) for j in range(1, m)]
            th = sorted(_quantiles(_scores(records, feature), cuts))
            rate = simulate_policy(records, accepted, costs, "ladder", usable, th, feature)
            keep("ladder", rate, trees=usable, thresholds=th, feature=feature)
    return best


def build_bank(
    model: Any,
    prompts: Sequence[torch.Tensor],
    *,
    num_masks: int = 1,
    head: Any = None,
    max_nodes: int = 15,
    debias_sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 11, 14),
    max_new_tokens: int = 64,
    profile: Any = None,
    progress: Callable[[str], None] | None = None,
) -> TopologyBank:
    """The calibrated bank for ``model`` on ``prompts`` (token tensors ``[1, L]``): the five steps of
    the module docstring. ``head``: a :class:`mtprobe.HeadsConfig` to build the bank of its circuit
    head (its ``vocab_top_k`` and ``block_complexity`` apply; ``num_masks`` is then unused), else the
    bank is for probing with ``num_masks`` masks. ``debias_sizes``: drafts counts of the frontier
    trees re-run on their own (each one rollout over all prompts); ``profile``: the forward profile
    (measured if ``None``)."""
    from mtprobe import _C
    from mtprobe.config import HeadsConfig
    from mtprobe.profile import ProfileKey, profile_forward

    if not prompts:
        raise ValueError("build_bank needs at least one calibration prompt")
    if max_nodes < 2:
        raise ValueError(f"max_nodes={max_nodes} must be >= 2 (the root and one draft)")
    if head is not None and not isinstance(head, HeadsConfig):
        raise TypeError(
            f"head must be a HeadsConfig (the circuit head the bank is for), got {type(head).__name__}"
        )
    started = time.perf_counter()
    profile = profile_forward(model) if profile is None else profile
    profile.check(model)
    key = ProfileKey.of(model)
    if head is not None:
        from mtprobe import heads

        loaded = heads.load_cached(head.path, model)
        head = dataclasses.replace(head, bank=None, policy=None, trees=None, thresholds=None, feature=None)
        # A head drafts no mask inputs (T = nodes) and reaches depth n - 1.
        drafter = {
            "drafter": "heads",
            "num_masks": 0,
            "window": loaded.spec.window,
            "vocab_top_k": head.vocab_top_k,
        }
        depth, identity = loaded.spec.window - 1, {"head": loaded.fingerprint()}
    else:
        drafter, depth, identity = {"num_masks": num_masks}, num_masks, {}
    # 1. Self-rollouts with a wide first depth and a chain below it (seed 001's shape): every step's
    # ranks are recorded whatever the tree, which only decides where steps start.
    scout = TopologyBank(trees=(chain_tree([max_nodes - 1] + [1] * (depth - 1)),), **drafter)
    scouted = rollout(model, prompts, scout, 0, max_new_tokens, progress, head)
    records, context = scouted.records, scouted.context
    # 2. Acceptance frontier.
    frontier = acceptance_frontier(records, depth, max_nodes)
    one_step = {}
    for t in frontier:
        topo = _C.Topology([list(p) for p in t])  # compiled once per tree, not per step
        one_step[len(t)] = 1 + sum(topo.accepted_depth(list(r.ranks)) for r in records) / max(1, len(records))
    # 3. Debiasing: the chosen sizes re-run with their own tree.
    chosen = [t for t in frontier if len(t) in set(debias_sizes)]
    candidates: list[Tree] = [(), *chosen]
    # The drafter's own time per step (outside the forwards): the root alone pays what the scout paid
    # (a head still runs every step; probing still reads its masks).
    debiased, overhead = {0: 1.0}, {0: scouted.overhead_s}
    for t in chosen:
        run = rollout(model, prompts, TopologyBank(trees=(t,), **drafter), 0, max_new_tokens, progress, head)
        debiased[len(t)], overhead[len(t)] = run.tau, run.overhead_s
    # 4. Throughput frontier: keep the trees that raise tau over every cheaper one; a step costs its
    # forward over T = (k + 1) nodes inputs plus the drafter's own time.
    kept: list[Tree] = []
    for t in candidates:
        if not kept or debiased[len(t)] > debiased[len(kept[-1])]:
            kept.append(t)
    bank = TopologyBank(trees=tuple(kept), **drafter)
    costs = [profile.time(bank.block_size(i), context) + overhead[len(t)] for i, t in enumerate(kept)]
    rates = [debiased[len(t)] / cost for t, cost in zip(kept, costs, strict=True)]
    # 5. Policy thresholds.
    policies = calibrate_policies(records, bank, costs)
    return TopologyBank(
        trees=tuple(kept),
        **drafter,
        **identity,
        model=model_fingerprint(model),
        device=key.device,
        dtype=key.dtype,
        best=max(range(len(kept)), key=lambda i: rates[i]),
        policies=policies,
        stats={
            "prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "recorded_steps": len(records),
            "scout_tau": scouted.tau,
            "context": context,
            "one_step_tau": {str(n): v for n, v in sorted(one_step.items())},
            "debiased_tau": {str(n): v for n, v in sorted(debiased.items())},
            "drafter_seconds_per_step": [overhead[len(t)] for t in kept],
            "predicted_tokens_per_s": rates,
            "plain_tokens_per_s": 1.0 / profile.time(1, context),
            "build_seconds": time.perf_counter() - started,
            # What the drafter's measured time per step depends on besides the machine.
            **({} if head is None else {"head_dtype": head.head_dtype}),
        },
    )


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mtprobe.topology",
        description="Build an EntMTP topology bank for mask-token probing (or, with --head, a circuit head) on a "
        "model (seed 002): self-rollouts on calibration prompts, the acceptance and throughput frontiers, policy "
        "thresholds.",
    )
    from mtprobe.data import add_calibration_arguments

    add_calibration_arguments(parser)
    parser.add_argument("--num-masks", type=int, default=1, help="k, mask tokens per node (1..4)")
    parser.add_argument(
        "--head",
        default=None,
        help="a circuit head's folder (python -m mtprobe.heads train): build the bank of its trees instead",
    )
    parser.add_argument(
        "--vocab-top-k",
        type=int,
        default=None,
        help="with --head: the head's restricted vocabulary (HeadsConfig.vocab_top_k) the bank is for",
    )
    parser.add_argument(
        "--head-dtype",
        default=None,
        help="with --head: the dtype of the head's per-step products (HeadsConfig.head_dtype), which its "
        "measured time per step depends on",
    )
    parser.add_argument(
        "--max-nodes", type=int, default=15, help="largest tree, root included (BC = (k+1) nodes)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--debias-sizes",
        default="1,2,3,4,6,8,11,14",
        help="draft counts of the frontier trees re-run on their own (one rollout each; default %(default)s)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="a forward profile saved with mtprobe.ForwardProfile.save (default: measured once and cached)",
    )
    args = parser.parse_args(argv)
    try:
        debias = tuple(int(x) for x in args.debias_sizes.split(","))
    except ValueError:
        parser.error(f"--debias-sizes must be comma-separated integers, got {args.debias_sizes!r}")
    from mtprobe.data import calibration_prompts, print_progress
    from mtprobe.profile import ForwardProfile

    for flag, value in (("--vocab-top-k", args.vocab_top_k), ("--head-dtype", args.head_dtype)):
        if value is not None and args.head is None:
            parser.error(f"{flag} is a circuit head's setting: give --head DIR too")
    from mtprobe.config import HeadsConfig

    head = None
    if args.head is not None:
        head = HeadsConfig(path=args.head, vocab_top_k=args.vocab_top_k, head_dtype=args.head_dtype)
    model, _, ids = calibration_prompts(args)

    bank = build_bank(
        model,
        ids,
        num_masks=args.num_masks,
        head=head,
        max_nodes=args.max_nodes,
        max_new_tokens=args.max_new_tokens,
        debias_sizes=debias,
        profile=None if args.profile is None else ForwardProfile.load(args.profile),
        progress=print_progress,
    )
    bank.save(args.out)
    s = bank.stats
    print(
        f"bank for {args.model}: {len(bank.trees)} trees, sizes {[len(t) for t in bank.trees]} drafts, "
        f"EntMTP* = tree {bank.best}; debiased tau {s['debiased_tau']}; built in {s['build_seconds']:.0f} s"
    )
    for name, p in bank.policies.items():
        print(
            f"  {name}: trees {p['trees']}, thresholds {[round(h, 4) for h in p['thresholds']]}, feature "
            f"{p['feature']}, simulated {p['simulated_tokens_per_s']:.2f} tok/s"
        )
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    # Run the imported module's entry point: the configurations check banks against its classes.
    from mtprobe.topology import _main as main

    raise SystemExit(main())
