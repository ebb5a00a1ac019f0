"""Property-based fuzzing (hypothesis) of the ops and the C++ core against ``mtprobe.reference``.

Every property draws a random valid input (trees of random shape: chains, stars, deep, wide,
binary, random trees and forests, 1 to 72 nodes; random prefix lengths, vocabularies, dtypes and
logits with forced ties) and checks that the op's output equals the reference's (exactly for masks,
indices, tokens and copies; within tests/tolerances.py for attention outputs), plus invariants the
reference itself must satisfy (an accepted path is a root path, compaction leaves every other row
alone, ...).

Here a fast slice runs under the derandomized profile ``mtprobe-fuzz-ci``, so CI sees the same
cases on every run. ``benchmarks/fuzz.py`` runs the same ``PROPERTIES`` through ``run_property``
under ``mtprobe-fuzz-bench`` with >= 10^5 cases in total.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtprobe import _C, ops
from mtprobe.reference import (
    compact_kv,
    dynamic_tree,
    expand_tree,
    merge_trees,
    static_tree,
    tree_ancestors,
    tree_attention,
    tree_attention_mask,
    tree_position_ids,
    verify_greedy,
    verify_rejection,
)
from tolerances import tolerance

PROFILE_CI = "mtprobe-fuzz-ci"
PROFILE_BENCH = "mtprobe-fuzz-bench"
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
# No deadline: timings on a shared 2-core CI machine are noise. No example database: a failure must
# reproduce from the seed alone, not from files left behind by an earlier run.
settings.register_profile(
    PROFILE_CI, deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET
)
settings.register_profile(
    PROFILE_BENCH,
    deadline=None,
    derandomize=False,
    database=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]
MAX_NODES = 64
WIDE_NODES = 72  # past 64: the ancestor bits take a second word
SHAPES = ["chain", "star", "deep", "wide", "binary", "random", "forest"]

seeds = st.integers(0, 2**32 - 1)


# --- strategies ------------------------------------------------------------------------------------


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = MAX_NODES, single_root: bool = False) -> list[int]:
    """A parents array (parents[i] in [-1, i - 1]) of one of SHAPES; ``single_root``: one tree at 0."""
    n = draw(st.integers(1, max_nodes))
    kind = draw(st.sampled_from(SHAPES[:-1] if single_root else SHAPES))
    parents = [-1]
    for i in range(1, n):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(0)
        elif kind == "deep":  # mostly a chain, with short side branches
            parents.append(i - 1 - draw(st.integers(0, min(2, i - 1))))
        elif kind == "wide":  # everything hangs off the first few nodes
            parents.append(draw(st.integers(0, min(2, i - 1))))
        elif kind == "binary":
            parents.append((i - 1) // 2)
        elif kind == "random":
            parents.append(draw(st.integers(0, i - 1)))
        else:  # forest: -1 starts another root
            parents.append(draw(st.integers(-1, i - 1)))
    return parents


def bits_by_definition(parents: list[int]) -> torch.Tensor:
    """[T, ceil(T / 64)] int64: bit a % 64 of word a // 64 of row i set when a is i or an ancestor of i."""
    words = (len(parents) + 63) // 64
    out = torch.zeros(len(parents), words, dtype=torch.long)
    for i in range(len(parents)):
        value = sum(1 << a for a in tree_ancestors(torch.tensor(parents), i))
        for w in range(words):
            chunk = (value >> (64 * w)) & ((1 << 64) - 1)
            out[i, w] = chunk - (1 << 64) if chunk >= 1 << 63 else chunk  # the int64 with those bits
    return out


def _assert_root_path(path: list[int], parents: list[int], root: int) -> None:
    assert path[0] == root
    for node, child in itertools.pairwise(path):
        assert parents[child] == node, f"{child} is not a child of {node}: {path}"


# --- tree mask, position ids and ancestor bits -----------------------------------------------------


@dataclass(frozen=True)
class TreeMaskCase:
    parents: list[int]
    prefix_len: int
    dtype: torch.dtype
    index_dtype: torch.dtype


