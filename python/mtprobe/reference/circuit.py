"""Reference of csrc/core/circuit.h: exact inference in the probabilistic circuits of MTP heads (seed 003).

A circuit is q(x_1..x_n | context) for one context, from a head's log-probabilities. Every kind is a
tree of latent variables with r states (FF: none, r = 1); each token is drawn given the state of its
parent latent. Layouts (log-probabilities):

    FF     emissions [n, V]
    CP     weights [r], emissions [r, n, V]
    HMM    weights [r], transitions [n - 1, r, r] ([i - 1, a, b] = q(z_i = b | z_{i-1} = a)), emissions [n, r, V]
    BTree  weights [r], transitions [L - 1, r, r] (latent k >= 1 given its parent), emissions [n, r, V]
           (token i given its parent latent); L = max(n - 1, 1) latents, breadth first, from the
           balanced split of a span [b, e) at b + (e - b) // 2 (see ``latent_tree``).

The evaluation is the circuit's bottom-up pass; a token left out (marginalised) gets input value
log 1 = 0, since its categorical sums to 1. The C++ core computes the same quantities with a
top-down forward pass instead, all prefixes at once.

Worked example (the header's), CP with n = 2, r = 2, V = 2:

>>> import torch
>>> def log(x):
...     return torch.tensor(x, dtype=torch.float64).log()
>>> c = Circuit("cp", log([.3, .7]), None, log([[[.8, .2], [.6, .4]], [[.4, .6], [.1, .9]]]))
>>> [round(log_prob(c, torch.tensor(x)).exp().item(), 6) for x in ([0, 0], [0, 1], [1, 0], [1, 1])]
[0.172, 0.348, 0.078, 0.402]
>>> prefix_log_marginals(c, torch.tensor([1, 1])).exp().round(decimals=4).tolist()
[0.48, 0.402]
>>> next_token_log_probs(c, torch.tensor([0])).exp().round(decimals=4).tolist()
[0.3308, 0.6692]
>>> greedy_window(c)[0].tolist(), beam_windows(c, 2)[0].tolist()
([0, 1], [[1, 1], [0, 1]])
>>> sample(c, torch.tensor([[.5, .9, .3]])).tolist()
[[1, 1]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("ff", "cp", "hmm", "btree")


def latent_tree(kind: str, n: int) -> tuple[list[int], list[list[int]], list[int]]:
    """(parents [L], children [L], token_parent [n]); a child c >= 0 is latent c, c < 0 the token -1 - c.

    >>> latent_tree("btree", 5)
    ([-1, 0, 0, 2], [[1, 2], [-1, -2], [-3, 3], [-4, -5]], [1, 1, 2, 3, 3])
    """
    if kind not in KINDS or n < 1:
        raise ValueError(f"latent_tree({kind!r}, {n}): kind must be one of {KINDS} and n >= 1")
    if kind in ("ff", "cp") or n == 1:
        return [-1], [[-1 - i for i in range(n)]], [0] * n
    if kind == "hmm":
        children = [[-1 - i] + ([i + 1] if i + 1 < n else []) for i in range(n)]
        return [i - 1 for i in range(n)], children, list(range(n))
    spans, parents, children, token_parent = [(0, n)], [-1], [], [0] * n
    for k, (b, e) in enumerate(spans):  # breadth first: spans grows while we walk it
        m = b + (e - b) // 2
        children.append([])
        for cb, ce in ((b, m), (m, e)):
            if ce - cb == 1:
                children[k].append(-1 - cb)
                token_parent[cb] = k
            else:
                children[k].append(len(spans))
                spans.append((cb, ce))
                parents.append(k)
    return parents, children, token_parent


@dataclass(frozen=True)
class Circuit:
    kind: str  # "ff" | "cp" | "hmm" | "btree"
    weights: torch.Tensor | None  # [r] log q(root state); None for FF
    transitions: torch.Tensor | None  # [L - 1, r, r]; None (or empty) for FF and CP
    emissions: torch.Tensor  # FF [n, V]; CP [r, n, V]; HMM, BTree [n, r, V]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"circuit kind {self.kind!r}: must be one of {KINDS}")
        e = self.emissions
        if e.dim() != (2 if self.kind == "ff" else 3) or min(e.shape) < 1:
            want = {"ff": "[n, V]", "cp": "[r, n, V]"}.get(self.kind, "[n, r, V]")
            raise ValueError(f"{self.kind} emissions have shape {list(e.shape)}; want {want}, all >= 1")
        if self.kind == "ff" and (self.weights is not None or self.transitions is not None):
            raise ValueError("ff circuits take no weights and no transitions (pass None)")
        if self.kind != "ff" and (self.weights is None or list(self.weights.shape) != [self.r]):
            got = None if self.weights is None else list(self.weights.shape)
            raise ValueError(f"{self.kind} weights have shape {got}; want [r] = [{self.r}]")
        want = [len(latent_tree(self.kind, self.n)[0]) - 1, self.r, self.r]
        got = [0, self.r, self.r] if self.transitions is None else list(self.transitions.shape)
        if got != want and not (want[0] == 0 and self.transitions is None):
            raise ValueError(f"{self.kind} transitions have shape {got}; want [L - 1, r, r] = {want}")

    @property
    def n(self) -> int:
        return self.emissions.shape[1 if self.kind == "cp" else 0]

    @property
    def r(self) -> int:
        return {"ff": 1, "cp": self.emissions.shape[0]}.get(self.kind, self.emissions.shape[-2])

    @property
    def vocab(self) -> int:
        return self.emissions.shape[-1]

    def emissions_nrv(self) -> torch.Tensor:
        """Emissions as [n, r, V] for every kind."""
        if self.kind == "ff":
            return self.emissions[:, None, :]
        return self.emissions.transpose(0, 1) if self.kind == "cp" else self.emissions

    def root_weights(self) -> torch.Tensor:  # [r]
        return self.emissions.new_zeros(1) if self.kind == "ff" else self.weights

    def num_uniforms(self) -> int:
        """Latents (none for FF), then tokens: the order ``sample`` reads its uniforms in."""
        return (0 if self.kind == "ff" else len(latent_tree(self.kind, self.n)[0])) + self.n


def _check_tokens(c: Circuit, tokens: torch.Tensor) -> None:
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= c.vocab):
        raise ValueError(f"tokens {tokens.tolist()} must lie in the vocabulary [0, {c.vocab})")


def evaluate(c: Circuit, tokens: torch.Tensor, observed: int) -> torch.Tensor:
    """log q(x_1..x_observed) for tokens [B, n] (positions >= observed ignored): [B]."""
    _check_tokens(c, tokens[:, :observed])
    parents, children, token_parent = latent_tree(c.kind, c.n)
    e = c.emissions_nrv()  # [n, r, V]
    batch = tokens.shape[0]
    leaf = e.new_zeros(batch, c.n, c.r)  # [B, n, r] input values; log 1 for marginalised tokens
    for i in range(observed):
        leaf[:, i] = e[i, :, tokens[:, i]].T
    inside: list[torch.Tensor | None] = [None] * len(parents)  # [B, r] log q(tokens below | state)
    for k in reversed(range(len(parents))):  # children come after their parents
        total = e.new_zeros(batch, c.r)
        for ch in children[k]:
            if ch < 0:
                total = total + leaf[:, -1 - ch]
            else:  # sum the child's state out: [B, r_parent, r_child] -> [B, r_parent]
                total = total + torch.logsumexp(c.transitions[ch - 1][None] + inside[ch][:, None, :], dim=-1)
        inside[k] = total
    return torch.logsumexp(c.root_weights()[None] + inside[0], dim=-1)


def log_prob(c: Circuit, tokens: torch.Tensor) -> torch.Tensor:
    """log q(window): tokens [n] -> scalar, or [B, n] -> [B]."""
    return evaluate(c, tokens.view(-1, c.n), c.n).view(tokens.shape[:-1])


def prefix_log_marginals(c: Circuit, tokens: torch.Tensor) -> torch.Tensor:
    """log q(x_1..x_i) for i = 1..n: tokens [n] -> [n] (n passes here; one in the C++ core)."""
    return torch.stack([evaluate(c, tokens[None], i)[0] for i in range(1, c.n + 1)])


def conditional_log_probs(c: Circuit, tokens: torch.Tensor) -> torch.Tensor:
    """log q(x_i | x_<i) = marginal(i) - marginal(i - 1): [n]; -inf after a prefix of probability 0."""
    m = prefix_log_marginals(c, tokens)
    before = torch.cat([m.new_zeros(1), m[:-1]])
    return torch.where(before == -torch.inf, -torch.inf, m - before)


def next_token_log_probs(c: Circuit, prefix: torch.Tensor) -> torch.Tensor:
    """log q(v | prefix) for every v: prefix [len] with len < n -> [V] (all -inf after probability 0)."""
    length = prefix.numel()
    if not 0 <= length < c.n:
        raise ValueError(f"prefix length {length} is outside [0, n) = [0, {c.n})")
    tokens = prefix.new_zeros(c.vocab, c.n)  # [V, n] the prefix extended by every v
    tokens[:, :length] = prefix
    tokens[:, length] = torch.arange(c.vocab)
    joint = evaluate(c, tokens, length + 1)  # [V]
    z = torch.logsumexp(joint, dim=0)
    return torch.full_like(joint, -torch.inf) if z == -torch.inf else joint - z


def _inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first k with p_0 + .. + p_k > u * sum(p), never a zero entry: logp [S, K], u [S] -> [S]."""
    p = (logp - logp.max(dim=-1, keepdim=True).values).exp()
    cdf = p.cumsum(dim=-1)
    k = (cdf <= (u * cdf[:, -1])[:, None]).sum(dim=-1)  # a zero entry repeats the cdf before it
    k = torch.where(k < p.shape[-1], k, k.new_full((), -1))
    last_positive = p.shape[-1] - 1 - (p > 0).flip(-1).to(torch.int64).argmax(dim=-1)
    return torch.where(k >= 0, k, last_positive)  # rounding: u * total reached the total


