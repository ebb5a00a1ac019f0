"""Exact inference in probabilistic-circuit heads: the PyTorch reference against brute force.

Brute force is the model's definition, independent of the circuit's pass: the joint of a window is
the explicit sum over every assignment of the latent variables (root weight x transitions x
emissions); marginals and conditionals are sums over all V^n windows. The reference's ancestral
sampler is checked by a chi-square test (with a power check against a sampler that ignores the shared
latent state). The C++ core (csrc/core/circuit.h) has its own test program, tests/core/test_circuit.cpp,
checking the same quantities against brute force in C++ and its sampler by counting windows drawn
from fixed-seed uniforms (run by tests/test_core_cpp.py). Its ATen ops (torch.ops.mtprobe.circuit_*,
batched over contexts) are tested at the end against the reference, with opcheck and bad input.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.library import opcheck

import mtprobe.ops
from mtprobe.reference import circuit as ref
from test_sampling import ALPHA, chi_square_pvalue
from tolerances import TOLERANCES, Tolerance, dtype_id

# Log-probabilities of windows of up to 4 tokens (magnitude <= ~15), the reference in `dtype` against
# brute force in float64 from the same parameters.
CIRCUIT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    torch.float32: TOLERANCES[torch.float32],
}
DTYPES = list(CIRCUIT_TOLERANCES)
KINDS = list(ref.KINDS)
# (n, V, r): every window length 1..4 on tiny vocabularies.
SHAPES = [(1, 3, 2), (2, 3, 2), (3, 2, 3), (3, 3, 2), (4, 2, 2)]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = CIRCUIT_TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol.atol, rtol=tol.rtol)


def random_circuit(kind: str, n: int, vocab: int, r: int, dtype: torch.dtype, seed: int) -> ref.Circuit:
    gen = torch.Generator().manual_seed(seed)

    def logp(*shape: int) -> torch.Tensor:  # normalised over the last dimension
        return torch.randn(*shape, generator=gen, dtype=torch.float64).log_softmax(-1).to(dtype)

    num_latents = len(ref.latent_tree(kind, n)[0])
    if kind == "ff":
        return ref.Circuit("ff", None, None, logp(n, vocab))
    if kind == "cp":
        return ref.Circuit("cp", logp(r), None, logp(r, n, vocab))
    return ref.Circuit(kind, logp(r), logp(num_latents - 1, r, r), logp(n, r, vocab))


def windows(n: int, vocab: int) -> torch.Tensor:
    """Every window, lexicographically: [V^n, n]."""
    return torch.tensor(list(itertools.product(range(vocab), repeat=n)), dtype=torch.int64).view(-1, n)


def brute_joint(c: ref.Circuit, x: torch.Tensor) -> torch.Tensor:
    """q(window) for windows [W, n] by summing over all latent assignments, float64: [W]."""
    parents, _, token_parent = ref.latent_tree(c.kind, c.n)
    num_latents = len(parents)
    z = torch.tensor(list(itertools.product(range(c.r), repeat=num_latents)), dtype=torch.int64)  # [A, L]
    e = c.emissions_nrv().double()  # [n, r, V]
    logp = c.root_weights().double()[z[:, 0]][None, :].expand(x.shape[0], -1).clone()  # [W, A]
    for k in range(1, num_latents):
        logp += c.transitions.double()[k - 1, z[:, parents[k]], z[:, k]][None, :]
    for i in range(c.n):
        logp += e[i][z[:, token_parent[i]][None, :], x[:, i][:, None]]
    return logp.exp().sum(dim=1)


def tokens_in_order(children: list[list[int]], k: int) -> list[int]:
    """The tokens below latent k, depth first, left to right."""
    return [t for ch in children[k] for t in ([-1 - ch] if ch < 0 else tokens_in_order(children, ch))]


def test_latent_trees():
    assert ref.latent_tree("btree", 1) == ([-1], [[-1]], [0])
    assert ref.latent_tree("btree", 2) == ([-1], [[-1, -2]], [0, 0])
    assert ref.latent_tree("btree", 3) == ([-1, 0], [[-1, 1], [-2, -3]], [0, 1, 1])
    assert ref.latent_tree("btree", 4) == ([-1, 0, 0], [[1, 2], [-1, -2], [-3, -4]], [1, 1, 2, 2])
    assert ref.latent_tree("btree", 8)[0] == [-1, 0, 0, 1, 1, 2, 2]
    assert ref.latent_tree("btree", 8)[2] == [3, 3, 4, 4, 5, 5, 6, 6]
    assert ref.latent_tree("hmm", 3) == ([-1, 0, 1], [[-1, 1], [-2, 2], [-3]], [0, 1, 2])
    assert ref.latent_tree("cp", 3) == ([-1], [[-1, -2, -3]], [0, 0, 0])
    for n in range(2, 34):  # n - 1 latents, the left half floor(size / 2), children in token order
        parents, children, _ = ref.latent_tree("btree", n)
        assert len(parents) == n - 1 and all(p < k for k, p in enumerate(parents))
        assert tokens_in_order(children, 0) == list(range(n))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_normalised_and_equal_to_the_latent_sum(kind, dtype):
    for seed, (n, vocab, r) in enumerate(SHAPES):
        c = random_circuit(kind, n, vocab, r, dtype, seed)
        x = windows(n, vocab)
        logp = ref.log_prob(c, x)  # [V^n]
        assert logp.dtype == dtype
        close(logp.double().exp().sum(), torch.tensor(1.0), dtype)
        close(logp, brute_joint(c, x).log(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_marginals_conditionals_and_next_token(kind, dtype):
    for seed, (n, vocab, r) in enumerate(SHAPES):
        c = random_circuit(kind, n, vocab, r, dtype, 100 + seed)
        x = windows(n, vocab)
        joint = brute_joint(c, x)  # [W]
        for w in range(0, x.shape[0], 3):  # every third window
            tokens = x[w]
            prefix = torch.stack(
                [joint[(x[:, :i] == tokens[:i]).all(1)].sum() for i in range(n + 1)]
            )  # [n+1]
            close(ref.prefix_log_marginals(c, tokens), prefix[1:].log(), dtype)
            close(ref.conditional_log_probs(c, tokens), (prefix[1:] / prefix[:-1]).log(), dtype)
            for i in range(n):
                nxt = ref.next_token_log_probs(c, tokens[:i])  # [V]
                match = (x[:, :i] == tokens[:i]).all(1)
                expect = torch.stack([joint[match & (x[:, i] == v)].sum() for v in range(vocab)]) / prefix[i]
                close(nxt, expect.log(), dtype)


def test_hand_computed():
    def log(x):
        return torch.tensor(x, dtype=torch.float64).log()

    # The same cases as tests/core/test_circuit.cpp (worked out in its comments).
    hmm = ref.Circuit(
        "hmm",
        log([0.3, 0.7]),
        log([[[0.9, 0.1], [0.2, 0.8]]]),
        log([[[0.8, 0.2], [0.4, 0.6]], [[0.6, 0.4], [0.1, 0.9]]]),
    )
    assert ref.log_prob(hmm, torch.tensor([0, 0])).exp().item() == pytest.approx(0.188)
    assert ref.log_prob(hmm, torch.tensor([1, 1])).exp().item() == pytest.approx(0.363)
    btree = ref.Circuit(
        "btree",
        log([0.3, 0.7]),
        log([[[0.9, 0.1], [0.2, 0.8]]]),
        log([[[0.8, 0.2], [0.4, 0.6]], [[0.6, 0.4], [0.1, 0.9]], [[0.5, 0.5], [0.3, 0.7]]]),
    )
    assert ref.log_prob(btree, torch.tensor([0, 0, 0])).exp().item() == pytest.approx(0.08904)
    m = ref.prefix_log_marginals(btree, torch.tensor([0, 0, 0])).exp()
    assert m.tolist() == pytest.approx([0.52, 0.188, 0.08904])
    ff = ref.Circuit("ff", None, None, log([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]))
    assert ref.log_prob(ff, torch.tensor([0, 1])).exp().item() == pytest.approx(0.3)
    assert ref.sample(ff, torch.tensor([[0.85, 0.05]], dtype=torch.float64)).tolist() == [[2, 0]]
    assert ref.sample(hmm, torch.tensor([[0.5, 0.1, 0.7, 0.5]], dtype=torch.float64)).tolist() == [[1, 0]]


@pytest.mark.parametrize("structured", ["hmm", "btree"])
def test_identity_transitions_equal_cp(structured):
    # The paper's HMM initialisation: identity transitions make it CP with the same weights.
    for n in range(1, 5):
        cp = random_circuit("cp", n, 2, 3, torch.float64, n)
        num_latents = len(ref.latent_tree(structured, n)[0])
        eye = torch.eye(3, dtype=torch.float64).log().expand(num_latents - 1, 3, 3)
        other = ref.Circuit(structured, cp.weights, eye, cp.emissions.transpose(0, 1))
        x = windows(n, 2)
        close(ref.log_prob(other, x), ref.log_prob(cp, x), torch.float64)
        for tokens in x:
            close(
                ref.prefix_log_marginals(other, tokens), ref.prefix_log_marginals(cp, tokens), torch.float64
            )


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_and_beam(kind):
    for seed, (n, vocab, r) in enumerate(SHAPES):
        c = random_circuit(kind, n, vocab, r, torch.float64, 200 + seed)
        x = windows(n, vocab)
        logp = ref.log_prob(c, x)
        window, g = ref.greedy_window(c)
        for i in range(n):  # each token maximises the brute-force conditional given the greedy prefix
            match = (x[:, :i] == window[:i]).all(1)
            mass = torch.stack([logp[match & (x[:, i] == v)].exp().sum() for v in range(vocab)])
            assert window[i] == mass.argmax()
        close(g, ref.log_prob(c, window), torch.float64)
        b1, s1 = ref.beam_windows(c, 1)
        assert b1.tolist() == [window.tolist()]
        order = sorted(range(x.shape[0]), key=lambda w: (-logp[w].item(), w))  # brute-force ranking
        for k in (2, 3, x.shape[0], x.shape[0] + 5):
            beam, scores = ref.beam_windows(c, k)
            assert beam.shape == (min(k, x.shape[0]), n)
            close(scores, ref.log_prob(c, beam), torch.float64)  # exact probabilities
            assert (scores[1:] <= scores[:-1]).all() and len(set(map(tuple, beam.tolist()))) == len(beam)
            if kind == "ff" or k >= x.shape[0]:  # exact top-k
                close(scores, logp[order[: len(beam)]], torch.float64)


N_SAMPLES = 20000


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_frequencies(kind):
    n, vocab, r = 3, 3, 3
    c = random_circuit(kind, n, vocab, r, torch.float64, 300)
    gen = torch.Generator().manual_seed(7)
    u = torch.rand(N_SAMPLES, c.num_uniforms(), generator=gen, dtype=torch.float64)
    draws = ref.sample(c, u)  # [S, n]
    cells = (draws * torch.tensor([vocab**2, vocab, 1])).sum(1)
    counts = torch.bincount(cells, minlength=vocab**n)
    exact = ref.log_prob(c, windows(n, vocab)).exp()
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, f"{kind}: sampled windows differ from q (chi-square p = {p:.2e})"


def test_chi_square_rejects_a_sampler_that_ignores_the_latent():
    # The same test at the same count rejects drawing each token from its own marginal (what a
    # sampler that forgets the shared latent state does), on a CP whose components disagree.
    log = torch.tensor([[0.9, 0.1], [0.1, 0.9]], dtype=torch.float64).log()
    c = ref.Circuit("cp", torch.tensor([0.5, 0.5]).double().log(), None, log[:, None, :].expand(2, 3, 2))
    gen = torch.Generator().manual_seed(7)
    u = torch.rand(N_SAMPLES, c.num_uniforms(), generator=gen, dtype=torch.float64)
    exact = ref.log_prob(c, windows(3, 2)).exp()
    right = ref.sample(c, u)
    wrong = (u[:, 1:] >= 0.5).long()  # each position's marginal is [.5 .5]
    weights = torch.tensor([4, 2, 1])
    for draws, ok in ((right, True), (wrong, False)):
        counts = torch.bincount((draws * weights).sum(1), minlength=8)
        assert (chi_square_pvalue(counts, exact) > ALPHA) == ok


def test_sampling_never_draws_a_zero_entry():
    log = torch.tensor([[0.0, 0.5, 0.0, 0.5]], dtype=torch.float64).log()
    c = ref.Circuit("ff", None, None, log)
    u = torch.tensor([[0.0], [0.49], [0.5], [1 - 1e-16]], dtype=torch.float64)
    assert ref.sample(c, u).flatten().tolist() == [1, 1, 3, 3]


def test_bad_input():
    c = random_circuit("hmm", 3, 4, 2, torch.float64, 0)
    with pytest.raises(ValueError, match=r"kind 'tree': must be one of"):
        ref.Circuit("tree", c.weights, c.transitions, c.emissions)
    with pytest.raises(
        ValueError, match=r"transitions have shape \[1, 2, 2\]; want \[L - 1, r, r\] = \[2, 2, 2\]"
    ):
        ref.Circuit("hmm", c.weights, c.transitions[:1], c.emissions)
    with pytest.raises(ValueError, match=r"weights have shape \[3\]; want \[r\] = \[2\]"):
        ref.Circuit("hmm", torch.zeros(3), c.transitions, c.emissions)
    with pytest.raises(ValueError, match=r"emissions have shape \[3, 4\]; want \[r, n, V\]"):
        ref.Circuit("cp", c.weights, None, c.emissions[:, 0])
    with pytest.raises(ValueError, match=r"ff circuits take no weights"):
        ref.Circuit("ff", c.weights, None, c.emissions[:, 0])
    with pytest.raises(ValueError, match=r"vocabulary \[0, 4\)"):
        ref.log_prob(c, torch.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match=r"prefix length 3 is outside \[0, n\) = \[0, 3\)"):
        ref.next_token_log_probs(c, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"want \[S, 6\]"):
        ref.sample(c, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ref.sample(c, torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"beam width k = 0"):
        ref.beam_windows(c, 0)
    with pytest.raises(ValueError, match=r"n >= 1"):
        ref.latent_tree("btree", 0)


# --- the ATen ops (csrc/ops/circuit.cpp, torch.ops.mtprobe.circuit_*) against the reference ------------

# (n, V, r, B): one-token windows, one latent state, vocabularies of one and two tokens, one context
# and three; n = 3, 5 and 7 are odd (BTree's unequal halves).
OP_SHAPES = [
    (1, 1, 1, 1),
    (1, 2, 3, 3),
    (2, 1, 2, 3),
    (2, 2, 1, 1),
    (3, 2, 2, 3),
    (4, 3, 2, 1),
    (5, 2, 3, 3),
    (7, 2, 2, 2),
]
CircuitParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # weights, transitions, emissions


def batch_circuits(
    kind: str, n: int, vocab: int, r: int, batch: int, dtype: torch.dtype, seed: int
) -> tuple[list[ref.Circuit], CircuitParams]:
    """``batch`` random circuits (one per context) and the op's stacked parameters: weights [B, r]
    ([B, 0] for FF), transitions [B, L - 1, r, r] ([B, 0, r, r] with one latent), emissions."""
    circuits = [random_circuit(kind, n, vocab, r, dtype, seed + b) for b in range(batch)]
    rr = 1 if kind == "ff" else r
    weights = torch.stack([torch.empty(0, dtype=dtype) if c.weights is None else c.weights for c in circuits])
    transitions = torch.stack(
        [torch.empty(0, rr, rr, dtype=dtype) if c.transitions is None else c.transitions for c in circuits]
    )
    return circuits, (weights, transitions, torch.stack([c.emissions for c in circuits]))


def as_float64(c: ref.Circuit) -> ref.Circuit:
    def up(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.double()

    return ref.Circuit(c.kind, up(c.weights), up(c.transitions), c.emissions.double())


def context(params: CircuitParams, b: int, count: int) -> CircuitParams:
    """Context b's parameters repeated ``count`` times: [count, ...]."""
    return tuple(p[b : b + 1].expand(count, *p.shape[1:]) for p in params)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_op_log_prob_and_prefix_marginals(kind, dtype):
    for seed, (n, vocab, r, batch) in enumerate(OP_SHAPES):
        circuits, params = batch_circuits(kind, n, vocab, r, batch, dtype, 400 + 10 * seed)
        tokens = torch.randint(vocab, (batch, n), generator=torch.Generator().manual_seed(seed))
        logp = torch.ops.mtprobe.circuit_log_prob(kind, *params, tokens)  # [B]
        assert logp.dtype == dtype and logp.shape == (batch,)
        close(logp, torch.stack([ref.log_prob(c, t) for c, t in zip(circuits, tokens, strict=True)]), dtype)
        marginals = torch.ops.mtprobe.circuit_prefix_log_marginals(kind, *params, tokens)  # [B, n]
        assert marginals.dtype == dtype and marginals.shape == (batch, n)
        expect = torch.stack([ref.prefix_log_marginals(c, t) for c, t in zip(circuits, tokens, strict=True)])
        close(marginals, expect, dtype)
        # Every window of the last context, as a batch: the op's q is normalised and is the reference's.
        x = windows(n, vocab)
        every = torch.ops.mtprobe.circuit_log_prob(kind, *context(params, batch - 1, x.shape[0]), x)
        close(every, ref.log_prob(circuits[-1], x), dtype)
        close(every.double().exp().sum(), torch.tensor(1.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_op_next_token_log_probs(kind, dtype):
    for seed, (n, vocab, r, batch) in enumerate(OP_SHAPES):
        circuits, params = batch_circuits(kind, n, vocab, r, batch, dtype, 500 + 10 * seed)
        tokens = torch.randint(vocab, (batch, n), generator=torch.Generator().manual_seed(seed))
        for length in range(n):
            prefix = tokens[:, :length]  # [B, len]
            got = torch.ops.mtprobe.circuit_next_token_log_probs(kind, *params, prefix)  # [B, V]
            assert got.dtype == dtype and got.shape == (batch, vocab)
            expect = torch.stack(
                [ref.next_token_log_probs(c, p) for c, p in zip(circuits, prefix, strict=True)]
            )
            close(got, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_op_sample_equals_the_reference_sampler(kind, dtype):
    # The same uniforms give the same windows. The reference draws in the parameters' dtype; the core
    # sums in double, so the reference here gets the same values in float64 (a float32 cumulative sum
    # could round across a CDF boundary that the double one does not).
    for seed, (n, vocab, r, batch) in enumerate(OP_SHAPES):
        circuits, params = batch_circuits(kind, n, vocab, r, batch, dtype, 600 + 10 * seed)
        u = torch.rand(batch, circuits[0].num_uniforms(), generator=torch.Generator().manual_seed(seed))
        u = u.double()
        u[0] = 0.0  # both ends of [0, 1)
        u[-1, ::2] = 1 - 2**-53
        got = torch.ops.mtprobe.circuit_sample(kind, *params, u)  # [B, n]
        assert got.dtype == torch.int64 and got.shape == (batch, n)
        expect = torch.cat([ref.sample(as_float64(c), u[b : b + 1]) for b, c in enumerate(circuits)])
        assert torch.equal(got, expect), f"{kind} n={n} V={vocab} r={r} B={batch}"
        u32 = u.float().clamp(max=1 - 2**-24)  # float32 uniforms are read exactly
        assert torch.equal(
            torch.ops.mtprobe.circuit_sample(kind, *params, u32),
            torch.ops.mtprobe.circuit_sample(kind, *params, u32.double()),
        )


@pytest.mark.parametrize("kind", KINDS)
def test_op_sampling_frequencies(kind):
    # N_SAMPLES contexts sharing one circuit, one window each: a chi-square against the exact q, and
    # the same windows as the reference's sampler from the same uniforms.
    n, vocab, r = 3, 3, 3
    circuits, params = batch_circuits(kind, n, vocab, r, 1, torch.float64, 300)
    u = torch.rand(N_SAMPLES, circuits[0].num_uniforms(), generator=torch.Generator().manual_seed(8))
    draws = torch.ops.mtprobe.circuit_sample(kind, *context(params, 0, N_SAMPLES), u.double())  # [S, n]
    assert torch.equal(draws, ref.sample(circuits[0], u.double()))
    counts = torch.bincount((draws * torch.tensor([vocab**2, vocab, 1])).sum(1), minlength=vocab**n)
    exact = ref.log_prob(circuits[0], windows(n, vocab)).exp()
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, f"{kind}: windows sampled by the op differ from q (chi-square p = {p:.2e})"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_op_upcasts_half_precision(kind, dtype):
    # float16 / bfloat16 parameters are read as float32: the same results as the float32 op.
    _, params = batch_circuits(kind, 3, 4, 2, 2, torch.float32, 700)
    half = tuple(p.to(dtype) for p in params)
    up = tuple(p.float() for p in half)
    tokens = torch.tensor([[0, 3, 1], [2, 2, 0]])
    u = torch.rand(2, num_uniforms(kind, 3), dtype=torch.float64)
    for name, arg in [
        ("circuit_log_prob", tokens),
        ("circuit_prefix_log_marginals", tokens),
        ("circuit_next_token_log_probs", tokens[:, :2]),
        ("circuit_sample", u),
    ]:
        op = getattr(torch.ops.mtprobe, name)
        got = op(kind, *half, arg)
        assert got.dtype == (torch.int64 if name == "circuit_sample" else torch.float32)
        assert torch.equal(got, op(kind, *up, arg)), name


def test_op_wrappers_take_none_for_absent_parameters():
    # mtprobe.ops passes None as the op's empty weights [B, 0] (FF) and transitions [B, 0, r, r].
    tokens = torch.tensor([[1, 0, 2], [0, 0, 1]])
    for kind, n in [("ff", 3), ("cp", 3), ("hmm", 1), ("btree", 2)]:
        _, (w, t, e) = batch_circuits(kind, n, 3, 2, 2, torch.float64, 800)
        weights = None if kind == "ff" else w
        u = torch.rand(2, num_uniforms(kind, n), dtype=torch.float64)
        for name, arg in [
            ("circuit_log_prob", tokens[:, :n]),
            ("circuit_prefix_log_marginals", tokens[:, :n]),
            ("circuit_next_token_log_probs", tokens[:, : n - 1]),
            ("circuit_sample", u),
        ]:
            got = getattr(mtprobe.ops, name)(kind, weights, None, e, arg)
            assert torch.equal(got, getattr(torch.ops.mtprobe, name)(kind, w, t, e, arg)), (kind, name)


def num_uniforms(kind: str, n: int) -> int:
    return (0 if kind == "ff" else len(ref.latent_tree(kind, n)[0])) + n


def test_op_empty_batch():
    for kind in KINDS:
        _, params = batch_circuits(kind, 3, 4, 2, 1, torch.float32, 0)
        empty = tuple(p[:0] for p in params)
        tokens = torch.zeros(0, 3, dtype=torch.int64)
        u = torch.zeros(0, num_uniforms(kind, 3), dtype=torch.float64)
        assert torch.ops.mtprobe.circuit_log_prob(kind, *empty, tokens).shape == (0,)
        assert torch.ops.mtprobe.circuit_prefix_log_marginals(kind, *empty, tokens).shape == (0, 3)
        assert torch.ops.mtprobe.circuit_next_token_log_probs(kind, *empty, tokens[:, :1]).shape == (0, 4)
        assert torch.ops.mtprobe.circuit_sample(kind, *empty, u).shape == (0, 3)


def _opcheck_samples() -> dict[str, tuple]:
    """(op name, args) per case: three kinds, float32 and float64, B = 1, 2 and 3."""
    samples = {}
    for kind, (n, vocab, r, batch), dtype in [
        ("ff", (3, 4, 1, 2), torch.float32),
        ("cp", (2, 3, 2, 1), torch.float64),
        ("btree", (5, 3, 2, 3), torch.float32),
    ]:
        _, params = batch_circuits(kind, n, vocab, r, batch, dtype, 900)
        gen = torch.Generator().manual_seed(9)
        tokens = torch.randint(vocab, (batch, n), generator=gen)
        u = torch.rand(batch, num_uniforms(kind, n), generator=gen, dtype=torch.float64)
        samples[f"log_prob-{kind}"] = ("circuit_log_prob", (kind, *params, tokens))
        samples[f"prefix_log_marginals-{kind}"] = ("circuit_prefix_log_marginals", (kind, *params, tokens))
        samples[f"next_token_log_probs-{kind}"] = (
            "circuit_next_token_log_probs",
            (kind, *params, tokens[:, :-1]),
        )
        samples[f"sample-{kind}"] = ("circuit_sample", (kind, *params, u))
    return samples


OPCHECK_SAMPLES = _opcheck_samples()


@pytest.mark.parametrize(
    "test_util", ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
)
@pytest.mark.parametrize("case", list(OPCHECK_SAMPLES))
def test_opcheck_circuit_ops(case: str, test_util: str) -> None:
    name, args = OPCHECK_SAMPLES[case]
    opcheck(getattr(torch.ops.mtprobe, name).default, args, test_utils=test_util)


def _bad_inputs() -> dict[str, tuple]:
    """(op name, args, message) per case, around an HMM with B = 2, n = 3, r = 2, V = 4."""
    _, (w, t, e) = batch_circuits("hmm", 3, 4, 2, 2, torch.float64, 1000)
    _, ff = batch_circuits("ff", 3, 4, 1, 2, torch.float64, 1000)
    x = torch.tensor([[0, 1, 2], [3, 3, 0]])
    u = torch.full((2, 6), 0.5, dtype=torch.float64)

    def with_value(tensor: torch.Tensor, index: tuple[int, int], value: float) -> torch.Tensor:
        tensor = tensor.clone()
        tensor[index] = value
        return tensor

    nan_emissions = e.clone()
    nan_emissions[1] = torch.nan
    lp, nt, smp = "circuit_log_prob", "circuit_next_token_log_probs", "circuit_sample"
    return {
        "kind": (lp, ("tree", w, t, e, x), r"circuit kind 'tree' is not one of 'ff', 'cp', 'hmm', 'btree'"),
        "kind_case": (lp, ("HMM", w, t, e, x), r"circuit kind 'HMM' is not one of"),
        "emissions_rank": (
            lp,
            ("ff", ff[0], ff[1], e, x),
            r"ff emissions must be \[B, n, V\], got \[2, 3, 2, 4\]",
        ),
        "emissions_empty": (lp, ("hmm", w, t, e[:, :, :, :0], x), r"need n, r and V >= 1"),
        "weights_shape": (
            lp,
            ("hmm", w[:, :1], t, e, x),
            r"hmm weights must be \[B, r\] = \[2, 2\], got \[2, 1\]",
        ),
        "weights_batch": (lp, ("hmm", w[:1], t, e, x), r"weights must be \[B, r\] = \[2, 2\], got \[1, 2\]"),
        "ff_weights": (
            lp,
            ("ff", w, ff[1], ff[2], x),
            r"ff weights must be \[B, 0\] \(FF has no latent\) = \[2, 0\]",
        ),
        "transitions_shape": (
            lp,
            ("hmm", w, t[:, :1], e, x),
            r"hmm transitions must be \[B, L - 1, r, r\] = \[2, 2, 2, 2\] \(L = 3 latents for n = 3\), "
            r"got \[2, 1, 2, 2\]",
        ),
        "cp_transitions": (
            lp,
            ("cp", w, t, e.transpose(1, 2), x),
            r"cp transitions must be \[B, L - 1, r, r\] = \[2, 0, 2, 2\]",
        ),
        "dtype_mismatch": (
            lp,
            ("hmm", w.float(), t, e, x),
            r"must share one dtype, got Float, Double and Double",
        ),
        "integer_emissions": (lp, ("hmm", w, t, e.long(), x), r"emissions must be float32 or float64"),
        "tokens_batch": (lp, ("hmm", w, t, e, x[:1]), r"tokens must be \[B, 3\] = \[2, 3\], got \[1, 3\]"),
        "tokens_window": (
            lp,
            ("hmm", w, t, e, x[:, :2]),
            r"tokens must be \[B, 3\] = \[2, 3\], got \[2, 2\]",
        ),
        "tokens_dtype": (lp, ("hmm", w, t, e, x.double()), r"tokens must be int32 or int64, got Double"),
        "token_out_of_range": (
            "circuit_prefix_log_marginals",
            ("hmm", w, t, e, with_value(x, (1, 2), 4)),
            r"tokens\[1, 2\] = 4 is outside the vocabulary \[0, 4\)",
        ),
        "token_negative": (
            lp,
            ("hmm", w, t, e, with_value(x, (0, 1), -1)),
            r"tokens\[0, 1\] = -1 is outside",
        ),
        "prefix_too_long": (
            nt,
            ("hmm", w, t, e, x),
            r"prefix must be \[B, len\] with len in \[0, n\) = \[0, 3\)",
        ),
        "prefix_token": (
            nt,
            ("hmm", w, t, e, with_value(x[:, :1], (1, 0), 9)),
            r"prefix\[1, 0\] = 9 is outside",
        ),
        "uniform_one": (
            smp,
            ("hmm", w, t, e, with_value(u, (0, 5), 1.0)),
            r"uniforms\[0, 5\] = 1 is outside \[0, 1\)",
        ),
        "uniform_negative": (
            smp,
            ("hmm", w, t, e, with_value(u, (1, 0), -0.25)),
            r"uniforms\[1, 0\] = -0.25 is",
        ),
        "uniform_nan": (
            smp,
            ("hmm", w, t, e, with_value(u, (1, 3), torch.nan)),
            r"uniforms\[1, 3\] = nan is",
        ),
        "uniforms_width": (
            smp,
            ("hmm", w, t, e, u[:, :5]),
            r"uniforms must be \[B, S \+ n\] = \[2, 6\] \(S = 3 sampled latents, then one per token\), got \[2, 5\]",
        ),
        "uniforms_dtype": (
            smp,
            ("hmm", w, t, e, u.long()),
            r"uniforms must be float64 \(or float32\), got Long",
        ),
        "nan_parameters": (
            smp,
            ("hmm", w, t, nan_emissions, u),
            r"circuit_sample: context 1: .*NaN in an emission",
        ),
    }


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_op_rejects_bad_input(case: str) -> None:
    name, args, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        getattr(torch.ops.mtprobe, name)(*args)


# --- the CUDA kernels (csrc/kernels/circuit.cuh via csrc/ops/circuit_cuda.cu) against the CPU ops ------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The OP_SHAPES plus a head-sized circuit: n = 16 (BTree's 15 latents), r = 4, a byte vocabulary.
CUDA_SHAPES = [*OP_SHAPES, (16, 257, 4, 3)]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_circuit_ops_match_the_cpu_ops(kind, dtype):
    for seed, (n, vocab, r, batch) in enumerate(CUDA_SHAPES):
        circuits, params = batch_circuits(kind, n, vocab, r, batch, dtype, 700 + 10 * seed)
        gpu = tuple(p.cuda() for p in params)
        tokens = torch.randint(vocab, (batch, n), generator=torch.Generator().manual_seed(seed))
        for name in ("circuit_log_prob", "circuit_prefix_log_marginals"):
            op = getattr(torch.ops.mtprobe, name)
            got = op(kind, *gpu, tokens.cuda())
            assert got.is_cuda and got.dtype == dtype
            close(got.cpu(), op(kind, *params, tokens), dtype)
        for length in range(n):
            got = torch.ops.mtprobe.circuit_next_token_log_probs(kind, *gpu, tokens[:, :length].cuda())
            expect = torch.ops.mtprobe.circuit_next_token_log_probs(kind, *params, tokens[:, :length])
            close(got.cpu(), expect, dtype)
        u = torch.rand(
            batch, circuits[0].num_uniforms(), generator=torch.Generator().manual_seed(seed)
        ).double()
        u[0] = 0.0  # both ends of [0, 1)
        u[-1, ::2] = 1 - 2**-53
        drawn = torch.ops.mtprobe.circuit_sample(kind, *gpu, u.cuda())
        assert drawn.is_cuda and torch.equal(drawn.cpu(), torch.ops.mtprobe.circuit_sample(kind, *params, u))
        opcheck(torch.ops.mtprobe.circuit_log_prob, (kind, *gpu, tokens.cuda()))
        opcheck(torch.ops.mtprobe.circuit_sample, (kind, *gpu, u.cuda()))


@requires_cuda
def test_cuda_circuit_ops_reject_bad_input():
    _, params = batch_circuits("hmm", 3, 4, 2, 2, torch.float32, 5)
    gpu = tuple(p.cuda() for p in params)
    with pytest.raises(ValueError, match=r"tokens\[1, 2\] = 4 is outside the vocabulary \[0, 4\)"):
        torch.ops.mtprobe.circuit_log_prob("hmm", *gpu, torch.tensor([[0, 1, 2], [0, 1, 4]]).cuda())
    u = torch.rand(2, 6, dtype=torch.float64)
    u[1, 3] = 1.0
    with pytest.raises(ValueError, match=r"uniforms\[1, 3\] = 1 is outside \[0, 1\)"):
        torch.ops.mtprobe.circuit_sample("hmm", *gpu, u.cuda())
    nan = gpu[2].clone()
    nan[1, 0, :, 0] = torch.nan  # every state of token 0: whichever state is drawn meets it
    with pytest.raises(ValueError, match=r"circuit_sample: context 1: .*NaN"):
        torch.ops.mtprobe.circuit_sample(
            "hmm", gpu[0], gpu[1], nan, torch.rand(2, 6, dtype=torch.float64).cuda()
        )
    _, big = batch_circuits("hmm", 40, 3, 32, 1, torch.float32, 6)  # L * r = 40 * 32 > 1024
    with pytest.raises(ValueError, match=r"L \* r <= 1024"):
        torch.ops.mtprobe.circuit_log_prob(
            "hmm", *(p.cuda() for p in big), torch.zeros(1, 40, dtype=torch.long).cuda()
        )
