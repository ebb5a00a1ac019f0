"""Which drafts a vLLM step verifies: every draft token priced against the step it lengthens.

vLLM verifies every chain the proposer returns in the step's one forward, so a draft token costs the whole
batch: the forward grows by a token (on a CPU, where a forward of many rows is bound by arithmetic, by
about a millisecond), and the proposer spends time making it. With ``E`` tokens expected of
a step of ``T`` seconds, a draft that adds ``p`` expected tokens (the probability that it and every draft
before it in its chain are accepted) at ``c`` seconds raises the step's tokens per second when
``p * T > E * c``; :meth:`StepPricer.plan` finds the drafts (each row's a prefix of one chain) that
maximise ``E / T`` exactly.

Both sides are measured while vLLM runs; nothing is assumed of the engine or the hardware:

- the step's seconds as ``a + r * rows + d * drafts`` (:class:`Plane`), from the wall time between two
  ``propose`` calls less the proposer's own, the rows the step verified and the drafts they sent (a row
  and a draft cost vLLM differently: a row has its own sampling and bookkeeping, a draft its rejection
  sampling); steps that ran a prompt (a request joined) are left out;
- the proposer's own seconds as ``a + c * drafts`` (the self-draft's forwards are most of it);
- a draft's acceptance at depth ``j`` of its chain given its request's last outcome (:data:`STATES`),
  counted over every request: each state's count leans on every state's at that depth, those on the
  depth above (the first on an optimistic prior); a drafter's first drafts are sent whatever their price
  until it has :data:`MIN_TRIES` verdicts, by no more rows than it lacks (once in the engine's life: a
  few of the self-draft's prompt forwards, the shortest), and now and then (:data:`EXPLORE`) a
  priced-out row drafts all the same.

On one request at a time the step's fixed cost dominates and nearly every draft pays; at twelve
concurrent requests on a two-core CPU a draft pays only when it is likely to be accepted (measured:
``benchmarks/results/vllm/``).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# A request's last outcome, which prices its next chain: just begun; sent no drafts last step; its last
# chain accepted whole; in part; not at all.
NEW, IDLE, ALL, SOME, NONE = range(5)
STATES = ("new", "idle", "all", "some", "none")

# Beta prior of a draft's acceptance at a depth, over every state: optimistic (2/3), so that an unmeasured
# draft is tried.
PRIOR_ACCEPTED, PRIOR_REJECTED = 2.0, 1.0
# The weight, in verdicts, of every state's rate at a depth in one state's estimate there.
POOLED_WEIGHT = 4.0
# A drafter's first drafts sent whatever their price, until it has this many verdicts on first drafts.
MIN_TRIES = 4
# Past that, the chance per row and step that a priced-out row drafts one more token all the same (the
# acceptance of a state changes with the text; without it an estimate once low is never revised).
EXPLORE = 1 / 256
# Weight of every earlier observation after each new one (about the last 50 steps count).
DECAY = 0.98
# The weight of each of a Line's or Plane's prior points, in observations.
PRIOR_WEIGHT = 0.5
# A drafter's one-time setup for a request (the self-draft's prompt forward) is priced over the steps the
# request is expected to have left (Candidate); SETUP_STEPS until MIN_LENGTHS requests have finished.
SETUP_STEPS = 4
MIN_LENGTHS = 8
# Finished requests' lengths kept to judge that by (the latest).
LENGTHS_KEPT = 256
# Dinkelbach's iterations a plan may take (it settles in two to four).
MAX_ITERATIONS = 32


def outcome_state(sent: int, accepted: int) -> int:
    """The state a request's next chain is priced in, after ``accepted`` of its ``sent`` drafts were."""
    if sent == 0:
        return IDLE
    return ALL if accepted == sent else SOME if accepted > 0 else NONE