@st.composite
def tree_mask_cases(draw: st.DrawFn) -> TreeMaskCase:
    prefix_len = draw(st.one_of(st.integers(0, 8), st.integers(0, 300), st.sampled_from([1023, 1024, 4096])))
    return TreeMaskCase(
        draw(trees(WIDE_NODES)),
        prefix_len,
        draw(st.sampled_from(FLOAT_DTYPES)),
        draw(st.sampled_from(INDEX_DTYPES)),
    )


def check_tree_mask(case: TreeMaskCase) -> None:
    parents = torch.tensor(case.parents, dtype=case.index_dtype)
    n, prefix = len(case.parents), case.prefix_len
    mask = ops.tree_attention_mask(parents, prefix, case.dtype)
    assert mask.shape == (1, 1, n, prefix + n) and mask.dtype == case.dtype
    assert torch.equal(mask, tree_attention_mask(parents, prefix, case.dtype))
    positions = ops.tree_position_ids(parents, prefix)
    assert positions.dtype == torch.long
    assert torch.equal(positions, tree_position_ids(parents, prefix))
    assert torch.equal(ops.tree_ancestor_bits(parents), bits_by_definition(case.parents))
    # Invariants: the prefix is always visible, every node sees itself, a node sees exactly what its
    # parent sees plus itself, and sits one position after its parent.
    allowed = mask[0, 0] == 0  # [T, P + T]
    assert bool(allowed[:, :prefix].all())
    for i, p in enumerate(case.parents):
        expected = torch.zeros(n, dtype=torch.bool) if p == -1 else allowed[p, prefix:].clone()
        expected[i] = True
        assert torch.equal(allowed[i, prefix:], expected)
        assert int(positions[0, i]) == (prefix if p == -1 else int(positions[0, p]) + 1)
    assert bool((mask[0, 0][~allowed] == torch.finfo(case.dtype).min).all())


# --- tree attention (ancestor bits) --------------------------------------------------------------


@dataclass(frozen=True)
class TreeAttentionCase:
    parents: list[int]
    prefix_len: int
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    scale: float | None
    dtype: torch.dtype
    seed: int


@st.composite
def tree_attention_cases(draw: st.DrawFn) -> TreeAttentionCase:
    # Small heads and prefixes: the reference loops over the nodes in Python (its cost sets the pace).
    return TreeAttentionCase(
        parents=draw(trees(WIDE_NODES)),
        prefix_len=draw(st.one_of(st.integers(0, 4), st.integers(0, 80))),
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.one_of(st.sampled_from([8, 16, 64]), st.integers(1, 24))),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        seed=draw(seeds),
    )


def check_tree_attention(case: TreeAttentionCase) -> None:
    g = torch.Generator().manual_seed(case.seed)
    t, kv_len, heads = len(case.parents), case.prefix_len + len(case.parents), case.kv_heads * case.group
    q = torch.randn(case.batch, heads, t, case.head_dim, generator=g).to(case.dtype)  # [B, H, T, D]
    k = torch.randn(case.batch, case.kv_heads, kv_len, case.head_dim, generator=g).to(case.dtype)
    v = torch.randn(case.batch, case.kv_heads, kv_len, case.head_dim, generator=g).to(case.dtype)
    parents = torch.tensor(case.parents)
    out = ops.tree_attention(q, k, v, ops.tree_ancestor_bits(parents), case.scale)
    assert out.shape == q.shape and out.dtype == case.dtype
    expected = tree_attention(q, k, v, parents, case.scale)
    torch.testing.assert_close(out, expected, **tolerance(case.dtype))


# --- draft trees: the C++ core's static and dynamic trees, and the hybrid's merge ---------------------


@dataclass(frozen=True)
class DraftTreeCase:
    root: int
    cand_tokens: list[list[int]]  # [depths][m], best first
    cand_probs: list[list[float]]  # [depths][m], descending, float32 values
    dynamic: bool
    branches: list[int]
    budget: int
    prune: bool