def sample(c: Circuit, uniforms: torch.Tensor) -> torch.Tensor:
    """Ancestral sampling (App. B, Alg. 1): uniforms [S, num_uniforms] in [0, 1) -> windows [S, n].

    Every latent from its parent's state (the weights for the root), then every token from its parent
    latent's state; u[:, :L] are the latents' (none for FF), u[:, L + i] token i's.
    """
    if uniforms.dim() != 2 or uniforms.shape[1] != c.num_uniforms():
        raise ValueError(f"uniforms have shape {list(uniforms.shape)}; want [S, {c.num_uniforms()}]")
    if uniforms.numel() and (uniforms.min() < 0 or uniforms.max() >= 1):
        raise ValueError("uniforms must lie in [0, 1)")
    parents, _, token_parent = latent_tree(c.kind, c.n)
    num = uniforms.shape[0]
    state = torch.zeros(num, len(parents), dtype=torch.int64)  # [S, L]
    latents = 0 if c.kind == "ff" else len(parents)
    for k in range(latents):
        logp = c.weights.expand(num, -1) if k == 0 else c.transitions[k - 1][state[:, parents[k]]]  # [S, r]
        state[:, k] = _inverse_cdf(logp, uniforms[:, k])
    e = c.emissions_nrv()
    out = torch.stack(
        [_inverse_cdf(e[i][state[:, token_parent[i]]], uniforms[:, latents + i]) for i in range(c.n)], dim=1
    )
    return out  # [S, n]


