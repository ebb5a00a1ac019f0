"""The proposer vLLM instantiates: mtprobe's own drafters, one per request, fed from the token history.

vLLM's custom proposer interface (``vllm/v1/spec_decode/custom_class_proposer.py``) is a class built with
the engine's ``VllmConfig`` whose ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``
returns one chain of draft tokens per row of the batch. It is handed no request ids and none of the
target's logits, and vLLM verifies the chains itself (greedy: the tokens of vLLM without speculation;
sampling: its rejection sampling, which treats a chain without probabilities as certain).

Each request gets the drafter its configuration describes (:func:`mtprobe.drafters.make_drafter`, the same
C++ drafter ``mtprobe.generate`` runs), driven as mtprobe's decode loop drives it: ``begin`` with the
history, then every step ``observe`` of what vLLM accepted (the new tokens, and the path of the chain
they matched) and ``propose`` of the next block, whose first chain is what vLLM verifies (a tree's other
branches are dropped). The outcomes carry no logits (``StepOutcome(...)``): STAND's store learns the
committed text, one-hot, as it learns the prompt's. Requests are recognised by their token history: a
row's drafter is the one whose history the row's extends (rows move when others finish); a drafter no row
claims has finished, and its text is folded into the cross-request memory if it keeps one.

The classes vLLM imports are made on demand from their names (:func:`__getattr__`):
``mtprobe.vllm.proposer.<ConfigClass>_<hex>`` carries the configuration (mtprobe.vllm.config).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import torch

from mtprobe import _C, models, registry
from mtprobe.drafters.base import leaves, make_drafter, ngram_memories
from mtprobe.state import state_of
from mtprobe.vllm.config import config_of
from mtprobe.vllm.requests import SeenRequest
from mtprobe.vllm.self_draft import SelfDraftRows, batched_self_draft

# Draft KV entries a self-draft's cache starts with (it grows as needed).
DRAFT_CAPACITY = 256


@dataclasses.dataclass
class ProposerStats:
    """What a proposer drafted and vLLM accepted (the proposer's own count: the accepted drafts are the
    sent chain's tokens the request's next history repeats)."""

    steps: int = 0  # chains asked for (rows with a sampled token)
    drafted: int = 0  # draft tokens sent
    accepted: int = 0  # of them, accepted
    requests: int = 0  # drafters begun


class RequestDrafter(SeenRequest):
    """One request's drafter and what it has seen (:class:`SeenRequest`), with the block inputs its last
    chain's tokens were."""

    def __init__(self, drafter: _C.Drafter, history: np.ndarray) -> None:
        super().__init__(history)
        self.drafter = drafter
        self.sent_inputs: list[int] = []
        drafter.begin(torch.from_numpy(self.tokens))

    def step(self, history: np.ndarray, k: int, budget: int) -> tuple[list[int], int]:
        """Observe what the history added since the last step, then propose: (chain of at most ``k`` tokens,
        drafts of the last chain accepted)."""
        new = history[self.tokens.shape[0] :]
        accepted = 0
        if new.shape[0] > 0:
            accepted = self.accepted(new)
            path = [0] + self.sent_inputs[:accepted]
            self.drafter.observe(_C.StepOutcome(self.tokens.shape[0] - 1, path, new.tolist()))
            self.tokens = history.copy()
        elif self.sent:  # asked again without progress: the same chain
            return self.sent[:k], 0
        limits = _C.StepLimits()
        limits.budget, limits.max_depth, limits.tokens_left = budget, k, k + 1
        n = history.shape[0]
        block = self.drafter.propose(torch.from_numpy(history[n - 1 :].copy()), n - 1, limits)
        self.sent_inputs = first_chain(block.parents, block.num_committed, block.num_nodes, k)
        tokens = block.tokens.tolist()
        self.sent = [tokens[i] for i in self.sent_inputs]
        return self.sent, accepted

    def finish(self) -> None:
        """The request left the batch: a drafter with a cross-request memory folds its text in."""
        self.drafter.observe(_C.StepOutcome(self.tokens.shape[0] - 1, [0], [], finished=True))


def first_chain(parents: list[int], num_committed: int, num_nodes: int, k: int) -> list[int]:
    """The block inputs of the chain vLLM verifies: from the last committed input down each node's first
    child (drafters list a node's children best first), at most ``k``, draft nodes only."""
    chain, node = [], num_committed - 1
    while len(chain) < k:
        child = next((j for j in range(node + 1, num_nodes) if parents[j] == node), None)
        if child is None:
            break
        chain.append(child)
        node = child
    return chain


class _StateKey:
    """Stands for the model in mtprobe's per-model state where no model is loaded (prompt lookup, STAND):
    the cross-request memory hangs on it."""


