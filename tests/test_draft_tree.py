"""Draft-tree construction: the C++ core (through _C.build_draft_tree) and the expand_draft_tree op (CPU,
and the CUDA kernel where there is a GPU) against reference.draft_tree."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from mtprobe import _C, ops
from mtprobe.reference import dynamic_tree, expand_tree, static_tree
from tolerances import dtype_id


def candidates(gen: torch.Generator, depths: int, m: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-m candidates of random distributions, best first: [depths, m] each."""
    probs = torch.rand(depths, vocab, generator=gen).pow(4)
    probs = probs / probs.sum(-1, keepdim=True)
    p, t = probs.topk(m, -1)
    return t, p


def run_core(root, t, p, *, dynamic, branches=(), budget=0, prune=True):
    return _C.build_draft_tree(
        root, t, p, dynamic=dynamic, branches=list(branches), budget=budget, prune=prune
    )


def check_tree_shape(tokens, parents, probs):
    assert parents[0] == -1
    for i in range(1, len(parents)):
        assert 0 <= parents[i] < i  # every parent before its children
        assert probs[i] <= probs[parents[i]] + 1e-12


def test_header_example():
    t = torch.tensor([[5, 9, 3], [4, 6, 8]])
    p = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2]])
    tokens, parents, _ = run_core(7, t, p, dynamic=False, branches=[2, 1], prune=False)
    assert (tokens, parents) == ([7, 5, 9, 4], [-1, 0, 0, 1])
    tokens, parents, _ = run_core(7, t, p, dynamic=True, budget=4, prune=False)
    assert (tokens, parents) == ([7, 5, 9, 4], [-1, 0, 0, 1])


def test_pruner_skips_parent_and_root_tokens():
    # Depth 1 proposes the root token 7 first; depth 2 proposes the parent's token 5 first.
    t = torch.tensor([[7, 5, 9, 3], [5, 7, 4, 6]])
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    tokens, parents, _ = run_core(7, t, p, dynamic=False, branches=[2, 1], prune=True)
    assert (tokens, parents) == ([7, 5, 9, 4], [-1, 0, 0, 1])
    tokens, _, _ = run_core(7, t, p, dynamic=False, branches=[2, 1], prune=False)
    assert tokens == [7, 7, 5, 5]


@pytest.mark.parametrize("depths", [1, 2, 3, 4])
@pytest.mark.parametrize("prune", [True, False])
def test_static_matches_reference(depths, prune):
    gen = torch.Generator().manual_seed(depths * 10 + prune)
    for _ in range(20):
        branches = torch.randint(1, 6, (depths,), generator=gen).tolist()
        t, p = candidates(gen, depths, max(branches) + 2, vocab=12)
        root = int(torch.randint(0, 12, (1,), generator=gen))
        core = run_core(root, t, p, dynamic=False, branches=branches, prune=prune)
        ref = static_tree(root, t.tolist(), p.tolist(), branches, prune)
        assert core[0] == ref[0] and core[1] == ref[1]
        assert core[2] == pytest.approx(ref[2], rel=1e-12)
        assert len(core[0]) <= 1 + sum(branches)
        check_tree_shape(*core)


@pytest.mark.parametrize("depths", [1, 2, 3, 4])
@pytest.mark.parametrize("budget", [2, 5, 10, 20, 30])
@pytest.mark.parametrize("prune", [True, False])
def test_dynamic_matches_reference(depths, budget, prune):
    gen = torch.Generator().manual_seed(depths * 1000 + budget * 10 + prune)
    for _ in range(10):
        t, p = candidates(gen, depths, budget + 1, vocab=64)
        root = int(torch.randint(0, 64, (1,), generator=gen))
        core = run_core(root, t, p, dynamic=True, budget=budget, prune=prune)
        ref = dynamic_tree(root, t.tolist(), p.tolist(), budget, prune)
        assert core[0] == ref[0] and core[1] == ref[1]
        assert len(core[0]) <= budget  # the budget B counts the root
        check_tree_shape(*core)
        if prune:
            for i in range(1, len(core[0])):
                assert core[0][i] not in (root, core[0][core[1][i]])


def test_dynamic_tree_grows_where_the_model_is_unsure():
    # Confident depth 1 (one token has 0.97): the budget goes deeper; uncertain: it goes wider.
    sure = torch.tensor([[0.97, 0.01, 0.01, 0.01], [0.5, 0.2, 0.2, 0.1]])
    unsure = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.2, 0.2, 0.1]])
    t = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    deep = run_core(0, t, sure, dynamic=True, budget=5, prune=False)
    wide = run_core(0, t, unsure, dynamic=True, budget=5, prune=False)
    assert sum(1 for p in deep[1] if p > 0) > sum(1 for p in wide[1] if p > 0)


