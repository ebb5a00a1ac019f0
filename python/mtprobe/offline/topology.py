"""Building a topology bank for a model: EntMTP's offline calibration (seed 002), in five steps
(:func:`build_bank`, ``python -m mtprobe topology``):

1. **Self-rollouts.** Greedy generation on calibration prompts with the drafter, recording at every
   step the true continuation's child ranks (probing: from its candidates of each depth; a head:
   computed in C++ from its circuit) and the features the policies read. Under greedy decoding the
   accepted path is the true continuation, so the candidates at a root position do not depend on
   the tree that ran; the rollout's tree only decides which positions are step starts.
2. **Acceptance frontier** (seed 002, section 3.1): from the root alone, add one node at a time,
   the one-node augmentation with the highest mean accepted length over the recorded steps (ties:
   smaller rank sum, then shallower): a nested sequence of trees, one per size.
3. **Debiasing** (App. B): the one-step estimate scores every tree on the step starts of the
   rollout's tree; each kept tree is re-run with its own topology and its τ measured.
4. **Throughput frontier** (section 3.2): predicted tokens/s = τ / (t(T) + c) with t from the
   measured forward profile (:func:`mtprobe.profile_forward`), T = (k + 1) × nodes (k = 0 for a
   head: its drafts need no extra inputs) and c the drafter's own time per step (everything outside
   the model's forwards, measured in the tree's rollout: a head's call, the tree's fill); the bank
   keeps the trees that raise τ over every cheaper tree, and ``best`` is the throughput-optimal one
   (EntMTP*).
5. **Policy calibration** (section 4): thresholds for the ladder and the hysteretic rule from a
   sweep that replays the recorded steps (which tree the policy would choose, what it would accept,
   what it would cost), per feature.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mtprobe import _C, registry
from mtprobe.decode import generate
from mtprobe.drafters import EntMTPConfig
from mtprobe.heads import load_cached
from mtprobe.reference.topology import choose
from mtprobe.target_model.profile import ProfileKey, profile_forward
from mtprobe.topology.bank import FEATURES, TopologyBank, Tree, chain_tree, model_fingerprint

__all__ = [
    "Rollout",
    "StepRecord",
    "acceptance_frontier",
    "build_bank",
    "calibrate_policies",
    "policy_trees",
    "replay_policy",
    "rollout",
    "simulate_policy",
    "true_ranks",
]

_FEATURE_COLUMN = {"top1": 0, "path_value": 1, "entropy": 2, "accept": 3}  # of the drafter's step log


@dataclass
class StepRecord:
    """One recorded decode step of a rollout: the true tokens' child ranks per depth (-1: absent or
    past the end), the features the policy read, and the rollout it belongs to."""

    rollout: int
    ranks: tuple[int, ...]  # [k]
    features: tuple[float, float, float, float]  # top1, path_value, entropy_ema, accept_ema


@dataclass(frozen=True)
class Rollout:
    """What :func:`rollout` measured over its prompts."""

    records: list[StepRecord]  # every decode step's record, prompt by prompt
    tau: float  # tokens gained per decode step
    context: int  # the median context length at the middle of the generations
    overhead_s: float  # seconds per forward outside the model's forwards: the drafter's and the loop's


def true_ranks(
    candidates: Sequence[Sequence[int]], sequence: Sequence[int], pos: int, prune: bool
) -> list[int]:
    """Child ranks of the true continuation below root ``sequence[pos]``: at depth d, the rank of
    ``sequence[pos + d]`` among depth d's candidates without its parent's and the root's token
    (-1 when it is not a candidate, or past the end of the sequence, or below a miss).

    >>> true_ranks([[5, 7, 9], [4, 5, 8]], [7, 9, 4], pos=0, prune=True)
    [1, 0]
    """
    out = []
    for d, cands in enumerate(candidates, start=1):
        if pos + d >= len(sequence) or (out and out[-1] < 0):
            out.append(-1)
            continue
        parent, root, want = sequence[pos + d - 1], sequence[pos], sequence[pos + d]
        allowed = [t for t in cands if not (prune and t in (parent, root))]
        out.append(allowed.index(want) if want in allowed else -1)
    return out


def _bank_config(bank: TopologyBank, tree: int, head: Any = None) -> Any:
    """The configuration that runs bank tree ``tree`` every step and records: EntMTP for a probing bank,
    ``head`` (a HeadsConfig) with the bank for a head's."""
    if bank.drafter == "heads":
        return dataclasses.replace(
            head,
            bank=bank,
            policy="static",
            trees=(tree,),
            thresholds=None,
            feature=None,
            record_steps=True,
            block_complexity=max(head.block_complexity, bank.block_complexity),
        )
    return EntMTPConfig(bank=bank, policy="static", trees=(tree,), record_steps=True)


