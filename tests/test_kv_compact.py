"""KV-cache compaction: the reference against hand-written cases, the C++ op against the reference."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import mtprobe  # noqa: F401  (loads the C++ library, registering torch.ops.mtprobe)
from mtprobe.reference import compact_kv
from tolerances import dtype_id

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEQ_LEN = 24

requires_op = pytest.mark.skipif(
    not hasattr(torch.ops.mtprobe, "compact_kv_"), reason="torch.ops.mtprobe.compact_kv_ is not built"
)


def _caches(dtype: torch.dtype, seed: int = 0, seq_len: int = SEQ_LEN) -> list[torch.Tensor]:
    """Keys and values of two layers; the value heads are wider to check that only S must agree."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, seq_len, 8), (2, 3, seq_len, 16), (2, 3, seq_len, 8), (2, 3, seq_len, 16)]
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]  # each [B, H, S, D]


# --- the reference on hand-written cases -----------------------------------------------------------


def test_reference_hand_written() -> None:
    # Position s holds s; accepted positions 2, 4, 6 pack to 2, 3, 4 and the rest stays as it was.
    cache = torch.arange(8.0).reshape(1, 1, 8, 1).repeat(2, 3, 1, 4)  # [B, H, S, D]
    compact_kv([cache], torch.tensor([2, 4, 6]), dst_start=2)
    expected = torch.tensor([0.0, 1.0, 2.0, 4.0, 6.0, 5.0, 6.0, 7.0])
    assert torch.equal(cache, expected.reshape(1, 1, 8, 1).expand(2, 3, 8, 4))


def test_reference_adjacent_overlap_reads_before_writing() -> None:
    # Each write lands on the slot just read: [1, 2, 3] -> [0, 1, 2] must shift, not smear.
    cache = torch.arange(5.0).reshape(1, 1, 5, 1)  # [B, H, S, D]
    compact_kv([cache], torch.tensor([1, 2, 3]), dst_start=0)
    assert cache.flatten().tolist() == [1.0, 2.0, 3.0, 3.0, 4.0]


BAD_COMPACTIONS: dict[str, tuple[list[int], int]] = {
    "not_increasing": ([5, 4], 0),
    "repeated": ([5, 5], 0),
    "source_before_destination": ([3, 4], 4),
    "later_source_before_destination": ([6, 7, 7], 5),
    "out_of_range": ([10, SEQ_LEN], 0),
    "negative_dst_start": ([3], -1),
}
bad_compaction_params = pytest.mark.parametrize(
    "case", list(BAD_COMPACTIONS.values()), ids=list(BAD_COMPACTIONS)
)


@bad_compaction_params
def test_reference_rejects_bad_src(case: tuple[list[int], int]) -> None:
    src, dst_start = case
    caches = _caches(torch.float32)
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError):
        compact_kv(caches, torch.tensor(src), dst_start)
    # Checked before anything moves.
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))


def test_reference_rejects_mismatched_sequence_lengths() -> None:
    caches = [torch.zeros(1, 2, SEQ_LEN, 4), torch.zeros(1, 2, SEQ_LEN + 1, 4)]
    with pytest.raises(ValueError, match="sequence length"):
        compact_kv(caches, torch.tensor([3]), 1)


# --- the C++ op against the reference ---------------------------------------------------------------

COMPACTIONS: dict[str, tuple[list[int], int]] = {
    "noop": ([5, 6, 7, 8], 5),  # src == dst
    "partial_noop": ([5, 6, 9, 12], 5),  # first two stay, then moves
    "overlapping_shift": ([6, 7, 8, 9], 5),  # each write hits the slot read one step before
    "overlapping_sparse": ([7, 9, 12, 13, 20], 5),
    "far": ([20, 21, 23], 0),
    "single": ([17], 3),
    "last_position": ([SEQ_LEN - 1], SEQ_LEN - 1),
    "empty": ([], 4),
}


def _random_compaction(g: torch.Generator) -> tuple[list[int], int]:
    dst_start = int(torch.randint(0, SEQ_LEN, (), generator=g))
    n = int(torch.randint(0, SEQ_LEN - dst_start + 1, (), generator=g))
    # n distinct sources in [dst_start, S): sorted, the j-th is >= dst_start + j.
    src = sorted((torch.randperm(SEQ_LEN - dst_start, generator=g)[:n] + dst_start).tolist())
    return src, dst_start


_g = torch.Generator().manual_seed(0)
COMPACTIONS.update({f"random{i}": _random_compaction(_g) for i in range(8)})


@requires_op
@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(COMPACTIONS.values()), ids=list(COMPACTIONS))
def test_op_matches_reference(
    case: tuple[list[int], int], dtype: torch.dtype, src_dtype: torch.dtype
) -> None:
    src, dst_start = case
    caches = _caches(dtype)
    expected = [c.clone() for c in caches]
    compact_kv(expected, torch.tensor(src, dtype=torch.long), dst_start)
    ptrs = [c.data_ptr() for c in caches]
    torch.ops.mtprobe.compact_kv_(caches, torch.tensor(src, dtype=src_dtype), dst_start)
    assert [c.data_ptr() for c in caches] == ptrs  # in place
    for c, e in zip(caches, expected, strict=True):
        assert c.dtype == dtype
        assert torch.equal(c, e)