class Proposer:
    """vLLM's custom proposer over mtprobe's drafters; ``config`` is set by the configured subclass that
    :func:`__getattr__` makes (build it through :func:`mtprobe.vllm.speculative_config`)."""

    config: ClassVar[Any] = None

    def __init__(self, vllm_config: Any) -> None:
        if self.config is None:
            raise TypeError(
                "mtprobe.vllm.proposer.Proposer carries no configuration: pass "
                "speculative_config=mtprobe.vllm.speculative_config(cfg) to vLLM"
            )
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.model_path = str(vllm_config.model_config.model)
        self.budget = max(
            1 + self.k, max(getattr(c, "block_complexity", 0) or 0 for c in leaves(self.config))
        )
        self.model: Any = None
        # The self-draft of every row at once where it runs (mtprobe.vllm.self_draft), else None: a drafter
        # per request.
        self.rows: SelfDraftRows | None = None
        self.requests: list[Any] = []  # RequestDrafter or SelfDraftRequest, one per live request
        self.stats = ProposerStats()

    def load_model(self, model: Any = None) -> None:
        """vLLM hands its own model module here; the drafters that run a model (the self-drafts, a
        scheduler's cost profile) run mtprobe's over transformers' copy of the same folder instead."""
        if self.model is not None:
            return
        needs_model = self.config.method == "auto" or any(
            registry.method_of(c).own_forwards for c in leaves(self.config)
        )
        if not needs_model:
            self.model = _StateKey()
            return
        self.model, _ = models.load(self.model_path)
        # Built once per model and kept in its state, here while vLLM loads rather than in the first
        # request's step: the quantized self-draft and its C++ decoder, a scheduler's forward profile.
        self.rows = batched_self_draft(self.model, self.config)
        if self.rows is None:
            make_drafter(self.model, self.config, capacity=1)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,  # [max_num_reqs]
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
        **_: Any,
    ) -> list[list[int]]:
        self.load_model()
        free = list(self.requests)  # not yet claimed by a row this step
        kept: list[Any] = []
        live: list[tuple[int, Any, np.ndarray, int]] = []  # (row, request, history, k) of rows that draft
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            history = np.asarray(token_ids_cpu[row, :n], dtype=np.int64)
            request = self._claim(history, free)
            k = min(self.k, self.max_model_len - n - 1)
            if sampled and k >= 1 and request is None:
                request = self._begin(history)
            if request is not None:
                kept.append(request)
            if sampled and k >= 1:  # not a prompt still prefilling, and room for drafts
                live.append((row, request, history, k))
        chains: list[list[int]] = [[] for _ in sampled_token_ids]
        if self.rows is not None:  # the self-draft: every row's chain in one decoder step per depth
            accepted = self.rows.draft(
                [r for _, r, _, _ in live], [h for _, _, h, _ in live], [k for *_, k in live]
            )
            results = [(request.sent, a) for (_, request, _, _), a in zip(live, accepted, strict=True)]
        else:
            results = [request.step(history, k, self.budget) for _, request, history, k in live]
        for (row, _, _, _), (chain, accepted) in zip(live, results, strict=True):
            chains[row] = chain
            self.stats.steps += 1
            self.stats.drafted += len(chain)
            self.stats.accepted += accepted
        for request in free:  # no row extends its history: the request finished
            request.finish()
        self.requests = kept
        return chains

    def forget(self) -> None:
        """Forget what finished requests taught the proposer: the cross-request memory's text and
        AutoConfig's carried measurements of its draft model (a benchmark's rounds then start alike)."""
        if self.model is None:
            return
        for memory in ngram_memories(self.model, self.config):
            memory.clear()
        state_of(self.model).carried.clear()

    def _begin(self, history: np.ndarray) -> Any:
        self.stats.requests += 1
        if self.rows is not None:
            return self.rows.new_request(history, DRAFT_CAPACITY)
        return RequestDrafter(make_drafter(self.model, self.config, capacity=DRAFT_CAPACITY), history)

    @staticmethod
    def _claim(history: np.ndarray, free: list[Any]) -> Any:
        """The free drafter whose history ``history`` extends (the longest such), taken out of ``free``."""
        best = None
        for request in free:
            if request.extended_by(history) and (
                best is None or request.tokens.shape[0] > best.tokens.shape[0]
            ):
                best = request
        if best is not None:
            free.remove(best)
        return best


_CLASSES: dict[str, type[Proposer]] = {}


def __getattr__(name: str) -> type[Proposer]:
    """``<ConfigClass>_<hex>``: the Proposer subclass that drafts with the configuration the name carries
    (made once per name)."""
    kind, _, payload = name.rpartition("_")
    if not kind or not payload or any(ch not in "0123456789abcdef" for ch in payload):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _CLASSES:  # a malformed payload is a ValueError that says so, not "no attribute"
        config = config_of(name)
        _CLASSES[name] = type(name, (Proposer,), {"config": config, "__module__": __name__})
    return _CLASSES[name]
