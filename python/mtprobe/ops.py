"""torch.ops.mtprobe: typed wrappers and fake kernels.

The CPU kernels are C++ (csrc/ops/); importing this module loads them. When the extension is built
with CUDA, the ops also take CUDA tensors (csrc/ops/*_cuda.cu, every op here but
``small_batch_linear``, ``quantized_linear`` and the ``quantize_search`` ops); those kernels ran once, on an H100 on 2026-11-26, and matched the CPU ops
wherever the test was right (benchmarks/results/gpu/README.md). The fake kernels below give every op
its output metadata without running it, so the ops trace under torch.compile and pass
``torch.library.opcheck``. Reference definitions: ``mtprobe.reference``.
"""

from __future__ import annotations

import torch

from mtprobe import _C  # noqa: F401  (registers torch.ops.mtprobe)

__all__ = [
    "tree_attention_mask",
    "tree_position_ids",
    "tree_ancestor_bits",
    "tree_attention",
    "expand_draft_tree",
    "verify_greedy",
    "verify_rejection",
    "compact_kv_",
    "small_batch_linear",
    "pack_panels",
    "panel_linear",
    "quantized_linear",
    "quantized_linear_int8",
    "quantize_search_q4_1",
    "quantize_search_q8_0",
    "circuit_log_prob",
    "circuit_prefix_log_marginals",
    "circuit_next_token_log_probs",
    "circuit_sample",
]


