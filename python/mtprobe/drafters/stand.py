"""STAND (``csrc/drafters/stand.cpp``): a draft tree from an n-gram store of the target's own next-token
distributions, and the cross-request n-gram memory that STAND and the hybrid share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mtprobe import _C, registry
from mtprobe.drafters.base import ConfigData, bc_option, check_int
from mtprobe.registry import Method, Option, ProcessFn, register
from mtprobe.state import state_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SHARED_NGRAM_MEMORY_SIZE = 1 << 18
"""Keys of the cross-request n-gram memory that ``--shared-ngram-memory`` alone asks for."""


def check_memory_size(memory_size: object) -> None:
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


@dataclass(frozen=True)
class StandConfig(ConfigData):
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
            check_int(name, getattr(self, name))
        if self.block_complexity < 2:
            raise ValueError(
                f"block_complexity={self.block_complexity} leaves no room for a draft: STAND needs at least 2 "
                "(the root and one draft)"
            )
        for name in ("max_depth", "max_ngram", "table_size", "logits_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        check_memory_size(self.memory_size)
        if self.prompt_logits is not None:
            check_int("prompt_logits", self.prompt_logits)
            if self.prompt_logits < 0:
                raise ValueError(
                    f"prompt_logits={self.prompt_logits} must be >= 0 (how many of the prompt's last positions "
                    "seed the store with the model's distribution), or None for every position"
                )


def ngram_memory(model: PreTrainedModel, config: Any) -> _C.NgramMemory | None:
    """The cross-request n-gram memory ``config`` (``memory_size`` set) uses with ``model``: one per
    model and (``memory_size``, ``max_ngram``, ``table_size``), created on first use, kept in the model's
    state (:mod:`mtprobe.state`) and shared by every STAND or hybrid drafter built with those settings,
    so that repeated :func:`mtprobe.generate` calls draft from each other's text. ``None`` when
    ``config.memory_size`` is ``None``."""
    method = registry.find(config)
    if method is None or method.memory is None:
        with_memory = ", ".join(m.config_type.__name__ for m in registry.methods() if m.memory is not None)
        raise TypeError(
            f"ngram_memory takes a {' or '.join(with_memory.split(', '))} (the drafters with a cross-request "
            f"memory), got {type(config).__name__}"
        )
    if config.memory_size is None:
        return None
    key = (config.memory_size, config.max_ngram, config.table_size)
    memories = state_of(model).ngram_memories
    if key not in memories:
        memories[key] = _C.NgramMemory(
            config.memory_size, max_ngram=config.max_ngram, top_k=config.table_size
        )
    return memories[key]


def stand_drafter(
    model: PreTrainedModel,
    config: StandConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.StandDrafter:
    """STAND's drafter, with the cross-request memory of ``config.memory_size`` if set; ``fold_memory``
    False: it reads the memory but leaves folding the finished generation in to another drafter of the
    same generation (an AutoConfig's drafters sharing one memory)."""
    return _C.StandDrafter(
        max_depth=config.max_depth,
        max_ngram=config.max_ngram,
        table_size=config.table_size,
        logits_top_k=config.logits_top_k,
        memory=ngram_memory(model, config),
        fold_memory=fold_memory,
        prompt_logits=config.prompt_logits,
    )


def prompt_logits_option() -> Option:
    return Option(
        "--prompt-logits",
        "prompt_logits",
        int,
        "pl",
        "how many of the prompt's last positions seed the n-gram store with the model's distribution (the "
        "prefill computes the LM head over those only; the prompt's n-grams go in regardless); "
        "default every position",
    )


def memory_option() -> Option:
    return Option(
        "--shared-ngram-memory",
        "memory_size",
        int,
        "mem",
        "one cross-request n-gram memory of at most this many keys (least recently used evicted; "
        f"{SHARED_NGRAM_MEMORY_SIZE} when the flag is given alone) shared by every question of the run: each "
        "finished answer's text is folded in and drafted from where the question's own store has no "
        "key (emptied after the warm-up; refuses --repeats above 1); default off",
        const=SHARED_NGRAM_MEMORY_SIZE,
    )


register(
    Method(
        name="stand",
        tokens_only=None,
        config_type=StandConfig,
        drafter=stand_drafter,
        summary="STAND: a draft tree from an n-gram store of the target's own next-token distributions",
        schedulable=True,
        memory=ngram_memory,
        options=(
            bc_option("most inputs of one decode forward: the root and BC - 1 draft nodes"),
            Option("--max-depth", "max_depth", int, "d", "deepest draft (tokens after the root)"),
            memory_option(),
            prompt_logits_option(),
        ),
    )
)
