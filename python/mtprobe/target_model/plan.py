"""The static forward plan: a fixed KV buffer, block-size buckets and (on a GPU) CUDA graphs.

FlashInfer plans once on the host and runs many times; gpt-fast keeps one KV buffer per layer and
writes it at device-side positions; SGLang captures one verify graph per padded block size. The
plan does the same for the HF forward of mtprobe's decode loop:

- **One KV buffer per layer**, ``[1, kv_heads, capacity, head_dim]``, allocated for the whole call
  (``capacity`` rounded up to ``PlanConfig.growth``; a block that would not fit grows every layer by
  whole chunks, and a growth re-plans: the graphs are captured again). A forward writes its block's
  entries with ``index_copy_`` at the positions in a device buffer (``write_pos``), so the write is
  part of the kernel stream, not a host-side slice.
- **Buckets**: a decode step of T inputs runs in the smallest bucket ``b >= T``
  (``PlanConfig.buckets``, e.g. 1, 2, 4, ..., 64). The ``b - T`` padding inputs sit after the real
  ones: zero embeddings at the root's position, each seeing only itself, so no real input sees them
  (their mask columns are hidden) and their KV entries, written past the block, are overwritten by
  the next step before anything reads them. A block larger than the last bucket (the prefill) runs
  unpadded.
- **Graphs** (CUDA only): each (bucket, hidden states read and which) is captured once and replayed; its
  inputs (embeddings ``[1, b, hidden]``, positions ``[1, b]``, write positions ``[b]``, masks
  ``[1, 1, b, capacity]``) are static buffers the step's block is copied into, and its outputs are
  copied out before the next replay. A model that cannot be captured (an op that syncs, a hook)
  runs eager, with the reason logged. A model's plan is kept for its next generate call with the
  same configuration (:func:`plan_for`): captures are paid once per model and bucket.

On the CPU the plan runs eager, unpadded by default (padding buys nothing without graphs and costs
the padded rows' compute): the same numbers as the growing cache, in one fixed buffer.

Worked example: capacity 16, buckets (1, 2, 4); a step after P = 5 cached positions with a
3-input block (root, two siblings) runs in bucket 4. write_pos = [5, 6, 7, 8], positions =
[5, 6, 6, 5] (the padding input at the root's position), and the mask rows are (``.`` visible,
``x`` hidden, columns 0..8; with graphs every column up to 15 exists and 9..15 are hidden)::

    root     . . . . . . x x x
    child a  . . . . . . . x x
    child b  . . . . . . x . x
    padding  x x x x x x x x .
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from mtprobe.state import kept, state_of
from mtprobe.target_model.cache import TreeKVCache, TreeKVLayer

logger = logging.getLogger("mtprobe")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class PlanConfig:
    """How the decode loop's forward is planned (:mod:`mtprobe.target_model.plan`); validated when built.

    ``buckets``: the block sizes a decode step is padded to, ascending from 1. ``growth``: the KV
    buffer's capacity is a multiple of it (a block that would not fit grows it by whole chunks).
    ``pad``: pad every decode block to its bucket (None: only where graphs run, since eager forwards
    take any shape). ``cuda_graphs``: capture each bucket's forward and replay it (None: on CUDA
    devices; True on a CPU model is an error). ``row_buckets``: the row counts a batch's decode step is padded
    to where its graphs run (:mod:`mtprobe.target_model.batch_plan`), ascending from 1.
    """

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    growth: int = 256
    pad: bool | None = None
    cuda_graphs: bool | None = None
    row_buckets: tuple[int, ...] = DEFAULT_ROW_BUCKETS

    def __post_init__(self) -> None:
        for name, default, what in (
            ("buckets", DEFAULT_BUCKETS, "plain decoding runs one input"),
            ("row_buckets", DEFAULT_ROW_BUCKETS, "a batch can run down to one row"),
        ):
            buckets = getattr(self, name)
            if isinstance(buckets, list):
                buckets = tuple(buckets)
                object.__setattr__(self, name, buckets)
            if (
                not isinstance(buckets, tuple)
                or not buckets
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets)
            ):
                raise ValueError(f"PlanConfig.{name} must be a non-empty tuple of ints, got {buckets!r}")
            if buckets[0] != 1:
                raise ValueError(
                    f"PlanConfig.{name} must start at 1 ({what}), got {buckets!r}; e.g. {default}"
                )
            if any(b >= c for b, c in zip(buckets, buckets[1:], strict=False)):
                raise ValueError(
                    f"PlanConfig.{name} must be strictly ascending, got {buckets!r}; e.g. {default}"
                )
        if not isinstance(self.growth, int) or isinstance(self.growth, bool) or self.growth < 1:
            raise ValueError(
                f"PlanConfig.growth must be an int >= 1 (KV entries per chunk), got {self.growth!r}"
            )
        for name in ("pad", "cuda_graphs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"PlanConfig.{name} must be True, False or None (automatic), got {value!r}")

    def bucket(self, inputs: int) -> int | None:
        """The smallest bucket holding ``inputs`` inputs, or None past the last one."""
        return next((b for b in self.buckets if b >= inputs), None)

    def row_bucket(self, rows: int) -> int | None:
        """The smallest rows bucket holding ``rows`` rows, or None past the last one."""
        return next((b for b in self.row_buckets if b >= rows), None)


class _Slots:
    """What every layer of a :class:`PlannedKVCache` reads at a forward: where to write, what to return."""

    def __init__(self) -> None:
        self.write_pos: torch.Tensor | None = None  # [b] int64 on the model's device
        self.key_len = 0  # keys returned per layer: the block's end (eager) or the capacity (graphs)


class PlannedKVLayer(TreeKVLayer):
    """One layer's fixed buffer: the block's entries go to ``write_pos``; ``key_len`` entries come back.
    Growth (``reserve``) and lengths are :class:`~mtprobe.target_model.cache.TreeKVLayer`'s."""

    def __init__(self, capacity: int, slots: _Slots) -> None:
        super().__init__(capacity)
        self._slots = slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self._slots
        pos = slots.write_pos  # [n]
        if pos is None or pos.shape[0] != key_states.shape[-2]:
            raise RuntimeError(
                f"PlannedKVCache: {key_states.shape[-2]} new entries but "
                f"{None if pos is None else pos.shape[0]} write positions were planned"
            )
        self.keys.index_copy_(2, pos, key_states)
        self.values.index_copy_(2, pos, value_states)
        n = slots.key_len
        if n == self.capacity:
            return self.keys, self.values
        return self.keys[:, :, :n], self.values[:, :, :n]


