"""benchmarks/bench_linear_routes.py: its timing loop and its report, on synthetic timings (nothing is
timed for real here, and no speed is asserted)."""

from __future__ import annotations

import pytest
import torch

from conftest import load_benchmark, tiny_llama
from mtprobe.cpu import linear_routes, small_batch_linear
from mtprobe.cpu.linear_routes import LinearRoutes, RouteKey, Router


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_linear_routes")


def _active_route(linear: torch.nn.Linear) -> str:
    """The route ``linear`` runs now: its instance ``forward``, bound by a Router, or its class's."""
    bound = vars(linear).get("forward")
    if bound is None:
        return "stock"
    return {small_batch_linear.forward: "small-batch", linear_routes._packed_forward: "packed"}[
        bound.__func__
    ]


def test_time_routes_interleaves_every_route_and_takes_medians_after_a_warm_up(bench):
    # A fake clock advanced by the forward itself, by a cost that depends on the route really switched on
    # around it: the medians are the costs of the timed rounds, the warm-up round (cost 100) is dropped,
    # each round times every T on every route in turn, and every linear is back on stock afterwards.
    routes, skipped = bench.runnable_routes()
    assert routes[0] == "stock" and set(routes) | set(skipped) == set(linear_routes.ROUTES)
    model = tiny_llama()
    router = Router(model, routes)
    probe = router.linears[0]
    now, calls = [0.0], []
    noise = {0: 100.0, 1: 0.0, 2: 5.0, 3: 0.0}  # per round: the warm-up, then one noisy timed round

    def cost(route: str, t: int) -> float:
        return (1 + linear_routes.ROUTES.index(route)) * t

    def forward(t: int) -> None:
        route = _active_route(probe)
        assert all(_active_route(m) == route for m in router.linears)
        rnd = len(calls) // (2 * len(routes))
        calls.append((rnd, t, route))
        now[0] += cost(route, t) + noise[rnd]

    got = bench.time_routes(forward, router, routes, [1, 3], repeats=3, clock=lambda: now[0])
    assert got == {(t, r): pytest.approx(cost(r, t)) for t in (1, 3) for r in routes}
    assert calls == [(rnd, t, r) for rnd in range(4) for t in (1, 3) for r in routes]
    assert all(_active_route(m) == "stock" for m in router.linears)


def test_the_report_gives_each_route_over_stocks_t1_and_flags_where_the_choice_lost(bench):
    # ms[context, T, route]: small-batch chosen at T 2-4 wins at T 2 and loses at T 4 (+20 %); T 24 is
    # past the choice's last block size, so stock, and outside the target (T in 2-20).
    ms = {}
    for t, stock, sb in [(1, 1.0, 1.5), (2, 2.0, 1.0), (4, 2.5, 3.0), (24, 8.0, 9.0)]:
        ms[64, t, "stock"], ms[64, t, "small-batch"] = stock, sb
    chosen = LinearRoutes(
        RouteKey(),
        (1, 2, 4),
        ("stock", "small-batch", "small-batch"),
        {"stock": (0.001, 0.002, 0.0025), "small-batch": (0.0015, 0.001, 0.002)},
        context=256,
    )
    assert bench.target_misses(ms, chosen, [64], [1, 2, 4, 24]) == (
        2,
        ["context 64, T 4: small-batch +20.0%"],
    )
    # Stock, not chosen at T 4, was faster there by more than the chooser's 3 % margin.
    gains = bench.missed_gains(ms, chosen, [64], [1, 2, 4, 24], ["stock", "small-batch"])
    assert gains == ["context 64, T 4: stock -16.7% vs small-batch"]
    assert bench.verdict({"stock": 2.0, "small-batch": 1.0}, "small-batch") == "yes (-50.0% vs stock)"
    assert bench.verdict({"stock": 2.0}, "stock") == "yes (stock)"
    lines = bench.report_lines(
        "tiny",
        ms,
        chosen,
        contexts=[64],
        sizes=[1, 2, 4, 24],
        routes=["stock", "small-batch"],
        skipped={"packed": "no oneDNN"},
        repeats=7,
        choose_s=12.0,
        routable=14,
        loads=("0.10 0.20 0.30", "0.40 0.50 0.60"),
    )
    text = "\n".join(lines)
    assert "missed at 1 of 2 (context, T) timed: context 64, T 4: small-batch +20.0%" in text
    assert "(T in 2-20): context 64, T 4: stock -16.7% vs small-batch" in text
    assert "`packed` not timed: no oneDNN" in text and "0.10 0.20 0.30 -> 0.40 0.50 0.60" in text
    assert "chosen (`choose_linear_routes(model, refresh=True, cache=False)`, 12.0 s, " in text
    assert chosen.describe() in text
    # Each route's t(T) over stock's t(1), not its own: small-batch's t(2) = 1.0 ms is 1.00, not 0.67.
    assert "| 2 | 2.00 | **1.00** | 2.00 | 1.00 | small-batch | yes (-50.0% vs stock) |" in lines
    assert "| 4 | **2.50** | 3.00 | 2.50 | 3.00 | small-batch | **no** (+20.0% vs stock) |" in lines
    assert "| 24 | **8.00** | 9.00 | 8.00 | 9.00 | stock | yes (stock) |" in lines
    # What the chooser itself measured, in ms, at its own context.
    assert "## What `choose_linear_routes` measured (context 256; its own medians)" in lines
    assert "| 4 | 2.50 | 2.00 | small-batch |" in lines


def test_a_met_target_and_a_forced_route_read_as_such(bench):
    ms = {(64, t, r): float(t) for t in (1, 2) for r in ("stock", "packed")}
    forced = LinearRoutes.only("packed", RouteKey())
    text = "\n".join(
        bench.report_lines(
            "tiny",
            ms,
            forced,
            contexts=[64],
            sizes=[1, 2],
            routes=["stock", "packed"],
            skipped={},
            repeats=1,
            choose_s=0.0,
            routable=3,
            loads=("n/a", "n/a"),
        )
    )
    assert "met at all 1 (context, T) timed" in text  # a tie is no loss
    assert "faster than the chosen route by more than 3% in this run (T in 2-20): none" in text
    assert "every T: packed (forced by MTPROBE_LINEAR_ROUTE)" in text
    assert "What `choose_linear_routes` measured" not in text  # nothing was measured


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-sizes", "2", "4"], "--block-sizes must ascend strictly from 1"),
        (["--block-sizes", "1", "4", "4"], "--block-sizes must ascend strictly from 1"),
        (["--repeats", "0"], "--repeats >= 1"),
        (["--contexts", "0", "64"], "--contexts must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(
    bench, tmp_path, capsys, monkeypatch, argv, message
):
    monkeypatch.setattr(bench.models, "load", lambda *a, **k: pytest.fail("loaded despite bad arguments"))
    with pytest.raises(SystemExit):
        bench.main([*argv, "--out", str(tmp_path / "r.md")])
    assert message in capsys.readouterr().err