@st.composite
def candidate_lists(
    draw: st.DrawFn, depths: int, m: int, vocab: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Per depth, m distinct tokens and descending probabilities (a top-m of some distribution); the
    weights come from a few levels, so equal probabilities (ties) are common."""
    tokens, probs = [], []
    for _ in range(depths):
        tokens.append(draw(st.lists(st.integers(0, vocab - 1), min_size=m, max_size=m, unique=True)))
        if draw(st.booleans()):
            weights = draw(st.lists(st.integers(1, 4), min_size=m, max_size=m))
        else:
            weights = draw(st.lists(st.floats(1e-3, 1.0), min_size=m, max_size=m))
        weights.sort(reverse=True)
        rest = draw(st.sampled_from([0.0, 0.5, 3.0]))  # mass outside the top m
        row = torch.tensor(weights, dtype=torch.float64) / (sum(weights) * (1 + rest))
        probs.append(row.float().tolist())  # the values the core sees (it takes float32)
    return tokens, probs


@st.composite
def draft_tree_cases(draw: st.DrawFn) -> DraftTreeCase:
    depths = draw(st.integers(1, 4))
    m = draw(st.integers(1, 16))
    vocab = draw(st.integers(m, m + draw(st.sampled_from([0, 2, 50]))))  # small: the pruner has work
    tokens, probs = draw(candidate_lists(depths, m, vocab))
    dynamic = draw(st.booleans())
    branches = draw(st.lists(st.integers(1, 6), min_size=depths, max_size=depths))
    budget = draw(st.integers(1, 40))
    return DraftTreeCase(
        draw(st.integers(0, vocab - 1)), tokens, probs, dynamic, branches, budget, draw(st.booleans())
    )


def _check_draft_tree_shape(tokens: list[int], parents: list[int], probs: list[float]) -> None:
    assert parents[0] == -1 and probs[0] == 1.0
    for i in range(1, len(parents)):
        assert 0 <= parents[i] < i  # every parent before its children
        assert probs[i] <= probs[parents[i]]


def check_draft_tree(case: DraftTreeCase) -> None:
    t = torch.tensor(case.cand_tokens, dtype=torch.long)  # [depths, m]
    p = torch.tensor(case.cand_probs, dtype=torch.float32)  # [depths, m]
    core = _C.build_draft_tree(
        case.root, t, p, dynamic=case.dynamic, branches=case.branches, budget=case.budget, prune=case.prune
    )
    if case.dynamic:
        ref = dynamic_tree(case.root, case.cand_tokens, case.cand_probs, case.budget, case.prune)
        assert len(core[0]) <= max(1, case.budget)  # the budget counts the root
    else:
        ref = static_tree(case.root, case.cand_tokens, case.cand_probs, case.branches, case.prune)
        assert len(core[0]) <= 1 + sum(case.branches)
    assert (core[0], core[1]) == (ref[0], ref[1])
    assert core[2] == ref[2]  # the same products of the same float32 values, in double
    tokens, parents, probs = core
    _check_draft_tree_shape(tokens, parents, probs)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
        # Node i is one of its depth's candidates, scored by its parent's score times its own.
        row = case.cand_tokens[depth[i] - 1]
        assert tokens[i] in row
        assert probs[i] == probs[parents[i]] * case.cand_probs[depth[i] - 1][row.index(tokens[i])]
        if case.prune:
            assert tokens[i] not in (case.root, tokens[parents[i]])


@dataclass(frozen=True)
class MergeCase:
    a: tuple[list[int], list[int], list[float]]
    b: tuple[list[int], list[int], list[float]]
    budget: int


@st.composite
def scored_trees(draw: st.DrawFn, root: int, vocab: int) -> tuple[list[int], list[int], list[float]]:
    """A draft tree of ``root`` (possibly empty): tokens from a small vocabulary (so the two trees
    share paths), scores at most 1 and never above the parent's, often tied."""
    if draw(st.integers(0, 9)) == 0:
        return [], [], []
    parents = draw(trees(32, single_root=True))
    tokens = [root] + draw(
        st.lists(st.integers(0, vocab - 1), min_size=len(parents) - 1, max_size=len(parents) - 1)
    )
    factor = st.one_of(st.sampled_from([1.0, 0.5, 0.25, 0.75]), st.floats(0.0, 1.0))
    probs = [1.0]
    for i in range(1, len(parents)):
        probs.append(probs[parents[i]] * draw(factor))
    return tokens, parents, probs


@st.composite
def merge_cases(draw: st.DrawFn) -> MergeCase:
    vocab = draw(st.integers(1, 8))
    root = draw(st.integers(0, vocab - 1))
    return MergeCase(
        draw(scored_trees(root, vocab)), draw(scored_trees(root, vocab)), draw(st.integers(0, 40))
    )


def check_merge(case: MergeCase) -> None:
    out = _C.merge_draft_trees(*case.a, *case.b, case.budget)
    ref = merge_trees(case.a, case.b, case.budget)
    assert tuple(out) == tuple(ref)
    tokens, parents, probs = out
    if not tokens:
        assert not case.a[0] and not case.b[0]
        return
    _check_draft_tree_shape(tokens, parents, probs)
    assert len(tokens) <= max(1, case.budget)

    def paths(tree: tuple[list[int], list[int], list[float]]) -> dict[tuple[int, ...], float]:
        best: dict[tuple[int, ...], float] = {}
        for i in range(len(tree[0])):
            key = tuple(tree[0][a] for a in tree_ancestors(torch.tensor(tree[1]), i))
            best[key] = max(best.get(key, 0.0), tree[2][i])
        return best

    # Every kept node is a token path of a or b, scored by the higher of its scores there.
    union: dict[tuple[int, ...], float] = {}
    for key, score in itertools.chain(paths(case.a).items(), paths(case.b).items()):
        union[key] = max(union.get(key, 0.0), score)
    union[(tokens[0],)] = 1.0
    for key, score in paths(out).items():
        assert key in union and score == union[key], key


# --- the dynamic tree from the masks' logits (expand_draft_tree) ---------------------------------------


@dataclass(frozen=True)
class ExpandCase:
    depths: int
    vocab: int
    style: str
    dtype: torch.dtype
    seed: int
    root: int
    budget: int
    width: int
    prune: bool

    def logits(self) -> torch.Tensor:
        """[depths, vocab] in ``dtype``; rounded to it first, so both sides see the same values."""
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.depths, self.vocab)
        if self.style == "normal":
            x = torch.randn(shape, generator=g) * 3
        elif self.style == "ties":  # a few levels: many equal logits
            x = torch.randint(-2, 3, shape, generator=g).float() * 0.75
        elif self.style == "flat":
            x = torch.zeros(shape)
        else:  # masked: -inf where a logits processor removed a token, never a whole row
            x = torch.randn(shape, generator=g)
            drop = torch.rand(shape, generator=g) < 0.5
            drop[:, torch.randint(0, self.vocab, (), generator=g)] = False
            x = x.masked_fill(drop, float("-inf"))
        return x.to(self.dtype)