# --- expand_draft_tree: the dynamic tree from the masks' logits, on their device --------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_logits(gen: torch.Generator, depths: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    # Peaked rows, rounded to the dtype first: both sides then see the very same logits.
    return (torch.randn(depths, vocab, generator=gen) * 3).to(dtype)


def unpadded(out: tuple) -> tuple[list[int], list[int], list[float]]:
    tokens, parents, probs, n = out
    n = int(n)
    assert tokens[n:].eq(-1).all() and parents[n:].eq(-1).all() and probs[n:].eq(0).all()
    return tokens[:n].tolist(), parents[:n].tolist(), probs[:n].tolist()


def test_expand_docstring_example():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]])
    out = ops.expand_draft_tree(logits, torch.tensor(2), budget=6, width=2)
    tokens, parents, probs = unpadded(out)
    # depth 1: 0 (.665), 1 (.245); depth 2: 1 (.909), then 0 and 2 tie at logit 0: 0 (.045) wins.
    # The pruner drops 0 -> 0 and 1 -> 1.
    assert (tokens, parents) == ([2, 0, 1, 1, 0], [-1, 0, 0, 1, 2])
    e = torch.tensor([2.0, 1.0, 0.0]).exp()
    p1 = (e / e.sum()).tolist()
    e2 = torch.tensor([0.0, 3.0, 0.0]).exp()
    p2 = (e2 / e2.sum()).tolist()
    assert probs == pytest.approx([1.0, p1[0], p1[1], p1[0] * p2[1], p1[1] * p2[0]], rel=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("depths", [1, 2, 4])
@pytest.mark.parametrize("budget", [1, 2, 7, 16, 30])
def test_expand_matches_reference(dtype, depths, budget):
    gen = torch.Generator().manual_seed(depths * 100 + budget)
    for trial in range(4):
        vocab = [5, 64, 1000, 49152][trial]
        width = min(vocab, [1, budget + 1, 3, budget + 1][trial])
        logits = random_logits(gen, depths, vocab, dtype)
        root = int(torch.randint(0, vocab, (1,), generator=gen))
        for prune in (True, False):
            out = ops.expand_draft_tree(logits, torch.tensor(root), budget=budget, width=width, prune=prune)
            assert [t.dtype for t in out] == [torch.long, torch.long, torch.float64, torch.long]
            assert [tuple(t.shape) for t in out] == [(budget,), (budget,), (budget,), ()]
            tokens, parents, probs = unpadded(out)
            ref = expand_tree(logits, root, budget, width, prune)
            assert (tokens, parents) == (ref[0], ref[1])
            assert probs == pytest.approx(ref[2], rel=1e-6)
            check_tree_shape(tokens, parents, probs)


def test_expand_ties_go_to_the_lower_token_id():
    # Every logit equal: the candidates are 0, 1, 2, ... in order, whatever the dtype.
    for dtype in DTYPES:
        out = ops.expand_draft_tree(torch.zeros(1, 10, dtype=dtype), torch.tensor(9), budget=4, width=3)
        assert unpadded(out)[0] == [9, 0, 1, 2]


def test_expand_equals_the_drafters_core():
    # The op's tree is the drafter's: build_dynamic_tree on the same top-m candidates.
    gen = torch.Generator().manual_seed(3)
    logits = random_logits(gen, 3, 200, torch.float32)
    p, t = logits.softmax(-1).topk(9, -1)
    core = run_core(5, t, p, dynamic=True, budget=8, prune=True)
    tokens, parents, _ = unpadded(ops.expand_draft_tree(logits, torch.tensor([5]), budget=8, width=9))
    assert (tokens, parents) == (core[0], core[1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.zeros(10), torch.tensor(0), 4, 2, True), r"logits must be \[depths, vocab\]"),
        ((torch.zeros(0, 10), torch.tensor(0), 4, 2, True), r"logits must be \[depths, vocab\]"),
        ((torch.zeros(2, 10, dtype=torch.long), torch.tensor(0), 4, 2, True), "floating point"),
        ((torch.zeros(2, 10), torch.tensor([0, 1]), 4, 2, True), "root_token must be one int32/int64 token"),
        ((torch.zeros(2, 10), torch.tensor(0.0), 4, 2, True), "root_token must be one int32/int64 token"),
        ((torch.zeros(2, 10), torch.tensor(0), 0, 2, True), "budget counts the root"),
        ((torch.zeros(2, 10), torch.tensor(0), 4, 0, True), r"width .* must be in \[1, 10\]"),
        ((torch.zeros(2, 10), torch.tensor(0), 4, 11, True), r"width .* must be in \[1, 10\]"),
        ((torch.full((1, 3), float("nan")), torch.tensor(0), 4, 2, True), "NaN"),
        # Sizes that make no sense: past the int32 node indices, or a workspace above 1 GiB.
        ((torch.zeros(1, 10), torch.tensor(0), 2**31, 2, True), "int32 indices"),
        ((torch.zeros(4, 5000), torch.tensor(0), 4000, 4000, True), r"above the limit of 1024 MiB"),
    ],
)
def test_expand_rejects_bad_input(args, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        torch.ops.mtprobe.expand_draft_tree(*args)


@pytest.mark.parametrize("test_util", ["test_schema", "test_autograd_registration", "test_faketensor"])
def test_opcheck_expand_draft_tree(test_util):
    logits = random_logits(torch.Generator().manual_seed(0), 2, 50, torch.float32)
    sample = (logits, torch.tensor(3), 6, 7, True)
    opcheck(torch.ops.mtprobe.expand_draft_tree.default, sample, test_utils=test_util)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("budget", [1, 16, 30])
def test_expand_path_probabilities(dtype, budget):
    # The checks the GPU test below applies, on the CPU op: each node's probability is the product
    # of its tokens' softmax probabilities, and a tree compared with itself has no differing path.
    gen = torch.Generator().manual_seed(budget)
    for vocab in (7, 1000, 49152):
        logits = random_logits(gen, 3, vocab, dtype)
        root = torch.randint(0, vocab, (), generator=gen)
        out = ops.expand_draft_tree(logits, root, budget=budget, width=min(vocab, budget + 1))
        assert_path_probs(out, logits, root)
        assert len(token_paths(out)) == int(out[3])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("budget", [1, 8, 16, 30])
@pytest.mark.parametrize("depths", [1, 2, 3, 4])
def test_cuda_expand_matches_cpu(dtype, budget, depths):
    gen = torch.Generator().manual_seed(budget * 10 + depths)
    for vocab in (7, 1000, 49152, 151936):  # SmolLM2's vocabulary and Qwen's
        logits = random_logits(gen, depths, vocab, dtype)
        width = min(vocab, budget + 1)
        root = torch.randint(0, vocab, (), generator=gen)
        cpu = ops.expand_draft_tree(logits, root, budget=budget, width=width)
        gpu = ops.expand_draft_tree(logits.cuda(), root.cuda(), budget=budget, width=width)
        assert all(t.is_cuda for t in gpu)
        assert int(gpu[3]) == int(cpu[3])
        # The GPU's softmax sums in another order, so two candidates whose path probabilities tie
        # may rank the other way round (seen on an H100 with float16 and bfloat16 logits, where ties
        # are common). Each GPU node's probability is right, and the two trees agree as sets of
        # token paths but for such ties at the budget's edge.
        assert_path_probs(gpu, logits, root)
        on_cpu, on_gpu = token_paths(cpu), token_paths(tuple(t.cpu() for t in gpu))
        for path in on_cpu.keys() & on_gpu.keys():
            assert on_gpu[path] == pytest.approx(on_cpu[path], rel=1e-5, abs=1e-7), path
        for kept, other in ((on_cpu, on_gpu), (on_gpu, on_cpu)):
            floor = min(other.values())  # the other side's least likely node
            for path in kept.keys() - other.keys():
                assert kept[path] <= floor * (1 + 1e-5) + 1e-7, f"{path} ({kept[path]}) beats {floor}"


def token_paths(out: tuple) -> dict[tuple[int, ...], float]:
    """Each node of an expanded tree as its tokens from the root, with its path probability."""
    tokens, parents, probs = unpadded(out)
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return dict(zip(paths, probs, strict=True))


def assert_path_probs(out: tuple, logits: torch.Tensor, root: torch.Tensor) -> None:
    """Every node's probability is the product of its tokens' softmax probabilities (float64)."""
    tokens, parents, probs = unpadded(tuple(t.cpu() for t in out))
    soft = logits.double().softmax(-1)  # [depths, vocab]
    depth = [0] * len(tokens)
    expected = [1.0] * len(tokens)
    assert tokens[0] == int(root) and parents[0] == -1
    for i in range(1, len(tokens)):
        assert 0 <= parents[i] < i
        depth[i] = depth[parents[i]] + 1
        expected[i] = expected[parents[i]] * float(soft[depth[i] - 1, tokens[i]])
    assert probs == pytest.approx(expected, rel=1e-5, abs=1e-7)


@requires_cuda
def test_cuda_expand_does_not_synchronise():
    # Everything stays on the device: the op is capturable in a CUDA graph (a host read would fail).
    logits = torch.randn(3, 49152, device="cuda")
    root = torch.tensor(5, device="cuda")
    ops.expand_draft_tree(logits, root, budget=12, width=13)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.expand_draft_tree(logits, root, budget=12, width=13)
    logits.copy_(torch.randn(3, 49152, device="cuda"))
    graph.replay()
    expected = ops.expand_draft_tree(logits.cpu(), root.cpu(), budget=12, width=13)
    assert torch.equal(out[0].cpu(), expected[0]) and torch.equal(out[1].cpu(), expected[1])