class Plane:
    """``y ≈ a + r * rows + d * drafts`` by least squares over decaying observations, held near a prior
    plane by three points on it that do not decay (weight :data:`PRIOR_WEIGHT` each): they set what the
    observations cannot (the cost of a draft while no row sends any), and weigh little against fifty
    steps' observations otherwise. The prior: the first observation's seconds with ``a`` at nine-tenths of
    them for one row, a row and a draft each a tenth of ``a``."""

    def __init__(self) -> None:
        self.prior = np.zeros((3, 4))  # Σw·x xᵀ | Σw·x y, x = (1, rows, drafts)
        self.sums = np.zeros((3, 4))
        self.seen = 0

    def add(self, rows: float, drafts: float, y: float) -> None:
        if self.seen == 0:
            a0 = y / (1 + (rows + drafts) / 10)
            for pr, pd in ((0.5 * rows, 0.0), (1.5 * rows + 1, 0.0), (rows, rows + 1.0)):
                self.prior += PRIOR_WEIGHT * self._outer(pr, pd, a0 * (1 + (pr + pd) / 10))
        self.sums *= DECAY
        self.sums += self._outer(rows, drafts, y)
        self.seen += 1

    @staticmethod
    def _outer(rows: float, drafts: float, y: float) -> np.ndarray:
        x = np.array([1.0, rows, drafts])
        return np.concatenate([np.outer(x, x), (x * y)[:, None]], axis=1)

    def fit(self) -> tuple[float, float, float]:
        """(a, r, d), each at least zero; zeros before any observation."""
        if self.seen == 0:
            return 0.0, 0.0, 0.0
        m = self.prior + self.sums
        a, r, d = np.linalg.solve(m[:, :3], m[:, 3])
        if r < 0 or d < 0:  # refit the intercept with the negative slopes held at zero
            r, d = max(r, 0.0), max(d, 0.0)
            a = (m[0, 3] - r * m[0, 1] - d * m[0, 2]) / m[0, 0]
        return max(float(a), 0.0), float(r), float(d)

    def __call__(self, rows: float, drafts: float) -> float:
        a, r, d = self.fit()
        return a + r * rows + d * drafts


class Line:
    """``y ≈ a + b x`` by least squares over decaying observations, anchored by a prior line with the
    weight of one observation, which real ones soon outweigh. The prior: slope ``slope`` through the
    origin where given, else the line through the first observation with ``a`` nine-tenths of it at
    x = 1 (``b = a / 10``: a fixed cost that dominates until about ten tokens), held at two points on
    either side of it (so that it sets the slope only while the observations' own spread cannot)."""

    def __init__(self, slope: float | None = None) -> None:
        self.sums = np.zeros(5)  # Σw, Σw·x, Σw·y, Σw·x², Σw·x·y
        self.seen = 0
        self.slope = slope
        if slope is not None:
            for px in (1.0, 8.0):
                self._add(px, slope * px, PRIOR_WEIGHT)

    def add(self, x: float, y: float) -> None:
        if self.seen == 0 and self.slope is None:
            a0 = y / (1 + x / 10)
            for px in (0.5 * x, 1.5 * x + 1):
                self._add(px, a0 * (1 + px / 10), PRIOR_WEIGHT)
        self.sums *= DECAY
        self._add(x, y)
        self.seen += 1

    def _add(self, x: float, y: float, w: float = 1.0) -> None:
        self.sums += (w, w * x, w * y, w * x * x, w * x * y)

    def fit(self) -> tuple[float, float]:
        """(a, b), both at least zero; (0, 0) before any observation or prior."""
        w, sx, sy, sxx, sxy = self.sums
        if w == 0:
            return 0.0, 0.0
        det = w * sxx - sx * sx
        b = (w * sxy - sx * sy) / det if det > 1e-12 * w * w else 0.0
        b = max(b, 0.0)
        return max((sy - b * sx) / w, 0.0), b

    def __call__(self, x: float) -> float:
        a, b = self.fit()
        return a + b * x


@dataclass(frozen=True)
class Candidate:
    """A chain a row could send: from drafter ``option``, priced in ``state``, at most ``limit`` long;
    ``explorable``: a priced-out row may draft it now and then (:data:`EXPLORE`) to keep its estimate
    true (not one that would first have to catch up, as the self-draft's cache after steps without
    drafts: a prompt's forward). Its ``setup`` is priced as spread over the steps the request is expected
    to have left (:meth:`StepPricer.remaining` of its ``age``, the tokens it has generated)."""

    option: int
    state: int
    limit: int
    explorable: bool = True
    setup: float = 0.0  # seconds before its first draft (a prompt's forward), paid once per request
    age: int = 0  # tokens the request has generated


