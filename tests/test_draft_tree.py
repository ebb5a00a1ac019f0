"""Draft-tree construction: the C++ core (through _C.build_draft_tree) against reference.draft_tree."""

from __future__ import annotations

import pytest
import torch

from mtprobe import _C
from mtprobe.reference import dynamic_tree, static_tree


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