@st.composite
def expand_cases(draw: st.DrawFn) -> ExpandCase:
    vocab = draw(st.one_of(st.integers(1, 12), st.integers(1, 300), st.sampled_from([1000, 2048])))
    budget = draw(st.integers(1, 40))
    return ExpandCase(
        depths=draw(st.integers(1, 4)),
        vocab=vocab,
        style=draw(st.sampled_from(["normal", "ties", "flat", "masked"])),
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        seed=draw(seeds),
        root=draw(st.integers(0, vocab - 1)),
        budget=budget,
        width=draw(st.integers(1, min(vocab, budget + 3))),
        prune=draw(st.booleans()),
    )


def check_expand(case: ExpandCase) -> None:
    logits = case.logits()
    out = ops.expand_draft_tree(logits, torch.tensor(case.root), case.budget, case.width, case.prune)
    assert [x.dtype for x in out] == [torch.long, torch.long, torch.float64, torch.long]
    assert [tuple(x.shape) for x in out] == [(case.budget,)] * 3 + [()]
    n = int(out[3])
    assert 1 <= n <= case.budget
    assert out[0][n:].eq(-1).all() and out[1][n:].eq(-1).all() and out[2][n:].eq(0).all()  # padding
    tokens, parents, probs = out[0][:n].tolist(), out[1][:n].tolist(), out[2][:n].tolist()
    ref = expand_tree(logits, case.root, case.budget, case.width, case.prune)
    assert (tokens, parents) == (ref[0], ref[1])
    # The same softmax (float32) and the same double products: equal, up to a last-bit slack.
    assert probs == pytest.approx(ref[2], rel=1e-12, abs=0)
    _check_draft_tree_shape(tokens, parents, probs)