def rollout(
    model: Any,
    prompts: Sequence[torch.Tensor],
    bank: TopologyBank,
    tree: int,
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
    head: Any = None,
) -> Rollout:
    """Greedy generation of every prompt with bank tree ``tree`` every step (``head``: the HeadsConfig of
    a head's bank), recording every step."""
    config = _bank_config(bank, tree, head)
    records: list[StepRecord] = []
    gained = steps = forwards = 0
    outside = 0.0
    contexts = []
    for r, ids in enumerate(prompts):
        out = generate(model, ids, config, max_new_tokens=max_new_tokens, do_sample=False)
        seq = out.sequences[0].tolist()
        log = out.topology_log
        if "ranks" in log:  # a head's: ranked in C++ from its circuit
            ranks = log["ranks"]
        else:
            ranks = [
                true_ranks(c, seq, pos, bank.prune)
                for pos, c in zip(log["positions"], log["candidates"].tolist(), strict=True)
            ]
        for pos, rk, feats in zip(log["positions"], ranks, log["features"], strict=True):
            if pos < len(seq):
                records.append(StepRecord(r, tuple(rk), tuple(feats)))
        gained += sum(out.accept_lengths)
        steps += out.steps
        forwards += out.forward_calls
        outside += out.timings["total_s"] - out.timings["forward_s"]
        contexts.append(ids.shape[-1] + out.new_tokens // 2)
        if progress:
            progress(f"tree {tree}: prompt {r + 1}/{len(prompts)}, tau so far {gained / max(1, steps):.3f}")
    context = int(sorted(contexts)[len(contexts) // 2]) if contexts else 0
    return Rollout(records, gained / max(1, steps), context, outside / max(1, forwards))


def acceptance_frontier(
    records: Sequence[StepRecord], depth: int, max_nodes: int, max_rank: int = 15
) -> list[Tree]:
    """Seed 002's greedy acceptance frontier: trees of 1, 2, ..., ``max_nodes`` - 1 drafts, each the
    previous plus the one node that raises the mean accepted depth over ``records`` most (ties:
    smaller rank sum, then shallower). A node is reached by exactly the steps whose true ranks start
    with its path, so its gain is the share of such steps.

    >>> recs = [StepRecord(0, (0, 0), (0, 0, 0, 0))] * 3 + [StepRecord(0, (1, -1), (0, 0, 0, 0))]
    >>> acceptance_frontier(recs, depth=2, max_nodes=4)
    [((0,),), ((0,), (0, 0)), ((0,), (0, 0), (1,))]
    """
    reach: dict[tuple[int, ...], int] = {}
    for rec in records:
        for d in range(1, depth + 1):
            if rec.ranks[d - 1] < 0:
                break
            reach[rec.ranks[:d]] = reach.get(rec.ranks[:d], 0) + 1
    tree: list[tuple[int, ...]] = []
    frontier: list[Tree] = []
    children: dict[tuple[int, ...], int] = {(): 0}  # node -> children so far (the next child's rank)
    while len(tree) + 1 < max_nodes:
        options = [node + (n,) for node, n in children.items() if len(node) < depth and n <= max_rank]
        if not options:
            break
        best = max(options, key=lambda c: (reach.get(c, 0), -sum(c), -len(c)))
        tree.append(best)
        children[best[:-1]] += 1
        children[best] = 0
        frontier.append(tuple(tree))
    return frontier


def replay_policy(
    records: Sequence[StepRecord],
    accepted: Sequence[Sequence[int]],
    policy: str,
    trees: Sequence[int],
    thresholds: Sequence[float],
    feature: str,
    ema: float = 0.5,
) -> list[int]:
    """The tree a policy picks at every step of ``records`` (``accepted[s][i]``: drafts tree ``i``
    accepts at step ``s``), as the drafters pick it: record ``s``'s features (read where its
    candidates were made) choose the tree step ``s`` drafts. The accept feature is re-derived from the
    replayed choices (it starts at the prefill's 0 accepted drafts); the others are as recorded."""
    col = _FEATURE_COLUMN[feature]
    chosen: list[int] = []
    current, rollout_id, accept_ema = trees[0], -1, 0.0
    for s, rec in enumerate(records):
        if rec.rollout != rollout_id:  # a new generation: the policy starts over
            rollout_id, current, accept_ema = rec.rollout, trees[0], 0.0
        if feature == "accept":
            score = accept_ema
        elif feature == "entropy":
            score = math.exp(-rec.features[col])
        else:
            score = rec.features[col]
        current = choose(policy, trees, thresholds, score, current)
        chosen.append(current)
        accept_ema = ema * accepted[s][current] + (1 - ema) * accept_ema
    return chosen


def simulate_policy(
    records: Sequence[StepRecord],
    accepted: Sequence[Sequence[int]],
    costs: Sequence[float],
    policy: str,
    trees: Sequence[int],
    thresholds: Sequence[float],
    feature: str,
    ema: float = 0.5,
) -> float:
    """Tokens per second a policy would reach replaying ``records`` (:func:`replay_policy`).

    ``costs[i]`` is the seconds of one step with tree ``i``: its forward t(T) plus the drafter's own
    time per step, as :func:`build_bank` passes them."""
    chosen = replay_policy(records, accepted, policy, trees, thresholds, feature, ema)
    tokens = sum(accepted[s][t] + 1 for s, t in enumerate(chosen))
    seconds = sum(costs[t] for t in chosen)
    return tokens / seconds if seconds else 0.0


def _scores(records: Sequence[StepRecord], feature: str) -> list[float]:
    col = _FEATURE_COLUMN[feature]
    if feature == "entropy":
        return [math.exp(-r.features[col]) for r in records]
    return [r.features[col] for r in records]


def _quantiles(values: Sequence[float], qs: Iterable[float]) -> list[float]:
    v = sorted(values)
    return [v[min(len(v) - 1, max(0, int(q * len(v))))] for q in qs] if v else []


def policy_trees(bank: TopologyBank, feature: str) -> list[int]:
    """The bank's trees a policy on ``feature`` may switch between: all of them, except that on the
    root alone nothing is ever accepted, so a policy on the accept EMA that reached it would never
    leave it; that feature gets the trees with drafts only.

    >>> policy_trees(TopologyBank(trees=((), ((0,),), chain_tree([3]))), "accept")
    [1, 2]
    """
    return [i for i, t in enumerate(bank.trees) if feature != "accept" or t]


def calibrate_policies(
    records: Sequence[StepRecord], bank: TopologyBank, costs: Sequence[float]
) -> dict[str, dict[str, Any]]:
    """Seed 002's one-dimensional sweeps, replayed on ``records``: for each policy the trees,
    thresholds and feature with the most simulated tokens per second."""
    n = len(bank.trees)
    topo = [bank.topology(i) for i in range(n)]
    accepted = [[t.accepted_depth(list(r.ranks)) for t in topo] for r in records]
    grid = [q / 20 for q in range(1, 20)]
    best: dict[str, dict[str, Any]] = {}

    def keep(name: str, rate: float, **settings: Any) -> None:
        if name not in best or rate > best[name]["simulated_tokens_per_s"]:
            best[name] = {**settings, "simulated_tokens_per_s": rate}

    for i in range(n):
        keep(
            "static",
            simulate_policy(records, accepted, costs, "static", [i], [], "path_value"),
            trees=[i],
            thresholds=[],
            feature="path_value",
        )
    for feature in FEATURES:
        qs = _quantiles(_scores(records, feature), grid)
        usable = policy_trees(bank, feature)
        if feature == "accept":
            qs = sorted(set(qs) | {0.25, 0.5, 1.0, 1.5, 2.0})
        for lo, hi in itertools.combinations(usable, 2):
            for a in range(len(qs)):
                for b in range(a, len(qs)):
                    th = [qs[a], qs[b]]
                    rate = simulate_policy(records, accepted, costs, "hysteretic", [lo, hi], th, feature)
                    keep("hysteretic", rate, trees=[lo, hi], thresholds=th, feature=feature)
        # The ladder over the usable trees: thresholds at evenly spaced quantiles, shifted by the sweep.
        m = len(usable)
        for shift in [s / 20 for s in range(-8, 9)] if m else []:
            cuts = [min(0.99, max(0.01, j / m + shift)) for j in range(1, m)]
            th = sorted(_quantiles(_scores(records, feature), cuts))
            rate = simulate_policy(records, accepted, costs, "ladder", usable, th, feature)
            keep("ladder", rate, trees=usable, thresholds=th, feature=feature)
    return best


def bucket_sizes(buckets: Sequence[int], inputs_per_node: int) -> tuple[int, tuple[int, ...]]:
    """(max_nodes, debias sizes) of a bank whose trees fill fixed block sizes: the static forward
    plan's buckets (:class:`mtprobe.PlanConfig`), where every forward is padded up to a bucket, so a
    tree between two buckets pays for the larger one. A tree of ``d`` drafts takes ``(d + 1) *
    inputs_per_node`` inputs (``num_masks + 1`` for probing, 1 for a head): each bucket gets the
    largest tree that fits it.

    >>> bucket_sizes((1, 2, 4, 8, 16, 32, 64), 2)
    (32, (1, 3, 7, 15, 31))
    >>> bucket_sizes((2, 4, 8, 16, 32, 64), 3)
    (21, (1, 4, 9, 20))
    """
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise ValueError(f"buckets must be positive ints (block sizes), got {list(buckets)!r}")
    if inputs_per_node < 1:
        raise ValueError(f"inputs_per_node={inputs_per_node} must be >= 1")
    drafts = sorted({b // inputs_per_node - 1 for b in buckets} - {-1, 0})
    if not drafts:
        raise ValueError(
            f"buckets {list(buckets)} hold no tree with a draft at {inputs_per_node} inputs per node; the "
            f"largest must be >= {2 * inputs_per_node}"
        )
    return drafts[-1] + 1, tuple(drafts)


def build_bank(
    model: Any,
    prompts: Sequence[torch.Tensor],
    *,
    num_masks: int = 1,
    head: Any = None,
    max_nodes: int = 15,
    debias_sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 11, 14),
    max_new_tokens: int = 64,
    profile: Any = None,
    progress: Callable[[str], None] | None = None,
) -> TopologyBank:
    """The calibrated bank for ``model`` on ``prompts`` (token tensors ``[1, L]``): the five steps of
    the module docstring. ``head``: a :class:`mtprobe.HeadsConfig` to build the bank of its circuit
    head (its ``vocab_top_k`` and ``block_complexity`` apply; ``num_masks`` is then unused), else the
    bank is for probing with ``num_masks`` masks. ``debias_sizes``: drafts counts of the frontier
    trees re-run on their own (each one rollout over all prompts); ``profile``: the forward profile
    (measured if ``None``)."""
    if not prompts:
        raise ValueError("build_bank needs at least one calibration prompt")
    if max_nodes < 2:
        raise ValueError(f"max_nodes={max_nodes} must be >= 2 (the root and one draft)")
    if head is not None and registry.find(head) is not registry.get("heads"):
        raise TypeError(
            f"head must be a HeadsConfig (the circuit head the bank is for), got {type(head).__name__}"
        )
    started = time.perf_counter()
    profile = profile_forward(model) if profile is None else profile
    profile.check(model)
    key = ProfileKey.of(model)
    if head is not None:
        loaded = load_cached(head.path, model)
        head = dataclasses.replace(head, bank=None, policy=None, trees=None, thresholds=None, feature=None)
        # A head drafts no mask inputs (T = nodes) and reaches depth n - 1.
        drafter = {
            "drafter": "heads",
            "num_masks": 0,
            "window": loaded.spec.window,
            "vocab_top_k": head.vocab_top_k,
        }
        depth, identity = loaded.spec.window - 1, {"head": loaded.fingerprint()}
    else:
        drafter, depth, identity = {"num_masks": num_masks}, num_masks, {}
    # 1. Self-rollouts with a wide first depth and a chain below it (seed 001's shape): every step's
    # ranks are recorded whatever the tree, which only decides where steps start.
    scout = TopologyBank(trees=(chain_tree([max_nodes - 1] + [1] * (depth - 1)),), **drafter)
    scouted = rollout(model, prompts, scout, 0, max_new_tokens, progress, head)
    records, context = scouted.records, scouted.context
    # 2. Acceptance frontier.
    frontier = acceptance_frontier(records, depth, max_nodes)
    one_step = {}
    for t in frontier:
        topo = _C.Topology([list(p) for p in t])  # compiled once per tree, not per step
        one_step[len(t)] = 1 + sum(topo.accepted_depth(list(r.ranks)) for r in records) / max(1, len(records))
    # 3. Debiasing: the chosen sizes re-run with their own tree.
    chosen = [t for t in frontier if len(t) in set(debias_sizes)]
    candidates: list[Tree] = [(), *chosen]
    # The drafter's own time per step (outside the forwards): the root alone pays what the scout paid
    # (a head still runs every step; probing still reads its masks).
    debiased, overhead = {0: 1.0}, {0: scouted.overhead_s}
    for t in chosen:
        run = rollout(model, prompts, TopologyBank(trees=(t,), **drafter), 0, max_new_tokens, progress, head)
        debiased[len(t)], overhead[len(t)] = run.tau, run.overhead_s
    # 4. Throughput frontier: keep the trees that raise tau over every cheaper one; a step costs its
    # forward over T = (k + 1) nodes inputs plus the drafter's own time.
    kept: list[Tree] = []
    for t in candidates:
        if not kept or debiased[len(t)] > debiased[len(kept[-1])]:
            kept.append(t)
    bank = TopologyBank(trees=tuple(kept), **drafter)
    costs = [profile.time(bank.block_size(i), context) + overhead[len(t)] for i, t in enumerate(kept)]
    rates = [debiased[len(t)] / cost for t, cost in zip(kept, costs, strict=True)]
    # 5. Policy thresholds.
    policies = calibrate_policies(records, bank, costs)
    return TopologyBank(
        trees=tuple(kept),
        **drafter,
        **identity,
        model=model_fingerprint(model),
        device=key.device,
        dtype=key.dtype,
        best=max(range(len(kept)), key=lambda i: rates[i]),
        policies=policies,
        stats={
            "prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "recorded_steps": len(records),
            "scout_tau": scouted.tau,
            "context": context,
            "one_step_tau": {str(n): v for n, v in sorted(one_step.items())},
            "debiased_tau": {str(n): v for n, v in sorted(debiased.items())},
            "drafter_seconds_per_step": [overhead[len(t)] for t in kept],
            "predicted_tokens_per_s": rates,
            "plain_tokens_per_s": 1.0 / profile.time(1, context),
            "build_seconds": time.perf_counter() - started,
            # What the drafter's measured time per step depends on besides the machine.
            **({} if head is None else {"head_dtype": head.head_dtype}),
        },
    )
