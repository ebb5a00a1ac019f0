"""The route a CPU decode step's linear layers take, chosen per block size by measurement.

Verifying a block of T inputs runs every linear layer of the model over T rows, and which kernel
does that fastest depends on the CPU, not on the model alone. With SmolLM2-135M on a 2-core Intel Xeon
with AVX-512, torch's GEMM costs little for 2-3 rows and mtprobe's small-batch op 15-26 % less than it
for 4-20, while oneDNN's packed linear loses everywhere (benchmarks/results/linear_routes.md); on a
2-core AMD EPYC the op was the cheaper from 2 rows and the packed linear helped even one
(small_batch_linear.md, cpu_linear.md). So no route is switched on for every CPU; each is timed on the
machine at hand:

- ``stock``: torch's ``F.linear``, what HF's ``generate`` runs;
- ``packed``: oneDNN's linear on a copy of each weight packed once into its blocked layout
  (``torch.ops.mkldnn``), made while measuring and kept only where chosen (it doubles the linears'
  memory);
- ``small-batch``: :mod:`mtprobe.cpu.small_batch_linear`, each weight read once for up to ``MAX_ROWS``
  inputs.

:class:`LinearRoutes` is the outcome, a route for every block size T:
:func:`mtprobe.target_model.profile.choose_linear_routes` measures it (seconds, once per machine and model
architecture; cached on disk under :class:`RouteKey`: CPU model, instruction set, threads, dtype,
torch) and :class:`~mtprobe.target_model.adapter.HFAdapter` runs each decode step's forward through its T's route.
Only decode steps (a cached prefix) of float32 CPU models are routed, and only models whose linear
weights outgrow the caches (:data:`MIN_WEIGHT_BYTES`); the prefill and whatever the user runs keep
torch's linear. A route other than stock is taken at a measured T only if it was at least
:data:`MARGIN` faster there; between measured sizes only where both neighbours took it; past the last,
stock. Routes differ from stock only in rounding, as two BLAS libraries do.

A worked example::

    >>> r = LinearRoutes(RouteKey(), (1, 2, 4, 8), ("stock", "small-batch", "small-batch", "stock"))
    >>> [r.route(t) for t in (1, 2, 3, 4, 6, 8, 9, 64)]
    ['stock', 'small-batch', 'small-batch', 'small-batch', 'stock', 'stock', 'stock', 'stock']
    >>> r.describe()
    'T 1: stock; T 2-4: small-batch; T 5+: stock'

``MTPROBE_LINEAR_ROUTE`` forces one route on every decode step (``stock``, ``packed``, ``small-batch``;
``auto``, the default, measures); ``MTPROBE_SMALL_BATCH_LINEAR=0`` keeps the small-batch op out.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import os
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtprobe.cpu import machine, small_batch_linear

ENV = "MTPROBE_LINEAR_ROUTE"
STOCK, PACKED, SMALL_BATCH = "stock", "packed", "small-batch"
ROUTES = (STOCK, PACKED, SMALL_BATCH)
"""Every route, in the order a tie is broken (stock first)."""

VERSIONS = {STOCK: STOCK, PACKED: "packed (oneDNN)", SMALL_BATCH: small_batch_linear.KERNEL}
"""What a measurement records of each route: a new kernel version is measured anew."""

BLOCK_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32)
"""The block sizes each route is timed at; larger blocks run torch's linear."""

MARGIN = 0.03
"""How much faster than stock (a fraction of stock's time) another route must measure to be taken:
timing noise alone must not move a block size off torch's linear."""

MIN_WINS = 0.75
"""The fraction of the interleaved repeats in which another route must also beat stock, repeat by
repeat: a burst of other work on the machine during a few of stock's repeats moves its median, not
this count."""

MIN_WEIGHT_BYTES = 16 << 20
"""Models whose linear weights take less stay on torch's linear without measuring: their weights sit
in the CPU's caches, where reading them once more costs little."""

