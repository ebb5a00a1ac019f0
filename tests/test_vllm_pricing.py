"""The steps' price of mtprobe's vLLM proposer (mtprobe.vllm.pricing): its measured lines, and plans that
maximise a step's expected tokens per second, checked against every plan there is on small batches."""

import itertools
import random

import numpy as np
import pytest

from mtprobe.vllm.pricing import (
    ALL,
    IDLE,
    MIN_TRIES,
    NEW,
    NONE,
    SETUP_STEPS,
    SOME,
    STATES,
    Candidate,
    Line,
    Plane,
    StepPricer,
    outcome_state,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class NoExploring:
    """Stands for the pricer's random source: never below EXPLORE."""

    def random(self) -> float:
        return 1.0


def measured(
    options: int, max_depth: int, a: float, b: float, rates, draft_seconds=0.0, d: float | None = None
) -> StepPricer:
    """A pricer whose step takes a + b·rows + d·drafts seconds exactly (d = b unless given), whose drafts
    cost ``draft_seconds`` each to make, and whose acceptance per (option, state) at every depth is
    ``rates[option][state]`` over many verdicts."""
    d = b if d is None else d
    clock = Clock()
    pricer = StepPricer(options, max_depth, clock, draft_seconds=[draft_seconds] * options)
    pricer.rng = NoExploring()
    for rows, drafts in zip((4, 9, 16, 12, 7, 1) * 10, (0, 9, 30, 4, 21, 0) * 10, strict=True):
        pricer.began(steady=True)
        pricer.ended(rows, drafts)
        clock.now += a + b * rows + d * drafts
    pricer.began(steady=True)
    for o in range(options):
        for s in range(len(STATES)):
            pricer.tried[o, s] = 10_000
            pricer.accepted[o, s] = 10_000 * rates[o][s]
    return pricer


def goodput(pricer: StepPricer, rows, plan) -> float:
    a, r, d = pricer.step.fit()
    cost = [d + line.fit()[1] for line in pricer.own]
    expected, seconds = float(len(rows)), a + r * len(rows)
    for cands, (i, n) in zip(rows, plan, strict=True):
        cand = cands[i]
        expected += float(pricer.acceptance(cand.option, cand.state)[:n].sum())
        seconds += n * cost[cand.option] + (cand.setup / SETUP_STEPS if n else 0.0)  # no request finished yet
    return expected / seconds


def test_a_plane_fits_a_step_of_rows_and_drafts():
    plane = Plane()
    for rows, drafts in zip((1, 4, 12, 12, 3, 8) * 20, (0, 9, 0, 30, 20, 2) * 20, strict=True):
        plane.add(rows, drafts, 0.018 + 0.0006 * rows + 0.0011 * drafts)
    a, r, d = plane.fit()
    assert (a, r, d) == pytest.approx((0.018, 0.0006, 0.0011), rel=0.03)
    # No row ever sent a draft: the draft's cost stays the prior's (a tenth of the fixed cost), the rest fits.
    idle = Plane()
    for rows in (1, 4, 12, 16, 8) * 30:
        idle.add(rows, 0, 0.02 + 0.0005 * rows)
    a, r, d = idle.fit()
    assert idle(10, 0) == pytest.approx(0.025, rel=0.02) and 0.001 < d < 0.003


def test_a_line_fits_what_it_measures():
    line = Line()
    for x in (1, 5, 9, 13, 2, 20) * 20:
        line.add(x, 0.02 + 0.003 * x)
    a, b = line.fit()
    assert a == pytest.approx(0.02, rel=0.02) and b == pytest.approx(0.003, rel=0.02)  # the prior, decayed
    # One observation: the prior line through it, a fixed cost that dominates until about ten tokens.
    first = Line()
    first.add(12, 0.044)
    assert first(12) == pytest.approx(0.044) and first.fit()[1] == pytest.approx(first.fit()[0] / 10)
    # A given slope holds until observations move it; the fit never goes below zero.
    assert Line(slope=0.004).fit() == pytest.approx((0.0, 0.004))
    falling = Line()
    for x in (1, 10) * 30:
        falling.add(x, 0.05 - 0.004 * x)
    a, b = falling.fit()
    assert b == 0.0 and a > 0


def test_outcome_states():
    assert [outcome_state(0, 0), outcome_state(3, 3), outcome_state(3, 1), outcome_state(3, 0)] == [
        IDLE,
        ALL,
        SOME,
        NONE,
    ]


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_the_best_there_is(seed):
    """Against every plan of a few rows and options: none gains more tokens per second than the pricer's."""
    rng = random.Random(seed)
    options, depth = rng.choice([1, 2]), 3
    rates = [[rng.uniform(0.05, 0.99) for _ in STATES] for _ in range(options)]
    a, b = rng.uniform(0.005, 0.03), rng.choice([0.0, 0.0005, 0.002, 0.01])
    pricer = measured(options, depth, a, b, rates, draft_seconds=rng.choice([0.0, 0.001, 0.005]))
    rows = [
        [Candidate(o, rng.randrange(len(STATES)), rng.randint(0, depth)) for o in range(options)]
        for _ in range(rng.randint(1, 4))
    ]
    plan = pricer.plan(rows)
    assert all(n <= cands[i].limit for cands, (i, n) in zip(rows, plan, strict=True))
    choices = [[(i, n) for i, c in enumerate(cands) for n in range(c.limit + 1)] for cands in rows]
    best = max(goodput(pricer, rows, p) for p in itertools.product(*choices))
    assert goodput(pricer, rows, plan) >= best * (1 - 1e-9)


def test_drafts_pay_when_tokens_are_cheap_and_not_when_a_batch_is_bound_by_arithmetic():
    rates = [[0.9] * len(STATES)]
    rows = [[Candidate(0, ALL, 8)] for _ in range(12)]
    # A GPU-like step: its time barely grows with tokens; every row sends its whole chain.
    cheap = measured(1, 8, 0.02, 0.00001, rates)
    assert [n for _, n in cheap.plan(rows)] == [8] * 12
    # Two CPU cores at twelve rows: a token costs a tenth of the step; 90 % chances pay to a depth, 30 % never.
    bound = measured(1, 8, 0.02, 0.002, rates)
    counts = [n for _, n in bound.plan(rows)]
    assert 0 < counts[0] < 8 and len(set(counts)) == 1
    poor = measured(1, 8, 0.02, 0.002, [[0.3] * len(STATES)])
    assert [n for _, n in poor.plan(rows)] == [0] * 12
    # One row alone: the step's fixed cost dominates and the 90 % chain pays whole.
    assert bound.plan(rows[:1]) == [(0, 8)]


def test_an_unmeasured_drafter_is_measured_first_then_priced():
    pricer = measured(2, 4, 0.02, 0.002, [[0.1] * len(STATES), [0.1] * len(STATES)])
    pricer.tried[1] = pricer.accepted[1] = 0  # drafter 1 has never drafted
    # Twelve rows, their prompts' forwards of different lengths: the MIN_TRIES cheapest measure drafter 1 with a
    # first draft each (a prompt's forward too); the rest are priced, and it is dear and likely poor.
    setups = [0.3, 0.05, 0.4, 0.2, 0.01, 0.5, 0.1, 0.6, 0.7, 0.03, 0.8, 0.9]
    rows = [[Candidate(0, NEW, 4), Candidate(1, ALL, 4, explorable=False, setup=t)] for t in setups]
    cheapest = sorted(range(12), key=lambda r: setups[r])[:MIN_TRIES]
    assert pricer.plan(rows) == [(1, 1) if r in cheapest else (0, 0) for r in range(12)]
    # Verdicts that came back count: one lacking, one row measures.
    pricer.tried[1, NEW, 0] = MIN_TRIES - 1
    assert [n for _, n in pricer.plan(rows)] == [1 if r == 4 else 0 for r in range(12)]
    pricer.learn(1, ALL, 4, 0)  # measured now (and poor): priced out
    assert [n for _, n in pricer.plan(rows)] == [0] * 12


def test_exploring_drafts_now_and_then_but_never_a_forward_of_a_prompt():
    pricer = measured(1, 4, 0.02, 0.002, [[0.1] * len(STATES)])
    pricer.rng = random.Random(0)
    rows = [[Candidate(0, NONE, 4)]] * 12
    explored = sum(n for _ in range(256) for _, n in pricer.plan(rows))
    assert 0 < explored < 12 * 256 / 64  # about one row-step in 256 drafts one
    behind = [[Candidate(0, NONE, 4, explorable=False, setup=0.3)]] * 12
    assert sum(n for _ in range(256) for _, n in pricer.plan(behind)) == 0


def test_the_first_step_sends_whole_chains_and_steps_with_prompts_are_not_measured():
    clock = Clock()
    pricer = StepPricer(1, 5, clock)
    assert pricer.plan([[Candidate(0, NEW, 5)], [Candidate(0, NEW, 2)]]) == [(0, 5), (0, 2)]
    pricer.began(steady=False)
    pricer.ended(2, 5)
    clock.now += 5.0  # a prompt's prefill, or the engine idle between two waves of requests
    pricer.began(steady=False)
    assert pricer.step.seen == 0
    pricer.ended(2, 4, known=False)  # a row still prefilling: the next step's tokens are not known
    clock.now += 1.0
    pricer.began(steady=True)
    assert pricer.step.seen == 0
    pricer.ended(2, 4)
    clock.now += 0.03
    pricer.began(steady=True)
    assert pricer.step.seen == 1 and pricer.step(2, 4) == pytest.approx(0.03)


def test_learning_counts_the_depths_whose_verdict_is_known():
    pricer = StepPricer(1, 4, Clock())
    pricer.learn(0, ALL, 4, 2)  # drafts 1, 2 accepted, 3 rejected, 4 never judged
    assert pricer.tried[0, ALL].tolist() == [1, 1, 1, 0] and pricer.accepted[0, ALL].tolist() == [1, 1, 0, 0]
    pricer.learn(0, ALL, 0, 0)  # nothing sent, nothing learnt
    assert pricer.tried.sum() == 3
    chances = pricer.acceptance(0, ALL)
    assert np.all(np.diff(chances) <= 0) and 0 < chances[-1] < chances[0] < 1


def test_a_setup_is_priced_over_the_steps_its_request_has_left():
    pricer = measured(1, 8, 0.02, 0.0005, [[0.95] * len(STATES)], draft_seconds=0.004)
    assert pricer.remaining(0) is None  # before MIN_LENGTHS requests finished: SETUP_STEPS steps
    for _ in range(10):
        pricer.finished(200)
    assert pricer.remaining(40) == 160 and pricer.remaining(250) == 1.0
    young = [[Candidate(0, ALL, 8, explorable=False, setup=0.3, age=10)]]
    old = [[Candidate(0, ALL, 8, explorable=False, setup=0.3, age=195)]]
    assert pricer.plan(young)[0][1] > 0  # 190 tokens left: the prompt forward pays off
    assert pricer.plan(old) == [(0, 0)]  # 5 tokens left: it never would
