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

How many drafts each row sends is the step's price (:mod:`mtprobe.vllm.pricing`): the whole chain where
vLLM's step costs little more for it, fewer or none where the batch's forward is bound by arithmetic and
a draft is unlikely to be accepted.

The classes vLLM imports are made on demand from their names (:func:`__getattr__`):
``mtprobe.vllm.proposer.<ConfigClass>_<hex>`` carries the configuration (mtprobe.vllm.config).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, ClassVar

import numpy as np
import torch

from mtprobe import _C, models, registry
from mtprobe.drafters import auto_formats
from mtprobe.drafters.base import leaves, make_drafter, ngram_memories
from mtprobe.state import state_of
from mtprobe.vllm import cpu_sampling
from mtprobe.vllm.config import config_of
from mtprobe.vllm.pricing import Candidate, StepPricer, outcome_state
from mtprobe.vllm.requests import SeenRequest
from mtprobe.vllm.self_draft import SelfDraftRows, batched_self_draft

# Draft KV entries a self-draft's cache starts with (it grows as needed).
DRAFT_CAPACITY = 256

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ProposerStats:
    """What a proposer drafted and vLLM accepted (the proposer's own count: the accepted drafts are the
    sent chain's tokens the request's next history repeats)."""

    steps: int = 0  # chains asked for (rows with a sampled token)
    drafted: int = 0  # draft tokens sent
    accepted: int = 0  # of them, accepted
    requests: int = 0  # drafters begun
    priced_out: int = 0  # draft tokens the drafters could have been asked for, left out by the steps' price
    seconds: float = 0.0  # spent in propose
    prompt_seconds: float = 0.0  # of them, on the self-draft's prompt forwards


class RequestDrafter(SeenRequest):
    """One request's drafter and what it has seen (:class:`SeenRequest`), with the block inputs its last
    chain's tokens were."""

    def __init__(self, drafter: _C.Drafter, history: np.ndarray) -> None:
        super().__init__(history)
        self.drafter = drafter
        self.sent_inputs: list[int] = []
        drafter.begin(torch.from_numpy(self.tokens))

    def step(self, history: np.ndarray, k: int, budget: int) -> list[int]:
        """Observe what the history added since the last step, then propose: a chain of at most ``k``
        tokens (which the step's price may cut)."""
        new = history[self.tokens.shape[0] :]
        if new.shape[0] > 0:
            accepted = self.accepted(new)
            path = [0] + self.sent_inputs[:accepted]
            self.drafter.observe(_C.StepOutcome(self.tokens.shape[0] - 1, path, new.tolist()))
            self.tokens = history.copy()
        elif self.sent:  # asked again without progress: the same chain
            return self.sent[:k]
        limits = _C.StepLimits()
        limits.budget, limits.max_depth, limits.tokens_left = budget, k, k + 1
        n = history.shape[0]
        block = self.drafter.propose(torch.from_numpy(history[n - 1 :].copy()), n - 1, limits)
        self.sent_inputs = first_chain(block.parents, block.num_committed, block.num_nodes, k)
        tokens = block.tokens.tolist()
        self.sent = [tokens[i] for i in self.sent_inputs]
        return self.sent

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


class HostedRequest(SeenRequest):
    """A request as the proposer drafts it: what it sent vLLM and the state that prices its next chain
    (:class:`SeenRequest`), the drafter (``option``) its last chain came from, and one part per drafter
    (a :class:`RequestDrafter` or a self-draft's :class:`~mtprobe.vllm.self_draft.SelfDraftRequest`)."""

    def __init__(self, history: np.ndarray, parts: list[Any]) -> None:
        super().__init__(history)
        self.parts = parts
        self.option = 0
        # The history's length before the first generated token (vLLM proposes after the prefill's).
        self.born = history.shape[0] - 1

    def finish(self) -> None:
        for part in self.parts:
            part.finish()