class PlannedKVCache(TreeKVCache):
    """``num_layers`` fixed buffers of ``capacity`` entries, written at device-side positions."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"PlannedKVCache capacity must be >= 1 entry, got {capacity}")
        self.slots = _Slots()
        Cache.__init__(self, layers=[PlannedKVLayer(capacity, self.slots) for _ in range(num_layers)])
        self.capacity = capacity


# One captured (bucket, hidden states read, variant): the static inputs and outputs of its graph.
@dataclass
class _Graph:
    replay: Callable[[], None] | None  # the captured graph's replay
    x: torch.Tensor  # [1, b, hidden] input embeddings
    position_ids: torch.Tensor  # [1, b]
    write_pos: torch.Tensor  # [b]
    masks: dict[str, torch.Tensor]  # "" (one mask) or per layer type: [1, 1, b, capacity]
    logits: torch.Tensor  # [1, b, vocab]
    hidden: torch.Tensor | None  # [1, b, hidden]


# (logits [1, b, vocab], hidden [1, b, hidden] or None)
Outputs = tuple[torch.Tensor, torch.Tensor | None]
# run(x [1, b, hidden], attention_mask, position_ids [1, b], want_hidden) -> Outputs
RunModel = Callable[[torch.Tensor, Any, torch.Tensor, bool], Outputs]


class ForwardPlan:
    """The plan of one model's decode forwards on one device and dtype (see the module docstring).

    ``capacity``: the KV entries the call needs at most (rounded up to ``config.growth``, never past
    ``max_positions + buckets[-1]``, beyond which no position exists). Raises ValueError for a
    capacity beyond the model's positions, CUDA graphs on a model not on a GPU.
    """

    # Device types whose forwards can be captured (tests add "cpu" with a stand-in for the capture).
    _CAPTURABLE: tuple[str, ...] = ("cuda",)

    def __init__(
        self,
        model: torch.nn.Module,
        config: PlanConfig,
        capacity: int,
        *,
        num_layers: int,
        max_positions: int,
    ) -> None:
        if not isinstance(config, PlanConfig):
            raise TypeError(f"ForwardPlan needs a PlanConfig, got {type(config).__name__}")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        limit = max_positions + config.buckets[-1]
        if not isinstance(capacity, int) or capacity < 1 or capacity > limit:
            raise ValueError(
                f"plan capacity {capacity!r} is outside [1, {limit}]: {type(model).__name__} has "
                f"{max_positions} positions and a block adds at most {config.buckets[-1]} padded inputs "
                "past them; plan for at most prompt + max_new_tokens + block_complexity entries"
            )
        capturable = self.device.type in self._CAPTURABLE
        graphs = config.cuda_graphs if config.cuda_graphs is not None else capturable
        if graphs and not capturable:
            raise ValueError(
                f"PlanConfig(cuda_graphs=True) needs a model on a CUDA device; {type(model).__name__} is on "
                f"{self.device}. Use cuda_graphs=None (automatic) or False"
            )
        self.config = config
        self.graphs = graphs
        self.pad = config.pad if config.pad is not None else graphs
        self._model = weakref.ref(model)
        self._limit = limit
        # Room for the padding of the last block too (up to the last bucket past the most entries).
        self.capacity = min(limit, -(-(capacity + config.buckets[-1]) // config.growth) * config.growth)
        self.cache = PlannedKVCache(num_layers, self.capacity)
        self._graphs: dict[tuple[int, bool, tuple], _Graph] = {}  # (bucket, hidden states, variant)
        self._pool: Any = None
        self.eager_reason = "" if graphs else f"no CUDA graphs on {self.device.type}"
        self.busy = False  # a generate call is running through this plan (plan_for hands out another)
        self.start_call()

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Marks the plan busy while a generate call runs through it (plan_for then hands out another)."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def start_call(self) -> None:
        """Zero the per-call counters that ``describe`` reports (the graphs themselves stay)."""
        self.call_eager_reason = ""  # why this call's forwards ran eager ("" if they could run as graphs)
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self.growths = 0

    def describe(self) -> dict[str, Any]:
        """What the plan did in the current call: capacity, buckets, padding, graphs captured (and held,
        captured by earlier calls too), replays, capture time, growths, why no graphs ran."""
        return {
            "capacity": self.capacity,
            "buckets": list(self.config.buckets),
            "pad": self.pad,
            "graphs": self.captures,
            "graphs_held": len(self._graphs),
            "replays": self.replays,
            "capture_s": self.capture_seconds,
            "growths": self.growths,
            "eager_reason": self.eager_reason or self.call_eager_reason,
        }

    def check(self, model: torch.nn.Module) -> None:
        """ValueError unless this plan was built for ``model`` as it is now (same object, device and dtype)."""
        if self._model() is not model:
            raise ValueError(
                f"this ForwardPlan was built for another model, not this {type(model).__name__}; "
                "build one per model (mtprobe.target_model.plan.ForwardPlan(model, ...))"
            )
        param = next(model.parameters())
        if (param.device, param.dtype) != (self.device, self.dtype):
            raise ValueError(
                f"this ForwardPlan was built for {self.dtype} on {self.device}, but the model is now "
                f"{param.dtype} on {param.device}; build a new plan after moving or casting the model"
            )

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` entries: whole chunks more, and the graphs captured again (a re-plan)."""
        if needed <= self.capacity:
            return
        grown = min(self._limit, -(-needed // self.config.growth) * self.config.growth)
        if grown < needed:
            raise ValueError(
                f"the plan cannot hold {needed} KV entries: the model's positions end at {self._limit}"
            )
        self.cache.reserve(grown)
        self.capacity = grown
        self._graphs.clear()
        # A new pool for the new graphs: the old one is left with no graph and blocks still held (the
        # dropped graphs' outputs), and capturing into such a pool fails CUDACachingAllocator's assertion
        # `use_count > 0` (seen on an H200 at the first growth; every later step then ran eager).
        self._pool = None
        self.growths += 1

    def run(
        self,
        run_model: RunModel,
        x: torch.Tensor,  # [1, T, hidden]
        masks: dict[str, torch.Tensor],  # "" or per layer type: [1, 1, T, P + T] additive
        position_ids: torch.Tensor,  # [1, T]
        prefix_len: int,
        want_hidden: bool,
        *,
        as_dict: bool,
        variant: tuple = (),
        eager: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, vocab], [T, hidden]?
        """One decode forward of T inputs after ``prefix_len`` cached entries, through the plan.

        ``variant``: what ``run_model`` computes beyond its inputs (graphs are kept per bucket, hidden
        states read and variant). ``eager``: why this forward must not run as a graph ("" when it may)."""
        T = x.shape[1]
        b = self.config.bucket(T) if prefix_len > 0 else None
        if b is not None and prefix_len + b > self.capacity >= prefix_len + T:
            # No growth for padding alone: the loop fetches the KV buffers again only when a block
            # outgrows them, so a growth here would leave it compacting the old ones. Unpadded and eager.
            b = None
        self.reserve(prefix_len + (b or T))
        self.cache.set_length(prefix_len)
        if eager and self.graphs and not self.call_eager_reason:
            self.call_eager_reason = eager
            logger.info("mtprobe: no CUDA graphs in this call: %s", eager)
        if b is not None and self.graphs and not eager:
            key = (b, want_hidden, variant)
            graph = self._graph(run_model, key, x, masks, position_ids, prefix_len, as_dict)
            if graph is not None:
                self._fill(graph, x, masks, position_ids, prefix_len)
                graph.replay()
                self.replays += 1
                # Copied out: the next replay overwrites the static outputs, and a drafter may keep them.
                hidden = graph.hidden[0, :T].clone() if graph.hidden is not None else None
                return graph.logits[0, :T].clone(), hidden
        if b is None or not self.pad:
            b = T
        slots = self.cache.slots
        slots.write_pos = torch.arange(prefix_len, prefix_len + b, device=x.device)  # [b]
        slots.key_len = prefix_len + b
        x_b, pos_b, masks_b = x, position_ids, masks
        if b > T:
            x_b = torch.cat([x, x.new_zeros((1, b - T, x.shape[-1]))], dim=1)  # [1, b, hidden]
            pos_b = torch.cat([position_ids, position_ids[:, :1].expand(1, b - T)], dim=1)  # [1, b]
            masks_b = {k: padded_mask(m, b, prefix_len + b) for k, m in masks.items()}
        mask = masks_b if as_dict else masks_b[""]
        logits, hidden = run_model(x_b, mask, pos_b, want_hidden)
        return logits[0, :T], (hidden[0, :T] if hidden is not None else None)

    def _fill(
        self,
        g: _Graph,
        x: torch.Tensor,
        masks: dict[str, torch.Tensor],
        position_ids: torch.Tensor,
        prefix_len: int,
    ) -> None:
        """The step's block into the bucket's static inputs (device copies, no sync)."""
        T, b = x.shape[1], g.x.shape[1]
        g.x[:, :T].copy_(x)
        g.x[:, T:].zero_()
        g.position_ids[:, :T].copy_(position_ids)
        g.position_ids[:, T:].copy_(position_ids[:, :1].expand(1, b - T))
        torch.arange(prefix_len, prefix_len + b, out=g.write_pos)
        for k, m in masks.items():
            write_padded_mask(g.masks[k], m, prefix_len)

    def _graph(
        self,
        run_model: RunModel,
        key: tuple[int, bool, tuple],
        x: torch.Tensor,
        masks: dict[str, torch.Tensor],
        position_ids: torch.Tensor,
        prefix_len: int,
        as_dict: bool,
    ) -> _Graph | None:
        """The captured forward of bucket ``b``: captured now (on this step's inputs) if it is not yet;
        None when the model cannot be captured (then every step runs eager, the reason logged once)."""
        b, want_hidden, _ = key
        if key in self._graphs:
            return self._graphs[key]
        if self.eager_reason:
            return None
        t0 = time.perf_counter()
        slots = self.cache.slots
        cap = self.capacity
        g_x = x.new_zeros((1, b, x.shape[-1]))  # [1, b, hidden]
        g_pos = position_ids.new_zeros((1, b))  # [1, b]
        g_wp = torch.zeros(b, dtype=torch.long, device=x.device)  # [b]
        g_masks = {k: m.new_zeros((1, 1, b, cap)) for k, m in masks.items()}  # [1, 1, b, capacity]
        graph = _Graph(None, g_x, g_pos, g_wp, g_masks, g_x, None)  # outputs set once captured
        self._fill(graph, x, masks, position_ids, prefix_len)
        slots.write_pos, slots.key_len = g_wp, cap

        def step() -> Outputs:
            return run_model(g_x, g_masks if as_dict else g_masks[""], g_pos, want_hidden)

        return try_capture(self, key, graph, step, "the model's forward", t0)

    def _capture(
        self, step: Callable[[], Outputs], device: torch.device
    ) -> tuple[Callable[[], None], Outputs]:
        """``step`` captured as a CUDA graph: (replay, the graph's static outputs). Two warm-up runs on
        a side stream first (lazy initialisations, autotuning), as ``torch.cuda.graphs`` asks; every
        bucket's graph shares one memory pool (they never run at once)."""
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(cuda_graph, pool=self._pool):
            outputs = step()
        return cuda_graph.replay, outputs


def try_capture(
    owner: Any, key: tuple, graph: Any, step: Callable[[], Outputs], what: str, started: float
) -> Any:
    """``step`` captured by ``ForwardPlan._capture`` into ``graph`` (its replay and static outputs) and kept in
    ``owner._graphs[key]``, counted in ``owner.captures`` and ``owner.capture_seconds`` (since ``started``);
    None when it cannot be captured: then ``owner.eager_reason`` says why (later steps run eager), logged."""
    device = owner.device
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    try:
        graph.replay, (graph.logits, graph.hidden) = ForwardPlan._capture(owner, step, device)
    except Exception as e:  # noqa: BLE001 (any failure to capture means: run eager)
        owner.eager_reason = f"{type(e).__name__}: {e}"
        logger.warning("mtprobe: %s could not be captured as a CUDA graph (%s); running eager", what, e)
        if stream is not None:
            # torch.cuda.graph enters its capture stream before capture_begin, and a capture_begin that
            # raises never leaves it: the caller's stream back, or every later op runs on the capture stream.
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(device)
        return None
    owner._graphs[key] = graph
    owner.captures += 1
    owner.capture_seconds += time.perf_counter() - started
    return graph


def plan_for(
    model: torch.nn.Module, config: PlanConfig, capacity: int, *, num_layers: int, max_positions: int
) -> ForwardPlan:
    """The plan for one generate call on ``model``: the plan of its last call when that was built with an
    equal ``config`` on the model's present device and dtype and is not in use (its KV buffer and graphs
    kept, grown if this call needs more), else a new one, kept for the next call. Captures are paid once
    per model and bucket, not once per call (SGLang and vLLM capture once per server). The kept plan holds
    its KV buffer between calls, in the model's state (:mod:`mtprobe.state`); ``mtprobe.release(model)``
    frees it."""
    param = next(model.parameters())
    state = state_of(model)
    plan = state.plan
    if (
        plan is None
        or plan.busy
        or plan.config != config
        or (plan.device, plan.dtype) != (param.device, param.dtype)
        or len(plan.cache.layers) != num_layers
    ):
        plan = ForwardPlan(model, config, capacity, num_layers=num_layers, max_positions=max_positions)
        state.plan = plan
    else:
        plan.start_call()
        plan.reserve(capacity + config.buckets[-1])
    return plan


def release(model: torch.nn.Module) -> None:
    """Forget ``model``'s kept plan (its KV buffer and graphs go with it); the rest of its state stays
    (``mtprobe.release(model)`` drops all of it)."""
    if kept(model):
        state_of(model).plan = None


def padded_mask(
    mask: torch.Tensor,  # [1, 1, T, P + T] additive
    bucket: int,
    key_len: int,
) -> torch.Tensor:  # [1, 1, bucket, key_len]
    """``mask`` padded to ``bucket`` queries and ``key_len`` keys: padding queries see only
    themselves, and no real query sees a padding key or a column past its block."""
    T = mask.shape[-2]
    prefix_len = mask.shape[-1] - T
    out = mask.new_full((1, 1, bucket, key_len), torch.finfo(mask.dtype).min)
    write_padded_mask(out, mask, prefix_len)
    return out


def write_padded_mask(
    out: torch.Tensor,  # [1, 1, b, K] additive, K >= P + b
    mask: torch.Tensor,  # [1, 1, T, P + T] additive
    prefix_len: int,
) -> None:
    """Write ``mask`` into the static ``out`` (see :func:`padded_mask`), in place."""
    T, b = mask.shape[-2], out.shape[-2]
    out.fill_(torch.finfo(out.dtype).min)
    out[:, :, :T, : prefix_len + T] = mask
    if b > T:
        rows = torch.arange(T, b, device=out.device)  # [b - T]
        out[0, 0, rows, prefix_len + rows] = 0.0


def chain_mask(prefix_len: int, T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask ``[1, 1, T, P + T]`` of a chain block (the loop passes None for one)."""
    m = torch.full((T, prefix_len + T), torch.finfo(dtype).min, dtype=dtype, device=device)  # [T, P + T]
    m[:, :prefix_len] = 0.0
    m[:, prefix_len:] = torch.triu(m[:, prefix_len:], diagonal=1)
    return m.view(1, 1, T, prefix_len + T)
