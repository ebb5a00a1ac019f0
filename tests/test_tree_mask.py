"""Tree attention mask and position ids: the reference against hand-written cases and attention itself,
and the C++ ops (torch.ops.mtprobe.*) against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import mtprobe  # loads the C++ library, registering torch.ops.mtprobe
from mtprobe.reference import tree_attention, tree_attention_mask, tree_depths, tree_position_ids
from tolerances import dtype_id, tolerance

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]
PREFIX_LENS = [0, 1, 7, 100, 1000]


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.mtprobe, name)


def _requires_op(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not _has_op(name), reason=f"torch.ops.mtprobe.{name} is not built")


# --- tree shapes -------------------------------------------------------------------------------


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def medusa(num_heads: int, depth: int) -> list[int]:
    """A root with ``num_heads`` children, each the start of a chain ``depth`` long."""
    parents = [-1]
    for _ in range(num_heads):
        parents.append(0)
        parents.extend(len(parents) - 1 for _ in range(depth - 1))
    return parents


def random_tree(n: int, seed: int, single_root: bool) -> list[int]:
    """parents[i] uniform in [-1, i - 1] (a forest), or in [0, i - 1] below node 0 (one tree)."""
    g = torch.Generator().manual_seed(seed)
    low = 0 if single_root else -1
    return [-1] + [int(torch.randint(low, i, (), generator=g)) for i in range(1, n)]


TREES: dict[str, list[int]] = {
    "single": [-1],
    "chain": chain(9),
    "star": star(9),
    "medusa": medusa(num_heads=4, depth=3),
    "two_roots": [-1, 0, -1, 2, 1],
    **{f"random_tree{s}": random_tree(24, seed=s, single_root=True) for s in range(3)},
    **{f"random_forest{s}": random_tree(24, seed=100 + s, single_root=False) for s in range(2)},
}
tree_params = pytest.mark.parametrize("parents", list(TREES.values()), ids=list(TREES))


# --- the reference on hand-written cases -----------------------------------------------------------


def test_reference_mask_4_node_tree_by_hand() -> None:
    # node 0 -> {1, 2}, node 1 -> {3}; two prefix positions. Columns: p0 p1 n0 n1 n2 n3.
    allowed = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )  # [T, P + T]
    for dtype in FLOAT_DTYPES:
        expected = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]  # [1, 1, 4, 6]
        mask = tree_attention_mask(torch.tensor([-1, 0, 0, 1]), prefix_len=2, dtype=dtype)
        assert mask.dtype == dtype
        assert torch.equal(mask, expected)


def test_reference_position_ids_4_node_tree_by_hand() -> None:
    position_ids = tree_position_ids(torch.tensor([-1, 0, 0, 1]), prefix_len=2)
    assert position_ids.dtype == torch.long
    assert torch.equal(position_ids, torch.tensor([[2, 3, 3, 4]]))
    assert torch.equal(
        tree_position_ids(torch.tensor([-1, 0, 0, 1]), prefix_len=0), torch.tensor([[0, 1, 1, 2]])
    )


@pytest.mark.parametrize("prefix_len", PREFIX_LENS)
def test_reference_chain_mask_is_causal(prefix_len: int) -> None:
    n = 6
    causal = torch.ones(prefix_len + n, prefix_len + n, dtype=torch.bool).tril()[prefix_len:]  # [T, P + T]
    mask = tree_attention_mask(torch.tensor(chain(n)), prefix_len, torch.float32)
    assert torch.equal(mask[0, 0] == 0, causal)
    assert torch.equal(tree_position_ids(torch.tensor(chain(n)), prefix_len)[0], torch.arange(n) + prefix_len)


def test_reference_depths() -> None:
    assert tree_depths(torch.tensor(medusa(num_heads=2, depth=3))) == [0, 1, 2, 3, 1, 2, 3]
    assert tree_depths(torch.tensor(star(4))) == [0, 1, 1, 1]


BAD_PARENTS = {
    "self_parent": [-1, 1],
    "forward_parent": [-1, 2, 0],
    "below_minus_one": [-1, -2],
    "first_not_root": [0],
}


@pytest.mark.parametrize("parents", list(BAD_PARENTS.values()), ids=list(BAD_PARENTS))
def test_reference_rejects_bad_parents(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="parents"):
        tree_attention_mask(torch.tensor(parents), 3, torch.float32)
    with pytest.raises(ValueError, match="parents"):
        tree_position_ids(torch.tensor(parents), 3)


def test_reference_rejects_bad_parent_tensors() -> None:
    with pytest.raises(ValueError, match="1-D"):
        tree_attention_mask(torch.tensor([[-1, 0]]), 0, torch.float32)
    with pytest.raises(ValueError, match="int32 or int64"):
        tree_position_ids(torch.tensor([-1.0, 0.0]), 0)
    with pytest.raises(ValueError, match="prefix_len"):
        tree_position_ids(torch.tensor([-1]), -1)


# --- attention: mask + SDPA against causal SDPA and against the reference tree attention ----------


def _mask(impl: str, parents: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    if impl == "op":
        return torch.ops.mtprobe.tree_attention_mask(parents, prefix_len, dtype)
    return tree_attention_mask(parents, prefix_len, dtype)


MASK_IMPLS = [
    pytest.param("reference"),
    pytest.param("op", marks=_requires_op("tree_attention_mask")),
]


def _qkv(
    prefix_len: int, n: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries for every position and keys/values with GQA (4 query heads share 2 kv heads)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, prefix_len + n, 16, generator=g).to(dtype)  # [B, H, P + T, D]
    k = torch.randn(2, 2, prefix_len + n, 16, generator=g).to(dtype)  # [B, Hkv, P + T, D]
    v = torch.randn(2, 2, prefix_len + n, 16, generator=g).to(dtype)  # [B, Hkv, P + T, D]
    return q, k, v


@pytest.mark.parametrize("impl", MASK_IMPLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", PREFIX_LENS)
def test_chain_mask_sdpa_equals_causal_sdpa(impl: str, dtype: torch.dtype, prefix_len: int) -> None:
    n = 8
    q, k, v = _qkv(prefix_len, n, dtype, seed=prefix_len)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, prefix_len:]
    mask = _mask(impl, torch.tensor(chain(n)), prefix_len, dtype)  # [1, 1, T, P + T]
    tree = F.scaled_dot_product_attention(q[:, :, prefix_len:], k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(tree, causal, **tolerance(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", PREFIX_LENS)
def test_reference_tree_attention_on_chain_equals_causal_sdpa(dtype: torch.dtype, prefix_len: int) -> None:
    n = 8
    q, k, v = _qkv(prefix_len, n, dtype, seed=prefix_len)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, prefix_len:]
    out = tree_attention(q[:, :, prefix_len:], k, v, torch.tensor(chain(n)))
    assert out.dtype == dtype
    torch.testing.assert_close(out, causal, **tolerance(dtype))


def test_reference_tree_attention_explicit_scale() -> None:
    parents = torch.tensor(TREES["medusa"])
    n = len(TREES["medusa"])
    q, k, v = _qkv(prefix_len=5, n=n, dtype=torch.float32, seed=1)
    mask = tree_attention_mask(parents, 5, torch.float32)  # [1, 1, T, P + T]
    out = F.scaled_dot_product_attention(q[:, :, 5:], k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(tree_attention(q[:, :, 5:], k, v, parents, scale=0.3), out)


def test_reference_tree_attention_branches_are_independent() -> None:
    # Sibling branches must not see each other: changing node 2's key/value leaves nodes 1 and 3 alone.
    parents = torch.tensor([-1, 0, 0, 1])
    q, k, v = _qkv(prefix_len=3, n=4, dtype=torch.float32, seed=0)
    out = tree_attention(q[:, :, 3:], k, v, parents)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3 + 2] += 1.0
    v2[:, :, 3 + 2] += 1.0
    out2 = tree_attention(q[:, :, 3:], k2, v2, parents)
    assert torch.equal(out[:, :, [0, 1, 3]], out2[:, :, [0, 1, 3]])
    assert not torch.equal(out[:, :, 2], out2[:, :, 2])


@pytest.mark.parametrize("impl", MASK_IMPLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", PREFIX_LENS)
@tree_params
def test_mask_sdpa_equals_reference_tree_attention(
    impl: str, dtype: torch.dtype, prefix_len: int, parents: list[int]
) -> None:
    n = len(parents)
    q, k, v = _qkv(prefix_len, n, dtype, seed=n + prefix_len)
    q = q[:, :, prefix_len:]  # [B, H, T, D]
    expected = tree_attention(q, k, v, torch.tensor(parents))
    mask = _mask(impl, torch.tensor(parents), prefix_len, dtype)  # [1, 1, T, P + T]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


# --- the C++ ops against the reference ----------------------------------------------------------------


@_requires_op("tree_attention_mask")
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", PREFIX_LENS)
@tree_params
def test_op_mask_matches_reference(
    index_dtype: torch.dtype, dtype: torch.dtype, prefix_len: int, parents: list[int]
) -> None:
    parents_t = torch.tensor(parents, dtype=index_dtype)
    mask = torch.ops.mtprobe.tree_attention_mask(parents_t, prefix_len, dtype)
    expected = tree_attention_mask(parents_t, prefix_len, dtype)
    assert mask.shape == (1, 1, len(parents), prefix_len + len(parents))
    assert mask.dtype == dtype
    assert torch.equal(mask, expected)


@_requires_op("tree_position_ids")
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", PREFIX_LENS)
@tree_params
def test_op_position_ids_match_reference(
    index_dtype: torch.dtype, prefix_len: int, parents: list[int]
) -> None:
    parents_t = torch.tensor(parents, dtype=index_dtype)
    position_ids = torch.ops.mtprobe.tree_position_ids(parents_t, prefix_len)
    torch.testing.assert_close(position_ids, tree_position_ids(parents_t, prefix_len), rtol=0, atol=0)


@_requires_op("tree_position_ids")
@pytest.mark.parametrize("seed", range(20))
def test_op_matches_reference_on_many_random_trees(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 64, (), generator=g))
    prefix_len = int(torch.randint(0, 50, (), generator=g))
    parents = torch.tensor(random_tree(n, seed=seed, single_root=seed % 2 == 0))
    assert torch.equal(
        torch.ops.mtprobe.tree_position_ids(parents, prefix_len), tree_position_ids(parents, prefix_len)
    )
    assert torch.equal(
        torch.ops.mtprobe.tree_attention_mask(parents, prefix_len, torch.float16),
        tree_attention_mask(parents, prefix_len, torch.float16),
    )


@_requires_op("tree_attention_mask")
@pytest.mark.parametrize("parents", list(BAD_PARENTS.values()), ids=list(BAD_PARENTS))
def test_op_rejects_bad_parents(parents: list[int]) -> None:
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.mtprobe.tree_attention_mask(torch.tensor(parents), 3, torch.float32)
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.mtprobe.tree_position_ids(torch.tensor(parents), 3)


@_requires_op("tree_attention_mask")
def test_op_rejects_bad_parent_tensors() -> None:
    for op_args in [
        (torch.tensor([[-1, 0]]), 0),  # 2-D
        (torch.tensor([-1.0, 0.0]), 0),  # float
        (torch.tensor([-1, 0]), -1),  # negative prefix
    ]:
        with pytest.raises((RuntimeError, ValueError)):
            torch.ops.mtprobe.tree_attention_mask(*op_args, torch.float32)
        with pytest.raises((RuntimeError, ValueError)):
            torch.ops.mtprobe.tree_position_ids(*op_args)


OPCHECK_SAMPLES = [
    (torch.tensor(chain(5)), 0),
    (torch.tensor(TREES["medusa"], dtype=torch.int32), 7),
    (torch.tensor(TREES["random_forest0"]), 100),
]


@_requires_op("tree_attention_mask")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_tree_attention_mask(dtype: torch.dtype, sample: tuple[torch.Tensor, int]) -> None:
    opcheck(torch.ops.mtprobe.tree_attention_mask.default, (*sample, dtype))


@_requires_op("tree_position_ids")
@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_tree_position_ids(sample: tuple[torch.Tensor, int]) -> None:
    opcheck(torch.ops.mtprobe.tree_position_ids.default, sample)


# --- the CUDA kernels (csrc/kernels/tree_mask.cuh) against the reference ------------------------------

# --- the decode loop's builder (csrc/decode/tree_mask_builder.cpp) ----------------------------------

BUILDER_TREES = [[-1, 0, 0, 1], [-1, 0, 1, 1, 0], [-1, 0, 0, 1], [-1, 0, 1, 2]]  # a shape met twice; a chain


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "naive"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_builder_matches_reference_as_the_prefix_grows(incremental: bool, dtype: torch.dtype) -> None:
    # Prefixes past the first capacity (8) make the builder widen its buffers.
    builder = mtprobe._C.TreeMaskBuilder(8, str(dtype).removeprefix("torch."), "cpu", incremental)
    for step, prefix_len in enumerate([0, 3, 8, 9, 17, 40, 41]):
        parents = BUILDER_TREES[step % len(BUILDER_TREES)]
        position_ids, mask = builder.build(parents, prefix_len)
        parents_t = torch.tensor(parents)
        assert torch.equal(position_ids, tree_position_ids(parents_t, prefix_len))
        if parents == [-1, 0, 1, 2]:
            assert mask is None  # a chain: the model's own causal mask
        else:
            assert torch.equal(mask, tree_attention_mask(parents_t, prefix_len, dtype))
    assert builder.capacity >= 41


def test_builder_copies_the_mask_it_returns_off_the_cpu() -> None:
    # On the CPU the mask is a view into the shape's buffer (prepending prefix columns costs nothing);
    # elsewhere it is a fresh tensor, since a view starting at an arbitrary element made CUDA's
    # memory-efficient SDPA fail with "misaligned address" (an H100, 2026-11-26). The meta device
    # stands in for a GPU: it allocates as CUDA does, without one.
    cpu = mtprobe._C.TreeMaskBuilder(64, "bfloat16", "cpu", True)
    meta = mtprobe._C.TreeMaskBuilder(64, "bfloat16", "meta", True)
    for prefix_len in [1, 5, 13, 50]:
        _, on_cpu = cpu.build([-1, 0, 0], prefix_len)
        _, on_meta = meta.build([-1, 0, 0], prefix_len)
        assert on_cpu.storage_offset() == 64 - prefix_len and not on_cpu.is_contiguous()
        assert on_meta.is_meta and on_meta.shape == (1, 1, 3, prefix_len + 3)
        assert on_meta.is_contiguous() and on_meta.storage_offset() == 0


def test_builder_rejects_an_unknown_mask_dtype() -> None:
    with pytest.raises(
        ValueError, match="mask dtype must be float32, float64, float16 or bfloat16, got 'int8'"
    ):
        mtprobe._C.TreeMaskBuilder(8, "int8", "cpu", True)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", [0, 1, 511, 2048, 8192])
@tree_params
def test_cuda_mask_and_positions_match_reference(
    dtype: torch.dtype, prefix_len: int, parents: list[int]
) -> None:
    parents_t = torch.tensor(parents)
    mask = torch.ops.mtprobe.tree_attention_mask(parents_t.cuda(), prefix_len, dtype)
    assert mask.is_cuda
    assert torch.equal(mask.cpu(), tree_attention_mask(parents_t, prefix_len, dtype))
    positions = torch.ops.mtprobe.tree_position_ids(parents_t.cuda(), prefix_len)
    assert torch.equal(positions.cpu(), tree_position_ids(parents_t, prefix_len))


@requires_cuda
@pytest.mark.parametrize("prefix_len", [0, 8192])
def test_cuda_chain_mask_is_causal(prefix_len: int) -> None:
    n = 64
    mask = torch.ops.mtprobe.tree_attention_mask(torch.tensor(chain(n)).cuda(), prefix_len, torch.float32)
    allowed = mask[0, 0, :, prefix_len:] == 0  # [n, n]
    assert torch.equal(allowed.cpu(), torch.ones(n, n, dtype=torch.bool).tril())
    assert bool((mask[0, 0, :, :prefix_len] == 0).all())


@requires_cuda
def test_cuda_mask_rejects_bad_parents() -> None:
    with pytest.raises(RuntimeError, match="invalid draft tree"):
        torch.ops.mtprobe.tree_attention_mask(torch.tensor([-1, 2, 0]).cuda(), 0, torch.float32)
