"""The hybrid drafter (seed 001, App. C; ``csrc/drafters/hybrid.cpp``): mask-token probing and STAND's
n-gram store drafting one tree under one budget."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mtprobe import _C
from mtprobe.drafters.base import ConfigData, bc_option, parse_bool
from mtprobe.drafters.mask_probe import (
    MASK_OPTIONS,
    ProbeConfig,
    calibrated_masks,
    check_mask_value,
    mask_options,
)
from mtprobe.drafters.stand import StandConfig, memory_option, ngram_memory, prompt_logits_option
from mtprobe.registry import Method, Option, ProcessFn, register

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class HybridConfig(ConfigData):
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
        check_mask_value(self)
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


def hybrid_drafter(
    model: PreTrainedModel,
    config: HybridConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.HybridDrafter:
    """Probing and STAND drafting one tree over ``model``'s input embedding table (``fold_memory``: see
    :func:`~mtprobe.drafters.stand.stand_drafter`)."""
    stand = config.stand
    return _C.HybridDrafter(
        model.get_input_embeddings().weight,
        max_depth=stand.max_depth,
        max_ngram=stand.max_ngram,
        table_size=stand.table_size,
        logits_top_k=stand.logits_top_k,
        memory=ngram_memory(model, config),
        fold_memory=fold_memory,
        mask_value=config.mask_value,
        grow_probed=config.grow_probed,
        prompt_logits=stand.prompt_logits,
        **mask_options(model, config.probe),
    )


register(
    Method(
        name="hybrid",
        tokens_only="its probing half reads mask tokens' logits from the target's forward; its n-gram half with the shared memory is StandConfig(memory_size=...)",
        config_type=HybridConfig,
        drafter=hybrid_drafter,
        summary="hybrid: mask-token probing and STAND's n-gram store drafting one tree under one budget",
        schedulable=True,
        mask_calibration=calibrated_masks,
        memory=ngram_memory,
        options=(
            bc_option("BC, the most input tokens of one decode forward, mask tokens included"),
            Option("--num-masks", "num_masks", int, "k", "k, mask tokens per tree node (the probing half)"),
            Option("--max-depth", "max_depth", int, "d", "deepest draft of the n-gram half"),
            *MASK_OPTIONS,
            memory_option(),
            prompt_logits_option(),
            Option(
                "--mask-value",
                "mask_value",
                float,
                "mv",
                "masks only where the step is likely to end, drafts with the inputs freed, valuing the "
                "next step's probing at V tokens (default: masks on every node, seed 001's rule)",
            ),
            Option(
                "--grow-probed",
                "grow_probed",
                parse_bool,
                "grow-",
                "true/false: one best-first tree over both sources, the n-gram store drafting below probed "
                "tokens too (default false: the union of two separate trees, seed 001's hybrid)",
            ),
        ),
    )
)
