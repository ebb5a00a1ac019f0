"""EntMTP (seed 002): mask-token probing over a topology bank of static trees, one tree per step chosen
by a policy (the bank mode of ``csrc/drafters/mask_probe.cpp``). The bank and policy helpers here serve
the circuit heads' bank mode too (:mod:`mtprobe.drafters.heads`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from mtprobe import _C
from mtprobe.drafters.base import ConfigData
from mtprobe.drafters.mask_probe import gaussian_init, gaussian_shift
from mtprobe.registry import Method, Option, ProcessFn, register
from mtprobe.topology import FEATURES, POLICIES, TopologyBank, check_policy, default_bank

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_bank(config: Any, drafter: str) -> Any:
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


def resolve_policy(config: Any, bank: Any) -> None:
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


@dataclass(frozen=True)
class EntMTPConfig(ConfigData):
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
            (what :func:`mtprobe.offline.topology.build_bank` reads).
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
        resolved = default_bank() if self.bank is None else load_bank(self, "probe")
        object.__setattr__(self, "_bank", resolved)
        resolve_policy(self, resolved)
        for name in ("record_steps", "incremental_masks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "block_complexity", resolved.block_complexity)

    @property
    def resolved_bank(self) -> Any:
        """The TopologyBank in use (loaded from ``bank`` when it is a path; the default bank for ``None``)."""
        return self._bank  # type: ignore[attr-defined]


def bank_arguments(config: Any, bank: Any) -> dict[str, Any]:
    """The C++ drafters' EntMTP keyword arguments (csrc/bindings/drafters.cpp, ``set_bank``): ``bank``'s
    compiled trees and ``config``'s policy over them (an EntMTPConfig, or a HeadsConfig with a bank)."""
    return {
        "bank": [bank.topology(i) for i in range(len(bank.trees))],
        "policy": _C.TopologyPolicy(
            config.policy, list(config.trees), list(config.thresholds), bank_size=len(bank.trees)
        ),
        "feature": config.feature,
        "ema": float(config.ema),
        "record": config.record_steps,
    }


def entmtp_drafter(
    model: PreTrainedModel,
    config: EntMTPConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.MaskProbeDrafter:
    """Mask-token probing over ``config``'s topology bank, one tree per step by its policy; the bank is
    checked against ``model`` (ValueError when it was built for another model, device or dtype)."""
    bank = config.resolved_bank
    bank.check(model)
    return _C.MaskProbeDrafter(
        model.get_input_embeddings().weight,
        num_masks=bank.num_masks,
        block_complexity=bank.block_complexity,
        dynamic_tree=False,
        branches=[],
        prune=bank.prune,
        mask_init=gaussian_init(bank.mask_init),
        gaussian_shift=gaussian_shift(bank.mask_init),
        mask_lambda=float(bank.mask_lambda),
        **bank_arguments(config, bank),
    )


def bank_choices(model: PreTrainedModel, config: Any, drafter: Any, output: Any, do_sample: bool) -> None:
    """After a generation over a bank: the tree the policy chose each step in ``output.choices``
    (``("tree<i>", T)``, or ``("none", 1 + k)`` for a step without candidates) and, with
    ``record_steps``, its step log in ``output.topology_log``."""
    bank = config.resolved_bank
    if bank is None:
        return
    output.choices = [
        (f"tree{i}", bank.block_size(i)) if i >= 0 else ("none", 1 + bank.num_masks)
        for i in drafter.tree_choices()
    ]
    if config.record_steps:
        output.topology_log = drafter.step_log()


register(
    Method(
        name="entmtp",
        tokens_only="its drafts come from mask tokens that the target's forward reads as extra inputs, and their logits",
        config_type=EntMTPConfig,
        drafter=entmtp_drafter,
        summary="EntMTP: mask-token probing over a topology bank of static trees, the tree chosen every step by "
        "a static, ladder or hysteretic policy (seed 002)",
        schedulable=True,
        finish=bank_choices,
        options=(
            Option("--policy", "policy", str, "", "static, ladder or hysteretic", always_in_id=True),
            Option(
                "--bank",
                "bank",
                str,
                "bank-",
                "a topology bank built with `python -m mtprobe topology` (default: the uncalibrated default "
                "bank, which fits any model)",
            ),
            Option(
                "--feature",
                "feature",
                str,
                "f-",
                "the policy's score: path_value, top1, entropy or accept (default: the bank's calibrated "
                "one, else path_value)",
            ),
        ),
    )
)