# Each routed linear's weight packed for oneDNN: (stamp, packed), kept beside the module rather than in it,
# so that copying the module (copy.deepcopy, which cannot copy oneDNN's opaque tensors) copies none.
_PACKED: weakref.WeakKeyDictionary[nn.Module, tuple[Any, torch.Tensor]] = weakref.WeakKeyDictionary()


def has_packed(m: nn.Module) -> bool:
    """Whether ``m`` holds a packed copy of its weight (the packed route made it, and it was not dropped)."""
    return m in _PACKED


@dataclass(frozen=True)
class RouteKey:
    """What a choice of routes depends on; a measurement holds only where every field is equal."""

    model: str = ""
    """Model class and a hash of its architecture (:func:`mtprobe.cpu.machine.architecture`)."""
    cpu: str = ""
    """``cpu (CPU name, N cores)``."""
    isa: str = ""
    """The instruction set torch's kernels use and the extensions that matter (:func:`mtprobe.cpu.machine.cpu_isa`)."""
    threads: int = 0
    dtype: str = ""
    torch: str = ""
    candidates: tuple[str, ...] = ()
    """The routes measured, with their kernel versions (:data:`VERSIONS`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", tuple(self.candidates))

    @classmethod
    def of(cls, model: nn.Module, candidates: Iterable[str]) -> RouteKey:
        return cls(
            model=machine.architecture(model),
            cpu=machine.device_name(torch.device("cpu")),
            isa=machine.cpu_isa(),
            threads=torch.get_num_threads(),
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            torch=torch.__version__,
            candidates=tuple(VERSIONS[r] for r in candidates),
        )


@dataclass(frozen=True, repr=False)
class LinearRoutes:
    """A route for every block size T of a decode step's forward.

    ``routes[j]`` is the route at ``block_sizes[j]`` (ascending, from 1); ``seconds`` the medians each
    measured route took there (``[len(block_sizes)]`` per route), ``context`` the cached positions they
    were measured after. ``forced``: the one route ``MTPROBE_LINEAR_ROUTE`` named for every T, or ``""``.
    ``other_load``: the share of the CPU other processes used while they were timed (None: not known).
    """

    key: RouteKey
    block_sizes: tuple[int, ...]  # [B]
    routes: tuple[str, ...]  # [B]
    seconds: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # route -> [B]
    context: int = 0
    forced: str = ""
    other_load: float | None = None

    def __post_init__(self) -> None:
        b = tuple(int(x) for x in self.block_sizes)
        object.__setattr__(self, "block_sizes", b)
        object.__setattr__(self, "routes", tuple(self.routes))
        object.__setattr__(self, "seconds", {k: tuple(float(s) for s in v) for k, v in self.seconds.items()})
        if not b or b[0] != 1 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"block_sizes must ascend strictly and start at 1, got {b}")
        if len(self.routes) != len(b):
            raise ValueError(f"{len(self.routes)} routes for {len(b)} block sizes: one route per block size")
        for r in (*self.routes, *self.seconds, *([self.forced] if self.forced else [])):
            if r not in ROUTES:
                raise ValueError(f"{r!r} is not a linear route; the routes are {', '.join(ROUTES)}")
        for r, s in self.seconds.items():
            if len(s) != len(b):
                raise ValueError(f"seconds[{r!r}] has {len(s)} entries for {len(b)} block sizes")
        machine.check_other_load(self.other_load)
        # route(T) for T in 1..block_sizes[-1], looked up once per forward.
        table = [STOCK]
        for t in range(1, b[-1] + 1):
            j = bisect.bisect_left(b, t)
            same = b[j] == t or self.routes[j - 1] == self.routes[j]
            table.append(self.routes[j] if same else STOCK)
        object.__setattr__(self, "_table", tuple(table))

    @classmethod
    def all_stock(cls, key: RouteKey) -> LinearRoutes:
        """torch's linear everywhere (a GPU, another dtype, a small model, or no other route here)."""
        return cls(key, (1,), (STOCK,))

    @classmethod
    def only(cls, route: str, key: RouteKey) -> LinearRoutes:
        """``route`` for every decode step, as ``MTPROBE_LINEAR_ROUTE`` forces it."""
        return cls(key, (1,), (route,), forced=route)

    def route(self, block_size: int) -> str:
        """The route of a decode step's forward over ``block_size`` inputs."""
        if self.forced:
            return self.forced
        table = self._table  # type: ignore[attr-defined]
        return table[block_size] if block_size < len(table) else STOCK

    @property
    def used(self) -> frozenset[str]:
        """The routes some block size takes."""
        return frozenset(self.routes)

    def describe(self) -> str:
        """The routes as runs of block sizes, e.g. ``T 1: stock; T 2-16: small-batch; T 17+: stock``."""
        if self.forced:
            return f"every T: {self.forced} (forced by {ENV})"
        last = self.block_sizes[-1]
        runs: list[list[Any]] = []
        for t in range(1, last + 2):
            r = self.route(t)
            if runs and runs[-1][2] == r:
                runs[-1][1] = t
            else:
                runs.append([t, t, r])
        parts = [f"T {a}: {r}" if a == b else f"T {a}-{b}: {r}" for a, b, r in runs[:-1]]
        a, _, r = runs[-1]
        parts.append(f"T {a}+: {r}")
        return "; ".join(parts)

    @property
    def tag(self) -> str:
        """What a forward profile's key records of the routes its forwards ran: ``stock`` when every T
        runs torch's linear, else the routes and the kernel versions they were measured among."""
        if self.used == {STOCK}:
            return STOCK
        versions = ", ".join(VERSIONS[r] for r in sorted(self.used))
        return f"{self.describe()} [{versions}]"

    def __repr__(self) -> str:
        return f"LinearRoutes({self.describe()})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": 1,
            "key": dataclasses.asdict(self.key),
            "block_sizes": list(self.block_sizes),
            "routes": list(self.routes),
            "seconds": {r: list(s) for r, s in self.seconds.items()},
            "context": self.context,
            "other_load": self.other_load,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinearRoutes:
        if not isinstance(data, Mapping) or data.get("format") != 1:
            raise ValueError("not a linear-route measurement of format 1")
        try:
            return cls(
                RouteKey(**data["key"]),
                data["block_sizes"],
                data["routes"],
                data["seconds"],
                data["context"],
                other_load=data.get("other_load"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed linear-route measurement: {e}") from None


def choose(
    key: RouteKey,
    block_sizes: tuple[int, ...],
    seconds: Mapping[str, tuple[float, ...]],
    context: int,
    wins: Mapping[str, tuple[float, ...]] | None = None,
) -> LinearRoutes:
    """Per block size the fastest measured route, stock unless another beat it by :data:`MARGIN` and,
    where ``wins`` is given (route -> ``[B]``: the fraction of interleaved repeats in which the route
    was faster than stock, repeat by repeat), in at least :data:`MIN_WINS` of them.

    >>> s = {"stock": (1.0, 2.0, 3.0), "small-batch": (1.2, 1.5, 2.95)}
    >>> choose(RouteKey(), (1, 2, 4), s, 0).routes
    ('stock', 'small-batch', 'stock')
    >>> choose(RouteKey(), (1, 2, 4), s, 0, wins={"small-batch": (0.0, 0.5, 1.0)}).routes  # 2 of 4: noise
    ('stock', 'stock', 'stock')
    """

    def cost(r: str, j: int) -> float:
        if r not in seconds or not math.isfinite(seconds[r][j]):
            return math.inf
        if r != STOCK and wins is not None and wins.get(r, (0.0,) * len(block_sizes))[j] < MIN_WINS:
            return math.inf  # its median may be luck: it did not win repeat after repeat
        return seconds[r][j]

    routes = []
    for j in range(len(block_sizes)):
        best = min(ROUTES, key=lambda r: cost(r, j))
        routes.append(best if best != STOCK and cost(best, j) <= seconds[STOCK][j] * (1 - MARGIN) else STOCK)
    return LinearRoutes(key, block_sizes, tuple(routes), seconds, context)


def forced_route() -> str:
    """The route ``MTPROBE_LINEAR_ROUTE`` forces, or ``""`` (``auto`` or unset: measure)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return ""
    if value not in ROUTES:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r} is not a linear route; use one of auto (measure, the default), "
            + ", ".join(ROUTES)
        )
    return value


def routable_linears(model: nn.Module) -> list[nn.Linear]:
    """The modules of ``model`` a route would swap: exactly ``nn.Linear`` (subclasses, such as quantized
    linears, compute something else), float32 weights on the CPU, contiguous, and no ``forward`` of
    their own already (accelerate's hooks, another patch)."""
    found = []
    for m in model.modules():
        if type(m) is not nn.Linear or "forward" in vars(m) or hasattr(m, "_hf_hook"):
            continue
        w, b = m.weight, m.bias
        if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
            continue
        if b is not None and (b.dtype != torch.float32 or b.device.type != "cpu"):
            continue
        found.append(m)
    return found


def unavailable(route: str) -> str:
    """Why ``route`` cannot run on this machine, or ``""`` where it can."""
    if route == PACKED and not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    if route == SMALL_BATCH and not small_batch_linear.enabled():
        if not small_batch_linear.simd():
            return "this CPU lacks AVX2/FMA, which the op's kernel needs"
        return f"{small_batch_linear.ENV}=0 in the environment turns it off"
    return ""


def weight_bytes(linears: Iterable[nn.Linear]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in linears)


def _packed_weight(m: nn.Linear) -> torch.Tensor:
    """``m``'s weight packed for oneDNN, packed again if the weight was replaced or changed in place."""
    w = m.weight
    stamp = (w.data_ptr(), w._version)
    got = _PACKED.get(m)
    if got is None or got[0] != stamp:
        with torch.no_grad():
            got = (stamp, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1))
        _PACKED[m] = got
    return got[1]


def drop_packed(model: nn.Module) -> None:
    """Free the packed copies of ``model``'s weights (made while measuring, kept only where chosen)."""
    for m in model.modules():
        _PACKED.pop(m, None)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through oneDNN on the packed weight; what it is not for goes to ``F.linear``."""
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))  # no backward
    ):
        return F.linear(x, self.weight, self.bias)
    packed = _packed_weight(
        self
    )  # packed again if the weight changed since (0.2 ms a forward for 211 layers)
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, self.bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


_FORWARDS = {PACKED: _packed_forward, SMALL_BATCH: small_batch_linear.forward}


class Router:
    """Runs ``model``'s routable linears through a route for the length of one forward.

    The routes' forwards are bound once (0.03 ms a forward for SmolLM2's 211 linears, against 1.1-1.4
    ms when binding and going through ``nn.Module.__setattr__`` each time; 2-core CPU); the packed
    route's weights are packed here, once per weight. ``routes``: those to prepare (stock needs nothing).
    """

    def __init__(self, model: nn.Module, routes: Iterable[str]) -> None:
        self.linears = routable_linears(model)
        self._bound: dict[str, tuple[tuple[dict, types.MethodType], ...]] = {}
        for route in sorted(set(routes) - {STOCK}):
            if unavailable(route):
                raise ValueError(f"the {route!r} linear route cannot run here: {unavailable(route)}")
            if route == PACKED:
                for m in self.linears:
                    _packed_weight(m)
            self._bound[route] = tuple((vars(m), types.MethodType(_FORWARDS[route], m)) for m in self.linears)

    def __bool__(self) -> bool:
        return bool(self._bound) and bool(self.linears)

    @contextlib.contextmanager
    def routed(self, route: str) -> Iterator[None]:
        """While open, every linear runs ``route``; on exit, its class's ``forward`` again (the instance
        attribute removed, whatever happened inside)."""
        bound = self._bound.get(route, ()) if route != STOCK else ()
        if route != STOCK and route not in self._bound:
            raise ValueError(f"the {route!r} route was not prepared; prepared: {sorted(self._bound)}")
        # The instance dictionary directly: what nn.Module.__setattr__ ends up doing for a method, minus
        # its checks for parameters, buffers and submodules.
        for attrs, forward in bound:
            attrs["forward"] = forward
        try:
            yield
        finally:
            for attrs, _ in bound:
                attrs.pop("forward", None)
