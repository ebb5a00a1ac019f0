"""Measured forward costs: what one target forward over T inputs costs on the machine at hand.

Whether a draft pays depends on the hardware. On a GPU a forward over 30 inputs costs about what a
forward over one costs; on a small CPU it costs twice as much or more. :func:`profile_forward`
measures t(T, context) for a model, device, dtype and thread count, in wall-clock seconds, and keeps
the result on disk so that the next call loads it instantly. The scheduler of
:class:`mtprobe.AutoConfig` divides the tokens a block is expected to gain by its cost
``profile.relative(T, context)`` = t(T, context) / t(1, context).

A worked example (numbers of the kind measured on a 2-core CPU with SmolLM2-135M, float32)::

    >>> from mtprobe.target_model.profile import ForwardProfile, ProfileKey
    >>> key = ProfileKey(model="LlamaForCausalLM:0123abcd", device="cpu", dtype="float32", threads=2)
    >>> p = ForwardProfile(key, block_sizes=(1, 8, 32), context_lengths=(64, 512),
    ...                    seconds=((0.020, 0.030, 0.046), (0.024, 0.036, 0.056)))
    >>> round(p.time(8, 64), 3)          # a grid point
    0.03
    >>> round(p.time(20, 64), 3)         # between block sizes: linear
    0.038
    >>> round(p.relative(32, 288), 3)    # between contexts too: t(32, 288) / t(1, 288)
    2.318

The profile measures the forward mtprobe runs in its decode loop: ``HFAdapter.forward`` with the
loop's own KV cache, a chain-shaped block of T inputs after ``context`` cached positions, the mask
format of the model's attention implementation, and on a CPU the linear route each T takes
(:func:`choose_linear_routes`, measured first: :mod:`mtprobe.cpu.linear_routes`). Median of ``repeats``
timed calls after ``warmup``. A profile's key names the model's architecture, the device (the CPU's
model name), its instruction set, dtype, threads and the linear routes; a profile measured under
another key is refused. Each measurement records how much of the CPU other processes used meanwhile
(:class:`mtprobe.cpu.machine.OtherLoad`): one made on a busy machine, where the load can reorder the
routes, is measured again by the first process that finds the machine quiet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtprobe import ops
from mtprobe._jsonl import read_json, write_json
from mtprobe.cpu import linear_routes
from mtprobe.cpu.linear_routes import ENV as ROUTE_ENV
from mtprobe.cpu.linear_routes import STOCK, LinearRoutes, RouteKey
from mtprobe.cpu.machine import BUSY_SHARE, OtherLoad, architecture, check_other_load, cpu_isa, device_name
from mtprobe.models import cache_root
from mtprobe.target_model.adapter import HFAdapter, max_positions
from mtprobe.target_model.native_forward import native_forward, version
from mtprobe.tree_attention import NAME as TREE_ATTENTION

logger = logging.getLogger(__name__)

PROFILE_FORMAT = 1
# Every block size the linear routes are measured at is on the grid too: a route may change at any of
# them, and interpolating across the change would smooth a step in the cost.
DEFAULT_BLOCK_SIZES = tuple(sorted({1, 2, 4, 8, 12, 16, 24, 32, 48, 64, *linear_routes.BLOCK_SIZES}))
DEFAULT_CONTEXT_LENGTHS = (64, 256, 1024)


_COMPARED = ("model", "device", "isa", "dtype", "threads", "linear", "forward")


_FIND: Any = object()
"""ProfileKey.of's ``native`` when not handed in: ask :func:`~mtprobe.target_model.native_forward.native_forward`."""


