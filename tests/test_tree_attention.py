"""Tree attention with the tree given compactly (ancestor bits): the ops against the reference
definition (mtprobe.reference.tree_attention: causal attention along every root-to-leaf path), a
chain against plain causal attention, opcheck, and the transformers attention implementation
"mtprobe_tree" inside a real HF model against SDPA with the dense tree mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import mtprobe
import mtprobe.tree_attention
from conftest import load_benchmark, tiny_llama
from mtprobe.reference import tree_ancestors, tree_attention, tree_attention_mask, tree_position_ids
from mtprobe.target_model.adapter import cache_argument
from test_tree_mask import TREES, chain, random_tree
from tolerances import dtype_id, tolerance

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = {**TREES, "wide_random_tree": random_tree(70, seed=5, single_root=True)}  # 70 > 64: two words


def bits_by_definition(parents: list[int]) -> torch.Tensor:
    words = (len(parents) + 63) // 64
    out = torch.zeros(len(parents), words, dtype=torch.long)
    for i in range(len(parents)):
        value = sum(1 << a for a in tree_ancestors(torch.tensor(parents), i))  # ancestors and i itself
        for w in range(words):
            chunk = (value >> (64 * w)) & ((1 << 64) - 1)
            out[i, w] = chunk - (1 << 64) if chunk >= 1 << 63 else chunk  # the int64 with those bits
    return out


@pytest.mark.parametrize("parents", list(SHAPES.values()), ids=list(SHAPES))
def test_ancestor_bits_match_the_definition(parents: list[int]) -> None:
    bits = mtprobe.ops.tree_ancestor_bits(torch.tensor(parents))
    assert torch.equal(bits, bits_by_definition(parents))


def test_ancestor_bits_by_hand() -> None:
    assert mtprobe.ops.tree_ancestor_bits(torch.tensor([-1, 0, 0, 1])).flatten().tolist() == [1, 3, 5, 11]
    with pytest.raises(RuntimeError, match="invalid draft tree"):
        mtprobe.ops.tree_ancestor_bits(torch.tensor([-1, 2, 0]))


def _qkv(
    parents: list[int], prefix_len: int, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, seed: int = 0
):
    g = torch.Generator().manual_seed(seed)
    t, d = len(parents), 16
    q = torch.randn(2, heads, t, d, generator=g).to(dtype)  # [B, H, T, D]
    k = torch.randn(2, kv_heads, prefix_len + t, d, generator=g).to(dtype)  # [B, Hkv, P + T, D]
    v = torch.randn(2, kv_heads, prefix_len + t, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", [0, 1, 100])
@pytest.mark.parametrize("parents", list(SHAPES.values()), ids=list(SHAPES))
def test_op_matches_reference(dtype: torch.dtype, prefix_len: int, parents: list[int]) -> None:
    q, k, v = _qkv(parents, prefix_len, dtype)
    bits = mtprobe.ops.tree_ancestor_bits(torch.tensor(parents))
    out = mtprobe.ops.tree_attention(q, k, v, bits)
    expected = tree_attention(q, k, v, torch.tensor(parents))
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("prefix_len", [0, 7])
def test_chain_is_causal_attention(prefix_len: int) -> None:
    parents = chain(12)
    q, k, v = _qkv(parents, prefix_len, torch.float32, heads=2, kv_heads=2)
    out = mtprobe.ops.tree_attention(q, k, v, mtprobe.ops.tree_ancestor_bits(torch.tensor(parents)))
    causal = torch.ones(12, prefix_len + 12, dtype=torch.bool).tril(prefix_len)  # bottom-right aligned
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, attn_mask=causal), **tolerance(torch.float32)
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ("bits_rows", r"ancestor_bits must be int64 \[T, ceil\(T / 64\)\]"),
        ("bits_dtype", r"ancestor_bits must be int64"),
        ("heads", "kv heads do not divide"),
        ("short_keys", "cannot hold the"),
    ],
)
def test_op_rejects_bad_input(change: str, message: str) -> None:
    parents = [-1, 0, 0]
    q, k, v = _qkv(parents, 2, torch.float32)
    bits = mtprobe.ops.tree_ancestor_bits(torch.tensor(parents))
    if change == "bits_rows":
        bits = bits[:2]
    elif change == "bits_dtype":
        bits = bits.int()
    elif change == "heads":
        k, v = k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1)
    elif change == "short_keys":
        k, v = k[:, :, :2], v[:, :, :2]
    with pytest.raises(ValueError, match=message):
        torch.ops.mtprobe.tree_attention(q, k, v, bits, 0.25)


OPCHECK_PARENTS = [chain(5), TREES["medusa"], [-1]]


@pytest.mark.parametrize("parents", OPCHECK_PARENTS, ids=["chain", "medusa", "single"])
def test_opcheck(parents: list[int]) -> None:
    opcheck(torch.ops.mtprobe.tree_ancestor_bits.default, (torch.tensor(parents),))
    q, k, v = _qkv(parents, 3, torch.float32)
    opcheck(
        torch.ops.mtprobe.tree_attention.default,
        (q, k, v, mtprobe.ops.tree_ancestor_bits(torch.tensor(parents)), 0.25),
    )


# --- the transformers attention implementation ------------------------------------------------------


def test_hf_model_with_mtprobe_tree_matches_sdpa_with_the_dense_mask() -> None:
    from transformers import DynamicCache

    mtprobe.tree_attention.register()
    sdpa = tiny_llama(vocab_size=64)
    tree = tiny_llama(vocab_size=64)  # the same seed: the same weights
    tree.set_attn_implementation(mtprobe.tree_attention.NAME)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    parents = torch.tensor(TREES["medusa"])
    block = torch.randint(0, 64, (1, len(parents)), generator=torch.Generator().manual_seed(2))
    p = prompt.shape[1]
    logits = {}
    for name, model in (("sdpa", sdpa), ("tree", tree)):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            kv = {cache_argument(model): cache}
            first = model(prompt, **kv).logits  # the prefill: no mask, a chain
            mask = (
                tree_attention_mask(parents, p, torch.float32)
                if name == "sdpa"
                else mtprobe.ops.tree_ancestor_bits(parents)[None, None]
            )
            logits[name] = (
                first,
                model(
                    block,
                    attention_mask=mask,
                    position_ids=tree_position_ids(parents, p),
                    **kv,
                ).logits,
            )
    for a, b in zip(logits["sdpa"], logits["tree"], strict=True):
        torch.testing.assert_close(a, b, **tolerance(torch.float32))


def test_hf_attention_function_rejects_a_dense_mask() -> None:
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="int64 ancestor bits"):
        mtprobe.tree_attention.tree_attention_forward(None, q, q, q, torch.zeros(1, 1, 3, 3))


# --- the CUDA kernel (csrc/kernels/tree_attention.cuh) ------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("prefix_len", [0, 512, 2048, 8192])
@pytest.mark.parametrize(
    "parents", [chain(16), TREES["star"], TREES["medusa"], random_tree(64, seed=3, single_root=True)]
)
def test_cuda_op_matches_reference(dtype: torch.dtype, prefix_len: int, parents: list[int]) -> None:
    q, k, v = _qkv(parents, prefix_len, dtype)
    bits = mtprobe.ops.tree_ancestor_bits(torch.tensor(parents).cuda())
    assert torch.equal(bits.cpu(), bits_by_definition(parents))
    out = mtprobe.ops.tree_attention(q.cuda(), k.cuda(), v.cuda(), bits)
    torch.testing.assert_close(out.cpu(), tree_attention(q, k, v, torch.tensor(parents)), **tolerance(dtype))


# --- the decode loop on "mtprobe_tree" ---------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        mtprobe.ProbeConfig(block_complexity=30),
        mtprobe.ProbeConfig(block_complexity=60, num_masks=2),
        mtprobe.StandConfig(block_complexity=30),
        mtprobe.LookaheadConfig.for_block_complexity(30),
        mtprobe.HybridConfig(block_complexity=30),
    ],
    ids=["probe30", "probe60", "stand30", "lookahead30", "hybrid30"],
)
def test_decode_loop_passes_ancestor_bits_and_stays_lossless(cfg) -> None:
    mtprobe.tree_attention.register()
    model = tiny_llama(vocab_size=24, eos_token_id=23)
    model.set_attn_implementation(mtprobe.tree_attention.NAME)
    seen = []

    def record(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        seen.append(None if mask is None else mask.dtype)

    handle = model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        gen = torch.Generator().manual_seed(0)
        for length in (1, 12):
            prompt = torch.randint(0, 6, (1, length), generator=gen)
            ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
            out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30)
            assert torch.equal(out.sequences, ref), length
    finally:
        handle.remove()
    assert torch.long in seen  # tree blocks went through as ancestor bits, not dense masks
    assert not any(dtype is not None and dtype.is_floating_point for dtype in seen)


def test_benchmark_script_runs(tmp_path):
    # benchmarks/bench_tree_attention.py end to end on tiny shapes (it times, so nothing is asserted
    # about speed): every row is reported and both attentions agree.
    bench = load_benchmark("bench_tree_attention")
    out = tmp_path / "report.md"
    args = ["--device", "cpu", "--dtype", "float32", "--prefix", "0", "40", "--tree-tokens", "3", "65"]
    assert bench.main([*args, "--reps", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = [
        line.split(" | ")
        for line in out.read_text().splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    assert [r[0:2] for r in rows[1:]] == [["| 0", "3"], ["| 0", "65"], ["| 40", "3"], ["| 40", "65"]]
    assert all(float(r[-1].rstrip(" |")) <= 1e-5 for r in rows[1:])
    with pytest.raises(SystemExit):
        bench.main(["--heads", "9", "--kv-heads", "2"])
