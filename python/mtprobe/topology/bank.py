"""The topology bank: static draft trees for mask-token probing or a circuit head, the checks that
tie a bank to its model (and head), and the policies that switch between its trees every step.

What the decoding configurations (:mod:`mtprobe.drafters`) need of EntMTP; building a bank for a model is
:mod:`mtprobe.offline.topology`'s.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtprobe import _C
from mtprobe._jsonl import read_json, write_json
from mtprobe.target_model.profile import ProfileKey, architecture

__all__ = [
    "BANK_FORMAT",
    "DRAFTERS",
    "FEATURES",
    "POLICIES",
    "Tree",
    "TopologyBank",
    "chain_tree",
    "check_policy",
    "default_bank",
    "default_branches",
    "model_fingerprint",
]

BANK_FORMAT = 1
DRAFTERS = ("probe", "heads")
POLICIES = ("static", "ladder", "hysteretic")
FEATURES = ("path_value", "top1", "entropy", "accept")

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


def default_branches(drafts: int, k: int) -> tuple[int, ...]:
    """Drafts per depth of the Top-1-expansion tree of ``drafts`` drafts over ``k`` mask tokens: most at
    depth 1, about a fifth at each deeper depth (the paper's [7, 2], [15, 4]).

    >>> default_branches(9, 2)
    (7, 2)
    """
    deeper = [max(1, round(0.2 * drafts))] * (k - 1)
    first = drafts - sum(deeper)
    if first < 1:
        deeper = [1] * (k - 1)
        first = drafts - (k - 1)
    return (first, *deeper)


def model_fingerprint(model: Any) -> str:
    """Architecture hash and a hash of the input embedding table's first rows: acceptance depends on
    the weights, so a bank belongs to one checkpoint (``LlamaForCausalLM:0123...:abcd...``)."""
    rows = model.get_input_embeddings().weight[:64].detach().to("cpu", torch.float32).contiguous()
    return f"{architecture(model)}:{hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:12]}"


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
                    f"{head.fingerprint()}); build one for it with `python -m mtprobe topology --head DIR ...`"
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
                "model with `python -m mtprobe topology --model ... --out FILE` or mtprobe.offline.topology.build_bank"
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
            path, "topology bank", f"build one with `python -m mtprobe topology --model ... --out {path}`"
        )
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def check_policy(policy: str, trees: Sequence[int], thresholds: Sequence[float], bank_size: int) -> None:
    """ValueError naming what is wrong with a policy's trees and thresholds for a bank of ``bank_size``."""
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
    for your model with :func:`mtprobe.offline.topology.build_bank` for the frontier and the thresholds.

    >>> [len(t) for t in default_bank().trees]
    [0, 1, 2, 4, 8, 14]
    """
    most = block_complexity // (num_masks + 1) - 1
    if most < 1:
        raise ValueError(f"block_complexity={block_complexity} leaves no draft for {num_masks} mask token(s)")
    sizes = sorted({0, *(n for n in (1, 2, 4, 8) if n < most), most})
    trees = [chain_tree(default_branches(n, num_masks)) if n >= num_masks else chain_tree([n]) for n in sizes]
    return TopologyBank(trees=tuple(trees), num_masks=num_masks)