@dataclass(frozen=True)
class ProfileKey:
    """What a forward's cost depends on. A profile is valid only for a model with the same key."""

    model: str
    """Model class and a hash of its architecture config (``LlamaForCausalLM:0123abcd...``)."""
    device: str
    """``cpu (CPU name, N cores)`` or ``cuda (GPU name)``."""
    dtype: str
    """The model's dtype, e.g. ``float32``."""
    threads: int
    """torch's CPU threads when measured (0 on a GPU, where it does not matter)."""
    torch: str = ""
    """torch version (informative: not compared)."""
    linear: str = STOCK
    """The route of the forward's linear layers by block size (:attr:`mtprobe.cpu.linear_routes.LinearRoutes.tag`):
    ``stock`` where every block size ran torch's own."""
    forward: str = "HF"
    """What runs the decode blocks: ``HF`` (its modules) or the C++ forward's version
    (:func:`mtprobe.target_model.native_forward.version`); a profile of one is not the other's."""
    isa: str = ""
    """On a CPU, the instruction set torch's kernels used and the extensions that matter
    (:func:`mtprobe.cpu.machine.cpu_isa`); empty on a GPU and in profiles measured before it was recorded."""

    @classmethod
    def of(cls, model: Any, routes: LinearRoutes | None = None, native: Any = _FIND) -> ProfileKey:
        """The key of ``model`` as loaded now; ``routes``: its linear routes (default: as
        :func:`choose_linear_routes` finds them, which measures them where none are cached); ``native``: its C++
        forward or None, as :func:`~mtprobe.target_model.native_forward.native_forward` gives it (default: asked
        here; a call that holds the answer already hands it in)."""
        device = next(model.parameters()).device
        if routes is None:
            routes = choose_linear_routes(model)
        if native is _FIND:
            native = native_forward(model) if device.type == "cpu" else None
        return cls(
            model=architecture(model),
            device=device_name(device),
            dtype=str(model.dtype).removeprefix("torch."),
            threads=torch.get_num_threads() if device.type == "cpu" else 0,
            torch=torch.__version__,
            linear=routes.tag,
            forward=version(native) if device.type == "cpu" and native is not None else "HF",
            isa=cpu_isa() if device.type == "cpu" else "",
        )

    def mismatches(self, other: ProfileKey) -> list[str]:
        """The fields (all but ``torch``) on which ``other`` differs, as ``name: this vs other``."""
        return [
            f"{f}: profile {getattr(self, f)!r} vs now {getattr(other, f)!r}"
            for f in _COMPARED
            if getattr(self, f) != getattr(other, f)
        ]


