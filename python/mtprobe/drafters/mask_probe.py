"""Mask-token probing (seed 001; ``csrc/drafters/mask_probe.cpp``): every draft node carries k mask
tokens whose logits draft the next step's tree; the core method."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mtprobe import _C
from mtprobe.drafters.base import ConfigData, bc_option, check_int, check_seed, parse_bool
from mtprobe.registry import Method, Option, ProcessFn, register
from mtprobe.target_model.mask_calibration import load_calibration
from mtprobe.topology import default_branches

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MASK_INITS = ("prompt_mean", "prompt_last", "gaussian", "gaussian_5sigma", "gaussian_10sigma", "calibrated")
TREES = ("static", "dynamic")
_GAUSSIAN_SHIFT = {"gaussian": 0.0, "gaussian_5sigma": 5.0, "gaussian_10sigma": 10.0}


def check_mask_value(config: Any) -> None:
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
class ProbeConfig(ConfigData):
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
        check_int("block_complexity", bc)
        if self.num_masks is None:
            object.__setattr__(self, "num_masks", 1)
        check_int("num_masks", self.num_masks)
        k = self.num_masks
        if not 1 <= k <= 4:
            raise ValueError(f"num_masks={k} must be between 1 and 4")
        if bc < 2 * (k + 1):
            raise ValueError(
                f"block_complexity={bc} is too small for {k} mask token(s): BC = (k + 1)(1 + sum K) needs at "
                f"least {2 * (k + 1)} to draft one token"
            )
        check_mask_value(self)
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
        check_mask_path(self.mask_init, self.mask_path)
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
        check_seed(self.seed)

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


def check_mask_path(mask_init: str, mask_path: object) -> None:
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


def mask_options(model: PreTrainedModel, config: ProbeConfig) -> dict[str, object]:
    """The probing options both MaskProbeDrafter and HybridDrafter take; a calibration file is loaded
    and checked against ``model`` here (ValueError when it was learned for another model)."""
    init = config.mask_init
    initial_masks = None
    if init == "calibrated":
        cal = load_calibration(config.mask_path)
        cal.check(model, config.num_masks)
        initial_masks = cal.masks  # [>= k, hidden] float32; the drafter takes the first k
    return dict(
        num_masks=config.num_masks,
        block_complexity=config.block_complexity,
        prune=config.prune,
        mask_init=gaussian_init(init),
        gaussian_shift=_GAUSSIAN_SHIFT.get(init, 0.0),
        mask_lambda=float(config.mask_lambda),
        seed=config.seed,
        initial_masks=initial_masks,
    )


def gaussian_init(mask_init: str) -> str:
    """The C++ drafter's name of ``mask_init``: the shifted Gaussians are ``"gaussian"`` with a shift."""
    return "gaussian" if mask_init in _GAUSSIAN_SHIFT else mask_init


def gaussian_shift(mask_init: str) -> float:
    """How many standard deviations a Gaussian mask initialisation is shifted (0 for the others)."""
    return _GAUSSIAN_SHIFT.get(mask_init, 0.0)


def mask_probe_drafter(
    model: PreTrainedModel,
    config: ProbeConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.MaskProbeDrafter:
    """The mask-token probing drafter of ``config`` over ``model``'s input embedding table."""
    return _C.MaskProbeDrafter(
        model.get_input_embeddings().weight,
        dynamic_tree=config.tree == "dynamic",
        branches=list(config.branches or ()),
        mask_value=config.mask_value,
        **mask_options(model, config),
    )


def calibrated_masks(config: Any) -> tuple[str, int] | None:
    """The calibration file and mask count of a probing configuration (ProbeConfig, HybridConfig) with
    calibrated masks, else None: what the target's forward adapts at the masks."""
    return (config.mask_path, config.num_masks) if config.mask_init == "calibrated" else None


# The mask tokens' start, shared by probing and the hybrid's probing half.
MASK_OPTIONS = (
    Option(
        "--mask-init",
        "mask_init",
        str,
        "init-",
        "mask design: prompt_mean, prompt_last, gaussian, gaussian_5sigma, gaussian_10sigma or "
        "calibrated (with --mask-path)",
    ),
    Option(
        "--mask-path",
        "mask_path",
        str,
        "masks-",
        "the mask calibration file of --mask-init calibrated (python -m mtprobe calibrate)",
    ),
)

register(
    Method(
        name="probe",
        tokens_only="its drafts come from mask tokens that the target's forward reads as extra inputs, and their logits",
        config_type=ProbeConfig,
        drafter=mask_probe_drafter,
        summary="mask-token probing: mtprobe.generate with a ProbeConfig",
        schedulable=True,
        mask_calibration=calibrated_masks,
        options=(
            bc_option("BC, the most input tokens of one decode forward, mask tokens included"),
            Option(
                "--num-masks",
                "num_masks",
                int,
                "k",
                "k, chained mask tokens per tree node, 1 to 4; default 1",
            ),
            Option(
                "--tree",
                "tree",
                str,
                "tree-",
                "static (fixed branches, Top-1 expansion) or dynamic (the best candidates by cumulative "
                "probability); default static for 1 mask, else dynamic",
            ),
            Option(
                "--prune",
                "prune",
                parse_bool,
                "prune-",
                "true/false: replace a draft that repeats its parent or the last token by the next best",
            ),
            *MASK_OPTIONS,
            Option(
                "--mask-lambda",
                "mask_lambda",
                float,
                "lam",
                "lambda in [0, 1], step of the running mask update m <- m + lambda (e_new - m); 0 keeps "
                "the initial masks",
            ),
            Option(
                "--mask-value",
                "mask_value",
                float,
                "mv",
                "masks only where the step is likely to end (dynamic tree), drafts with the inputs freed, "
                "valuing the next step's probing at V tokens (default: masks on every node, seed 001's rule)",
            ),
        ),
    )
)