class StepPricer:
    """The proposer's measurements and each step's plan: which drafter's chain each row sends, and how
    much of it. ``options``: the drafters a row may draft with (one, or a scheduler's candidates).

    Per step: :meth:`began` when ``propose`` is entered, :meth:`learn` for each request whose last chain
    vLLM has verified, :meth:`plan`, :meth:`timed` for each drafter's work, then :meth:`ended` with the
    tokens the next step verifies.
    """

    def __init__(
        self,
        options: int,
        max_depth: int,
        clock: Callable[[], float],
        draft_seconds: list[float | None] | None = None,
        seed: int = 0,
    ) -> None:
        self.max_depth = max_depth
        self.clock = clock
        self.step = Plane()  # vLLM's step seconds over the rows and drafts it verified
        # Each drafter's seconds over the drafts it made; a measured seconds per draft, where given, is the
        # prior slope (the self-draft's decoder, timed as it loads).
        self.own = [Line(slope=s) for s in (draft_seconds or [None] * options)]
        # [option, state, depth - 1]: drafts sent and accepted, over every request so far
        self.tried = np.zeros((options, len(STATES), max_depth))
        self.accepted = np.zeros((options, len(STATES), max_depth))
        self.rng = random.Random(seed)
        self._entered = self._left = None  # this propose call's entry, the last one's exit
        # (rows, drafts) the step in flight verifies; None: not a clean step
        self._pending: tuple[int, int] | None = None
        self.lengths: deque[int] = deque(maxlen=LENGTHS_KEPT)  # tokens finished requests generated

    def began(self, steady: bool) -> None:
        """``propose`` was entered; ``steady``: the step that just ran verified only the rows the last
        call saw (no request joined with its prompt), so its time is a verification's."""
        now = self.clock()
        if steady and self._pending is not None and self._left is not None:
            self.step.add(*self._pending, now - self._left)
        self._entered = now

    def learn(self, option: int, state: int, sent: int, accepted: int) -> None:
        """A chain of ``sent`` drafts of ``option`` priced in ``state`` kept its first ``accepted``."""
        reached = min(sent, accepted + 1)  # depths whose verdict is known
        if reached == 0:
            return
        self.tried[option, state, :reached] += 1
        self.accepted[option, state, :accepted] += 1

    def acceptance(self, option: int, state: int) -> np.ndarray:
        """[max_depth]: the probability that a chain of ``option`` priced in ``state`` keeps its drafts up
        to each depth. Each depth's rate leans on every state's there (:data:`POOLED_WEIGHT`), and every
        state's on the depth above it (the optimistic prior at the first): a depth not yet drafted is
        taken as likely as the one before it, so chains lengthen as fast as their drafts are kept."""
        tried, accepted = self.tried[option], self.accepted[option]
        all_tried, all_accepted = tried.sum(0), accepted.sum(0)  # [max_depth]
        rate = np.empty(self.max_depth)
        prior = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED)
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
        for j in range(self.max_depth):
            pooled = (all_accepted[j] + weight * prior) / (all_tried[j] + weight)
            rate[j] = (accepted[state, j] + POOLED_WEIGHT * pooled) / (tried[state, j] + POOLED_WEIGHT)
            prior, weight = pooled, POOLED_WEIGHT
        return np.cumprod(rate)

    def timed(self, option: int, drafts: int, seconds: float) -> None:
        """Drafter ``option`` took ``seconds`` this step to make ``drafts`` drafts."""
        self.own[option].add(drafts, seconds)

    def plan(self, rows: list[list[Candidate]]) -> list[tuple[int, int]]:
        """Each row's (candidate index, drafts to send) among its candidates (every row has one at least),
        chosen to maximise the step's expected tokens per second ``E / T``. Dinkelbach's iteration makes it
        exact: at a rate ``λ`` each row takes the candidate and the prefix of it whose drafts gain most
        ``Σ (p − λ · cost)``, and ``λ`` becomes the plan's ``E / T`` until no plan beats it (every step
        raises it; starting from no drafts at all). A row offered a drafter not yet measured
        (:data:`MIN_TRIES`) sends it, one draft at least, as many rows as it lacks verdicts
        (:meth:`_measuring`). Before the step's time is measured every row
        sends its first candidate whole."""
        if self.step.seen == 0:
            return [(0, cands[0].limit) for cands in rows]
        a, r, d = self.step.fit()
        cost = [d + line.fit()[1] for line in self.own]  # [options]: seconds per draft sent
        n = len(rows)
        base = max(a + r * n, 1e-9)
        rate = n / base  # tokens per second with no drafts
        chances = {  # (option, state) -> [max_depth], each computed once per plan
            (c.option, c.state): self.acceptance(c.option, c.state) for cands in rows for c in cands
        }
        measuring = self._measuring(rows)
        plan = [(0, 0)] * n
        for _ in range(MAX_ITERATIONS):
            candidate_plan = [
                self._best(cands, rate, cost, chances, measure)
                for cands, measure in zip(rows, measuring, strict=True)
            ]
            expected, seconds = float(n), base
            for cands, (i, k) in zip(rows, candidate_plan, strict=True):
                cand = cands[i]
                expected += float(chances[cand.option, cand.state][:k].sum())
                seconds += k * cost[cand.option] + (self._setup(cand, chances) if k else 0.0)
            plan = candidate_plan
            if expected / seconds <= rate * (1 + 1e-12):
                break
            rate = expected / seconds
        explored = []
        for (i, k), cands in zip(plan, rows, strict=True):  # now and then a priced-out row drafts one more
            cand = cands[i]
            more = cand.explorable and k < cand.limit and self.rng.random() < EXPLORE
            explored.append((i, k + 1 if more else k))
        return explored

    def _measuring(self, rows: list[list[Candidate]]) -> list[frozenset[int]]:
        """Per row, the drafters it sends a chain of to measure them: of each drafter short of
        :data:`MIN_TRIES` verdicts, only as many rows as it lacks, those whose chain costs least to set up
        (the shortest prompts to run). Twelve rows of a first step had each run its prompt's forward for a
        self-draft not yet measured (a second or two on a CPU, once per engine)."""
        measuring: list[set[int]] = [set() for _ in rows]
        for option in {c.option for cands in rows for c in cands}:
            lacking = MIN_TRIES - int(self.tried[option, :, 0].sum())
            if lacking <= 0:
                continue
            offered = [
                (c.setup, r)
                for r, cands in enumerate(rows)
                for c in cands
                if c.option == option and c.limit >= 1
            ]
            for _, r in sorted(offered)[:lacking]:
                measuring[r].add(option)
        return [frozenset(m) for m in measuring]

    def _best(
        self,
        cands: list[Candidate],
        rate: float,
        cost: list[float],
        chances: dict[tuple[int, int], np.ndarray],
        measure: frozenset[int] = frozenset(),
    ) -> tuple[int, int]:
        """The candidate and prefix length whose drafts gain most at ``rate`` tokens per second (none: the
        first, with no drafts), or the best of a candidate whose drafter this row measures (``measure``,
        :meth:`_measuring`) with one draft at least."""
        best, best_gain = (0, 0), 0.0
        for i, cand in enumerate(cands):
            if cand.limit < 1:
                continue
            p = chances[cand.option, cand.state][: cand.limit]
            spent = np.full(cand.limit, rate * cost[cand.option])
            spent[0] += rate * self._setup(cand, chances)
            gains = np.cumsum(p - spent)
            if cand.option in measure:
                return i, int(np.argmax(gains)) + 1  # measure it first
            k = int(np.argmax(gains))
            if gains[k] > best_gain:
                best, best_gain = (i, k + 1), float(gains[k])
        return best

    def _setup(self, cand: Candidate, chances: dict[tuple[int, int], np.ndarray]) -> float:
        """The share of ``cand``'s setup one step pays: spread over the steps its request is expected to
        have left, each taking 1 + its chain's expected accepted drafts."""
        if cand.setup == 0.0:
            return 0.0
        left = self.remaining(cand.age)
        if left is None:
            return cand.setup / SETUP_STEPS
        per_step = 1.0 + float(chances[cand.option, cand.state][: cand.limit].sum())
        return cand.setup / max(1.0, left / per_step)

    def remaining(self, age: int) -> float | None:
        """Tokens a request that has generated ``age`` is expected to generate still: the mean excess of
        the finished requests that went on longer (1 when none did); None until :data:`MIN_LENGTHS`
        requests have finished."""
        if len(self.lengths) < MIN_LENGTHS:
            return None
        lengths = np.asarray(self.lengths)
        longer = lengths[lengths > age]
        return float(np.mean(longer - age)) if longer.size else 1.0

    def finished(self, length: int) -> None:
        """A request finished after generating ``length`` tokens."""
        self.lengths.append(int(length))

    def summary(self) -> dict[str, object]:
        """What was measured: the step's line and each drafter's (seconds), and per drafter and state the
        verdicts and the chance of keeping a first draft."""
        return {
            "step_seconds": list(self.step.fit()),
            "draft_seconds": [list(line.fit()) for line in self.own],
            "steps_measured": self.step.seen,  # step_seconds: a, r (per row), d (per draft)
            "tokens_left_at_0_16_48": [self.remaining(age) for age in (0, 16, 48)],
            "first_draft": [
                {
                    name: [int(self.tried[o, i, 0]), round(float(self.acceptance(o, i)[0]), 3)]
                    for i, name in enumerate(STATES)
                }
                for o in range(self.tried.shape[0])
            ],
        }

    def ended(self, rows: int, drafts: int, known: bool = True) -> None:
        """``propose`` returns; the next step verifies ``rows`` rows with ``drafts`` drafts among them (not
        ``known`` when a row is still prefilling: its prompt's tokens run too)."""
        self._left, self._pending = self.clock(), (rows, drafts) if known else None