@dataclass(frozen=True, repr=False)
class ForwardProfile:
    """Median seconds of one forward, ``seconds[i][j]`` = t(block_sizes[j], context_lengths[i]).

    ``block_sizes`` ascend and start at 1 (plain decoding); ``context_lengths`` ascend. Between grid
    points the time is linear in each coordinate; past the last block size it continues the last
    segment's slope; outside the context range it is clamped to the nearest measured context.
    """

    key: ProfileKey
    block_sizes: tuple[int, ...]  # [B]
    context_lengths: tuple[int, ...]  # [C]
    seconds: tuple[tuple[float, ...], ...]  # [C][B]
    other_load: float | None = None
    """The share of the CPU other processes used while it was measured (None: not known)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_sizes", tuple(int(b) for b in self.block_sizes))
        object.__setattr__(self, "context_lengths", tuple(int(c) for c in self.context_lengths))
        object.__setattr__(self, "seconds", tuple(tuple(float(s) for s in row) for row in self.seconds))
        b, c = self.block_sizes, self.context_lengths
        if not b or b[0] != 1 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"block_sizes must ascend strictly and start at 1 (plain decoding), got {b}")
        if not c or c[0] < 0 or any(x >= y for x, y in zip(c, c[1:], strict=False)):
            raise ValueError(f"context_lengths must be non-negative and ascend strictly, got {c}")
        if len(self.seconds) != len(c) or any(len(row) != len(b) for row in self.seconds):
            raise ValueError(
                f"seconds must be [len(context_lengths)][len(block_sizes)] = [{len(c)}][{len(b)}], got "
                f"[{len(self.seconds)}][{', '.join(str(len(r)) for r in self.seconds)}]"
            )
        for i, row in enumerate(self.seconds):
            for j, s in enumerate(row):
                if not (math.isfinite(s) and s > 0):
                    raise ValueError(
                        f"seconds[{i}][{j}] (block size {b[j]}, context {c[i]}) is {s}: every forward time must "
                        "be a positive finite number of seconds; measure again with profile_forward"
                    )
        check_other_load(self.other_load)

    def __repr__(self) -> str:  # the grid of numbers would drown a config's repr and the logs
        k = self.key
        return (
            f"ForwardProfile({k.model}, {k.device}, {k.dtype}, {k.threads} threads, "
            f"T in {list(self.block_sizes)}, contexts {list(self.context_lengths)}, "
            f"t(1) = {self.seconds[0][0] * 1e3:.2f} ms, t({self.block_sizes[-1]}) / t(1) = "
            f"{self.seconds[0][-1] / self.seconds[0][0]:.2f} at context {self.context_lengths[0]})"
        )

    def _row(self, i: int, block_size: float) -> float:
        b, s = self.block_sizes, self.seconds[i]
        if len(b) == 1:
            return s[0] * block_size
        j = min(max(1, next((k for k, x in enumerate(b) if x >= block_size), len(b) - 1)), len(b) - 1)
        x0, x1, y0, y1 = b[j - 1], b[j], s[j - 1], s[j]
        return max(y0 + (y1 - y0) * (block_size - x0) / (x1 - x0), min(s) * 0.5)

    def time(self, block_size: float, context: float) -> float:
        """Estimated seconds of one forward over ``block_size`` inputs after ``context`` positions."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        c = self.context_lengths
        if context <= c[0] or len(c) == 1:
            return self._row(0, block_size)
        if context >= c[-1]:
            return self._row(len(c) - 1, block_size)
        i = next(k for k, x in enumerate(c) if x >= context)
        w = (context - c[i - 1]) / (c[i] - c[i - 1])
        return (1 - w) * self._row(i - 1, block_size) + w * self._row(i, block_size)

    def relative(self, block_size: float, context: float) -> float:
        """t(block_size, context) / t(1, context): the cost of a block in plain-decoding steps."""
        return self.time(block_size, context) / self.time(1, context)

    def for_rows(self, rows: int) -> ForwardProfile:
        """The profile as one row of a batch of ``rows`` sequences decoded together sees it: there a
        row's block of T inputs runs in one forward with every other row's, and each row waits out that
        forward, so its step costs t(rows x T) (every row's block taken as large as its own). Priced so, a
        row's scheduler drafts less the more rows share the forward: on a CPU a forward of many inputs is
        bound by arithmetic, not by reading the weights, and the drafts the others verify cost every row."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows={rows!r} must be an int >= 1 (the sequences sharing each forward)")
        if rows == 1:
            return self
        # Grid points where the measured ones fall (rows x T on a measured block size), so that between them
        # the line is the measured one's.
        sizes = tuple(sorted({*self.block_sizes, *(max(1, round(b / rows)) for b in self.block_sizes)}))
        seconds = tuple(tuple(self.time(rows * b, c) for b in sizes) for c in self.context_lengths)
        return dataclasses.replace(self, block_sizes=sizes, seconds=seconds)

    def check(self, model: Any) -> None:
        """Raise ValueError naming every field on which ``model`` (as loaded now) differs from the
        profile's key: a profile from another model, device, dtype or thread count misleads."""
        bad = self.key.mismatches(ProfileKey.of(model))
        if bad:
            raise ValueError(
                "this forward profile was measured for another setting (" + "; ".join(bad) + "); measure one "
                "for this model with mtprobe.profile_forward(model)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "key": dataclasses.asdict(self.key),
            "block_sizes": list(self.block_sizes),
            "context_lengths": list(self.context_lengths),
            "seconds": [list(r) for r in self.seconds],
            "other_load": self.other_load,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ForwardProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a forward profile of format {PROFILE_FORMAT} (format {got!r})")
        try:
            return cls(
                ProfileKey(**data["key"]),
                data["block_sizes"],
                data["context_lengths"],
                data["seconds"],
                data.get("other_load"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed forward profile: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ForwardProfile:
        data = read_json(path, "forward profile", "measure one with mtprobe.profile_forward")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def profile_dir() -> Path:
    """Where measured profiles are kept: ``$MTPROBE_CACHE/profiles`` (default ``~/.cache/mtprobe``)."""
    return cache_root() / "profiles"


def _cache_path(key: ProfileKey, block_sizes: Sequence[int], context_lengths: Sequence[int]) -> Path:
    # A profile of HF's forward keeps the name it had before the key named the forward.
    fields = [getattr(key, f) for f in _COMPARED if f != "forward" or key.forward != "HF"]
    ident = json.dumps([fields, list(block_sizes), list(context_lengths)])
    return profile_dir() / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"


_ROUTES_SEEN: dict[RouteKey, LinearRoutes] = {}
# Profiles read from the cache, by path, with the file's (mtime, size) then: AutoConfig asks at every generation,
# and each sequence of a batch asks again.
_READ: dict[Path, tuple[tuple[int, int], ForwardProfile]] = {}


def _load_cached(path: Path) -> ForwardProfile:
    """The profile in ``path``, read again only when the file changed since this process last read it."""
    st = path.stat()
    stamp = (st.st_mtime_ns, st.st_size)
    seen = _READ.get(path)
    if seen is not None and seen[0] == stamp:
        return seen[1]
    profile = ForwardProfile.load(path)
    _READ[path] = (stamp, profile)
    return profile


# Cached profiles measured on a busy machine that this process found the machine still busy for.
_KEPT_BUSY: set[Path] = set()


def _quiet_now(other_load: float | None) -> bool:
    """Whether a measurement made under ``other_load`` (busy: above :data:`~mtprobe.cpu.machine.BUSY_SHARE`)
    should be made again because the machine is quiet now (sampled for a quarter of a second, only
    for a busy one)."""
    if other_load is None or other_load <= BUSY_SHARE:
        return False
    with OtherLoad() as now:
        time.sleep(0.25)
    return now.share is not None and not now.busy


def _routes_path(key: RouteKey) -> Path:
    ident = json.dumps(dataclasses.astuple(key))
    return cache_root() / "linear_routes" / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"


def choose_linear_routes(
    model: Any, *, refresh: bool = False, cache: bool = True, repeats: int = 4, warmup: int = 1
) -> LinearRoutes:
    """The route of each decode step's linear layers by its block size, for ``model`` on this machine
    (:mod:`mtprobe.cpu.linear_routes`).

    torch's linear everywhere on a GPU, for a model in another dtype than float32 or one whose linear
    weights fit the caches, and where no other route runs here. ``MTPROBE_LINEAR_ROUTE`` forces a route
    (ValueError where it cannot run). Otherwise every route that runs here is timed at each of
    :data:`mtprobe.cpu.linear_routes.BLOCK_SIZES` (interleaved, medians of ``repeats`` after ``warmup``
    rounds; about 10 s for SmolLM2-135M on 2 cores) and the fastest taken per block size; the outcome is
    kept in memory and, with ``cache``, on disk under ``$MTPROBE_CACHE/linear_routes``, keyed by
    :class:`~mtprobe.cpu.linear_routes.RouteKey` (``refresh`` measures again).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    forced = linear_routes.forced_route()
    if next(model.parameters()).device.type != "cpu":
        return LinearRoutes.all_stock(RouteKey())  # routes are a CPU matter
    linears = linear_routes.routable_linears(model)
    if forced:
        why = linear_routes.unavailable(forced)
        if not why and forced != STOCK and not linears:
            why = "the model has no float32 nn.Linear on the CPU to route"
        if why:
            raise ValueError(
                f"{ROUTE_ENV}={forced}: the {forced!r} linear route cannot run here: {why}. Unset it (auto: the "
                f"routes are measured) or name a route that runs here: "
                + ", ".join(r for r in linear_routes.ROUTES if not linear_routes.unavailable(r))
            )
        return LinearRoutes.only(forced, RouteKey.of(model, (forced,)))
    candidates = tuple(r for r in linear_routes.ROUTES if not linear_routes.unavailable(r))
    if (
        not linears
        or len(candidates) == 1
        or linear_routes.weight_bytes(linears) < linear_routes.MIN_WEIGHT_BYTES
    ):
        return LinearRoutes.all_stock(RouteKey())
    key = RouteKey.of(model, candidates)
    if not refresh and key in _ROUTES_SEEN:
        return _ROUTES_SEEN[key]
    path = _routes_path(key)
    routes = None
    if cache and not refresh and path.is_file():
        try:
            routes = LinearRoutes.from_dict(
                read_json(path, "linear-route measurement", "it is measured again")
            )
        except ValueError:
            routes = None  # a corrupt cache entry is measured again and overwritten
    if routes is not None and routes.key == key and _quiet_now(routes.other_load):
        logger.info(
            "mtprobe: the CPU linear routes of %s were timed while other processes used %.0f%% of the CPU; "
            "timed again now that the machine is quiet",
            key.model,
            100 * (routes.other_load or 0.0),
        )
        routes = None
    if routes is None or routes.key != key:
        # A warning, so that a notebook shows why its first call pauses (seconds; once per machine).
        logger.warning(
            "mtprobe: timing the CPU linear routes (%s) of %s on this machine (%s, %s); once per machine and "
            "model architecture",
            ", ".join(candidates),
            key.model,
            key.cpu,
            key.isa,
        )
        with OtherLoad() as load:
            routes = _measure_routes(model, key, candidates, repeats, warmup)
        routes = dataclasses.replace(routes, other_load=load.share)
        if load.busy:
            logger.warning(
                "mtprobe: other processes used %s while the CPU linear routes were timed: the choice (%s) may "
                "not hold on a quiet machine; the first process to find it quiet times them again",
                load.describe(),
                routes.describe(),
            )
        if cache:
            write_json(path, routes.to_dict())
    if linear_routes.PACKED not in routes.used:
        linear_routes.drop_packed(model)
    logger.info("mtprobe: CPU linear routes for %s: %s", key.model, routes.describe())
    _ROUTES_SEEN[key] = routes
    return routes


def _measure_routes(
    model: Any, key: RouteKey, candidates: Sequence[str], repeats: int, warmup: int
) -> LinearRoutes:
    """Time each of ``candidates`` at every block size, interleaved, and choose per block size."""
    limit = max_positions(model)
    sizes = tuple(t for t in linear_routes.BLOCK_SIZES if t <= limit)
    context = max(0, min(256, limit - sizes[-1]))
    device = torch.device("cpu")
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(
        0, vocab, (context + sizes[-1],), generator=torch.Generator().manual_seed(0)
    )  # [P + T]
    adapter = HFAdapter(model, context + sizes[-1], max_capacity=context + sizes[-1], checked=True)
    router = linear_routes.Router(model, candidates)
    times: dict[tuple[str, int], list[float]] = {(r, t): [] for r in candidates for t in sizes}
    with torch.inference_mode():
        if context > 0:
            adapter.forward(ids[:context], None, torch.arange(context)[None], None, 0, False)
        for rep in range(warmup + repeats):
            for t in sizes:
                pos = torch.arange(context, context + t)[None]  # [1, T]: a chain's positions
                mask = chain_mask(model, t, context, device)
                for r in candidates:  # interleaved: a drift in the machine's speed falls on all alike
                    with router.routed(r):
                        t0 = time.perf_counter()
                        adapter.forward(ids[context : context + t], None, pos, mask, context, False)
                        elapsed = time.perf_counter() - t0
                    if rep >= warmup:
                        times[r, t].append(elapsed)
    seconds = {r: tuple(statistics.median(times[r, t]) for t in sizes) for r in candidates}
    wins = {  # the repeats are interleaved: repeat i of a route and of stock ran side by side
        r: tuple(
            sum(a < b for a, b in zip(times[r, t], times[STOCK, t], strict=True)) / len(times[r, t])
            for t in sizes
        )
        for r in candidates
    }
    return linear_routes.choose(key, sizes, seconds, context, wins)


def chain_mask(model: Any, t: int, context: int, device: torch.device) -> torch.Tensor | None:
    """The mask the decode loop hands a T-input block after ``context`` positions (None for T = 1): what
    :func:`profile_forward` and :func:`choose_linear_routes` time a forward with."""
    if t == 1:
        return None
    if getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION:
        return ops.tree_ancestor_bits(torch.arange(-1, t - 1, device=device))[None, None]  # [1, 1, T, W]
    mask = torch.zeros(t, context + t, dtype=model.dtype, device=device)  # [T, P + T] additive
    mask[:, context:] = torch.full(
        (t, t), torch.finfo(model.dtype).min, dtype=model.dtype, device=device
    ).triu(1)
    return mask[None, None]


def profile_forward(
    model: Any,
    *,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    repeats: int = 5,
    warmup: int = 2,
    cache: bool = True,
    refresh: bool = False,
    routes: LinearRoutes | None = None,
    native: Any = _FIND,
) -> ForwardProfile:
    """Measure t(T, context) of ``model`` where it sits (device, dtype, current torch threads).

    With ``cache`` (default) the result is stored under :func:`profile_dir` keyed by the model's
    architecture, device, dtype, threads and the grid, and a later call with the same key loads it
    instead of measuring (``refresh=True`` measures again; it does not re-time the linear routes, which
    ``choose_linear_routes(model, refresh=True)`` does). Contexts beyond the model's positions are
    dropped. Takes seconds for a small model: len(block_sizes) x len(context_lengths) x (repeats + warmup)
    forwards. ``routes`` and ``native``: the model's linear routes and C++ forward where the caller holds them
    already (a generation's, asked once for all its sequences), else found here. A cached profile is read from
    its file once per process while the file stays as it was.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    sizes = tuple(int(b) for b in block_sizes)
    if not sizes or sizes[0] != 1 or any(x >= y for x, y in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(
            f"block_sizes must ascend strictly and start at 1 (plain decoding), got {tuple(block_sizes)}"
        )
    limit = max_positions(model)
    contexts = tuple(int(c) for c in context_lengths if 0 <= int(c) <= limit - sizes[-1])
    if not contexts or any(x >= y for x, y in zip(contexts, contexts[1:], strict=False)):
        raise ValueError(
            f"context_lengths must ascend strictly and leave room for the largest block ({sizes[-1]}) in the "
            f"model's {limit} positions, got {tuple(context_lengths)}"
        )
    routes = routes if routes is not None else choose_linear_routes(model)
    if native is _FIND:
        native = native_forward(model) if next(model.parameters()).device.type == "cpu" else None
    key = ProfileKey.of(model, routes, native)
    path = _cache_path(key, sizes, contexts)
    if cache and not refresh and path.is_file():
        try:
            cached = _load_cached(path)
        except ValueError:
            cached = None  # a corrupt cache entry is measured again and overwritten
        # A busy entry costs a 0.25 s sample once per process, not at every call (AutoConfig asks at
        # every generation): once the machine was found still busy, this process keeps the entry.
        if cached is not None and (path in _KEPT_BUSY or not _quiet_now(cached.other_load)):
            if cached.other_load is not None and cached.other_load > BUSY_SHARE:
                _KEPT_BUSY.add(path)
            return cached

    device = next(model.parameters()).device
    # A warning, so that a notebook shows why AutoConfig's first call pauses (half a minute for SmolLM2 on
    # two cores).
    logger.warning(
        "mtprobe: measuring the forward costs of %s on this machine for AutoConfig's scheduler (%d forwards); "
        "once per machine, model, dtype and thread count, kept in %s",
        key.model,
        len(sizes) * len(contexts) * (warmup + repeats),
        path.parent,
    )
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    capacity = contexts[-1] + sizes[-1]
    # The forward the caller's generation runs (a sliding-window model's C++ forward where its generations fit
    # the window: measured over longer contexts all the same, for its time).
    adapter = HFAdapter(model, capacity, max_capacity=capacity, linear_routes=routes, native=native)
    ids = torch.randint(0, vocab, (capacity,), generator=gen).to(device)  # [capacity] arbitrary tokens

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows: list[tuple[float, ...]] = []
    with torch.inference_mode(), OtherLoad() as load:
        if contexts[-1] > 0:  # the prefix every measured block attends to
            pos = torch.arange(contexts[-1], device=device)[None]
            adapter.forward(ids[: contexts[-1]], None, pos, None, 0, False)
        for context in contexts:
            row = []
            for t in sizes:
                pos = torch.arange(context, context + t, device=device)[None]  # [1, T]: a chain's positions
                mask = chain_mask(model, t, context, device)
                tokens = ids[context : context + t]
                times = []
                for r in range(warmup + repeats):
                    sync()
                    t0 = time.perf_counter()
                    adapter.forward(tokens, None, pos, mask, context, False)
                    sync()
                    if r >= warmup:
                        times.append(time.perf_counter() - t0)
                row.append(statistics.median(times))
            rows.append(tuple(row))
    profile = ForwardProfile(key, sizes, contexts, tuple(rows), load.share)
    if load.busy:
        logger.warning(
            "mtprobe: other processes used %s while the forward profile was measured: its costs may not hold "
            "on a quiet machine; the first process to find it quiet measures it again",
            load.describe(),
        )
    if cache:
        profile.save(path)
    return profile
