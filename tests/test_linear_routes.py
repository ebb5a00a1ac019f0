"""mtprobe.cpu.linear_routes and its choice in mtprobe.target_model.profile: which linears a route swaps, the route of
each block size, the measurement and its caches, the adapter taking a decode step's route, and greedy
output unchanged under every route.

Only tiny models: nothing here times anything for a verdict (the measured choice runs one round of
forwards and is checked for its shape and caching, not for which route won).
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mtprobe
from conftest import QuietMachine, tiny_llama
from mtprobe.cpu import linear_routes, machine, small_batch_linear
from mtprobe.cpu.linear_routes import (
    BLOCK_SIZES,
    ENV,
    PACKED,
    ROUTES,
    SMALL_BATCH,
    STOCK,
    LinearRoutes,
    RouteKey,
    Router,
    choose,
    drop_packed,
    forced_route,
    routable_linears,
)
from mtprobe.target_model import native_forward, profile
from mtprobe.target_model.adapter import HFAdapter
from mtprobe.target_model.profile import ForwardProfile, ProfileKey, chain_mask, choose_linear_routes

requires_simd = pytest.mark.skipif(
    not small_batch_linear.simd(), reason="this CPU has no AVX2/FMA: the small-batch route cannot run"
)
requires_onednn = pytest.mark.skipif(
    bool(linear_routes.unavailable(PACKED)), reason="this torch build has no oneDNN: no packed route"
)
# Every route that runs on this machine (stock always does).
RUNNABLE = [r for r in ROUTES if not linear_routes.unavailable(r)]
FORCED = {r: f"every T: {r} (forced by {ENV})" for r in ROUTES}


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    """No memoized choice, forced route or cached measurement leaks into or out of a test."""
    monkeypatch.setattr(profile, "_ROUTES_SEEN", {})
    monkeypatch.setattr(profile, "OtherLoad", QuietMachine)  # not the other test worker's load
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(small_batch_linear.ENV, raising=False)
    monkeypatch.setenv("MTPROBE_CACHE", str(tmp_path / "cache"))


def _forward_is(m: nn.Module):
    """The function an ``nn.Linear`` runs as its forward now: its instance's, or None (the class's)."""
    own = vars(m).get("forward")
    return None if own is None else own.__func__


_ROUTE_FORWARD = {STOCK: None, PACKED: linear_routes._packed_forward, SMALL_BATCH: small_batch_linear.forward}


# --- which linears are routable ---------------------------------------------------------------------


class _OwnLinear(nn.Linear):
    """A subclass (as quantized linears are): it may compute something else, so it is never swapped."""


def test_routable_linears_picks_exactly_plain_float32_cpu_linears():
    model = nn.Sequential(
        nn.Linear(4, 4),  # 0: routable
        nn.Linear(4, 4).double(),
        _OwnLinear(4, 4),
        nn.Linear(4, 4),  # 3: given a forward of its own below
        nn.Linear(4, 4, bias=False),  # 4: routable
        nn.Linear(4, 4).bfloat16(),
        nn.Linear(4, 4),  # 6: an accelerate hook below
        nn.Linear(4, 4),  # 7: a non-contiguous weight below
        nn.Linear(4, 4),  # 8: a float64 bias below
        nn.Linear(4, 4, device="meta"),  # not on the CPU
    )
    model[3].forward = lambda x: x  # a forward of its own (accelerate's hooks set one)
    model[6]._hf_hook = object()
    model[7].weight = nn.Parameter(torch.randn(4, 4).t())
    model[8].bias = nn.Parameter(torch.randn(4, dtype=torch.float64))
    assert routable_linears(model) == [model[0], model[4]]
    # Not gated on the small-batch op any more: turned off, the linears are still there for other routes.
    assert routable_linears(tiny_llama()) != []


def test_a_tiny_llama_has_its_projections_and_head_routable(monkeypatch):
    model = tiny_llama()
    linears = routable_linears(model)
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    monkeypatch.setenv(small_batch_linear.ENV, "0")
    assert routable_linears(model) == linears
    assert routable_linears(tiny_llama().to(torch.bfloat16)) == []


# --- LinearRoutes -----------------------------------------------------------------------------------


def test_route_at_between_and_past_the_measured_sizes():
    r = LinearRoutes(
        RouteKey(),
        (1, 2, 4, 8, 16),
        (STOCK, SMALL_BATCH, SMALL_BATCH, PACKED, PACKED),
    )
    want = {
        1: STOCK,
        2: SMALL_BATCH,  # measured
        3: SMALL_BATCH,  # between two small-batch neighbours
        4: SMALL_BATCH,
        5: STOCK,  # between small-batch and packed: neither neighbour's choice holds, so stock
        7: STOCK,
        8: PACKED,
        12: PACKED,
        16: PACKED,
        17: STOCK,  # past the last measured size
        1000: STOCK,
    }
    assert {t: r.route(t) for t in want} == want
    assert r.used == {STOCK, SMALL_BATCH, PACKED}
    assert r.describe() == "T 1: stock; T 2-4: small-batch; T 5-7: stock; T 8-16: packed; T 17+: stock"
    assert repr(r) == f"LinearRoutes({r.describe()})"
    # A route other than stock at the last measured size still ends there.
    tail = LinearRoutes(RouteKey(), (1, 2), (STOCK, PACKED))
    assert [tail.route(t) for t in (1, 2, 3)] == [STOCK, PACKED, STOCK]
    assert tail.describe() == "T 1: stock; T 2: packed; T 3+: stock"


def test_forced_routes_take_every_block_size():
    r = LinearRoutes.only(PACKED, RouteKey())
    assert r.forced == PACKED and [r.route(t) for t in (1, 2, 20, 21, 4096)] == [PACKED] * 5
    assert r.describe() == FORCED[PACKED] and r.used == {PACKED}
    stock = LinearRoutes.only(STOCK, RouteKey())
    assert stock.route(7) == STOCK and stock.tag == STOCK


def test_the_tag_is_stock_only_when_every_block_size_is(monkeypatch):
    assert LinearRoutes.all_stock(RouteKey()).tag == STOCK
    assert LinearRoutes(RouteKey(), (1, 2, 4), (STOCK,) * 3).tag == STOCK
    mixed = LinearRoutes(RouteKey(), (1, 2, 4), (STOCK, SMALL_BATCH, PACKED))
    tag = mixed.tag
    assert tag.startswith(mixed.describe() + " [") and small_batch_linear.KERNEL in tag and "oneDNN" in tag
    # A new kernel version is a new tag: profiles measured with the old one are refused.
    monkeypatch.setitem(linear_routes.VERSIONS, SMALL_BATCH, "small-batch v99")
    assert mixed.tag != tag and "small-batch v99" in mixed.tag


@pytest.mark.parametrize(
    "args,message",
    [
        (((2, 4), (STOCK, STOCK)), "block_sizes must ascend strictly and start at 1"),
        (((1, 4, 4), (STOCK,) * 3), "block_sizes must ascend strictly and start at 1"),
        (((), ()), "block_sizes must ascend strictly and start at 1"),
        (((1, 2, 4), (STOCK, STOCK)), "2 routes for 3 block sizes"),
        (
            ((1, 2), (STOCK, "gemm")),
            "'gemm' is not a linear route; the routes are stock, packed, small-batch",
        ),
        (((1, 2), (STOCK, STOCK), {"stock": (1.0,)}), r"seconds\['stock'\] has 1 entries for 2 block sizes"),
        (((1,), (STOCK,), {"fast": (1.0,)}), "'fast' is not a linear route"),
        (((1,), (STOCK,), {}, 0, "turbo"), "'turbo' is not a linear route"),
        (
            ((1,), (STOCK,), {}, 0, "", 2.0),
            r"other_load must be None or the share of the CPU .* in \[0, 1\]; got 2.0",
        ),
    ],
    ids=[
        "from_2",
        "repeated",
        "empty",
        "lengths",
        "route_name",
        "seconds_length",
        "seconds_name",
        "forced",
        "other_load",
    ],
)
def test_linear_routes_refuse_bad_values(args, message):
    with pytest.raises(ValueError, match=message):
        LinearRoutes(RouteKey(), *args)


def test_to_dict_and_from_dict_round_trip_through_json():
    key = RouteKey("LlamaForCausalLM:0", "cpu (X, 2 cores)", "AVX2", 2, "float32", "2.0", ("stock", "packed"))
    r = LinearRoutes(
        key, (1, 2, 4), (STOCK, PACKED, STOCK), {STOCK: (1.0, 2.0, 3.0), PACKED: (1.1, 1.5, 3.5)}, 64
    )
    back = LinearRoutes.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.key.candidates == ("stock", "packed") and back.route(2) == PACKED
    with pytest.raises(ValueError, match="not a linear-route measurement of format 1"):
        LinearRoutes.from_dict({**r.to_dict(), "format": 2})
    with pytest.raises(ValueError, match="not a linear-route measurement of format 1"):
        LinearRoutes.from_dict([])  # type: ignore[arg-type]
    data = r.to_dict()
    del data["routes"]
    with pytest.raises(ValueError, match="malformed linear-route measurement"):
        LinearRoutes.from_dict(data)
    with pytest.raises(ValueError, match="malformed linear-route measurement"):
        LinearRoutes.from_dict({**r.to_dict(), "key": {"gpu": "H100"}})


def test_choose_takes_another_route_only_past_the_margin():
    assert linear_routes.MARGIN == 0.03
    nan = math.nan
    sizes = (1, 2, 3, 4, 6, 8)
    seconds = {
        STOCK: (1.0, 1.0, 1.0, 1.0, 1.0, 1.0),
        PACKED: (0.98, 0.95, 1.0, nan, 0.90, 2.0),
        SMALL_BATCH: (0.99, 0.97, 1.0, 0.90, 0.90, math.inf),
    }
    r = choose(RouteKey(), sizes, seconds, 32)
    # 2 % faster: stock; 5 % faster: taken; a tie: stock; NaN ignored; a tie of two others: the first in
    # ROUTES; neither finite and faster: stock.
    assert r.routes == (STOCK, PACKED, STOCK, SMALL_BATCH, PACKED, STOCK)
    assert r.seconds[PACKED][1] == 0.95 and math.isnan(r.seconds[PACKED][3]) and r.context == 32
    # A route not measured is never chosen.
    only_packed = choose(RouteKey(), (1, 2), {STOCK: (1.0, 1.0), PACKED: (0.5, 2.0)}, 0)
    assert only_packed.routes == (PACKED, STOCK)
    assert choose(RouteKey(), (1,), {STOCK: (1.0,)}, 0).tag == STOCK


# --- MTPROBE_LINEAR_ROUTE ---------------------------------------------------------------------------


def test_forced_route_reads_the_environment(monkeypatch):
    assert forced_route() == ""  # unset: measure
    for value, want in [
        ("auto", ""),
        ("", ""),
        (" AUTO ", ""),
        *((r, r) for r in ROUTES),
        ("Small-Batch", SMALL_BATCH),
    ]:
        monkeypatch.setenv(ENV, value)
        assert forced_route() == want, value
    monkeypatch.setenv(ENV, "gemm")
    with pytest.raises(ValueError, match=re.escape(f"{ENV}='gemm' is not a linear route")) as e:
        forced_route()
    assert "auto (measure, the default), stock, packed, small-batch" in str(e.value)


# --- the Router -------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", RUNNABLE)
def test_the_router_swaps_forward_and_puts_it_back_even_on_error(route):
    model = tiny_llama()
    router = Router(model, [route])
    linears = routable_linears(model)
    assert router.linears == linears and bool(router) == (route != STOCK)
    with pytest.raises(RuntimeError, match="inside"):
        with router.routed(route):
            assert all(_forward_is(m) is _ROUTE_FORWARD[route] for m in linears)
            assert all(vars(m)["forward"].__self__ is m for m in linears if route != STOCK)
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())
    # Bound once: every later forward reuses the same bound methods.
    if route != STOCK:
        with router.routed(route):
            first = [vars(m)["forward"] for m in linears]
        with router.routed(route):
            assert all(vars(m)["forward"] is f for m, f in zip(linears, first, strict=True))
    assert not any("forward" in vars(m) for m in model.modules())


def test_the_router_refuses_a_route_it_cannot_run_or_did_not_prepare(monkeypatch):
    model = tiny_llama()
    router = Router(model, [STOCK])
    assert not router  # nothing prepared: the adapter keeps no router
    with router.routed(STOCK):  # stock needs nothing
        assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match=r"the 'packed' route was not prepared; prepared: \[\]"):
        with router.routed(PACKED):
            pass
    monkeypatch.setenv(small_batch_linear.ENV, "0")
    with pytest.raises(
        ValueError,
        match="the 'small-batch' linear route cannot run here: (MTPROBE_SMALL_BATCH_LINEAR=0|this CPU)",
    ):
        Router(model, [SMALL_BATCH])
    assert not any("forward" in vars(m) or linear_routes.has_packed(m) for m in model.modules())


@pytest.mark.parametrize("route", RUNNABLE)
@pytest.mark.parametrize("lead", [(3,), (1, 5), (1, 1)], ids=["3", "1x5", "1x1"])
def test_each_route_computes_torch_linear(route, lead):
    layer = nn.Linear(96, 40)
    model = nn.Sequential(layer)
    router = Router(model, [route])
    x = torch.randn(*lead, 96, generator=torch.Generator().manual_seed(1))  # [..., in]
    want = F.linear(x, layer.weight, layer.bias)
    with torch.no_grad(), router.routed(route):
        got = layer(x)
    assert got.shape == (*lead, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if route == PACKED:  # exactly oneDNN's own linear on the packed weight
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)
        onednn = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, 96), packed, layer.bias, "none", [], "")
        assert torch.equal(got.reshape(-1, 40), onednn)
    elif route == SMALL_BATCH:
        assert torch.equal(got, torch.ops.mtprobe.small_batch_linear(x, layer.weight, layer.bias))


@requires_onednn
def test_a_new_router_packs_a_changed_weight_again():
    # What each mtprobe.generate call does (a new adapter, a new Router): weights changed in place or
    # replaced since the last one are packed again.
    layer = nn.Linear(32, 16)
    model = nn.Sequential(layer)
    x = torch.randn(4, 32)  # [T, in]
    Router(model, [PACKED])
    with torch.no_grad():
        layer.weight.add_(1)
    router = Router(model, [PACKED])
    with torch.no_grad(), router.routed(PACKED):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight = nn.Parameter(torch.randn(16, 32))
    router = Router(model, [PACKED])
    with torch.no_grad(), router.routed(PACKED):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@requires_onednn
def test_the_packed_route_follows_a_weight_changed_in_place_under_the_same_router():
    layer = nn.Linear(32, 16)
    router = Router(nn.Sequential(layer), [PACKED])
    x = torch.randn(4, 32)  # [T, in]
    with torch.no_grad():
        layer.weight.add_(1)
        with router.routed(PACKED):
            got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", [r for r in RUNNABLE if r != STOCK])
def test_routes_fall_back_to_torch_linear_where_they_do_not_apply(route):
    layer = nn.Linear(16, 8)
    router = Router(nn.Sequential(layer), [route])
    with torch.no_grad(), router.routed(route):
        doubles = torch.randn(2, 16, dtype=torch.float64)  # not float32: torch's linear (and its error)
        with pytest.raises(RuntimeError, match="dtype"):
            layer(doubles)
    # With autograd recording, neither kernel (no backward) is used: gradients reach input and weight.
    x = torch.randn(2, 16, requires_grad=True)
    with router.routed(route):
        layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer.bias.grad is not None
    layer.zero_grad()
    with router.routed(route):  # an input without grad (a frozen embedding's): the weight's still flow
        layer(torch.randn(2, 16)).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None


@requires_onednn
def test_drop_packed_frees_the_packed_copies():
    model = tiny_llama()
    Router(model, [PACKED])
    linears = routable_linears(model)
    assert all(linear_routes.has_packed(m) for m in linears)
    # A model with packed copies still deep-copies (oneDNN's opaque tensors cannot be copied: a LoRA head
    # copies decoder layers), and the copy holds none.
    twin = copy.deepcopy(model.model.layers[0])
    assert not any(linear_routes.has_packed(m) for m in twin.modules())
    drop_packed(model)
    assert not any(linear_routes.has_packed(m) for m in model.modules())
    drop_packed(model)  # nothing left to drop: no error


# --- choose_linear_routes ---------------------------------------------------------------------------


def _no_measuring(*args, **kwargs):
    raise AssertionError("measured where the routes were to come from a cache or a rule")


def test_small_models_other_dtypes_and_gpus_stay_on_torch_linear_without_measuring(monkeypatch):
    monkeypatch.setattr(profile, "_measure_routes", _no_measuring)
    model = tiny_llama()
    assert linear_routes.weight_bytes(routable_linears(model)) < linear_routes.MIN_WEIGHT_BYTES
    for m in (model, tiny_llama().to(torch.bfloat16), tiny_llama().to("meta")):
        r = choose_linear_routes(m)
        assert r.used == {STOCK} and r.tag == STOCK and not r.forced and r.route(4) == STOCK
    # Forcing is a CPU matter: a model off the CPU (here on the meta device, as on a GPU) keeps torch's.
    monkeypatch.setenv(ENV, PACKED)
    assert choose_linear_routes(tiny_llama().to("meta")).used == {STOCK}


@pytest.mark.parametrize("route", RUNNABLE)
def test_a_forced_route_is_taken_without_measuring(route, monkeypatch):
    monkeypatch.setattr(profile, "_measure_routes", _no_measuring)
    monkeypatch.setenv(ENV, route)
    model = tiny_llama()
    r = choose_linear_routes(model)
    assert r == LinearRoutes.only(route, RouteKey.of(model, (route,)))
    assert r.key.isa == machine.cpu_isa() and r.key.dtype == "float32" and r.describe() == FORCED[route]


def test_a_forced_route_that_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, SMALL_BATCH)
    monkeypatch.setenv(small_batch_linear.ENV, "0")
    with pytest.raises(
        ValueError, match=f"{ENV}=small-batch: the 'small-batch' linear route cannot run here"
    ) as e:
        choose_linear_routes(tiny_llama())
    why = "MTPROBE_SMALL_BATCH_LINEAR=0" if small_batch_linear.simd() else "lacks AVX2/FMA"
    assert why in str(e.value) and "name a route that runs here: stock" in str(e.value)
    monkeypatch.setenv(ENV, PACKED)
    with pytest.raises(ValueError, match="the model has no float32 nn.Linear on the CPU to route"):
        choose_linear_routes(tiny_llama().to(torch.bfloat16))
    monkeypatch.setenv(ENV, STOCK)  # stock runs anywhere
    assert choose_linear_routes(tiny_llama().to(torch.bfloat16)).forced == STOCK
    monkeypatch.setenv(ENV, "gemm")
    with pytest.raises(ValueError, match="is not a linear route"):
        choose_linear_routes(tiny_llama())
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        choose_linear_routes(tiny_llama(), repeats=0)


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="only torch's linear runs here: nothing to measure")
def test_the_measured_choice_is_memoized_cached_on_disk_and_remeasured_when_stale(monkeypatch, tmp_path):
    cache = tmp_path / "cache"  # the fixture's MTPROBE_CACHE
    monkeypatch.setattr(linear_routes, "MIN_WEIGHT_BYTES", 0)
    measured = []
    real = profile._measure_routes

    def spy(*args, **kwargs):
        measured.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(profile, "_measure_routes", spy)
    model = tiny_llama()
    first = choose_linear_routes(model, repeats=1, warmup=0)
    key = RouteKey.of(model, RUNNABLE)
    assert measured == [key] and first.key == key and not first.forced
    assert first.block_sizes == BLOCK_SIZES and len(first.routes) == len(BLOCK_SIZES)
    assert set(first.seconds) == set(RUNNABLE)
    assert all(len(s) == len(BLOCK_SIZES) and all(x > 0 for x in s) for s in first.seconds.values())
    assert (
        first.context == 256 - BLOCK_SIZES[-1]
    )  # the model's 256 positions leave room for the largest block
    assert first.routes == choose(key, BLOCK_SIZES, first.seconds, first.context).routes
    # The packed copies stay only where the packed route was chosen.
    kept = any(linear_routes.has_packed(m) for m in model.modules())
    assert kept == (PACKED in first.used)
    assert not any("forward" in vars(m) for m in model.modules())

    # Memoized: the same object, nothing measured.
    monkeypatch.setattr(profile, "_measure_routes", _no_measuring)
    assert choose_linear_routes(model, repeats=1, warmup=0) is first
    assert choose_linear_routes(tiny_llama(), repeats=1, warmup=0) is first  # same architecture, same machine
    # On disk: loaded after the memo is cleared.
    files = list((cache / "linear_routes").glob("*.json"))
    assert len(files) == 1
    profile._ROUTES_SEEN.clear()
    loaded = choose_linear_routes(model)
    assert loaded == first and loaded is not first

    # A stale file (another key at this path) or a corrupt one is measured again and overwritten. From
    # here on only whether it measures matters: a stand-in answers at once with the first numbers.
    def stand_in(model, key, candidates, repeats, warmup):
        measured.append(key)
        return choose(key, first.block_sizes, first.seconds, first.context)

    monkeypatch.setattr(profile, "_measure_routes", stand_in)
    data = json.loads(files[0].read_text())
    data["key"]["threads"] += 1
    for text in (json.dumps(data), "{not json", json.dumps({"format": 1, "key": {}})):
        files[0].write_text(text)
        profile._ROUTES_SEEN.clear()
        measured.clear()
        again = choose_linear_routes(model, repeats=1, warmup=0)
        assert measured == [key] and again.key == key, text
        assert LinearRoutes.from_dict(json.loads(files[0].read_text())).key == key
    # refresh measures even what is memoized; cache=False writes nothing.
    measured.clear()
    choose_linear_routes(model, repeats=1, warmup=0, refresh=True)
    assert measured == [key]
    files[0].unlink()
    profile._ROUTES_SEEN.clear()
    choose_linear_routes(model, repeats=1, warmup=0, cache=False)
    assert measured == [key, key] and not files[0].exists()


def test_routes_timed_on_a_busy_machine_are_timed_again_once_it_is_quiet(monkeypatch, tmp_path, caplog):
    from conftest import BusyMachine, QuietMachine

    cache = tmp_path / "cache"  # the fixture's MTPROBE_CACHE
    monkeypatch.setattr(linear_routes, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(profile, "OtherLoad", BusyMachine)
    model = tiny_llama()
    with caplog.at_level("WARNING", logger="mtprobe"):
        first = choose_linear_routes(model, repeats=1, warmup=0)
    assert "other processes used 60% of the CPU while the CPU linear routes were timed" in caplog.text
    (path,) = cache.glob("linear_routes/*.json")
    assert first.other_load == 0.6 and LinearRoutes.from_dict(json.loads(path.read_text())) == first
    # A later process on a machine still busy loads them; on a quiet one it times them again.
    profile._ROUTES_SEEN.clear()
    monkeypatch.setattr(profile, "_measure_routes", _no_measuring)
    assert choose_linear_routes(model, repeats=1, warmup=0) == first
    profile._ROUTES_SEEN.clear()
    measured = []

    def stand_in(model, key, candidates, repeats, warmup):
        measured.append(key)
        return choose(key, first.block_sizes, first.seconds, first.context)

    monkeypatch.setattr(profile, "_measure_routes", stand_in)
    monkeypatch.setattr(profile, "OtherLoad", QuietMachine)
    again = choose_linear_routes(model, repeats=1, warmup=0)
    assert len(measured) == 1 and again.other_load == 0.0
    assert LinearRoutes.from_dict(json.loads(path.read_text())).other_load == 0.0


# --- the adapter ------------------------------------------------------------------------------------

_MIXED = (STOCK, SMALL_BATCH, PACKED, PACKED)  # at T = 1, 2, 4, 8


def _adapter_cases():
    mixed = LinearRoutes(RouteKey(), (1, 2, 4, 8), _MIXED)
    cases = []
    if len(RUNNABLE) == 3:
        cases += [(mixed, t) for t in (1, 2, 3, 4, 6, 8, 9)]
    cases += [(LinearRoutes.only(r, RouteKey()), t) for r in RUNNABLE for t in (1, 5)]
    return cases


@pytest.mark.parametrize(
    "routes,t", _adapter_cases(), ids=[f"{r.forced or 'mixed'}-T{t}" for r, t in _adapter_cases()]
)
def test_the_adapter_runs_a_decode_steps_route_and_not_the_prefills(routes, t, monkeypatch):
    model = tiny_llama()
    entered = []
    real = Router.routed

    def spy(self, route):
        entered.append(route)
        return real(self, route)

    monkeypatch.setattr(Router, "routed", spy)
    seen = []  # (prefix_len, the forward each linear ran)
    linears = routable_linears(model)
    for m in linears:
        m.register_forward_pre_hook(lambda m, args: seen[-1][1].append(_forward_is(m)))
    routed = HFAdapter(model, 64, linear_routes=routes)
    stock = HFAdapter(model, 64)
    assert stock._router is None and (routed._router is None) == (routes.used == {STOCK})
    ids = torch.randint(0, 96, (12 + t,), generator=torch.Generator().manual_seed(t))  # [P + T]
    logits = []
    with torch.inference_mode():
        for adapter in (routed, stock):
            seen.append((0, []))
            adapter.forward(ids[:12], None, torch.arange(12)[None], None, 0, False)
            seen.append((12, []))
            mask = chain_mask(model, t, 12, torch.device("cpu"))
            out, _ = adapter.forward(ids[12:], None, torch.arange(12, 12 + t)[None], mask, 12, False)
            logits.append(out)
    want = routes.route(t)
    assert entered == ([want] if routed._router is not None else [])  # once, by the routed decode step
    expected = [
        [None] * len(linears),  # the routed adapter's prefill: torch's linear
        [_ROUTE_FORWARD[want]] * len(linears),  # its decode step: the route of T
        [None] * len(linears),  # the stock adapter: torch's linear throughout
        [None] * len(linears),
    ]
    assert [fs for _, fs in seen] == expected
    assert not any("forward" in vars(m) for m in model.modules())
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


# --- greedy output ----------------------------------------------------------------------------------


_METHODS = {
    "stand": {"method": "stand", "block_complexity": 6},
    "pld": {"method": "pld", "num_tokens": 5},
    "probe": {"method": "probe", "block_complexity": 8},
}
# Every method under every route that runs here; auto (the tiny model: stock, as forced stock) once.
_GREEDY_CASES = [("stand", "auto"), *((m, r) for m in _METHODS for r in RUNNABLE)]


@pytest.mark.parametrize("name,route", _GREEDY_CASES, ids=[f"{m}-{r}" for m, r in _GREEDY_CASES])
def test_greedy_output_is_hf_greedy_under_every_route(name, route, monkeypatch, greedy):
    method = _METHODS[name]
    model = tiny_llama(vocab_size=64)
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 3, 7, 5, 9]])
    expected = greedy(model, ids, 24, pad_token_id=0)[0, ids.shape[1] :]
    entered = []
    real = Router.routed

    def spy(self, r):
        entered.append(r)
        return real(self, r)

    monkeypatch.setattr(Router, "routed", spy)
    monkeypatch.setenv(ENV, route)
    monkeypatch.setenv(native_forward.ENV, "0")  # the routes are HF's forward's: the C++ forward has its own
    out = mtprobe.generate(model, ids, method, max_new_tokens=24)
    assert torch.equal(out.sequences[0, ids.shape[1] :], expected), (method, route)
    assert out.forward_calls < 24  # drafts were verified: some forwards had 2 or more inputs
    # The tiny model stays on torch's linear unless forced; a forced route ran every decode step.
    want = "T 1+: stock" if route == "auto" else FORCED[route]
    assert out.linear_routes == want and out.summary()["linear_routes"] == want
    assert set(entered) == ({route} if route in (PACKED, SMALL_BATCH) else set())
    assert len(entered) == (out.forward_calls - 1 if entered else 0)  # all but the prefill
    assert not any("forward" in vars(m) for m in model.modules())


# --- forward profiles -------------------------------------------------------------------------------


@pytest.mark.parametrize("route", [r for r in RUNNABLE if r != STOCK])
def test_profiles_record_the_routes_and_isa_and_refuse_others(route, monkeypatch):
    model = tiny_llama()
    key = ProfileKey.of(model)
    assert key.linear == STOCK and key.isa == machine.cpu_isa() != ""
    routes = LinearRoutes.only(route, RouteKey())
    assert ProfileKey.of(model, routes).linear == routes.tag != STOCK
    stock = ForwardProfile(key, (1, 2), (0,), ((1.0, 1.7),))
    stock.check(model)
    monkeypatch.setenv(ENV, route)  # the model's forwards now run another route: the profile is refused
    with pytest.raises(ValueError, match=re.escape(f"linear: profile 'stock' vs now '{routes.tag}'")):
        stock.check(model)
    monkeypatch.delenv(ENV)
    # Another instruction set than this CPU's, whichever it has.
    isa = "AVX512" if machine.cpu_isa() != "AVX512" else "AVX2"
    other_isa = ForwardProfile(ProfileKey(**{**key.__dict__, "isa": isa}), (1, 2), (0,), ((1.0, 1.7),))
    with pytest.raises(ValueError, match=re.escape(f"isa: profile '{isa}' vs now '{machine.cpu_isa()}'")):
        other_isa.check(model)
    # A profile saved before the instruction set was recorded is not taken for this CPU's.
    data = stock.to_dict()
    del data["key"]["isa"]
    old = ForwardProfile.from_dict(data)
    assert old.key.isa == ""
    with pytest.raises(ValueError, match="isa: profile '' vs now"):
        old.check(model)


def test_choose_takes_a_route_only_if_it_won_repeat_after_repeat():
    seconds = {"stock": (1.0, 2.0, 2.0), "small-batch": (0.5, 1.0, 1.0), "packed": (0.9, 1.95, 1.2)}
    key = RouteKey()
    # Far faster in the median, but faster than stock in only half the repeats side by side: noise.
    wins = {"small-batch": (0.75, 0.5, 1.0), "packed": (1.0, 1.0, 1.0)}
    got = linear_routes.choose(key, (1, 2, 3), seconds, 0, wins)
    assert got.routes == ("small-batch", "stock", "small-batch")  # at T 2 packed is < 3 % faster
    # A route missing from ``wins`` never won a repeat.
    assert linear_routes.choose(key, (1, 2, 3), seconds, 0, {"packed": (1.0,) * 3}).routes == (
        "packed",
        "stock",
        "packed",
    )
    assert linear_routes.MIN_WINS == 0.75