@requires_op
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.float64, torch.int8], ids=dtype_id)
def test_op_copies_bits_exactly(dtype: torch.dtype) -> None:
    # A move is a copy: NaN, inf, -0.0 and any other bit pattern must survive unchanged.
    cache = torch.randint(-100, 100, (1, 2, 10, 4)).to(dtype)  # [B, H, S, D]
    if dtype.is_floating_point:
        cache[0, 0, 7] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")], dtype=dtype)
    expected = cache.clone()
    compact_kv([expected], torch.tensor([3, 7, 9]), 1)
    torch.ops.mtprobe.compact_kv_([cache], torch.tensor([3, 7, 9]), 1)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@requires_op
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_op_on_non_contiguous_caches(dtype: torch.dtype) -> None:
    # [B, S, H, D] storage seen as [B, H, S, D], and a slice of a longer (static) cache.
    g = torch.Generator().manual_seed(1)
    transposed = torch.randn(2, SEQ_LEN, 3, 8, generator=g).to(dtype).transpose(1, 2)  # [B, H, S, D]
    sliced = torch.randn(2, 5, SEQ_LEN, 8, generator=g).to(dtype)[:, 1:4]  # [B, H, S, D]
    caches = [transposed, sliced]
    expected = [c.clone() for c in caches]
    src, dst_start = COMPACTIONS["overlapping_sparse"]
    compact_kv(expected, torch.tensor(src), dst_start)
    torch.ops.mtprobe.compact_kv_(caches, torch.tensor(src), dst_start)
    for c, e in zip(caches, expected, strict=True):
        assert torch.equal(c, e)


@requires_op
@pytest.mark.parametrize("seed", range(20))
def test_op_matches_reference_on_random_compactions(seed: int) -> None:
    g = torch.Generator().manual_seed(1000 + seed)
    src, dst_start = _random_compaction(g)
    caches = _caches(torch.float16, seed=seed)
    expected = [c.clone() for c in caches]
    compact_kv(expected, torch.tensor(src, dtype=torch.long), dst_start)
    torch.ops.mtprobe.compact_kv_(caches, torch.tensor(src, dtype=torch.long), dst_start)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected, strict=True))


@requires_op
@bad_compaction_params
def test_op_rejects_bad_src(case: tuple[list[int], int]) -> None:
    src, dst_start = case
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.mtprobe.compact_kv_(_caches(torch.float32), torch.tensor(src), dst_start)


@requires_op
def test_op_rejects_mismatched_sequence_lengths() -> None:
    caches = [torch.zeros(1, 2, SEQ_LEN, 4), torch.zeros(1, 2, SEQ_LEN + 1, 4)]
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.mtprobe.compact_kv_(caches, torch.tensor([3]), 1)


@requires_op
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ["noop", "overlapping_sparse", "far"])
def test_opcheck_compact_kv(case: str, dtype: torch.dtype) -> None:
    src, dst_start = COMPACTIONS[case]
    opcheck(torch.ops.mtprobe.compact_kv_.default, (_caches(dtype), torch.tensor(src), dst_start))


# --- the CUDA kernel (csrc/kernels/kv_compact.cuh) against the reference ------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.int8, torch.float64], ids=dtype_id)
@pytest.mark.parametrize("case", list(COMPACTIONS.values()), ids=list(COMPACTIONS))
def test_cuda_op_matches_reference(case: tuple[list[int], int], dtype: torch.dtype) -> None:
    src, dst_start = case
    caches = _caches(dtype) if dtype.is_floating_point else [c.to(dtype) for c in _caches(torch.float32)]
    expected = [c.clone() for c in caches]
    compact_kv(expected, torch.tensor(src, dtype=torch.long), dst_start)
    on_gpu = [c.cuda() for c in caches]
    torch.ops.mtprobe.compact_kv_(on_gpu, torch.tensor(src, dtype=torch.long), dst_start)
    for c, e in zip(on_gpu, expected, strict=True):
        assert torch.equal(c.cpu(), e)


@requires_cuda
@pytest.mark.parametrize("seed", range(10))
def test_cuda_op_on_long_caches(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    seq_len = 8192 + 64
    dst_start = int(torch.randint(0, 8192, (), generator=g))
    n = int(torch.randint(1, 33, (), generator=g))
    # distinct rows at or after dst_start, increasing: dst_start + j <= src[j] holds
    src = sorted(torch.randperm(seq_len - dst_start, generator=g)[:n].add(dst_start).tolist())
    caches = [torch.randn(1, 4, seq_len, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    expected = [c.clone() for c in caches]
    compact_kv(expected, torch.tensor(src), dst_start)
    on_gpu = [c.cuda() for c in caches]
    torch.ops.mtprobe.compact_kv_(on_gpu, torch.tensor(src, dtype=torch.long), dst_start)
    for c, e in zip(on_gpu, expected, strict=True):
        assert torch.equal(c.cpu(), e)