# --- verification ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyGreedyCase:
    parents: list[int]
    tokens: list[int]
    target: list[int]
    root: int
    index_dtype: torch.dtype


@st.composite
def verify_greedy_cases(draw: st.DrawFn) -> VerifyGreedyCase:
    parents = draw(trees())
    n = len(parents)
    vocab = draw(st.one_of(st.integers(1, 4), st.just(50_000)))  # small: matches and tied siblings
    ids = st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)
    return VerifyGreedyCase(
        parents, draw(ids), draw(ids), draw(st.integers(0, n - 1)), draw(st.sampled_from(INDEX_DTYPES))
    )


def check_verify_greedy(case: VerifyGreedyCase) -> None:
    tokens = torch.tensor(case.tokens, dtype=case.index_dtype)
    parents = torch.tensor(case.parents, dtype=case.index_dtype)
    target = torch.tensor(case.target, dtype=case.index_dtype)
    path = ops.verify_greedy(tokens, parents, target, case.root)
    assert path.dtype == torch.long
    assert torch.equal(path, verify_greedy(tokens, parents, target, case.root))
    # Invariants: a root path, each step the lowest-index child that drafted the target's token, and
    # it stops only where no child did.
    nodes = path.tolist()
    _assert_root_path(nodes, case.parents, case.root)
    children = [
        [c for c in range(len(case.parents)) if case.parents[c] == i] for i in range(len(case.parents))
    ]
    for node, child in itertools.pairwise(nodes):
        assert case.tokens[child] == case.target[node]
        assert all(case.tokens[c] != case.target[node] for c in children[node] if c < child)
    assert all(case.tokens[c] != case.target[nodes[-1]] for c in children[nodes[-1]])


@dataclass(frozen=True)
class VerifyRejectionCase:
    parents: list[int]
    p_weights: list[list[int]]  # [n, vocab]
    q_weights: list[list[int]]  # [n - 1, vocab]
    tokens: list[int]  # node 0's token is not used
    uniforms: list[float]  # [n + 1]
    dtype: torch.dtype

    def tensors(self) -> tuple[torch.Tensor, ...]:
        def rows(weights: list[list[int]], n_rows: int) -> torch.Tensor:
            w = torch.tensor(weights, dtype=torch.float64).reshape(n_rows, -1)
            return (w / w.sum(-1, keepdim=True)).to(self.dtype)

        n, vocab = len(self.parents), len(self.p_weights[0])
        q = rows(self.q_weights, n - 1) if n > 1 else torch.zeros(0, vocab, dtype=self.dtype)
        return (
            torch.tensor(self.tokens),
            torch.tensor(self.parents),
            rows(self.p_weights, n),
            q,
            torch.tensor(self.uniforms, dtype=torch.float64),
        )


@st.composite
def verify_rejection_cases(draw: st.DrawFn) -> VerifyRejectionCase:
    parents = draw(trees(40, single_root=True))
    n = len(parents)
    vocab = draw(st.integers(1, draw(st.sampled_from([4, 8, 64]))))
    levels = st.integers(0, 3)  # integer weights: exact zeros and equal probabilities are common

    def row() -> list[int]:
        w = draw(st.lists(levels, min_size=vocab, max_size=vocab))
        if not any(w):
            w[draw(st.integers(0, vocab - 1))] = 1
        return w

    p = [row() for _ in range(n)]
    # Siblings are independent draws from one q (SpecInfer), or each child has its own.
    per_parent = [row() for _ in range(n)]
    q = [per_parent[parents[j]] if draw(st.booleans()) else row() for j in range(1, n)]
    tokens = [0] + [draw(st.sampled_from([x for x in range(vocab) if q[j - 1][x] > 0])) for j in range(1, n)]
    uniform = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1 / 3]), st.floats(0.0, 1.0, exclude_max=True))
    uniforms = draw(st.lists(uniform, min_size=n + 1, max_size=n + 1))
    return VerifyRejectionCase(parents, p, q, tokens, uniforms, draw(st.sampled_from(FLOAT_DTYPES)))