@torch.library.register_fake("mtprobe::tree_attention_mask")
def _tree_attention_mask_fake(parents: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    t = parents.shape[0]
    return parents.new_empty((1, 1, t, prefix_len + t), dtype=dtype)


@torch.library.register_fake("mtprobe::tree_position_ids")
def _tree_position_ids_fake(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    return parents.new_empty((1, parents.shape[0]), dtype=torch.long)


@torch.library.register_fake("mtprobe::tree_ancestor_bits")
def _tree_ancestor_bits_fake(parents: torch.Tensor) -> torch.Tensor:
    t = parents.shape[0]
    return parents.new_empty((t, (t + 63) // 64), dtype=torch.long)


@torch.library.register_fake("mtprobe::tree_attention")
def _tree_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor, scale: float
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("mtprobe::expand_draft_tree")
def _expand_draft_tree_fake(
    logits: torch.Tensor, root_token: torch.Tensor, budget: int, width: int, prune: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Fixed shapes (padded to the budget), so a step that expands the tree keeps static shapes.
    return (
        logits.new_empty((budget,), dtype=torch.long),
        logits.new_empty((budget,), dtype=torch.long),
        logits.new_empty((budget,), dtype=torch.float64),
        logits.new_empty((), dtype=torch.long),
    )


@torch.library.register_fake("mtprobe::verify_greedy")
def _verify_greedy_fake(
    tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, root: int
) -> torch.Tensor:
    # The accepted path's length depends on the data.
    n = torch.library.get_ctx().new_dynamic_size()
    return tokens.new_empty((n,), dtype=torch.long)


@torch.library.register_fake("mtprobe::verify_rejection")
def _verify_rejection_fake(
    tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n = torch.library.get_ctx().new_dynamic_size()
    return tokens.new_empty((n,), dtype=torch.long), tokens.new_empty((), dtype=torch.long)


@torch.library.register_fake("mtprobe::compact_kv_")
def _compact_kv_fake(caches: list[torch.Tensor], src: torch.Tensor, dst_start: int) -> None:
    return None


@torch.library.register_fake("mtprobe::small_batch_linear")
def _small_batch_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("mtprobe::pack_panels")
def _pack_panels_fake(weight: torch.Tensor) -> torch.Tensor:
    out, inp = weight.shape
    return weight.new_empty((-(-out // 32), inp, 32))


@torch.library.register_fake("mtprobe::panel_linear")
def _panel_linear_fake(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("mtprobe::quantized_linear")
def _quantized_linear_fake(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    min: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


# The same shapes on int8 activations.
torch.library.register_fake("mtprobe::quantized_linear_int8")(_quantized_linear_fake)


@torch.library.register_fake("mtprobe::quantize_search_q4_1")
def _quantize_search_q4_1_fake(
    weight: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    min: torch.Tensor,
    error_weights: torch.Tensor,
    cuts: list[float],
    refines: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(codes), torch.empty_like(scale), torch.empty_like(min)


@torch.library.register_fake("mtprobe::quantize_search_q8_0")
def _quantize_search_q8_0_fake(
    weight: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    error_weights: torch.Tensor,
    iterations: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(codes), torch.empty_like(scale)


def _circuit_out_dtype(emissions: torch.Tensor) -> torch.dtype:
    # float64 stays float64; float32, float16 and bfloat16 parameters give float32 log-values.
    return torch.float64 if emissions.dtype == torch.float64 else torch.float32


def _circuit_window(kind: str, emissions: torch.Tensor) -> int:
    return emissions.shape[2] if kind == "cp" else emissions.shape[1]  # n


@torch.library.register_fake("mtprobe::circuit_log_prob")
def _circuit_log_prob_fake(
    kind: str, weights: torch.Tensor, transitions: torch.Tensor, emissions: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    return emissions.new_empty((emissions.shape[0],), dtype=_circuit_out_dtype(emissions))


@torch.library.register_fake("mtprobe::circuit_prefix_log_marginals")
def _circuit_prefix_log_marginals_fake(
    kind: str, weights: torch.Tensor, transitions: torch.Tensor, emissions: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    shape = (emissions.shape[0], _circuit_window(kind, emissions))
    return emissions.new_empty(shape, dtype=_circuit_out_dtype(emissions))


@torch.library.register_fake("mtprobe::circuit_next_token_log_probs")
def _circuit_next_token_log_probs_fake(
    kind: str, weights: torch.Tensor, transitions: torch.Tensor, emissions: torch.Tensor, prefix: torch.Tensor
) -> torch.Tensor:
    shape = (emissions.shape[0], emissions.shape[-1])
    return emissions.new_empty(shape, dtype=_circuit_out_dtype(emissions))


@torch.library.register_fake("mtprobe::circuit_sample")
def _circuit_sample_fake(
    kind: str,
    weights: torch.Tensor,
    transitions: torch.Tensor,
    emissions: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    return emissions.new_empty((emissions.shape[0], _circuit_window(kind, emissions)), dtype=torch.long)


def tree_attention_mask(
    parents: torch.Tensor, prefix_len: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive mask ``[1, 1, T, prefix_len + T]`` of a draft block (see ``reference.tree_mask``)."""
    return torch.ops.mtprobe.tree_attention_mask(parents, prefix_len, dtype)


def tree_position_ids(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Position ids ``[1, T]``: ``prefix_len + depth``."""
    return torch.ops.mtprobe.tree_position_ids(parents, prefix_len)


def expand_draft_tree(
    logits: torch.Tensor,
    root_token: torch.Tensor | int,
    budget: int,
    width: int | None = None,
    prune: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dynamic draft tree (seed 001, Alg. 1) from the mask tokens' logits, on their device.

    ``logits``: ``[depths, vocab]``, row ``d - 1`` the ``d``-th mask token's logits. Each row's top
    ``width`` tokens (by logit, ties to the lower id; default ``budget + 1``) and their softmax
    probabilities are that depth's candidates. Returns ``(tokens, parents, probs, num_nodes)``: the
    first ``num_nodes`` entries of the ``[budget]`` tensors are the tree (root first, parents before
    children, ``probs`` the cumulative path probabilities), the rest padding (token -1, parent -1,
    prob 0). On a GPU nothing is read back to the host. Reference: ``reference.expand_tree``.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]]).log_softmax(-1)
    >>> tokens, parents, probs, n = expand_draft_tree(logits, torch.tensor(2), budget=4, width=2)
    >>> int(n), tokens.tolist(), parents.tolist()
    (4, [2, 0, 1, 1], [-1, 0, 0, 1])
    """
    if not torch.is_tensor(root_token):
        root_token = torch.tensor(int(root_token), device=logits.device)
    if width is None:
        width = min(budget + 1, logits.shape[-1])
    return torch.ops.mtprobe.expand_draft_tree(logits, root_token, budget, width, prune)


def verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, root: int = 0
) -> torch.Tensor:
    """Accepted path ``[n_path]`` of node indices from ``root`` (see ``reference.verify``)."""
    return torch.ops.mtprobe.verify_greedy(tokens, parents, target, root)


def verify_rejection(
    tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification: (accepted path ``[n_path]``, output token ``[]``); see ``reference.verify``."""
    return torch.ops.mtprobe.verify_rejection(tokens, parents, p, q, uniforms)


def compact_kv_(caches: list[torch.Tensor], src: torch.Tensor, dst_start: int) -> None:
    """In place: ``cache[:, :, dst_start + j] = cache[:, :, src[j]]`` for every cache tensor."""
    torch.ops.mtprobe.compact_kv_(caches, src, dst_start)


def small_batch_linear(
    x: torch.Tensor,  # [..., in] float32, CPU
    weight: torch.Tensor,  # [out, in] float32 or bfloat16 (widened exactly as it is read), contiguous
    bias: torch.Tensor | None = None,  # [out] float32
) -> torch.Tensor:  # [..., out] float32
    """``x @ weight.T + bias`` with the weight read from memory once for up to 12 rows of ``x``
    (csrc/core/small_batch_linear.h); reference: :func:`mtprobe.reference.small_batch_linear`."""
    return torch.ops.mtprobe.small_batch_linear(x, weight, bias)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:  # weight [out, in] float32 or bfloat16, CPU
    """The weight in panels ``[ceil(out / 32), in, 32]`` of its dtype, for :func:`panel_linear`
    (csrc/core/panel_linear.h); reference: :func:`mtprobe.reference.pack_panels`."""
    return torch.ops.mtprobe.pack_panels(weight)


def panel_linear(
    x: torch.Tensor,  # [..., in] float32, CPU
    panels: torch.Tensor,  # [ceil(out / 32), in, 32] float32 or bfloat16: pack_panels(weight)
    bias: torch.Tensor | None,  # [out] float32
    out_features: int,
) -> torch.Tensor:  # [..., out] float32
    """``x @ weight.T + bias`` from the weight's panels, read from memory once for up to 13 rows of ``x``
    per pass (the C++ target forward's kernel); reference: :func:`mtprobe.reference.panel_linear`."""
    return torch.ops.mtprobe.panel_linear(x, panels, bias, out_features)


def quantized_linear(
    x: torch.Tensor,  # [..., in] float32, CPU
    codes: torch.Tensor,  # [out, in / 2] uint8 (Q4_1, two codes a byte) or [out, in] int8 (Q8_0)
    scale: torch.Tensor,  # [out, in / 32] float32
    min: torch.Tensor | None = None,  # [out, in / 32] float32, Q4_1 only
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """``x @ W.T + bias`` with ``W`` in groups of 32 codes (csrc/core/quantized_linear.h,
    :mod:`mtprobe.cpu.quantized_linear`); reference: :func:`mtprobe.reference.quantized_linear`."""
    return torch.ops.mtprobe.quantized_linear(x, codes, scale, min, bias)


def quantized_linear_int8(
    x: torch.Tensor,  # [..., in] float32, CPU
    codes: torch.Tensor,  # [out, in / 2] uint8 (Q4_1) or [out, in] int8 (Q8_0)
    scale: torch.Tensor,  # [out, in / 32] float32
    min: torch.Tensor | None = None,  # [out, in / 32] float32, Q4_1 only
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """:func:`quantized_linear` on ``x`` rounded to int8 per group of 32 (the quantized self-draft's C++
    step's kernel, csrc/core/quantized_linear.h); reference: :func:`mtprobe.reference.quantized_linear_int8`."""
    return torch.ops.mtprobe.quantized_linear_int8(x, codes, scale, min, bias)


def quantize_search_q4_1(
    weight: torch.Tensor,  # [out, in] float32
    codes: torch.Tensor,  # [out, in] GGUF's Q4_1 codes, as floats
    scale: torch.Tensor,  # [out, in / 32]
    min: torch.Tensor,  # [out, in / 32]
    error_weights: torch.Tensor,  # [in] non-negative
    cuts: list[float],
    refines: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every group's searched Q4_1 rounding (csrc/core/quantized_linear.h,
    :func:`mtprobe.cpu.quantized_linear.quantize`); reference: :func:`mtprobe.reference.searched_q4_1`."""
    return torch.ops.mtprobe.quantize_search_q4_1(weight, codes, scale, min, error_weights, cuts, refines)


def quantize_search_q8_0(
    weight: torch.Tensor,  # [out, in] float32
    codes: torch.Tensor,  # [out, in] GGUF's Q8_0 codes, as floats
    scale: torch.Tensor,  # [out, in / 32]
    error_weights: torch.Tensor,  # [in] non-negative
    iterations: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's searched Q8_0 scale; reference: :func:`mtprobe.reference.searched_q8_0`."""
    return torch.ops.mtprobe.quantize_search_q8_0(weight, codes, scale, error_weights, iterations)


def tree_ancestor_bits(parents: torch.Tensor) -> torch.Tensor:
    """The block's ancestor pattern, compact: ``[T, ceil(T / 64)]`` int64, bit ``a % 64`` of word
    ``a // 64`` in row ``i`` set when input ``a`` is ``i`` or an ancestor of ``i``.

    >>> tree_ancestor_bits(torch.tensor([-1, 0, 0, 1])).flatten().tolist()  # 0b0001, 0b0011, 0b0101, 0b1011
    [1, 3, 5, 11]
    """
    return torch.ops.mtprobe.tree_ancestor_bits(parents)


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Tree attention ``[B, H, T, D]`` over the cached prefix and the tree inputs, the tree given by
    :func:`tree_ancestor_bits` (no dense mask). ``k``, ``v``: ``[B, Hkv, P + T, D]``, ``Hkv`` dividing
    ``H``; ``scale`` defaults to ``1 / sqrt(D)``. Reference: ``mtprobe.reference.tree_attention``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.ops.mtprobe.tree_attention(q, k, v, ancestor_bits, float(scale))


# --- circuit heads' exact inference (csrc/core/circuit.h, csrc/ops/circuit.cpp) ----------------------


def _circuit_params(
    kind: str, weights: torch.Tensor | None, transitions: torch.Tensor | None, emissions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """None for weights (FF) or transitions (FF, CP, one-latent HMM/BTree) -> the op's empty tensors."""
    expected_dims = 3 if kind == "ff" else 4
    if emissions.dim() != expected_dims:  # the op names the bad shape
        r = 1
    else:
        r = {"ff": 1, "cp": emissions.shape[1]}.get(kind, emissions.shape[2])
    batch = emissions.shape[0] if emissions.dim() else 0
    if weights is None:
        weights = emissions.new_empty((batch, 0))  # [B, 0]
    if transitions is None:
        transitions = emissions.new_empty((batch, 0, r, r))  # [B, 0, r, r]
    return weights, transitions


def circuit_log_prob(
    kind: str,
    weights: torch.Tensor | None,
    transitions: torch.Tensor | None,
    emissions: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """log q(x_1..x_n) of one window per context: ``[B]``.

    A circuit head gives, per context, log-probabilities (``log_softmax`` outputs, not checked) of
    ``kind`` "ff", "cp", "hmm" or "btree" (layouts: ``csrc/core/circuit.h``), with a leading batch
    dimension: ``weights [B, r]`` (None or ``[B, 0]`` for FF), ``transitions [B, L - 1, r, r]`` (None or
    ``[B, 0, r, r]`` where there is one latent: FF, CP, HMM and BTree with L = 1), ``emissions`` FF
    ``[B, n, V]``, CP ``[B, r, n, V]``, HMM and BTree ``[B, n, r, V]``; float32 or float64 (float16 and
    bfloat16 are upcast and give float32). ``tokens``: ``[B, n]`` int64 in ``[0, V)``.
    CPU and CUDA (the CUDA kernels ran once, on an H100: benchmarks/results/gpu/README.md). Reference:
    ``mtprobe.reference.circuit.log_prob``.

    The header's worked example, a CP with n = 2, r = 2, V = 2 (one context):

    >>> w = torch.tensor([[0.3, 0.7]]).log()  # [B, r]
    >>> e = torch.tensor([[[[0.8, 0.2], [0.6, 0.4]], [[0.4, 0.6], [0.1, 0.9]]]]).log()  # [B, r, n, V]
    >>> circuit_log_prob("cp", w, None, e, torch.tensor([[0, 1]])).exp()
    tensor([0.3480])
    """
    weights, transitions = _circuit_params(kind, weights, transitions, emissions)
    return torch.ops.mtprobe.circuit_log_prob(kind, weights, transitions, emissions, tokens)


def circuit_prefix_log_marginals(
    kind: str,
    weights: torch.Tensor | None,
    transitions: torch.Tensor | None,
    emissions: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """log q(x_1..x_i) for i = 1..n, in one pass per context: ``[B, n]`` (parameters as in
    :func:`circuit_log_prob`). Conditionals log q(x_i | x_<i) are the differences of neighbours.

    >>> w = torch.tensor([[0.3, 0.7]]).log()
    >>> e = torch.tensor([[[[0.8, 0.2], [0.6, 0.4]], [[0.4, 0.6], [0.1, 0.9]]]]).log()
    >>> circuit_prefix_log_marginals("cp", w, None, e, torch.tensor([[1, 1]])).exp()
    tensor([[0.4800, 0.4020]])
    """
    weights, transitions = _circuit_params(kind, weights, transitions, emissions)
    return torch.ops.mtprobe.circuit_prefix_log_marginals(kind, weights, transitions, emissions, tokens)


def circuit_next_token_log_probs(
    kind: str,
    weights: torch.Tensor | None,
    transitions: torch.Tensor | None,
    emissions: torch.Tensor,
    prefix: torch.Tensor,
) -> torch.Tensor:
    """log q(v | x_1..x_len) for every token v: ``[B, V]``, from ``prefix [B, len]`` with ``len`` in
    ``[0, n)`` (one length for the batch; parameters as in :func:`circuit_log_prob`). A prefix of
    probability 0 gives -inf everywhere.

    >>> w = torch.tensor([[0.3, 0.7]]).log()
    >>> e = torch.tensor([[[[0.8, 0.2], [0.6, 0.4]], [[0.4, 0.6], [0.1, 0.9]]]]).log()
    >>> circuit_next_token_log_probs("cp", w, None, e, torch.tensor([[0]])).exp()
    tensor([[0.3308, 0.6692]])
    """
    weights, transitions = _circuit_params(kind, weights, transitions, emissions)
    return torch.ops.mtprobe.circuit_next_token_log_probs(kind, weights, transitions, emissions, prefix)


def circuit_sample(
    kind: str,
    weights: torch.Tensor | None,
    transitions: torch.Tensor | None,
    emissions: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One window per context by ancestral sampling from the caller's uniforms: ``[B, n]`` int64.

    ``uniforms``: ``[B, S + n]`` float64 in ``[0, 1)``, ``S`` the sampled latents (0 for FF, 1 for
    CP, n for HMM, L for BTree): ``u[:, :S]`` the latents' (breadth first), then one per token. Each
    categorical is drawn by inverse CDF (the first k with p_0 + .. + p_k > u, never an entry of
    probability 0), so equal uniforms give equal windows. Parameters as in :func:`circuit_log_prob`.
    Reference: ``mtprobe.reference.circuit.sample``.

    >>> w = torch.tensor([[0.3, 0.7]]).log()
    >>> e = torch.tensor([[[[0.8, 0.2], [0.6, 0.4]], [[0.4, 0.6], [0.1, 0.9]]]]).log()
    >>> circuit_sample("cp", w, None, e, torch.tensor([[0.5, 0.9, 0.3]], dtype=torch.float64))
    tensor([[1, 1]])
    """
    weights, transitions = _circuit_params(kind, weights, transitions, emissions)
    return torch.ops.mtprobe.circuit_sample(kind, weights, transitions, emissions, uniforms)
