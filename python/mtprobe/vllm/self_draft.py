"""The quantized self-draft for a whole vLLM batch at once: one C++ decoder step per draft depth for every row.

Driven request by request (:class:`mtprobe.vllm.proposer.RequestDrafter`), each row's chain costs K one-token
forwards of its own, and a batch of B rows drafts B chains one after another: the 4-bit weights are read B
times per depth. Here every row's token of a depth runs in one ``QuantizedDecoder.step_rows`` call, which
reads the weights once for all of them (csrc/decode/quantized_decoder.h). Each request keeps its own draft
KV cache (an :class:`~mtprobe.target_model.adapter.HFAdapter` over the quantized twin, whose buffers the
decoder writes): a new request's history runs once through transformers' modules on the twin (its prefill),
after which every step it drafts in feeds the tokens vLLM added since (one or two, more after steps it sent
no drafts in), then drafts greedily. The bookkeeping is ``DraftModelDrafter``'s
(csrc/drafters/draft_model.h): after a step that accepted a of the K drafts, the cache's first
len + min(a, K - 1) entries are still right.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from mtprobe import _C
from mtprobe.target_model.adapter import HFAdapter
from mtprobe.target_model.self_draft import draft_head_scan, is_full_depth, quantized, quantized_decoder
from mtprobe.vllm.requests import SeenRequest

# Tokens a request's cache catches up by through decoder steps (one per position, every row at once): the
# one or two vLLM adds a step, or a few more after steps priced out of drafting; more run as a prompt.
SHORT_FEED = 8
# Tokens of the prompt the decoder's cost is first measured on as it loads.
CALIBRATION_PROMPT = 64


def batched_self_draft(model: Any, config: Any) -> SelfDraftRows | None:
    """The batched self-draft of ``config`` (a ``DraftModelConfig(self_draft="quantized")`` of every layer)
    on ``model``, or None where its C++ decoder does not run (another architecture: the drafters then run
    request by request)."""
    if getattr(config, "method", None) != "sps" or config.self_draft != "quantized" or config.draft_model:
        return None
    if not is_full_depth(model, config.num_draft_layers):
        return None
    draft = quantized(model, config.num_draft_layers, config.draft_format)
    decoder = quantized_decoder(draft)
    return SelfDraftRows(draft, decoder) if decoder is not None else None


class SelfDraftRequest(SeenRequest):
    """One request's draft cache and what it has seen (:class:`SeenRequest`); ``cached``, the cache's
    entries that hold its history (and drafts past it)."""

    def __init__(self, draft: Any, history: np.ndarray, capacity: int) -> None:
        super().__init__(history)
        self.adapter = HFAdapter(draft, capacity, checked=True)
        self.cached = 0

    def finish(self) -> None:
        """Nothing to keep: the cache goes with the request."""


class SelfDraftRows:
    """The quantized self-draft of a model for any number of requests at once."""

    def __init__(self, twin: Any, decoder: _C.QuantizedDecoder) -> None:
        self.twin = twin  # the quantized twin (self_draft.quantized), whose HF modules run the prompts
        self.decoder = decoder
        # Its 8-bit head through a 4-bit scan first (self_draft.SCAN_ENV), where the decoder has one.
        self.head_scan = draft_head_scan() if decoder.has_head_scan else 0
        # Seconds the last draft call spent on prompts (a request's first forward, or its catching up):
        # a one-time cost per request, which the steps' price keeps apart from a draft's.
        self.prompt_seconds = 0.0
        self._prompts = [0.0, 0]  # seconds and tokens of every prompt forward so far
        self.clock = time.perf_counter

    def use_clock(self, clock: Any) -> None:
        """Time prompt forwards by ``clock`` from now on, forgetting those timed before (a test's engine
        time, in which the proposer's own work takes none)."""
        self.clock, self._prompts = clock, [0.0, 0]

    def new_request(self, history: np.ndarray, capacity: int) -> SelfDraftRequest:
        return SelfDraftRequest(self.twin, history, capacity)

    def seconds_per_draft(self) -> float:
        """Seconds of one row's draft (a decoder step), timed on a short request of its own: the prior of
        the steps' price (mtprobe.vllm.pricing) until drafts in vLLM are timed. Its second prompt forward
        starts the seconds per prompt token (the first warms the modules up)."""
        times = []
        with torch.inference_mode():
            for _ in range(2):
                request = self.new_request(
                    np.zeros(CALIBRATION_PROMPT, dtype=np.int64), 2 * CALIBRATION_PROMPT
                )
                self._prompts = [0.0, 0]
                self._prefill(request, request.tokens)
            for _ in range(4):
                start = time.perf_counter()
                self._step([request], [0])
                times.append(time.perf_counter() - start)
        return sorted(times[1:])[1]  # the median of three, past the first

    @staticmethod
    def caught_up(request: SelfDraftRequest, history: np.ndarray) -> bool:
        """Whether ``request`` would draft after ``history`` without a prompt's forward first: its cache
        began and lags the history by at most :data:`SHORT_FEED` tokens."""
        return request.cached > 0 and history.shape[0] - request.cached <= SHORT_FEED

    def setup_seconds(self, request: SelfDraftRequest, history: np.ndarray) -> float:
        """Seconds ``request`` would spend catching up before drafting after ``history``: 0 when caught up,
        else its lag at the measured seconds per prompt token (calibrated as the decoder loads)."""
        if self.caught_up(request, history):
            return 0.0
        seconds, tokens = self._prompts
        return (history.shape[0] - request.cached) * seconds / max(tokens, 1)

    def draft(self, requests: list[SelfDraftRequest], histories: list[np.ndarray], ks: list[int]) -> None:
        """Each request's chain of ``ks[i]`` greedy drafts after ``histories[i]``, left in
        ``requests[i].sent``. A row with ``ks[i]`` = 0 runs nothing: its cache catches up with its history
        when it next drafts."""
        feeds = []
        self.prompt_seconds = 0.0
        for request, history in zip(requests, histories, strict=True):
            accepted = request.accepted(history[request.tokens.shape[0] :])
            # Asked again without progress, the last token runs again (rewriting its own entry): every row
            # feeds at least one token, whose logits start its chain.
            request.cached = min(request.cached, request.tokens.shape[0] + accepted, history.shape[0] - 1)
            request.tokens = history.copy()
            feeds.append(history[request.cached :])
        last: list[torch.Tensor | None] = [None] * len(requests)  # [vocab] after each history
        with torch.inference_mode():
            short = []
            for i, (request, feed) in enumerate(zip(requests, feeds, strict=True)):
                if ks[i] == 0:
                    continue
                if request.cached == 0 or feed.shape[0] > SHORT_FEED:  # a prompt: the twin's HF modules
                    last[i] = self._prefill(request, feed)
                else:
                    short.append(i)
            for j in range(SHORT_FEED):  # the tokens vLLM added: a decoder step per position, all rows
                rows = [i for i in short if feeds[i].shape[0] > j]
                if rows:
                    logits = self._step(
                        [requests[i] for i in rows], [int(feeds[i][j]) for i in rows]
                    )  # [len(rows), vocab]
                    for r, i in enumerate(rows):
                        if j == feeds[i].shape[0] - 1:
                            last[i] = logits[r]
            chains = [[int(last[i].argmax())] if ks[i] >= 1 else [] for i in range(len(requests))]
            for depth in range(1, max(ks, default=0)):
                rows = [i for i in range(len(requests)) if ks[i] > depth]
                if not rows:
                    break
                logits = self._step([requests[i] for i in rows], [chains[i][-1] for i in rows])
                for r, token in zip(rows, logits.argmax(-1).tolist(), strict=True):
                    chains[r].append(token)
        for request, chain in zip(requests, chains, strict=True):
            request.sent = chain

    def _prefill(self, request: SelfDraftRequest, feed: np.ndarray) -> torch.Tensor:
        begun = self.clock()
        adapter, start = request.adapter, request.cached
        n = feed.shape[0]
        adapter.prefill_logits_from = n - 1  # only the last row's logits are read
        positions = torch.arange(start, start + n).view(1, n)
        logits, _ = adapter.forward(torch.from_numpy(feed.copy()), None, positions, None, start, False)
        request.cached = start + n
        seconds = self.clock() - begun
        self.prompt_seconds += seconds
        self._prompts[0] += seconds
        self._prompts[1] += n
        return logits[-1]

    def _step(self, requests: list[SelfDraftRequest], tokens: list[int]) -> torch.Tensor:
        """One decoder step for each request's next token at its next cache entry: logits [rows, vocab]."""
        keys, values, positions = [], [], []
        for request in requests:
            position = request.cached
            request.adapter.reserve(position + 1)
            layers = request.adapter.cache.layers
            keys.append([layer.keys for layer in layers])
            values.append([layer.values for layer in layers])
            positions.append(position)
        logits = self.decoder.step_rows(tokens, positions, keys, values, head_scan=self.head_scan)
        for request in requests:
            request.cached += 1
            request.adapter.cache.set_length(request.cached)
        return logits