@dataclass
class FuzzStats:
    """Counters a run can report: cases checked per property, and rounding near-ties."""

    cases: dict[str, int] = field(default_factory=dict)
    near_ties: dict[str, int] = field(default_factory=dict)


STATS = FuzzStats()
NUDGE = 1e-5  # how close to a decision boundary a uniform must be for rounding to excuse a difference


def check_verify_rejection(case: VerifyRejectionCase) -> None:
    tokens, parents, p, q, u = case.tensors()
    path, token = ops.verify_rejection(tokens, parents, p, q, u)
    ref_path, ref_token = verify_rejection(tokens, parents, p, q, u)
    got = (path.tolist(), int(token))
    if got != (ref_path.tolist(), ref_token):
        # The op keeps the residual in float32, the reference in float64: they may part only where a
        # uniform sits within rounding of an acceptance threshold or a CDF step. Then moving that one
        # uniform by NUDGE must give the op's answer; anything else is a real difference.
        assert _rounding_explains(got, tokens, parents, p, q, u), (got, (ref_path.tolist(), ref_token))
        STATS.near_ties["verify_rejection"] = STATS.near_ties.get("verify_rejection", 0) + 1
    nodes = got[0]
    _assert_root_path(nodes, case.parents, 0)
    # Residuals max(r - q, 0) stay inside p's support: the output token is one p can emit there.
    assert 0 <= got[1] < p.shape[1] and p[nodes[-1], got[1]] > 0


def _rounding_explains(got: tuple[list[int], int], tokens, parents, p, q, u) -> bool:
    for i in range(len(u)):
        for step in (-NUDGE, NUDGE):
            nudged = u.clone()
            nudged[i] = min(max(float(u[i]) + step, 0.0), 1.0 - 2**-53)
            ref_path, ref_token = verify_rejection(tokens, parents, p, q, nudged)
            if (ref_path.tolist(), ref_token) == got:
                return True
    return False


# --- KV-cache compaction ---------------------------------------------------------------------------------

CACHE_DTYPES = [*FLOAT_DTYPES, torch.float64, torch.int8]


@dataclass(frozen=True)
class CompactCase:
    seq_len: int
    shapes: list[tuple[int, int, int]]  # per cache: (batch, heads, head_dim)
    layouts: list[str]  # per cache: "contiguous", "transposed", "head_slice", "seq_prefix"
    dtype: torch.dtype
    src: list[int]
    dst_start: int
    src_dtype: torch.dtype
    specials: bool  # NaN, inf and -0.0 among the values (bits must survive the move)
    seed: int