def greedy_window(c: Circuit) -> tuple[torch.Tensor, torch.Tensor]:
    """(window [n], log q): x_i = argmax_v q(v | x_<i), ties to the lower id."""
    tokens: list[int] = []
    for _ in range(c.n):
        tokens.append(int(next_token_log_probs(c, torch.tensor(tokens, dtype=torch.int64)).argmax()))
    window = torch.tensor(tokens)
    return window, log_prob(c, window)


def beam_windows(c: Circuit, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows [m, n], log q [m]), m = min(k, V^n): a beam of width k over exact prefix marginals.

    Exact top-k for FF and when k >= V^n; a heuristic for CP, HMM and BTree (their most probable
    window is NP-hard in general). Ties: the earlier prefix, then the lower token id.
    """
    if k < 1:
        raise ValueError(f"beam width k = {k}, must be >= 1")
    beams, scores = [[]], [0.0]
    for i in range(c.n):
        cand = []  # (score, beam, token)
        for b, prefix in enumerate(beams):
            prefix_t = torch.tensor(prefix, dtype=torch.int64)
            tokens = prefix_t.new_zeros(c.vocab, c.n)
            tokens[:, :i] = prefix_t
            tokens[:, i] = torch.arange(c.vocab)
            cand += [(s, b, v) for v, s in enumerate(evaluate(c, tokens, i + 1).tolist())]
        cand.sort(key=lambda t: (-t[0], t[1], t[2]))
        beams = [beams[b] + [v] for _, b, v in cand[:k]]
        scores = [s for s, _, _ in cand[:k]]
    return torch.tensor(beams), torch.tensor(scores, dtype=c.emissions.dtype)
