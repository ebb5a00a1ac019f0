"""Exact inference in probabilistic-circuit heads: the PyTorch reference against brute force.

Brute force is the model's definition, independent of the circuit's pass: the joint of a window is
the explicit sum over every assignment of the latent variables (root weight x transitions x
emissions); marginals and conditionals are sums over all V^n windows. The reference's ancestral
sampler is checked by a chi-square test (with a power check against a sampler that ignores the shared
latent state). The C++ core (csrc/core/circuit.h) has no Python binding yet; its test program
tests/core/test_circuit.cpp checks the same quantities against brute force in C++ and its sampler
by counting windows drawn from fixed-seed uniforms (run by tests/test_core_cpp.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch

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