@st.composite
def compact_cases(draw: st.DrawFn) -> CompactCase:
    seq_len = draw(st.integers(1, 48))
    n_caches = draw(st.integers(1, 4))
    shapes = [
        (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 16))) for _ in range(n_caches)
    ]
    layouts = [
        draw(st.sampled_from(["contiguous", "transposed", "head_slice", "seq_prefix"])) for _ in shapes
    ]
    dst_start = draw(st.integers(0, seq_len))
    # Distinct sorted sources in [dst_start, S): src[j] >= dst_start + j holds by construction.
    src: list[int] = []
    if dst_start < seq_len:
        rows = st.integers(dst_start, seq_len - 1)
        src = sorted(draw(st.lists(rows, unique=True, max_size=seq_len - dst_start)))
    return CompactCase(
        seq_len,
        shapes,
        layouts,
        draw(st.sampled_from(CACHE_DTYPES)),
        src,
        dst_start,
        draw(st.sampled_from(INDEX_DTYPES)),
        draw(st.booleans()),
        draw(seeds),
    )


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def check_compact(case: CompactCase) -> None:
    g = torch.Generator().manual_seed(case.seed)
    s = case.seq_len
    bases, caches = [], []
    for (b, h, d), layout in zip(case.shapes, case.layouts, strict=True):
        # Each cache is a [B, H, S, D] view of `base`, all of its storage: nothing outside may move.
        storage = {"transposed": (b, s, h, d), "head_slice": (b, h + 2, s, d), "seq_prefix": (b, h, s + 5, d)}
        base = (torch.randn(storage.get(layout, (b, h, s, d)), generator=g) * 50).to(case.dtype)
        if case.specials and case.dtype.is_floating_point:
            flat = base.view(-1)
            flat[torch.randint(0, flat.numel(), (3,), generator=g)] = torch.tensor(
                [float("nan"), float("inf"), -0.0], dtype=case.dtype
            )
        if layout == "transposed":  # [B, S, H, D] storage, as some caches keep it
            cache = base.transpose(1, 2)
        elif layout == "head_slice":
            cache = base[:, 1 : 1 + h]
        elif layout == "seq_prefix":  # a static cache longer than the part in use
            cache = base[:, :, :s]
        else:
            cache = base
        bases.append(base)
        caches.append(cache)
    before = [c.clone() for c in caches]
    base_before = [x.clone() for x in bases]
    expected = [c.clone() for c in caches]
    compact_kv(expected, torch.tensor(case.src, dtype=torch.long), case.dst_start)
    ptrs = [c.data_ptr() for c in caches]
    ops.compact_kv_(caches, torch.tensor(case.src, dtype=case.src_dtype), case.dst_start)
    assert [c.data_ptr() for c in caches] == ptrs  # in place
    n, d0 = len(case.src), case.dst_start
    for c, e, old in zip(caches, expected, before, strict=True):
        assert torch.equal(_bits(c), _bits(e))
        # Invariants: rows before dst_start and past the packed block are untouched; the packed rows
        # are the accepted rows of the old cache.
        assert torch.equal(_bits(c[:, :, :d0]), _bits(old[:, :, :d0]))
        assert torch.equal(_bits(c[:, :, d0 + n :]), _bits(old[:, :, d0 + n :]))
        for j, src in enumerate(case.src):
            assert torch.equal(_bits(c[:, :, d0 + j]), _bits(old[:, :, src]))
    # Storage outside the views (other heads, positions past S) is not written either.
    for base, old_base, layout, cache in zip(bases, base_before, case.layouts, caches, strict=True):
        outside = torch.ones_like(base, dtype=torch.bool)
        if layout == "head_slice":
            outside[:, 1 : 1 + cache.shape[1]] = False
        elif layout == "seq_prefix":
            outside[:, :, :s] = False
        else:
            outside[...] = False
        assert torch.equal(_bits(base[outside]), _bits(old_base[outside]))


# --- the property table, shared with benchmarks/fuzz.py ---------------------------------------------------


@dataclass(frozen=True)
class Property:
    name: str
    strategy: Callable[[], st.SearchStrategy]
    check: Callable[[Any], None]
    fast_examples: int  # cases in the test suite's fast slice (~2-3 s each on a 2-core CPU)
    bench_examples: int  # cases in a default benchmarks/fuzz.py run (10^5 in all, ~30 min)


PROPERTIES: list[Property] = [
    Property("tree_mask", tree_mask_cases, check_tree_mask, 60, 10_000),
    Property("tree_attention", tree_attention_cases, check_tree_attention, 30, 4_000),
    Property("draft_tree", draft_tree_cases, check_draft_tree, 150, 20_000),
    Property("merge_trees", merge_cases, check_merge, 100, 14_000),
    Property("expand_draft_tree", expand_cases, check_expand, 80, 12_000),
    Property("verify_greedy", verify_greedy_cases, check_verify_greedy, 120, 15_000),
    Property("verify_rejection", verify_rejection_cases, check_verify_rejection, 60, 8_000),
    Property("compact_kv", compact_cases, check_compact, 150, 17_000),
]


def run_property(prop: Property, profile: str, max_examples: int, seed: int | None = None) -> None:
    """Run ``prop`` for ``max_examples`` cases under the named settings profile (``seed``: hypothesis's
    seed, for a run that is random yet repeatable); raises on the first, shrunk counterexample.
    ``STATS.cases[prop.name]`` counts the cases checked, shrinking included."""

    @settings(settings.get_profile(profile), max_examples=max_examples)
    @given(case=prop.strategy())
    def run(case: Any) -> None:
        STATS.cases[prop.name] = STATS.cases.get(prop.name, 0) + 1
        prop.check(case)

    if seed is not None:
        run = hypothesis.seed(seed)(run)
    run()


@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.name)
def test_fuzz(prop: Property) -> None:
    run_property(prop, PROFILE_CI, prop.fast_examples)