class Proposer:
    """vLLM's custom proposer over mtprobe's drafters; ``config`` is set by the configured subclass that
    :func:`__getattr__` makes (build it through :func:`mtprobe.vllm.speculative_config`).

    Its drafters (``options``): the configuration's own, or under ``AutoConfig`` with the steps priced
    each of its candidates, the step's price choosing every row's (the self-draft's forwards then run for
    the rows that chose it, all at once). Unpriced, ``AutoConfig`` runs mtprobe's C++ scheduler per
    request, which prices a chain as if the request ran alone.
    """

    config: ClassVar[Any] = None
    price_steps: ClassVar[bool] = True

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
        # The drafters a row may draft with: a configuration per option, and for those the batched
        # self-draft runs (mtprobe.vllm.self_draft) its SelfDraftRows, else None (a drafter per request).
        self.options: list[Any] = []
        self.rows: list[SelfDraftRows | None] = []
        self.requests: list[HostedRequest] = []  # one per live request
        self.stats = ProposerStats()
        self.pricer: StepPricer | None = None  # the steps' price (None: whole chains)
        self.clock = time.perf_counter  # what the proposer and its price time themselves by

    def load_model(self, model: Any = None) -> None:
        """vLLM hands its own model module here; the drafters that run a model (the self-drafts, a
        scheduler's cost profile) run mtprobe's over transformers' copy of the same folder instead."""
        # vLLM's CPU build samples wrongly under speculation (mtprobe.vllm.cpu_sampling): mended here, in the
        # process that samples.
        cpu_sampling.mend()
        if self.model is not None:
            return
        scheduled = self.config.method == "auto" and self.price_steps
        self.options = list(leaves(self.config)) if scheduled else [self.config]
        if not any(c.method == "auto" or registry.method_of(c).own_forwards for c in self.options):
            self.model = _StateKey()
        else:
            self.model, _ = models.load(self.model_path)
        if self.config.method == "auto" and not scheduled:
            # mtprobe's scheduler per request: no generation of it finishes as mtprobe's do, so the self-draft's
            # format is not measured here (it would explore every format in every request).
            self.config = auto_formats.without_measuring(self.model, self.config)
            self.options = [self.config]
        # Built once per model and kept in its state, here while vLLM loads rather than in the first
        # request's step: the quantized self-draft and its C++ decoder, a scheduler's forward profile.
        draft_seconds: list[float | None] = []
        for option in self.options:
            rows = batched_self_draft(self.model, option) if not isinstance(self.model, _StateKey) else None
            if rows is None and not isinstance(self.model, _StateKey):
                make_drafter(self.model, option, capacity=1)
            self.rows.append(rows)
            draft_seconds.append(rows.seconds_per_draft() if rows is not None else None)
        if self.price_steps:
            self.pricer = StepPricer(len(self.options), self.k, self.clock, draft_seconds)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,  # [max_num_reqs]
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
        **_: Any,
    ) -> list[list[int]]:
        self.load_model()
        entered = self.clock()
        free = list(self.requests)  # not yet claimed by a row this step
        kept: list[HostedRequest] = []
        live: list[tuple[int, HostedRequest, np.ndarray, int]] = []  # (row, request, history, k) that draft
        steady = bool(self.requests)  # the step that ran verified only requests seen before
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            history = np.asarray(token_ids_cpu[row, :n], dtype=np.int64)
            request = self._claim(history, free)
            k = min(self.k, self.max_model_len - n - 1)
            steady = steady and request is not None and bool(sampled)
            if sampled and k >= 1 and request is None:
                request = self._begin(history)
            if request is not None:
                kept.append(request)
            if sampled and k >= 1:  # not a prompt still prefilling, and room for drafts
                live.append((row, request, history, k))
        if self.pricer is not None:
            self.pricer.began(steady)
        chains: list[list[int]] = [[] for _ in sampled_token_ids]
        drafting = []  # (row, request, history, k) of the rows that draft this step
        for row, request, history, k in live:
            new = history[request.tokens.shape[0] :]
            if new.shape[0] == 0 and request.sent:  # asked again without progress: the same chain
                chains[row] = request.sent[:k]
                continue
            accepted = request.accepted(new) if new.shape[0] else 0
            self.stats.accepted += accepted
            if self.pricer is not None and new.shape[0]:
                self.pricer.learn(request.option, request.state, len(request.sent), accepted)
            request.state = outcome_state(len(request.sent), accepted)
            request.tokens = history.copy()
            drafting.append((row, request, history, k))
        for (row, request, _, _), chain in zip(drafting, self._draft(drafting), strict=True):
            chains[row] = request.sent = chain
        for row, _, _, _ in live:
            self.stats.steps += 1
            self.stats.drafted += len(chains[row])
        for request in free:  # no row extends its history: the request finished
            request.finish()
            if self.pricer is not None:
                self.pricer.finished(request.tokens.shape[0] - request.born)
        self.requests = kept
        if self.pricer is not None:
            # Every row verifies its token and its chain; a row still prefilling, an unknown number.
            self.pricer.ended(len(chains), sum(map(len, chains)), known=len(live) == len(sampled_token_ids))
        self.stats.seconds += self.clock() - entered
        return chains

    def _draft(self, drafting: list[tuple[int, HostedRequest, np.ndarray, int]]) -> list[list[int]]:
        """Each drafting row's chain: the drafters that need no forwards propose for every row (they must
        see every step's tokens, and cost little), then the pricer chooses each row's drafter and length,
        then the self-drafts run for the rows that chose them."""
        offered: list[list[list[int] | None]] = []  # [option][row]: the chain, None where not yet drafted
        for o in range(len(self.options)):
            if self.rows[o] is not None:
                offered.append([None] * len(drafting))
                continue
            t0 = self.clock()
            offered.append([r.parts[o].step(h, k, self.budget) for _, r, h, k in drafting])
            if self.pricer is not None:
                self.pricer.timed(o, sum(map(len, offered[o])), self.clock() - t0)
        if self.pricer is None:
            plans = [(0, k) for *_, k in drafting]
        else:
            candidates = [
                [
                    Candidate(
                        o,
                        request.state,
                        k if offered[o][i] is None else len(offered[o][i]),
                        self.rows[o] is None or self.rows[o].caught_up(request.parts[o], history),
                        0.0
                        if self.rows[o] is None
                        else self.rows[o].setup_seconds(request.parts[o], history),
                        history.shape[0] - request.born,
                    )
                    for o in range(len(self.options))
                ]
                for i, (_, request, history, k) in enumerate(drafting)
            ]
            plans = self.pricer.plan(candidates)
            self.stats.priced_out += sum(k for *_, k in drafting) - sum(n for _, n in plans)
        for o, rows in enumerate(self.rows):
            if rows is None:
                continue
            t0 = self.clock()
            ks = [n if choice == o else 0 for choice, n in plans]
            rows.draft([r.parts[o] for _, r, _, _ in drafting], [h for _, _, h, _ in drafting], ks)
            offered[o] = [r.parts[o].sent for _, r, _, _ in drafting]
            self.stats.prompt_seconds += rows.prompt_seconds
            if self.pricer is not None:  # a draft's cost; a prompt's forward is paid once per request
                self.pricer.timed(o, sum(ks), max(0.0, self.clock() - t0 - rows.prompt_seconds))
        chains = []
        for i, ((_, request, _, _), (choice, n)) in enumerate(zip(drafting, plans, strict=True)):
            request.option = choice
            chains.append(list(offered[choice][i][:n]))
        return chains

    def forget(self) -> None:
        """Forget what finished requests taught the proposer: the cross-request memory's text and
        AutoConfig's carried measurements of its draft model (a benchmark's rounds then start alike)."""
        if self.model is None:
            return
        for memory in ngram_memories(self.model, self.config):
            memory.clear()
        state_of(self.model).carried.clear()

    def _begin(self, history: np.ndarray) -> HostedRequest:
        self.stats.requests += 1
        parts = [
            rows.new_request(history, DRAFT_CAPACITY)
            if rows is not None
            else RequestDrafter(make_drafter(self.model, option, capacity=DRAFT_CAPACITY), history)
            for option, rows in zip(self.options, self.rows, strict=True)
        ]
        return HostedRequest(history, parts)

    @staticmethod
    def _claim(history: np.ndarray, free: list[HostedRequest]) -> HostedRequest | None:
        """The free request whose history ``history`` extends (the longest such), taken out of ``free``."""
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
        config, price_steps = config_of(name)
        _CLASSES[name] = type(
            name, (Proposer,), {"config": config, "price_steps": price_steps, "__module__": __name__}
        )
    return _CLASSES[name]
