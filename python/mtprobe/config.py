"""Decoding configurations: frozen dataclasses that validate themselves when built."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import torch

from mtprobe import registry
from mtprobe.profile import ForwardProfile
from mtprobe.topology import FEATURES, POLICIES, TopologyBank, check_policy, default_bank, default_branches

MASK_INITS = ("prompt_mean", "prompt_last", "gaussian", "gaussian_5sigma", "gaussian_10sigma", "calibrated")
TREES = ("static", "dynamic")
_HEAD_DTYPES = ("float32", "bfloat16", "float16")  # HeadsConfig.head_dtype


_C = TypeVar("_C", bound="_ConfigData")
_T = TypeVar("_T")


class _ConfigData:
    """``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` for the decoding configurations.

    The dict holds ``"method"`` (the short name the class is registered under, :mod:`mtprobe.registry`)
    and every field with its resolved value (defaults such as ``num_masks=None`` already filled in),
    tuples as lists, so it is JSON as it stands and ``from_dict(to_dict(c)) == c``.
    """

    # The registered method's short name; each class declares it and registration checks it agrees.
    method: ClassVar[str]
    # How many of the prompt's last positions the drafter reads the target's distributions at (the
    # n-gram stores seed themselves from them); None: every position. The prefill computes logits
    # at those only, and always at the last, which picks the first token
    # (mtprobe.adapter.HFAdapter.prefill_logits_from): on a long prompt the LM head over every row
    # costs a sixth of the prefill.
    prompt_logit_rows: ClassVar[int | None] = 1

    def to_dict(self) -> dict[str, Any]:
        """``{"method": ..., field: value, ...}`` with JSON types (tuples become lists)."""
        out: dict[str, Any] = {"method": self.method}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if hasattr(value, "to_dict"):  # a nested object that serialises itself (a TopologyBank)
                value = value.to_dict()
            elif isinstance(value, os.PathLike):
                value = os.fspath(value)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_json(self, **dumps_kwargs: Any) -> str:
        """``to_dict()`` as JSON text (``dumps_kwargs`` go to ``json.dumps``, e.g. ``indent=2``)."""
        return json.dumps(self.to_dict(), **dumps_kwargs)

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any], **overrides: Any) -> _C:
        """Rebuild a configuration from :meth:`to_dict`'s output (or any subset of its fields; the
        others keep their defaults). ``overrides`` set fields a dict cannot hold (a live
        ``draft_model``). Unknown keys and a ``"method"`` of another class are errors; the values are
        validated as the constructor validates them."""
        return _dataclass_from_dict(cls, cls.method, data, overrides)

    @classmethod
    def from_json(cls: type[_C], text: str | bytes, **overrides: Any) -> _C:
        """Rebuild a configuration from :meth:`to_json`'s output."""
        return cls.from_dict(json.loads(text), **overrides)


def _dataclass_from_dict(
    cls: type[_T], method: str, data: Mapping[str, Any], overrides: Mapping[str, Any]
) -> _T:
    """``cls(**fields)`` from a dict of method ``method``'s fields (``"method"`` optional; derived fields,
    ``init=False``, skipped); an unknown key or another method's name is a ValueError."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict takes a dict of its fields, got {type(data).__name__}")
    given = data.get("method", method)
    if given != method:
        raise ValueError(
            f"{cls.__name__}.from_dict got method={given!r}, but {cls.__name__} is method {method!r}; "
            f"use mtprobe.config_from_dict to pick the class from the method"
        )
    valid = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    derived = {f.name for f in fields(cls) if not f.init}  # type: ignore[arg-type]
    # Derived fields (to_dict writes them) are recomputed by the constructor, not passed to it.
    values = {k: v for k, v in data.items() if k != "method" and k not in derived}
    unknown = sorted(set(values) - set(valid), key=str) + sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"{cls.__name__} (method {method!r}) has no field(s) {', '.join(map(repr, unknown))}; "
            f"valid keys: method, {', '.join(valid)}"
        )
    values.update(overrides)
    # JSON has no tuples: a list stands for a tuple field (ProbeConfig.branches).
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)


def config_from_dict(data: Mapping[str, Any], **overrides: Any) -> Any:
    """The decoding configuration a dict describes, vLLM ``speculative_config`` style: ``"method"``
    names a registered drafter method (``probe``, ``pld``, ``sps``, ``stand``, ``lookahead``, ``hybrid``,
    ``entmtp``, ``heads``, ``auto`` and any registered since: the names the Spec-Bench harness uses) and
    the other keys are its configuration's fields (built by the class's ``from_dict`` if it has one).

    >>> config_from_dict({"method": "pld", "num_tokens": 4})
    PromptLookupConfig(num_tokens=4, max_ngram_size=2, block_complexity=5)
    >>> config_from_dict({"method": "medusa"})
    Traceback (most recent call last):
    ...
    ValueError: unknown method 'medusa'; known methods: probe, pld, sps, stand, lookahead, hybrid, entmtp, heads, auto, plain
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"a configuration dict must be a dict with a 'method' key, got {type(data).__name__}")
    drafters = {m.name: m for m in registry.methods() if m.drafter is not None}
    known = ", ".join(drafters)
    if "method" not in data:
        raise ValueError(
            f"a configuration dict needs a 'method' key naming the decoding method (one of {known}); "
            f"got keys {sorted(map(str, data))}"
        )
    name = data["method"]
    if isinstance(name, str) and name in registry.names():
        if name not in drafters:
            raise ValueError(
                f"method {name!r} has no drafter (a Spec-Bench harness baseline, run by mtprobe.specbench only); "
                f"known methods: {known}"
            )
    if not isinstance(name, str) or name not in drafters:
        raise ValueError(f"unknown method {name!r}; known methods: {known}")
    cls = drafters[name].config_type
    from_dict = getattr(cls, "from_dict", None)
    if callable(from_dict):
        return from_dict(data, **overrides)
    return _dataclass_from_dict(cls, name, data, overrides)


def config_from_json(text: str | bytes, **overrides: Any) -> _ConfigData:
    """:func:`config_from_dict` of JSON text (what a configuration's ``to_json`` wrote)."""
    return config_from_dict(json.loads(text), **overrides)


def _check_mask_value(config: Any) -> None:
    """``config.mask_value`` (ProbeConfig, HybridConfig): None or a finite number >= 0, stored as a float."""
    v = config.mask_value
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"mask_value must be None or a number >= 0, got {v!r}")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"mask_value={v} must be None (masks on every node) or a finite number >= 0")
    object.__setattr__(config, "mask_value", float(v))


@dataclass(frozen=True)
class ProbeConfig(_ConfigData):
    """Mask-token probing (seed 001).

    Args:
        block_complexity: BC, the most input tokens one decode forward may take. With k mask
            tokens per node and K_i drafts at depth i, BC = (k + 1)(1 + sum K_i) (Eq. 6). It is a
            hard budget: no decode forward processes more tokens.
        num_masks: k, chained mask tokens per node (1 to 4). ``None``: one mask at every BC. (The
            paper's default takes two from BC = 60 on, ``ProbeConfig.paper``; over Spec-Bench's dev
            split one mask [29] reaches τ 1.324 at BC 60 against 1.273 for two masks with the
            dynamic tree, benchmarks/results/ablations/.)
        tree: ``"static"`` (branches [K_1, ..., K_k] with Top-1 expansion, App. D) or ``"dynamic"``
            (Alg. 1: candidates scored by cumulative probability, the best B - 1 kept, B = BC / (k + 1)).
            ``None``: static for one mask, dynamic for more.
        branches: the static tree's [K_1, ..., K_k]. ``None``: the largest tree the budget allows,
            K_1 = B - 1 for one mask; for more, about a fifth of the drafts at each deeper level
            ([7, 2] at BC 30 and [15, 4] at BC 60 for two masks, as in the paper's Table 4).
        prune: replace a child that repeats its parent or the last generated token by the next
            best candidate (section 3.5).
        mask_init: ``"prompt_mean"`` (soft: mean of the prompt embeddings), ``"prompt_last"``
            (hard: the last k prompt embeddings), ``"gaussian"`` (N(mu, sigma^2 I) fitted to the
            embedding table) or its out-of-distribution stress settings ``"gaussian_5sigma"`` and
            ``"gaussian_10sigma"`` (mean mu + 5 sigma, mu + 10 sigma), re-initialised per prompt; or
            ``"calibrated"``: masks learned once for the model (``python -m mtprobe calibrate``), read
            from ``mask_path`` (beyond seed 001).
        mask_path: the calibration file of ``mask_init="calibrated"`` (checked against the model when
            the drafter is built); ``None`` for every other initialisation. A file made with
            ``--layer-offsets`` also adds its per-layer vectors to the masks' hidden states in every
            forward (the running update moves the masks only).
        mask_lambda: step of the running update m <- m + lambda (e_new - m), in [0, 1]; 0 keeps the
            initial masks. ``None``: 0.5 for the prompt and Gaussian initialisations (the paper's 0.1
            raised to what the sweep on Spec-Bench's dev split shows: τ 1.257 with 0.1, 1.319 with
            0.3, 1.330 with 0.5 over its 120 questions at BC 30, benchmarks/results/ablations/;
            ``ProbeConfig.paper()`` keeps 0.1), 0 for calibrated masks, which the update only pulls away from what they learned (τ 1.27
            with 0.1 against 1.47 with 0 at BC 30 on Spec-Bench's dev split,
            benchmarks/results/calibrate/).
        incremental_masks: carry the attention mask and position ids across steps of the same
            tree shape (App. E) instead of rebuilding them every step.
        seed: seed of the Gaussian mask initialisations, an int in [0, 2**63 - 1].
        mask_value: ``None``: every node carries k masks (seed 001's rule, B - 1 drafts). A number >= 0
            (beyond seed 001; the dynamic tree): masks only on the nodes a step is likely to end at, and
            up to BC - k - 1 drafts with the inputs that frees, as :class:`HybridConfig`'s ``mask_value``
            plans them. A step that ends at a node without masks drafts the next tree from its nearest
            masked ancestor's deeper masks (csrc/drafters/mask_probe.h).

    >>> ProbeConfig(block_complexity=30).branches
    (14,)
    >>> cfg = ProbeConfig(block_complexity=60)
    >>> cfg.num_masks, cfg.tree, cfg.branches
    (1, 'static', (29,))
    >>> ProbeConfig(block_complexity=60, num_masks=2).tree
    'dynamic'
    >>> ProbeConfig(block_complexity=3)
    Traceback (most recent call last):
    ...
    ValueError: block_complexity=3 is too small for 1 mask token(s): BC = (k + 1)(1 + sum K) needs at least 4 to draft one token
    """

    method: ClassVar[str] = "probe"

    block_complexity: int = 30
    num_masks: int | None = None
    tree: str | None = None
    branches: tuple[int, ...] | None = None
    prune: bool = True
    mask_init: str = "prompt_mean"
    mask_path: str | None = None
    mask_lambda: float | None = None
    incremental_masks: bool = True
    seed: int = 0
    mask_value: float | None = None

    def __post_init__(self) -> None:
        bc = self.block_complexity
        _check_int("block_complexity", bc)
        if self.num_masks is None:
            object.__setattr__(self, "num_masks", 1)
        _check_int("num_masks", self.num_masks)
        k = self.num_masks
        if not 1 <= k <= 4:
            raise ValueError(f"num_masks={k} must be between 1 and 4")
        if bc < 2 * (k + 1):
            raise ValueError(
                f"block_complexity={bc} is too small for {k} mask token(s): BC = (k + 1)(1 + sum K) needs at "
                f"least {2 * (k + 1)} to draft one token"
            )
        _check_mask_value(self)
        if self.tree is None:
            object.__setattr__(self, "tree", "static" if k == 1 and self.mask_value is None else "dynamic")
        if self.mask_value is not None and self.tree != "dynamic":
            raise ValueError(
                f"mask_value={self.mask_value} plans the dynamic tree's masks; use tree='dynamic' (or None)"
            )
        if self.tree not in TREES:
            raise ValueError(f"tree={self.tree!r} must be one of {TREES}")
        budget = bc // (k + 1)  # B: tree nodes, root included
        if self.tree == "dynamic":
            if self.branches is not None:
                raise ValueError("branches are for tree='static'; the dynamic tree chooses its own shape")
        else:
            branches = default_branches(budget - 1, k) if self.branches is None else tuple(self.branches)
            if len(branches) != k:
                raise ValueError(f"branches={list(branches)} needs one count per mask token (num_masks={k})")
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in branches):
                raise ValueError(f"branches={list(branches)} must be positive ints")
            if (k + 1) * (1 + sum(branches)) > bc:
                raise ValueError(
                    f"branches={list(branches)} sum to {sum(branches)} drafts: (k + 1)(1 + sum K) = "
                    f"{(k + 1) * (1 + sum(branches))} exceeds block_complexity={bc}; at most {budget - 1} drafts fit"
                )
            object.__setattr__(self, "branches", branches)
        if self.mask_init not in MASK_INITS:
            raise ValueError(f"mask_init={self.mask_init!r} must be one of {MASK_INITS}")
        _check_mask_path(self.mask_init, self.mask_path)
        if self.mask_path is not None:
            object.__setattr__(self, "mask_path", os.fspath(self.mask_path))  # str: serialisable, hashable
        if self.mask_lambda is None:
            object.__setattr__(self, "mask_lambda", default_mask_lambda(self.mask_init))
        if isinstance(self.mask_lambda, bool) or not isinstance(self.mask_lambda, (int, float)):
            raise TypeError(f"mask_lambda must be a float, got {self.mask_lambda!r}")
        if not 0.0 <= float(self.mask_lambda) <= 1.0:
            raise ValueError(f"mask_lambda={self.mask_lambda} must be in [0, 1] (0 keeps the initial mask)")
        for name in ("prune", "incremental_masks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_seed(self.seed)

    @classmethod
    def paper(cls, block_complexity: int = 30, **overrides: Any) -> ProbeConfig:
        """Seed 001's own settings, pinned whatever this class's defaults become.

        One mask with a static Top-1 tree below BC = 60, two masks with the dynamic tree from 60 on,
        the prompt-mean (soft) mask, the running update with lambda = 0.1, the pruner on; any field
        can be overridden, as in the ablations (``benchmarks/ablations.py``).

        >>> ProbeConfig.paper().mask_lambda, ProbeConfig.paper(60).tree
        (0.1, 'dynamic')
        >>> ProbeConfig.paper(mask_lambda=0.0).mask_lambda
        0.0
        """
        settings: dict[str, Any] = dict(
            num_masks=2 if block_complexity >= 60 else 1,
            prune=True,
            mask_init="prompt_mean",
            mask_lambda=PAPER_MASK_LAMBDA,
        )
        settings.update(overrides)
        return cls(block_complexity=block_complexity, **settings)

    @property
    def budget_nodes(self) -> int:
        """B = BC // (k + 1): tree nodes per step, root included."""
        return self.block_complexity // (self.num_masks + 1)

    @property
    def num_branches(self) -> int:
        """K_1, the root's draft children (static trees); B - 1 for the dynamic tree."""
        return self.branches[0] if self.branches else self.budget_nodes - 1


PAPER_MASK_LAMBDA = 0.1  # seed 001's step of the running mask update
TUNED_MASK_LAMBDA = 0.5  # the best of the sweep on Spec-Bench's dev split (benchmarks/results/ablations/)


def default_mask_lambda(mask_init: str) -> float:
    """The running update's step when none is given: 0.5 (tuned on Spec-Bench's dev split; the paper's
    is 0.1), or 0 for calibrated masks, which the update only pulls away from what they learned.

    >>> default_mask_lambda("prompt_mean"), default_mask_lambda("calibrated")
    (0.5, 0.0)
    """
    return 0.0 if mask_init == "calibrated" else TUNED_MASK_LAMBDA


def _check_mask_path(mask_init: str, mask_path: object) -> None:
    if mask_init == "calibrated":
        if mask_path is None:
            raise ValueError(
                "mask_init='calibrated' needs mask_path=FILE, a calibration made by python -m mtprobe calibrate "
                "--model ... --out FILE"
            )
        if not isinstance(mask_path, (str, os.PathLike)):
            raise TypeError(f"mask_path must be a str or path, got {mask_path!r}")
    elif mask_path is not None:
        raise ValueError(
            f"mask_path is for mask_init='calibrated', not {mask_init!r}: drop mask_path or set "
            "mask_init='calibrated'"
        )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _load_bank(config: Any, drafter: str) -> Any:
    """``config.bank`` (a TopologyBank, a saved one's path, or its dict) as a TopologyBank of ``drafter``'s
    trees; a dict is replaced by the bank in ``config`` so that the configuration holds a value."""
    bank = config.bank
    if isinstance(bank, TopologyBank):
        resolved = bank
    elif isinstance(bank, (str, os.PathLike)):
        resolved = TopologyBank.load(bank)
    elif isinstance(bank, Mapping):
        resolved = TopologyBank.from_dict(bank)
        object.__setattr__(config, "bank", resolved)
    else:
        raise TypeError(
            f"bank must be a TopologyBank, the path of a saved one (python -m mtprobe topology), or None, got "
            f"{type(bank).__name__}"
        )
    if resolved.drafter != drafter:
        use = "HeadsConfig(bank=...)" if resolved.drafter == "heads" else "EntMTPConfig(bank=...)"
        raise ValueError(
            f"{type(config).__name__} needs a bank of {drafter!r} trees; this one holds {resolved.drafter!r} trees "
            f"(use it with {use})"
        )
    return resolved


def _resolve_policy(config: Any, bank: Any) -> None:
    """Fill ``config``'s ``policy``, ``trees``, ``thresholds`` and ``feature`` left at ``None`` from
    ``bank``'s calibration (else uncalibrated defaults) and validate them and ``ema``."""
    if config.policy not in POLICIES:
        raise ValueError(f"policy={config.policy!r} must be one of {', '.join(POLICIES)}")
    n = len(bank.trees)
    calibrated = bank.policies.get(config.policy, {})
    trees = config.trees
    if trees is None:
        trees = calibrated.get("trees")
    if trees is None:
        if config.policy == "static":
            trees = [bank.best if bank.best is not None else n - 1]
        elif config.policy == "hysteretic":
            trees = [min(1, n - 1), n - 1] if n > 1 else [0, 0]
        else:
            trees = list(range(n))
    thresholds = config.thresholds
    if thresholds is None:
        thresholds = calibrated.get("thresholds")
    if thresholds is None:
        if config.policy == "hysteretic":
            thresholds = [0.3, 0.5]
        elif config.policy == "ladder":
            thresholds = [0.1 + 0.6 * j / max(1, len(trees) - 2) for j in range(len(trees) - 1)]
        else:
            thresholds = []
    object.__setattr__(config, "trees", tuple(trees))
    object.__setattr__(config, "thresholds", tuple(thresholds))
    check_policy(config.policy, config.trees, config.thresholds, n)
    object.__setattr__(config, "thresholds", tuple(float(h) for h in config.thresholds))
    feature = config.feature if config.feature is not None else calibrated.get("feature", "path_value")
    if feature not in FEATURES:
        raise ValueError(f"feature={feature!r} must be one of {', '.join(FEATURES)}")
    object.__setattr__(config, "feature", feature)
    ema = config.ema
    if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 < ema <= 1:
        raise ValueError(f"ema={ema!r} must be a number in (0, 1]")


# The C++ drafters take the seed as an int64 and seed a uint64 generator with it (csrc/bindings/drafters.cpp,
# csrc/drafters/mask_probe.cpp): the seeds both sides carry unchanged are 0 .. 2**63 - 1.
SEED_MAX = 2**63 - 1


def _check_seed(seed: object) -> None:
    _check_int("seed", seed)
    if not 0 <= seed <= SEED_MAX:
        raise ValueError(
            f"seed={seed} is out of range: a seed must be an int in [0, 2**63 - 1] = [0, {SEED_MAX}] "
            "(the C++ drafters take it as a signed 64-bit integer)"
        )


def _resolve_budget(config: object, needed: int, what: str) -> None:
    """Fill ``config.block_complexity`` with what its drafts need, or check a given budget holds them."""
    bc = config.block_complexity
    if bc is None:
        object.__setattr__(config, "block_complexity", needed)
        return
    _check_int("block_complexity", bc)
    if bc < needed:
        raise ValueError(f"{what} needs block_complexity >= {needed} inputs per step, got {bc}")


@dataclass(frozen=True)
class PlainConfig(_ConfigData):
    """Plain decoding through mtprobe's own loop: no drafts, one input per decode step (T = 1), the
    step :class:`AutoConfig` falls back to when no draft pays. Its output is the model's own greedy
    (or sampled) decoding; it is the baseline that prices mtprobe's loop, KV cache and linear routes
    beside HF's ``generate``.

    >>> PlainConfig().block_complexity
    1
    """

    method: ClassVar[str] = "plain"
    block_complexity: ClassVar[int] = 1


@dataclass(frozen=True)
class PromptLookupConfig(_ConfigData):
    """Prompt lookup decoding (PLD, seed 001 App. F): draft the chain that followed an earlier
    occurrence of the context's last n-gram, the rule of transformers' ``prompt_lookup_num_tokens``.

    Args:
        num_tokens: chain depth (transformers' ``prompt_lookup_num_tokens``; 10 in the paper).
        max_ngram_size: the longest n-gram matched (transformers' ``max_matching_ngram_size``).
        block_complexity: the budget of one step; ``None`` (the default): what the chain needs,
            ``1 + num_tokens`` (the root and the chain). A smaller budget is an error.

    >>> PromptLookupConfig().block_complexity
    11
    >>> PromptLookupConfig(num_tokens=10, block_complexity=5)
    Traceback (most recent call last):
    ...
    ValueError: a chain of num_tokens=10 drafts after the root needs block_complexity >= 11 inputs per step, got 5
    """

    method: ClassVar[str] = "pld"

    num_tokens: int = 10
    max_ngram_size: int = 2
    block_complexity: int | None = None

    def __post_init__(self) -> None:
        _check_int("num_tokens", self.num_tokens)
        _check_int("max_ngram_size", self.max_ngram_size)
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens={self.num_tokens} must be >= 1 (the chain depth)")
        if self.max_ngram_size < 1:
            raise ValueError(f"max_ngram_size={self.max_ngram_size} must be >= 1")
        _resolve_budget(
            self, 1 + self.num_tokens, f"a chain of num_tokens={self.num_tokens} drafts after the root"
        )


SELF_DRAFTS = ("truncated", "quantized")
"""The drafts :class:`DraftModelConfig` makes from the target itself when no ``draft_model`` is given."""

TRUNCATED_DRAFT_LAYERS = 8
"""The layer-truncated self-draft's depth when ``num_draft_layers`` is not given."""


@dataclass(frozen=True)
class DraftModelConfig(_ConfigData):
    """Draft-model speculative decoding (seed 004): a smaller model drafts a chain of ``num_tokens``
    tokens with its own KV cache; the target verifies them in one forward, by exact match under
    greedy decoding and by rejection sampling (Leviathan et al., Chen et al.) under sampling.

    Args:
        draft_model: any HF causal LM with the target's tokenizer (same vocabulary, same special
            tokens), on the target's device. ``None``: a draft made from the target itself, as
            ``self_draft`` says.
        self_draft: which draft the target makes of itself when ``draft_model`` is ``None``.
            ``"truncated"`` (the default): its first ``num_draft_layers`` layers, final norm and head,
            sharing the target's weights (``mtprobe.draft_model.layer_truncated``). ``"quantized"``:
            every layer, the linear weights in 4 bits and the head's in 8
            (``mtprobe.draft_model.quantized``; a float32 CPU model), which on a CPU drafts in a
            fraction of a target forward and agrees with it on almost every token.
        num_draft_layers: the self-draft's depth, its first layers: ``None`` (the default) is 8 for
            ``"truncated"`` and every layer for ``"quantized"``.
        num_tokens: K, the chain's drafts per step.
        top_branches: b, children of the root: the chain's first token and b - 1 siblings from the
            same first draft forward (the draft's next best tokens under greedy decoding, more
            independent samples of its q under sampling, verified by SpecInfer's multi-draft rule).
            1 drafts a plain chain. A step feeds the target 1 + K + (b - 1) inputs.
        block_complexity: the budget of one step; ``None`` (the default): what the drafts need,
            ``num_tokens + top_branches``. A smaller budget is an error.

    >>> DraftModelConfig(num_tokens=4).block_complexity
    5
    >>> DraftModelConfig(num_tokens=4, top_branches=3).block_complexity
    7
    >>> DraftModelConfig(num_tokens=0)
    Traceback (most recent call last):
    ...
    ValueError: num_tokens=0 must be >= 1 (drafts per step)
    """

    method: ClassVar[str] = "sps"

    draft_model: Any = field(default=None, repr=False)
    num_draft_layers: int | None = None
    num_tokens: int = 5
    top_branches: int = 1
    block_complexity: int | None = None
    self_draft: str = "truncated"

    def __post_init__(self) -> None:
        if self.self_draft not in SELF_DRAFTS:
            raise ValueError(
                f"self_draft={self.self_draft!r} is not a self-draft; choose one of {', '.join(map(repr, SELF_DRAFTS))}"
            )
        if self.self_draft != "truncated" and self.draft_model is not None:
            raise ValueError(
                f"self_draft={self.self_draft!r} makes the draft from the target, so it cannot be given with a "
                "draft_model; pass one or the other"
            )
        _check_int("num_tokens", self.num_tokens)
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens={self.num_tokens} must be >= 1 (drafts per step)")
        if self.num_draft_layers is not None:
            _check_int("num_draft_layers", self.num_draft_layers)
            if self.num_draft_layers < 1:
                raise ValueError(f"num_draft_layers={self.num_draft_layers} must be >= 1")
        _check_int("top_branches", self.top_branches)
        if self.top_branches < 1:
            raise ValueError(f"top_branches={self.top_branches} must be >= 1 (1 drafts a plain chain)")
        _resolve_budget(
            self,
            self.num_tokens + self.top_branches,
            f"a chain of num_tokens={self.num_tokens} drafts and top_branches - 1 = {self.top_branches - 1} "
            "siblings after the root",
        )
        if self.draft_model is not None and not hasattr(self.draft_model, "generate"):
            raise TypeError(
                f"draft_model must be a HuggingFace causal LM (a PreTrainedModel with generate), "
                f"got {type(self.draft_model).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        """As for every configuration; a live ``draft_model`` has no identity a dict can hold, so it
        is refused (the layer-truncated self-draft, ``draft_model=None``, serialises)."""
        if self.draft_model is not None:
            raise ValueError(
                f"DraftModelConfig.to_dict: draft_model is a live {type(self.draft_model).__name__} object, which "
                "a dict or JSON cannot hold; serialise dataclasses.replace(cfg, draft_model=None) and record the "
                "draft model's folder or name yourself, then rebuild with "
                "DraftModelConfig.from_dict(d, draft_model=model)"
            )
        return super().to_dict()


@dataclass(frozen=True)
class StandConfig(_ConfigData):
    """STAND (Song et al. 2025; seed 001, App. F): an n-gram store of the target's own next-token
    distributions (the prompt's text and logits, then the logits of every accepted token) from which
    a draft tree is grown best-first by cumulative probability within the block-complexity budget.

    Args:
        block_complexity: most inputs of one decode forward: the root and ``block_complexity - 1``
            draft nodes.
        max_depth: deepest draft (10 in the paper).
        max_ngram: longest n-gram key matched.
        table_size: next tokens kept per key.
        logits_top_k: tokens of each stored distribution.
        prompt_logits: ``None`` (the default): the store starts from the model's distribution at
            every prompt position. An int N >= 0: at the prompt's last N positions only, so that the
            prefill computes the LM head (and its softmax) over N rows, not the whole prompt; the
            prompt's n-grams go in at every position regardless, so its text is still copied.
        memory_size: ``None`` (the default): every generation starts from an empty store. An int
            N >= 1: a cross-request n-gram memory of at most N keys (least recently used keys
            evicted; csrc/core/ngram_store.h, ``NgramMemory``), shared by every
            :func:`mtprobe.generate` call in the process with the same model and the same
            ``memory_size``, ``max_ngram`` and ``table_size`` (STAND and the hybrid alike). Each
            finished generation folds its text (prompt + output) into it, and drafting reads it
            where this generation's own store has no key, so text that recurs across prompts is
            drafted. ``mtprobe.ngram_memory(model, config)`` returns that memory (to inspect or
            ``clear()`` it). Output is unchanged: every draft is verified.

    >>> StandConfig(block_complexity=30).block_complexity
    30
    >>> StandConfig(block_complexity=1)
    Traceback (most recent call last):
    ...
    ValueError: block_complexity=1 leaves no room for a draft: STAND needs at least 2 (the root and one draft)
    >>> StandConfig(memory_size=0)
    Traceback (most recent call last):
    ...
    ValueError: memory_size=0 must be >= 1 (the most n-gram keys the shared memory keeps), or None for no memory

    The memory across calls, on a tiny random Llama (the second call drafts the first one's text):

    >>> import torch, transformers, mtprobe
    >>> _ = torch.manual_seed(0)
    >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=1)).eval()
    >>> cfg = StandConfig(block_complexity=10, memory_size=4096)
    >>> ids = torch.tensor([[5, 6, 7, 8, 9]])
    >>> first = mtprobe.generate(model, ids, cfg, max_new_tokens=30, eos_token_id=None)
    >>> memory = mtprobe.ngram_memory(model, cfg)
    >>> memory.capacity, len(memory) > 0  # the first call's text is in it
    (4096, True)
    >>> again = mtprobe.generate(model, ids, cfg, max_new_tokens=30, eos_token_id=None)
    >>> torch.equal(again.sequences, first.sequences), again.forward_calls < first.forward_calls
    (True, True)
    >>> memory.clear()
    """

    method: ClassVar[str] = "stand"

    block_complexity: int = 30
    max_depth: int = 10
    max_ngram: int = 3
    table_size: int = 8
    logits_top_k: int = 8
    memory_size: int | None = None
    prompt_logits: int | None = None

    @property
    def prompt_logit_rows(self) -> int | None:  # type: ignore[override]
        return self.prompt_logits  # the store starts from the prompt's distributions

    def __post_init__(self) -> None:
        for name in ("block_complexity", "max_depth", "max_ngram", "table_size", "logits_top_k"):
            _check_int(name, getattr(self, name))
        if self.block_complexity < 2:
            raise ValueError(
                f"block_complexity={self.block_complexity} leaves no room for a draft: STAND needs at least 2 "
                "(the root and one draft)"
            )
        for name in ("max_depth", "max_ngram", "table_size", "logits_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        _check_memory_size(self.memory_size)
        if self.prompt_logits is not None:
            _check_int("prompt_logits", self.prompt_logits)
            if self.prompt_logits < 0:
                raise ValueError(
                    f"prompt_logits={self.prompt_logits} must be >= 0 (how many of the prompt's last positions "
                    "seed the store with the model's distribution), or None for every position"
                )


def max_prompt_logit_rows(configs: Any) -> int | None:
    """The prompt rows (from its end) whose logits any of ``configs`` reads: the most of their
    ``prompt_logit_rows``, ``None`` (every row) when one reads every row or does not say."""
    rows = 1
    for c in configs:
        r = getattr(c, "prompt_logit_rows", None)
        if r is None:
            return None
        rows = max(rows, r)
    return rows


def _check_memory_size(memory_size: object) -> None:
    if memory_size is None:
        return
    if isinstance(memory_size, bool) or not isinstance(memory_size, int):
        raise TypeError(
            f"memory_size must be an int >= 1 (the most n-gram keys the shared memory keeps) or None, got "
            f"{memory_size!r} ({type(memory_size).__name__})"
        )
    if memory_size < 1:
        raise ValueError(
            f"memory_size={memory_size} must be >= 1 (the most n-gram keys the shared memory keeps), or None "
            "for no memory"
        )


# The paper's LADE configurations per block complexity (seed 001, App. F): (L, W, G).
LOOKAHEAD_PAPER_CONFIGS = {10: (3, 4, 1), 30: (4, 5, 5), 60: (5, 8, 7)}


@dataclass(frozen=True)
class LookaheadConfig(_ConfigData):
    """Lookahead decoding (LADE, Fu et al. 2024; seed 001 App. F): each forward runs one Jacobi
    iteration of a window of W future tokens over L - 1 levels, collects the n-grams along the
    window's trajectories into a pool, and verifies the pool's n-grams that start with the current
    token (at most G of them) in the same forward. See csrc/core/lookahead.h.

    Args:
        ngram_size: L, the n-gram size (the window keeps L - 1 levels); at least 2.
        window: W, future positions the window looks ahead; at least 1.
        guess_set_size: G, n-grams kept and verified per starting token; at least 1.
        pool_from_prompt: also pool every n-gram of the prompt and of the output (LADE's
            ``POOL_FROM_PROMPT``; off in LADE and in the paper's baseline).
        block_complexity: the budget of one step; ``None`` (the default): (L - 1)(W + G). A
            smaller budget is an error.

    A step feeds at most (L - 1)(W + G) inputs, the root included: LADE's block complexity.

    >>> LookaheadConfig(ngram_size=4, window=5, guess_set_size=5).block_complexity
    30
    >>> LookaheadConfig.for_block_complexity(60)
    LookaheadConfig(ngram_size=5, window=8, guess_set_size=7, pool_from_prompt=False, block_complexity=60)
    >>> LookaheadConfig(ngram_size=1)
    Traceback (most recent call last):
    ...
    ValueError: ngram_size=1 must be >= 2: lookahead collects n-grams of at least 2 tokens (L = 2 is Jacobi decoding)
    """

    method: ClassVar[str] = "lookahead"

    ngram_size: int = 4
    window: int = 5
    guess_set_size: int = 5
    pool_from_prompt: bool = False
    block_complexity: int | None = None

    # The prefill reads the last prompt row only (the first token): the window starts after the prompt
    # and reads its own cells' logits from the first decode step on (csrc/drafters/lookahead.cpp).
    prompt_logit_rows: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        for name in ("ngram_size", "window", "guess_set_size"):
            _check_int(name, getattr(self, name))
        if self.ngram_size < 2:
            raise ValueError(
                f"ngram_size={self.ngram_size} must be >= 2: lookahead collects n-grams of at least 2 tokens "
                "(L = 2 is Jacobi decoding)"
            )
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1 (future positions of the Jacobi window)")
        if self.guess_set_size < 1:
            raise ValueError(
                f"guess_set_size={self.guess_set_size} must be >= 1: with no guesses nothing is ever verified"
            )
        if not isinstance(self.pool_from_prompt, bool):
            raise TypeError(f"pool_from_prompt must be a bool, got {type(self.pool_from_prompt).__name__}")
        L, W, G = self.ngram_size, self.window, self.guess_set_size
        _resolve_budget(self, (L - 1) * (W + G), f"lookahead with L={L}, W={W}, G={G} ((L - 1)(W + G))")

    @classmethod
    def for_block_complexity(cls, block_complexity: int) -> LookaheadConfig:
        """The paper's configuration at BC 10 (L3 W4 G1), 30 (L4 W5 G5) or 60 (L5 W8 G7)."""
        try:
            ngram_size, window, guess_set_size = LOOKAHEAD_PAPER_CONFIGS[block_complexity]
        except KeyError:
            raise ValueError(
                f"the paper gives lookahead configurations for block_complexity 10, 30 and 60, not "
                f"{block_complexity!r}; build LookaheadConfig(ngram_size=L, window=W, guess_set_size=G) with "
                "(L - 1)(W + G) <= your budget instead"
            ) from None
        return cls(ngram_size, window, guess_set_size)


@dataclass(frozen=True)
class HybridConfig(_ConfigData):
    """The hybrid drafter (seed 001, App. C): mask-token probing and STAND's n-gram store draft one
    tree under one block-complexity budget. Both trees grow from the root with cumulative
    probabilities; their union (a shared token path is one node, scored by its higher score) keeps
    the best B - 1 nodes, B = BC / (k + 1), and every node carries k mask tokens as in probing.

    Args:
        block_complexity: BC, most inputs of one decode forward (masks included).
        num_masks, prune, mask_init, mask_path, mask_lambda, seed: the probing half, as in :class:`ProbeConfig`
            (its tree is the dynamic one).
        max_depth, max_ngram, table_size, logits_top_k, memory_size, prompt_logits: the n-gram half, as
            in :class:`StandConfig` (``memory_size``: the cross-request memory, off by default;
            ``prompt_logits``: the prompt's last positions whose distributions seed the store, every
            one by default).
        mask_value: ``None``: every node carries k masks (seed 001's rule, B - 1 drafts). A number
            >= 0: masks and drafts share the BC inputs, masks only where the step is likely to end
            (a node inside a confident n-gram chain rarely does) and more drafts with the inputs
            that frees; the plan maximises the expected accepted drafts plus ``mask_value`` times
            the chance that the step ends at a masked node (the tokens the next step's probing is
            taken to add). Verification is the same either way: greedy output stays identical.
        grow_probed: ``False`` (seed 001's hybrid): the union of probing's tree and STAND's, each
            grown on its own. ``True``: one best-first tree over both sources' candidates, STAND's
            store drafting below probed tokens too, so a probed token the store did not predict is
            followed by the store's continuation after it instead of ending its branch.

    >>> HybridConfig(block_complexity=30).probe
    ProbeConfig(block_complexity=30, num_masks=1, tree='dynamic', branches=None, prune=True, mask_init='prompt_mean', mask_path=None, mask_lambda=0.5, incremental_masks=True, seed=0, mask_value=None)
    >>> HybridConfig(block_complexity=3)
    Traceback (most recent call last):
    ...
    ValueError: block_complexity=3 is too small for 1 mask token(s): BC = (k + 1)(1 + sum K) needs at least 4 to draft one token
    """

    method: ClassVar[str] = "hybrid"

    block_complexity: int = 30
    num_masks: int = 1
    prune: bool = True
    mask_init: str = "prompt_mean"
    mask_path: str | None = None
    mask_lambda: float | None = None
    seed: int = 0
    max_depth: int = 10
    max_ngram: int = 3
    table_size: int = 8
    logits_top_k: int = 8
    memory_size: int | None = None
    mask_value: float | None = None
    grow_probed: bool = False
    prompt_logits: int | None = None

    @property
    def prompt_logit_rows(self) -> int | None:  # type: ignore[override]
        return self.prompt_logits  # its STAND half's; probing reads the last row, which is always computed

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask_lambda", self.probe.mask_lambda)  # resolved (None: by mask_init)
        self.stand  # noqa: B018  (each half validates its own fields)
        _check_mask_value(self)
        if not isinstance(self.grow_probed, bool):
            raise TypeError(f"grow_probed must be True or False, got {self.grow_probed!r}")
        if self.mask_path is not None:
            object.__setattr__(self, "mask_path", os.fspath(self.mask_path))

    @property
    def probe(self) -> ProbeConfig:
        return ProbeConfig(
            block_complexity=self.block_complexity,
            num_masks=self.num_masks,
            tree="dynamic",
            prune=self.prune,
            mask_init=self.mask_init,
            mask_path=self.mask_path,
            mask_lambda=self.mask_lambda,
            seed=self.seed,
        )

    @property
    def stand(self) -> StandConfig:
        return StandConfig(
            block_complexity=self.block_complexity,
            max_depth=self.max_depth,
            max_ngram=self.max_ngram,
            table_size=self.table_size,
            logits_top_k=self.logits_top_k,
            memory_size=self.memory_size,
            prompt_logits=self.prompt_logits,
        )


@dataclass(frozen=True)
class EntMTPConfig(_ConfigData):
    """EntMTP (seed 002): mask-token probing over a bank of static draft trees, one chosen per step.

    The bank (:class:`mtprobe.topology.TopologyBank`) holds trees by child rank and the probing
    settings they were built with; a policy maps a per-step confidence score to one of them. The
    score is computed from the logits the step already has: ``"path_value"`` (the target's top-1
    probability at the accepted node times the drafter's top-1 probability at every depth, EAGLE-2's
    path value), ``"top1"`` (the target's alone), ``"entropy"`` (exp of minus an EMA of the target's
    entropy) or ``"accept"`` (an EMA of drafts accepted per step).

    Args:
        bank: a TopologyBank, the path of one saved with ``TopologyBank.save`` (built for this
            model by ``python -m mtprobe topology``), or ``None``: :func:`mtprobe.topology.default_bank`,
            uncalibrated shapes that fit any model.
        policy: ``"static"`` (one tree every step: EntMTP*), ``"ladder"`` (trees by cost, score
            thresholds between them) or ``"hysteretic"`` (a conservative and an aggressive tree,
            switch up above ``up``, down below ``down``: EntMTP-tau).
        trees: bank indices the policy uses (static: one; ladder: n; hysteretic: conservative,
            aggressive). ``None``: the bank's calibrated choice, else the defaults below.
        thresholds: ladder: n - 1 ascending; hysteretic: ``(down, up)`` with down <= up. ``None``: the
            bank's calibrated ones, else uncalibrated defaults on the path value.
        feature: the score the policy reads (``None``: the bank's calibrated one, else ``"path_value"``).
        ema: weight of the newest step in the entropy and accept EMAs, in (0, 1].
        record_steps: keep every step's candidates and features in ``GenerateOutput.topology_log``
            (what :func:`mtprobe.topology.build.build_bank` reads).
        incremental_masks: as for :class:`ProbeConfig`.
        block_complexity: the largest bank tree's (k + 1) × nodes (derived).

    Without a calibrated bank: static uses the largest tree; hysteretic the trees of 1 and of the
    most drafts with thresholds (0.3, 0.5); the ladder every tree with thresholds evenly in [0.1, 0.7].

    >>> cfg = EntMTPConfig()
    >>> cfg.policy, cfg.trees, cfg.thresholds, cfg.block_complexity
    ('hysteretic', (1, 5), (0.3, 0.5), 30)
    >>> EntMTPConfig(thresholds=(0.6, 0.4))
    Traceback (most recent call last):
    ...
    ValueError: hysteretic thresholds: switch-down 0.600000 is above switch-up 0.400000; down must be <= up, or the policy flips every step
    """

    method: ClassVar[str] = "entmtp"

    bank: Any = None
    policy: str = "hysteretic"
    trees: tuple[int, ...] | None = None
    thresholds: tuple[float, ...] | None = None
    feature: str | None = None
    ema: float = 0.5
    record_steps: bool = False
    incremental_masks: bool = True
    block_complexity: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        resolved = default_bank() if self.bank is None else _load_bank(self, "probe")
        object.__setattr__(self, "_bank", resolved)
        _resolve_policy(self, resolved)
        for name in ("record_steps", "incremental_masks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "block_complexity", resolved.block_complexity)

    @property
    def resolved_bank(self) -> Any:
        """The TopologyBank in use (loaded from ``bank`` when it is a path; the default bank for ``None``)."""
        return self._bank  # type: ignore[attr-defined]


@dataclass(frozen=True)
class HeadsConfig(_ConfigData):
    """Probabilistic-circuit heads (MTPC, seed 003): self-speculative drafts from a trained circuit head
    over the target's last hidden state (``mtprobe.heads``; train one with
    ``python -m mtprobe heads train --model ... --out DIR``).

    Args:
        path: the head's checkpoint folder (or its ``head.safetensors``), checked against the model
            when the drafter is built (another backbone or vocabulary is an error).
        block_complexity: most inputs of one decode forward: the root and ``block_complexity - 1``
            draft nodes. Greedy: the most probable paths of the head's circuit, best first, given
            the root token, at most ``window - 1`` deep.
        top_branches: under sampling, independent windows drawn from the circuit as chains below
            the root (as many as fit the budget).
        min_path_prob: greedy trees leave out drafts whose path probability under the circuit,
            q(x_1..x_d | root), is below this, so confident steps verify fewer inputs (a forward over
            fewer inputs is cheaper, most of all on a CPU); 0 fills the budget. Lossless either way.
        vocab_top_k: the head emits only the K tokens it saw most often in training (its checkpoint's
            ``token_counts``), so a step computes K LM-head rows instead of V; ``None`` keeps the
            whole vocabulary. Drafts can then never hold the other tokens, which costs acceptance
            when they come; verification keeps the output exact either way.
        head_dtype: the dtype the head's per-step products read their weights in: its LoRA draft
            layers (folded, one product per linear map) and, with ``vocab_top_k``, the restricted
            LM-head rows and adapters; ``"bfloat16"`` or ``"float16"`` halves the memory a step reads,
            most of a one-row product's time on a CPU (check that yours multiplies them natively:
            AVX512-BF16 or AMX for bfloat16). Normalisation stays float32; the drafts may differ
            by rounding, the output never does. ``None``: the draft layers in the model's dtype and
            the rest in float32, as trained. A head with neither draft layers nor ``vocab_top_k``
            refuses it (it would change nothing).
        bank: EntMTP (seed 002) over the head: a :class:`~mtprobe.topology.TopologyBank` of static
            trees (``drafter="heads"``, built for this head by ``python -m mtprobe topology --head
            DIR``) or its path. Every step the policy picks one of its trees and fills it with the
            head's ranked next tokens (child r of a node: the r-th most probable token given the
            node's path), under greedy decoding and sampling alike. ``None``: the best-first tree.
        policy, trees, thresholds, feature, ema: the bank's policy, as for
            :class:`EntMTPConfig` (``policy=None``: ``"static"``, the bank's throughput-optimal tree).
        record_steps: with a bank, log every step's true child ranks and features in
            ``GenerateOutput.topology_log`` (what :func:`mtprobe.topology.build.build_bank` reads).

    >>> HeadsConfig(path="heads/cp4").block_complexity
    30
    >>> HeadsConfig()
    Traceback (most recent call last):
    ...
    ValueError: HeadsConfig needs path=DIR, a head trained by python -m mtprobe heads train --model ... --out DIR
    """

    method: ClassVar[str] = "heads"

    path: str | None = None
    block_complexity: int = 30
    top_branches: int = 4
    min_path_prob: float = 0.0
    vocab_top_k: int | None = None
    head_dtype: str | None = None
    bank: Any = None
    policy: str | None = None
    trees: tuple[int, ...] | None = None
    thresholds: tuple[float, ...] | None = None
    feature: str | None = None
    ema: float = 0.5
    record_steps: bool = False

    def __post_init__(self) -> None:
        if self.path is None:
            raise ValueError(
                "HeadsConfig needs path=DIR, a head trained by python -m mtprobe heads train --model ... --out DIR"
            )
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise TypeError(f"path must be a non-empty str or path, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        for name in ("block_complexity", "top_branches"):
            _check_int(name, getattr(self, name))
        if self.block_complexity < 2:
            raise ValueError(
                f"block_complexity={self.block_complexity} leaves no room for a draft: heads need at least 2 "
                "(the root and one draft)"
            )
        if self.top_branches < 1:
            raise ValueError(f"top_branches={self.top_branches} must be >= 1")
        p = self.min_path_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ValueError(f"min_path_prob={p!r} must be a number in [0, 1) (0: fill the budget)")
        if self.vocab_top_k is not None:
            _check_int("vocab_top_k", self.vocab_top_k)
            if self.vocab_top_k < 1:
                raise ValueError(
                    f"vocab_top_k={self.vocab_top_k} must be >= 1 (tokens the head may emit), or None for all"
                )
        if isinstance(self.head_dtype, torch.dtype):
            object.__setattr__(self, "head_dtype", str(self.head_dtype).removeprefix("torch."))
        if self.head_dtype is not None and self.head_dtype not in _HEAD_DTYPES:
            raise ValueError(
                f"head_dtype={self.head_dtype!r}: expected one of {', '.join(map(repr, _HEAD_DTYPES))} "
                "(or None: the model's dtype for the draft layers, float32 for the rest)"
            )
        if not isinstance(self.record_steps, bool):
            raise TypeError(f"record_steps must be a bool, got {self.record_steps!r}")
        if self.bank is None:
            given = [
                name
                for name in ("policy", "trees", "thresholds", "feature")
                if getattr(self, name) is not None
            ]
            if given or self.record_steps:
                raise ValueError(
                    f"{', '.join(given + ['record_steps'] * self.record_steps)} set without bank=...: the policy "
                    "switches between a topology bank's trees; build one with python -m mtprobe topology --head DIR"
                )
            return
        bank = _load_bank(self, "heads")
        object.__setattr__(self, "_bank", bank)
        if self.policy is None:
            object.__setattr__(self, "policy", "static")
        _resolve_policy(self, bank)
        if bank.block_complexity > self.block_complexity:
            raise ValueError(
                f"the bank's largest tree needs block_complexity {bank.block_complexity}, above "
                f"block_complexity={self.block_complexity}; raise it or use a bank of smaller trees"
            )

    @property
    def resolved_bank(self) -> Any:
        """The TopologyBank in use (loaded from ``bank`` when it is a path), or ``None`` (best-first trees)."""
        return getattr(self, "_bank", None)

    @property
    def torch_head_dtype(self) -> torch.dtype | None:
        """``head_dtype`` as a torch dtype (``None`` stays ``None``)."""
        return None if self.head_dtype is None else getattr(torch, self.head_dtype)


@dataclass(frozen=True)
class AutoConfig(_ConfigData):
    """Per-step scheduling by measured cost (beyond the papers; seed 002's idea of choosing the
    draft tree per step, priced by this machine's own forward times).

    Every step each of ``drafters`` proposes its block. For each block and each cut of it (the k
    nodes most likely accepted) the scheduler estimates the tokens it gains, E[k] = 1 + the sum of
    P(node accepted) over the kept nodes, from the run's own acceptance counts by depth and sibling
    rank (decayed, so they follow the text; every candidate's tree is walked along the real
    continuation, a sampled one only on steps it ran), and its cost t(T_k) / t(1) from a
    :class:`~mtprobe.profile.ForwardProfile` of the model on this machine. The step verifies the
    block and cut with the most tokens per unit of time, or only the committed token (plain
    decoding, T = 1) when no draft pays for itself. A draft model (``DraftModelConfig``) costs its
    own forwards before its chain exists, so it is not asked every step: its chain is forecast from its
    acceptance so far and the measured seconds of its forwards, and it drafts only when the forecast
    beats the best block in hand (and to explore: at its first step, with all ``num_tokens`` drafts,
    and after ``explore_every`` idle steps); what it measured of the draft model carries over to the
    model's next generation in the process. What it chose is in ``GenerateOutput.choices``. The
    output is that of plain decoding whatever it chooses.

    The default drafters are prompt lookup, STAND (BC 10, its store seeded with the prompt's text but
    not its logits, ``prompt_logits=0``, so that the prefill skips the LM head over the prompt) and the
    quantized self-draft with chains of up to 24 (``DraftModelConfig(self_draft="quantized",
    num_tokens=24)``), which on a CPU drafts in about a third of a target forward (its one-token
    forwards in C++ on a Llama-architecture model) and agrees with the model on almost every token. A
    quantized self-draft the model cannot run (on a GPU, in bfloat16, no linear to quantize:
    :func:`mtprobe.draft_model.why_not_quantized`) is left out of the candidates.

    Args:
        drafters: the candidate drafters' configurations (not ``AutoConfig``). Blocks made only of
            draft tokens (prompt lookup, STAND) can be cut to any subtree; blocks with auxiliary inputs
            (probing's mask tokens, lookahead's window) run whole or not at all; a draft model's chain
            runs as long as its forecast says (``top_branches`` siblings are not drafted here).
        profile: a ForwardProfile, the path of one saved with ``ForwardProfile.save``, or ``None``:
            :func:`mtprobe.profile_forward` measures the model at the first call (seconds; cached on disk).
        decay: per-step decay of the acceptance counts, in (0, 1].
        explore_every: a drafter with auxiliary inputs that has not run for this many steps runs once
            (its masks must run for it to have drafts at all).
        block_complexity: the most inputs one step may take: the largest of the drafters' (derived).
            Each drafter still drafts within its own ``block_complexity``.

    >>> AutoConfig().block_complexity
    25
    >>> AutoConfig(drafters=())
    Traceback (most recent call last):
    ...
    ValueError: AutoConfig needs at least one drafter to choose from, e.g. drafters=(PromptLookupConfig(), StandConfig(block_complexity=10))
    """

    method: ClassVar[str] = "auto"

    drafters: tuple[Any, ...] = field(
        default_factory=lambda: (
            PromptLookupConfig(),
            StandConfig(block_complexity=10, prompt_logits=0),
            DraftModelConfig(self_draft="quantized", num_tokens=24),
        )
    )
    profile: Any = None
    decay: float = 0.95
    explore_every: int = 16
    block_complexity: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        drafters = self.drafters
        if isinstance(drafters, (list, _ConfigData)):
            drafters = tuple(drafters) if isinstance(drafters, list) else (drafters,)
            object.__setattr__(self, "drafters", drafters)
        if not isinstance(drafters, tuple) or not drafters:
            raise ValueError(
                "AutoConfig needs at least one drafter to choose from, e.g. "
                "drafters=(PromptLookupConfig(), StandConfig(block_complexity=10))"
            )
        # The registered methods with schedulable=True (probing, prompt lookup, STAND, lookahead, the hybrid,
        # EntMTP, heads, draft models, and any registered so since).
        choosable = tuple(m.config_type for m in registry.methods() if m.schedulable)
        for i, c in enumerate(drafters):
            if isinstance(c, choosable):
                continue
            names = ", ".join(k.__name__ for k in choosable)
            if registry.find(c) is not None:
                raise ValueError(
                    f"drafters[{i}] is a {type(c).__name__}, which AutoConfig cannot schedule; choose among {names}"
                )
            raise TypeError(
                f"drafters[{i}] is {type(c).__name__}, not a drafter configuration; use one of {names}"
            )
        if self.profile is not None and not isinstance(self.profile, (ForwardProfile, str)):
            raise TypeError(
                f"profile must be a ForwardProfile, the path of a saved one, or None (measure it), got "
                f"{type(self.profile).__name__}"
            )
        if (
            isinstance(self.decay, bool)
            or not isinstance(self.decay, (int, float))
            or not 0 < self.decay <= 1
        ):
            raise ValueError(f"decay={self.decay!r} must be a number in (0, 1]")
        _check_int("explore_every", self.explore_every)
        if self.explore_every < 1:
            raise ValueError(f"explore_every={self.explore_every} must be >= 1")
        object.__setattr__(self, "block_complexity", max(c.block_complexity for c in drafters))

    @property
    def prompt_logit_rows(self) -> int | None:  # type: ignore[override]
        return max_prompt_logit_rows(self.drafters)

    def to_dict(self) -> dict[str, Any]:
        profile = self.profile.to_dict() if hasattr(self.profile, "to_dict") else self.profile
        return {
            "method": self.method,
            "drafters": [c.to_dict() for c in self.drafters],
            "profile": profile,
            "decay": self.decay,
            "explore_every": self.explore_every,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **overrides: Any) -> AutoConfig:
        if not isinstance(data, Mapping):
            raise TypeError(f"AutoConfig.from_dict takes a dict of its fields, got {type(data).__name__}")
        if data.get("method", cls.method) != cls.method:
            raise ValueError(
                f"AutoConfig.from_dict got method={data.get('method')!r}; use mtprobe.config_from_dict"
            )
        valid = ("drafters", "profile", "decay", "explore_every")
        values = {k: v for k, v in data.items() if k not in ("method", "block_complexity")}
        unknown = sorted(set(values) - set(valid), key=str)
        if unknown:
            raise ValueError(
                f"AutoConfig (method 'auto') has no field(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: method, {', '.join(valid)}"
            )
        if "drafters" in values:
            values["drafters"] = tuple(
                config_from_dict(c) if isinstance(c, Mapping) else c for c in values["drafters"]
            )
        if isinstance(values.get("profile"), Mapping):
            values["profile"] = ForwardProfile.from_dict(dict(values["profile"]))
        values.update(overrides)
        return cls(**values)
