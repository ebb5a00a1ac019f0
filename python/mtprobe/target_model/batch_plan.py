"""A batch's forward through HF's modules: one KV buffer with a row dimension, graphs per (rows, tokens).

Where the target's C++ forward does not run (a model on a GPU, an architecture it does not take), the rows
of a batch decoded together (:mod:`mtprobe.decode.batch`) still meet at one forward per step: this plan's.
As SGLang's ``cuda_graph_runner`` pads a batch to a captured size and vLLM keeps one persistent batch:

- **One KV buffer per layer for the batch**, ``[rows + 1, kv_heads, capacity, head_dim]``: row ``r`` is
  sequence ``r``'s cache (its decode loop compacts it in place through the views :meth:`BatchedPlan.row_cache`
  hands its adapter), the last row a scratch row that padding rows write and nobody reads. Allocated once
  for the call at the most entries any row can need plus the last bucket, so no buffer moves while the loops
  run.
- **A decode step** takes every waiting row's block: ``x [R, T, hidden]`` (each row's block, zeros after
  it), positions ``[R, T]``, write positions ``[R, T]`` (row ``r``'s inputs at ``P_r, P_r + 1, ...``) and
  additive masks ``[R, 1, T, K]`` (row ``r``'s cached entries and its tree; each padding input sees only its
  own entry, written past the row's block and overwritten by its next step before anything reads it). Each
  layer scatters the step's keys and values at (row, write position) and attends over the rows' buffers
  (sliced where the rows are a contiguous range, else gathered).
- **Graphs** (CUDA): each (rows bucket, tokens bucket, hidden states read, masks) captured once and replayed,
  as ``PlanConfig.row_buckets`` x ``PlanConfig.buckets``; padding rows point at the scratch row. A plan that runs
  graphs is kept in the model's state for its next batch (:func:`batch_plan_for`). A step
  past the last bucket, a prefill, or a model that cannot be captured runs eager. On the CPU every step runs
  eager, unpadded.
- **A prefill** runs row by row (``[1, L]``, HF's own causal mask): compute-bound, and prompts differ in
  length.

Worked example: rows 0 and 2 of a 3-row batch (row 1 finished), blocks of 2 and 1 inputs after 4 and 6 cached
entries, graphs with buckets (1, 2, 4) x (1, 2, 4): rows bucket 2, tokens bucket 2. rows = [0, 2],
write_pos = [[4, 5], [6, 7]], positions = [[4, 5], [6, 6]] (row 2's padding input at its root's position),
and row 2's mask shows it columns 0..6 for its input and column 7 alone for its padding input.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from mtprobe.state import state_of
from mtprobe.target_model.adapter import cache_argument
from mtprobe.target_model.cache import TreeKVCache, TreeKVLayer
from mtprobe.target_model.plan import ForwardPlan, PlanConfig, chain_mask, try_capture, write_padded_mask

__all__ = ["HEAD_OVER_LAST", "BatchedKVCache", "BatchedPlan", "batch_plan_for"]

HEAD_OVER_LAST = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})
"""Model types whose causal LM's logits are its output embedding over the decoder's last hidden states
(Gemma 3's softcapped where its config says so): an eager batch step computes them at its real inputs only."""


class _Slots:
    """What every layer of a :class:`BatchedKVCache` reads at a forward: which rows, where to write, what to return."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None  # [R] int64: each forward row's buffer row
        self.write_pos: torch.Tensor | None = None  # [R, T] int64
        self.key_len = 0  # entries returned per row
        self.view: tuple[int, int] | None = None  # the rows as a range [start, stop): sliced, not gathered


class BatchedKVLayer(TreeKVLayer):
    """One layer's buffers for the whole batch; a forward's rows are :class:`_Slots`' rows."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: _Slots) -> None:
        super().__init__(keys.shape[2])
        self.keys, self.values = keys, values  # [rows + 1, kv_heads, capacity, head_dim] each
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._slots = slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._slots
        assert s.rows is not None and s.write_pos is not None
        expected = (s.rows.shape[0], self.keys.shape[1], s.write_pos.shape[1], self.keys.shape[3])
        if tuple(key_states.shape) != expected or value_states.shape[:3] != key_states.shape[:3]:
            raise RuntimeError(
                f"BatchedKVCache: a layer wrote keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)}, where the plan expected [rows, kv_heads, inputs, head_dim] = "
                f"{list(expected)} (a model whose layers' key/value shapes differ cannot run a batched plan)"
            )
        at = (s.rows[:, None], slice(None), s.write_pos)  # selects [R, T, kv_heads, head_dim]
        self.keys[at] = key_states.transpose(1, 2)
        self.values[at] = value_states.transpose(1, 2)
        n = s.key_len
        if s.view is not None:
            a, b = s.view
            return self.keys[a:b, :, :n], self.values[a:b, :, :n]
        return self.keys[:, :, :n].index_select(0, s.rows), self.values[:, :, :n].index_select(0, s.rows)


class BatchedKVCache(TreeKVCache):
    """``num_layers`` buffers of ``[rows + 1, kv_heads, capacity, head_dim]``, written at (row, position)."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        self.slots = _Slots()
        layers = [BatchedKVLayer(k, v, self.slots) for k, v in zip(keys, values, strict=True)]
        Cache.__init__(self, layers=layers)
        self.capacity = keys[0].shape[2]


# One captured (rows bucket, tokens bucket, hidden states, variant, mask kinds): its static inputs and outputs.
@dataclass
class _Graph:
    replay: Callable[[], None] | None
    x: torch.Tensor  # [Rb, Tb, hidden]
    position_ids: torch.Tensor  # [Rb, Tb]
    rows: torch.Tensor  # [Rb]
    write_pos: torch.Tensor  # [Rb, Tb]
    masks: dict[str, torch.Tensor]  # "" or per layer type: [Rb, 1, Tb, capacity]
    logits: torch.Tensor | None = None  # [Rb, Tb, vocab]
    hidden: torch.Tensor | None = None  # [Rb, Tb, hidden]


# A row's part of a step, prepared: its input embeddings [T, hidden], positions [T], masks "" or per layer
# type [1, 1, T, P + T] additive, cached entries P.
@dataclass
class _Row:
    index: int
    x: torch.Tensor
    positions: torch.Tensor
    masks: dict[str, torch.Tensor]
    prefix_len: int


class BatchedPlan:
    """The forwards of a batch of ``rows`` sequences of ``model`` through HF's modules (module docstring).

    ``capacity``: the KV entries a row can need at most (its prompt, ``max_new_tokens`` and a block).
    ValueError for CUDA graphs asked of a model not on a GPU, or a model whose key/value shape its config
    does not give."""

    def __init__(self, model: torch.nn.Module, config: PlanConfig, rows: int, capacity: int) -> None:
        if not isinstance(config, PlanConfig):
            raise TypeError(f"BatchedPlan needs a PlanConfig, got {type(config).__name__}")
        if rows < 1 or capacity < 1:
            raise ValueError(f"BatchedPlan needs rows >= 1 and capacity >= 1, got {rows} and {capacity}")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        capturable = self.device.type in ForwardPlan._CAPTURABLE
        self.graphs = config.cuda_graphs if config.cuda_graphs is not None else capturable
        if self.graphs and not capturable:
            raise ValueError(
                f"PlanConfig(cuda_graphs=True) needs a model on a CUDA device; {type(model).__name__} is on "
                f"{self.device}. Use cuda_graphs=None (automatic) or False"
            )
        text = model.config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.config = config
        self.rows = rows
        self._model = weakref.ref(model)
        # Room for the last block's padding past a row's most entries.
        self.capacity = capacity + config.buckets[-1]
        shape = (rows + 1, kv_heads, self.capacity, head_dim)  # the last row: padding rows' scratch
        layers = range(text.num_hidden_layers)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]
        self.cache = BatchedKVCache(keys, values)
        self._graphs: dict[tuple, _Graph] = {}
        self._pool: Any = None
        self.eager_reason = "" if self.graphs else f"no CUDA graphs on {self.device.type}"
        self.captures = self.replays = self.forwards = 0
        self.capture_seconds = 0.0

    def row_cache(self, row: int) -> TreeKVCache:
        """Row ``row``'s cache as its adapter and decode loop see it: views ``[1, kv_heads, capacity, head_dim]``
        of the batch's buffers (the loop compacts them in place; nothing grows)."""
        cache = TreeKVCache(len(self.cache.layers), self.capacity)
        for mine, batch in zip(cache.layers, self.cache.layers, strict=True):
            mine.keys, mine.values = batch.keys[row : row + 1], batch.values[row : row + 1]
            mine.dtype, mine.device, mine.is_initialized = batch.dtype, batch.device, True
        return cache

    def describe(self) -> dict[str, Any]:
        """What the plan did: rows, capacity, buckets, graphs captured and replayed, why steps ran eager."""
        return {
            "rows": self.rows,
            "capacity": self.capacity,
            "buckets": list(self.config.buckets),
            "row_buckets": list(self.config.row_buckets),
            "graphs": self.captures,
            "replays": self.replays,
            "forwards": self.forwards,
            "capture_s": self.capture_seconds,
            "eager_reason": self.eager_reason,
        }

    def forward_fn(self, adapters: Sequence[Any]) -> Callable[[list[Any]], list[tuple[Any, Any]]]:
        """The batch forward of :class:`mtprobe._C.BatchedForward` over ``adapters`` (row ``r``'s
        :class:`~mtprobe.target_model.adapter.HFAdapter`, whose embedding, masks and model call it takes): the
        step's blocks (``_C.TargetBlock``, each naming its row) in, ``(logits [T, vocab], hidden [T, hidden] or
        None)`` per block out."""

        def forward(blocks: list[Any]) -> list[tuple[Any, Any]]:
            with torch.no_grad():
                out: list[Any] = [None] * len(blocks)
                step = [i for i, b in enumerate(blocks) if b.prefix_len > 0]
                for i, b in enumerate(blocks):
                    if b.prefix_len == 0:
                        out[i] = self._prefill(adapters[b.row], b)
                if step:
                    for i, o in zip(step, self._step(adapters, [blocks[i] for i in step]), strict=True):
                        out[i] = o
                self.forwards += 1
                return out

        return forward

    def _inputs(self, adapter: Any, block: Any) -> torch.Tensor:  # [T, hidden]
        x = adapter.embed(block.tokens.to(self.device))  # [n_tok, hidden]
        if block.embeds is not None:
            x = torch.cat([x, block.embeds.to(x.device, x.dtype)])  # [T, hidden]
        return x

    def _prefill(self, adapter: Any, block: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row ``block.row``'s prompt alone, as its adapter runs one (HF's causal mask where none is given)."""
        x = self._inputs(adapter, block)[None]  # [1, T, hidden]
        T, r = x.shape[1], block.row
        positions = block.positions.to(self.device)[None]  # [1, T]
        s = self.cache.slots
        s.rows = torch.tensor([r], device=self.device)
        s.write_pos = torch.arange(T, device=self.device)[None]  # [1, T]
        s.key_len, s.view = T, (r, r + 1)
        self.cache.set_length(0)
        attn = adapter._attention_mask(block.mask, positions, 0)
        skip = block.logits_from if adapter._logits_to_keep else 0
        logits, hidden = adapter._run_model(x, attn, positions, block.want_hidden, skip, cache=self.cache)
        return logits[0], (hidden[0] if hidden is not None else None)

    def _row(self, adapter: Any, block: Any) -> _Row:
        x = self._inputs(adapter, block)
        T, P = x.shape[0], block.prefix_len
        positions = block.positions.to(self.device)  # [T]
        mask = block.mask if block.mask is not None else chain_mask(P, T, self.dtype, self.device)
        attn = adapter._attention_mask(mask.to(self.device), positions[None], P)
        return _Row(block.row, x, positions, attn if isinstance(attn, dict) else {"": attn}, P)

    def _step(
        self, adapters: Sequence[Any], blocks: list[Any]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One decode step of every row in ``blocks`` (one forward; a graph's where one is captured or can be)."""
        rows = [self._row(adapters[b.row], b) for b in blocks]
        want_hidden = any(b.want_hidden for b in blocks)
        adapter = adapters[blocks[0].row]  # the model's call, the same for every row
        R, T = len(rows), max(r.x.shape[0] for r in rows)
        kinds = tuple(sorted({k for r in rows for k in r.masks}))
        if len(kinds) > 1:  # a row inside its window has one mask for every layer type; the step needs each
            kinds = tuple(k for k in kinds if k)
            for r in rows:
                r.masks = {k: r.masks.get(k, r.masks.get("")) for k in kinds}
        key = None
        if self.graphs and not self.eager_reason:
            rb, tb = self.config.row_bucket(R), self.config.bucket(T)
            if rb is not None and tb is not None:
                key = (rb, tb, want_hidden, (adapter.hidden_layer,), kinds)
        if key is not None:
            graph = self._graph(adapter, key, rows)
            if graph is not None:
                self._fill(graph, rows, self.capacity)
                graph.replay()
                self.replays += 1
                assert graph.logits is not None
                # Copied out: the next replay overwrites the static outputs.
                return [
                    (
                        graph.logits[i, : r.x.shape[0]].clone(),
                        graph.hidden[i, : r.x.shape[0]].clone()
                        if graph.hidden is not None and b.want_hidden
                        else None,
                    )
                    for i, (r, b) in enumerate(zip(rows, blocks, strict=True))
                ]
        key_len = max(r.prefix_len for r in rows) + T
        g = self._buffers(R, T, key_len, rows[0])
        self._fill(g, rows, key_len)
        s = self.cache.slots
        s.rows, s.write_pos, s.key_len = g.rows, g.write_pos, key_len
        index = [r.index for r in rows]
        s.view = (index[0], index[-1] + 1) if index == list(range(index[0], index[-1] + 1)) else None
        mask = g.masks if kinds != ("",) else g.masks[""]
        lengths = [r.x.shape[0] for r in rows]
        model = adapter.model
        if getattr(model.config, "model_type", None) not in HEAD_OVER_LAST:
            logits, hidden = adapter._run_model(g.x, mask, g.position_ids, want_hidden, 0, cache=self.cache)
            logits = [logits[i, :n] for i, n in enumerate(lengths)]
        else:
            # The LM head at the blocks' real inputs only: a padded step's head over every padded position
            # was most of its cost on a large vocabulary (Gemma 3's 262,144 tokens).
            decoder = model.get_decoder()
            out = decoder(
                inputs_embeds=g.x,
                attention_mask=mask,
                position_ids=g.position_ids,
                use_cache=True,
                return_dict=True,
                **{cache_argument(decoder): self.cache},
            )
            hidden = out.last_hidden_state  # [R, T, hidden], final-normed
            real = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])  # [sum of T, hidden]
            joined = model.get_output_embeddings()(real)  # [sum of T, vocab]
            cap = getattr(model.config, "final_logit_softcapping", None)
            if cap is not None:  # as Gemma 3's forward caps them
                joined = torch.tanh(joined / cap) * cap
            logits = list(joined.split(lengths))
        return [
            (logits[i], hidden[i, :n] if hidden is not None and b.want_hidden else None)
            for i, (n, b) in enumerate(zip(lengths, blocks, strict=True))
        ]

    def _buffers(self, R: int, T: int, key_len: int, like: _Row) -> _Graph:
        """Inputs for ``R`` rows of ``T`` inputs over ``key_len`` entries (a graph's static ones, or a step's),
        uninitialised: :meth:`_fill` writes every element."""
        hidden = like.x.shape[-1]
        index = dict(dtype=torch.long, device=self.device)
        return _Graph(
            None,
            like.x.new_empty((R, T, hidden)),
            torch.empty((R, T), **index),
            torch.empty((R,), **index),
            torch.empty((R, T), **index),
            {k: m.new_empty((R, 1, T, key_len)) for k, m in like.masks.items()},
        )

    def _fill(self, g: _Graph, rows: list[_Row], key_len: int) -> None:
        """The step's rows into ``g``'s inputs; rows past them padding (the scratch row, each input its own entry)."""
        Rb, Tb = g.x.shape[:2]
        steps = torch.arange(Tb, device=self.device)  # [Tb]
        g.x.zero_()
        g.position_ids.zero_()
        g.rows.fill_(self.rows)
        g.write_pos.copy_(steps.expand(Rb, Tb))
        for m in g.masks.values():
            m.fill_(torch.finfo(m.dtype).min)
            m[:, 0, steps, steps] = 0.0  # padding rows: each input sees its own entry
        for i, r in enumerate(rows):
            T, P = r.x.shape[0], r.prefix_len
            g.x[i, :T] = r.x
            g.position_ids[i, :T] = r.positions
            g.position_ids[i, T:] = r.positions[0]
            g.rows[i] = r.index
            g.write_pos[i] = steps + P
            for k, m in r.masks.items():
                write_padded_mask(g.masks[k][i : i + 1, :, :, :key_len], m, P)

    def _graph(self, adapter: Any, key: tuple, rows: list[_Row]) -> _Graph | None:
        """The captured step of ``key``'s buckets: captured now (on this step's rows) if it is not yet; None when
        the model cannot be captured (then every step runs eager, the reason logged once)."""
        if key in self._graphs:
            return self._graphs[key]
        rb, tb, want_hidden = key[:3]
        t0 = time.perf_counter()
        g = self._buffers(rb, tb, self.capacity, rows[0])
        self._fill(g, rows, self.capacity)
        s = self.cache.slots
        s.rows, s.write_pos, s.key_len, s.view = g.rows, g.write_pos, self.capacity, None
        mask = g.masks if key[4] != ("",) else g.masks[""]

        def step() -> tuple[torch.Tensor, torch.Tensor | None]:
            return adapter._run_model(g.x, mask, g.position_ids, want_hidden, 0, cache=self.cache)

        return try_capture(self, key, g, step, "the batch's forward", t0)

    busy = False  # a batch runs through this plan (batch_plan_for then makes another)
    in_use = ForwardPlan.in_use


def batch_plan_for(model: torch.nn.Module, config: PlanConfig, rows: int, capacity: int) -> BatchedPlan:
    """The batch plan for a call of ``rows`` sequences needing up to ``capacity`` entries each: the model's
    last one where it was built with an equal ``config`` on the model's present device and dtype, has as many
    rows and entries and is not in use (its graphs kept: captures are paid once per model and bucket), else a
    new one, kept for the next call where it runs graphs (``mtprobe.release(model)`` frees it). An eager plan
    is not kept: it would hold ``rows + 1`` rows of KV buffers between calls for nothing (1.8 GB for 32 rows of
    SmolLM2's longest calls)."""
    param = next(model.parameters())
    state = state_of(model)
    plan = state.batch_plan
    if (
        plan is None
        or plan.busy
        or plan._model() is not model
        or plan.config != config
        or (plan.device, plan.dtype) != (param.device, param.dtype)
        or plan.rows < rows
        or plan.capacity < capacity + config.buckets[-1]
    ):
        plan = BatchedPlan(model, config, rows, capacity)
        state.batch_plan = plan if plan.graphs else None
    return plan
