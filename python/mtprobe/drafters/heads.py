"""Probabilistic-circuit heads (MTPC, seed 003; ``csrc/drafters/heads.cpp``): drafts from a trained head
over the target's hidden state, alone or over an EntMTP topology bank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mtprobe import _C, heads
from mtprobe.drafters.base import ConfigData, bc_option, check_int
from mtprobe.drafters.entmtp import bank_arguments, bank_choices, load_bank, resolve_policy
from mtprobe.registry import Method, Option, ProcessFn, register

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_HEAD_DTYPES = ("float32", "bfloat16", "float16")  # HeadsConfig.head_dtype


@dataclass(frozen=True)
class HeadsConfig(ConfigData):
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
            ``GenerateOutput.topology_log`` (what :func:`mtprobe.offline.topology.build_bank` reads).

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
            check_int(name, getattr(self, name))
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
            check_int("vocab_top_k", self.vocab_top_k)
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
        bank = load_bank(self, "heads")
        object.__setattr__(self, "_bank", bank)
        if self.policy is None:
            object.__setattr__(self, "policy", "static")
        resolve_policy(self, bank)
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


def heads_drafter(
    model: PreTrainedModel,
    config: HeadsConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.HeadsDrafter:
    """The circuit-head drafter of ``config``: its checkpoint loaded (cached) and checked against ``model``;
    with a topology bank, the bank checked against both (ValueError naming what differs)."""
    head = heads.load_cached(config.path, model)
    bank = config.resolved_bank
    entmtp: dict[str, Any] = {}
    if bank is not None:
        bank.check(model, head=head, vocab_top_k=config.vocab_top_k)
        entmtp = bank_arguments(config, bank)
    return heads.heads_drafter(
        head,
        do_sample=do_sample,
        top_branches=config.top_branches,
        min_path_prob=config.min_path_prob,
        vocab_top_k=config.vocab_top_k,
        dtype=config.torch_head_dtype,
        **entmtp,
    )


def head_hidden_layer(model: PreTrainedModel, config: HeadsConfig) -> int:
    """The ``hidden_states`` index the head reads: -1 (the last), or with LoRA draft layers the input of
    the first of them."""
    return heads.load_cached(config.path, model).hidden_layer


register(
    Method(
        name="heads",
        tokens_only="its heads read the target's hidden states",
        config_type=HeadsConfig,
        drafter=heads_drafter,
        summary="probabilistic-circuit heads (MTPC): drafts from a trained head over the last hidden state",
        schedulable=True,
        hidden_layer=head_hidden_layer,
        finish=bank_choices,
        options=(
            Option(
                "--head-path",
                "path",
                str,
                "head-",
                "the head's checkpoint folder (python -m mtprobe heads train --out DIR); required",
                always_in_id=True,
            ),
            bc_option("BC, the most input tokens of one decode forward"),
            Option(
                "--top-branches",
                "top_branches",
                int,
                "branches",
                "under sampling: independent windows drawn from the circuit as chains below the root",
            ),
            Option(
                "--min-path-prob",
                "min_path_prob",
                float,
                "floor",
                "greedy: leave out drafts whose path probability under the circuit is below this (0: fill BC)",
            ),
            Option(
                "--vocab-top-k",
                "vocab_top_k",
                int,
                "vocab",
                "the head emits only its K most frequent training tokens (default: the whole vocabulary)",
            ),
            Option(
                "--head-dtype",
                "head_dtype",
                str,
                "hd-",
                "the dtype of the head's per-step products: float32, bfloat16 or float16 (default: the "
                "model's for the LoRA draft layers, float32 for the rest)",
            ),
            Option(
                "--bank",
                "bank",
                str,
                "bank-",
                "EntMTP over the head: a topology bank built for it with `python -m mtprobe topology --head DIR` "
                "(default: none, the best-first tree)",
            ),
            Option(
                "--policy",
                "policy",
                str,
                "",
                "with --bank: static, ladder or hysteretic (default: static, the bank's best tree)",
            ),
            Option(
                "--feature",
                "feature",
                str,
                "f-",
                "with --bank: the policy's score, path_value, top1, entropy or accept (default: the bank's "
                "calibrated one, else path_value)",
            ),
        ),
    )
)
