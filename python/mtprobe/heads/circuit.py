"""The circuit model of a circuit head: its architecture (:class:`HeadSpec`), the head module
(:class:`CircuitHead`) and the circuits it outputs (:class:`CircuitParams`), and their window
likelihood (:func:`window_log_marginals`, :func:`window_loss`).

The head (:class:`CircuitHead`), for a hidden state ``h`` (the backbone's final-norm output, ``[d]``):

- sum weights ``q(z_root) = softmax(W_w h + b_w)`` (CP, HMM, BTree);
- transitions ``q(z_child | z_parent) = softmax(W_t h + b_t)`` per child latent (HMM, BTree), started
  near the identity (each off-diagonal entry 1e-3), so that an HMM or BTree head starts as the CP head
  with the same weights and emissions, as the paper initialises its HMM;
- emissions, the categorical of token ``i`` given state ``z``, one of two ways:

  ``"lowrank"`` (subword vocabularies): ``softmax(E h + E C_iz silu(A_iz h))`` with ``E`` the model's own
  LM head (frozen, not stored in the checkpoint), ``A_iz`` ``[rho, d]`` and ``C_iz`` ``[d, rho]``: a rank-rho
  adapter in the hidden space feeding the LM head. ``E h`` is the target's own next-token logits,
  which the drafter reads for free from the verification forward, and ``E C_iz`` ``[V, rho]`` is
  precomputed once, so a step costs ``n r (rho d + V rho)`` multiply-adds instead of ``n r`` LM heads.
  ``C`` starts at zero: every position starts as the next-token distribution.

  ``"unembedding"`` (small vocabularies, the paper's choice for byte models): one unembedding matrix
  ``[V, d]`` per position and state, started from the LM head plus noise.

  Either can be restricted at decode time to the ``K`` tokens the head saw most often in training
  (``HeadsConfig(vocab_top_k=K)``, :meth:`CircuitHead.restricted_vocab`; a checkpoint records its
  ``token_counts``), plus each step the target's ``ROOT_CANDIDATES`` most probable next tokens (the
  window starts with the target's choice, which the circuit is conditioned on): the same arithmetic
  over ``K + 16`` rows instead of ``V``, the other tokens at probability 0. It matters most with LoRA
  draft layers and ``lora_base="draft"``, whose ``E h`` is a whole LM-head pass.

Shapes below: ``B`` contexts, ``n`` window, ``r`` states (1 for FF), ``L`` latents, ``V`` vocabulary.

>>> spec = HeadSpec(circuit="cp", window=3, rank=2, hidden_size=8, vocab_size=11)
>>> head = CircuitHead(spec, lm_head=torch.randn(11, 8))
>>> params = head(torch.randn(5, 8))
>>> params.weights.shape, params.emissions.shape
(torch.Size([5, 2]), torch.Size([5, 3, 2, 11]))
>>> window_log_marginals(params, torch.randint(0, 11, (5, 3))).shape  # log q(x_1..x_j), j = 1..3
torch.Size([5, 3])
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from mtprobe.reference.circuit import KINDS, latent_tree

__all__ = [
    "EMISSIONS",
    "KINDS",
    "LORA_BASES",
    "ROOT_CANDIDATES",
    "CircuitHead",
    "CircuitParams",
    "HeadSpec",
    "RestrictedVocab",
    "default_gamma",
    "latent_tree",
    "window_log_marginals",
    "window_loss",
]

EMISSIONS = ("lowrank", "unembedding")
LORA_BASES = ("target", "draft")  # HeadSpec.lora_base
# A restricted head (HeadsConfig.vocab_top_k) also emits the target's this many most probable next tokens
# each step: the window starts with the target's choice (greedy: its argmax, always among them).
ROOT_CANDIDATES = 16
# Off-diagonal probability of a fresh transition matrix: near the identity (the head starts as CP),
# yet far enough from 0 that softmax gradients reach the off-diagonal entries.
_TRANSITION_EPS = 1e-3


def _check_int(name: str, value: object) -> None:
    """TypeError unless ``value`` is an int (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def default_gamma(window: int) -> float:
    """The paper's discount of later window positions: 0.8, or 0.9 for windows longer than 8."""
    return 0.9 if window > 8 else 0.8


@dataclass(frozen=True)
class HeadSpec:
    """A head's architecture.

    Args:
        circuit: ``"ff"``, ``"cp"``, ``"hmm"`` or ``"btree"``.
        window: n, the tokens the circuit covers: the target's next token and n - 1 drafts after it.
        rank: r, latent states of each latent variable (must be 1 for FF).
        emission: ``"lowrank"`` (adapters into the model's LM head) or ``"unembedding"``.
        adapter_rank: rho of the ``"lowrank"`` adapters.
        hidden_size: d of the backbone.
        vocab_size: V of the backbone's LM head.
        lora_layers: k, the backbone's last layers the draft has its own LoRA-adapted copies of
            (:mod:`mtprobe.heads.lora`); 0 reads the backbone's last hidden state (fully shared backbone).
        lora_rank: the rank of those adapters.
        lora_base: with LoRA draft layers and ``"lowrank"`` emissions, whose logits the adapters'
            term is added to: ``"target"`` (the backbone's own logits at the anchor, which the decode
            loop has anyway) or ``"draft"`` (``E h`` of the draft layers' output: a second pass of the
            LM head every step; what checkpoints from before this field was added hold).

    >>> HeadSpec(circuit="ff", window=4, rank=2, hidden_size=8, vocab_size=10)
    Traceback (most recent call last):
    ...
    ValueError: an FF head has no latent states: rank must be 1, got 2
    """

    circuit: str = "cp"
    window: int = 4
    rank: int = 4
    emission: str = "lowrank"
    adapter_rank: int = 16
    hidden_size: int = 0
    vocab_size: int = 0
    lora_layers: int = 0
    lora_rank: int = 8
    lora_base: str = "target"

    def __post_init__(self) -> None:
        if self.circuit not in KINDS:
            raise ValueError(f"circuit={self.circuit!r}: expected one of {', '.join(KINDS)}")
        if self.emission not in EMISSIONS:
            raise ValueError(f"emission={self.emission!r}: expected one of {', '.join(EMISSIONS)}")
        for name in (
            "window",
            "rank",
            "adapter_rank",
            "hidden_size",
            "vocab_size",
            "lora_layers",
            "lora_rank",
        ):
            _check_int(name, getattr(self, name))
        if self.window < 2:
            raise ValueError(
                f"window={self.window} must be >= 2: the window holds the target's next token and at least "
                "one draft after it"
            )
        if self.rank < 1:
            raise ValueError(f"rank={self.rank} must be >= 1 (latent states of the circuit)")
        if self.circuit == "ff" and self.rank != 1:
            raise ValueError(f"an FF head has no latent states: rank must be 1, got {self.rank}")
        if self.adapter_rank < 1:
            raise ValueError(f"adapter_rank={self.adapter_rank} must be >= 1")
        if self.lora_layers < 0:
            raise ValueError(
                f"lora_layers={self.lora_layers} must be >= 0 (0: the backbone's last hidden state)"
            )
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank={self.lora_rank} must be >= 1")
        if self.lora_base not in LORA_BASES:
            raise ValueError(f"lora_base={self.lora_base!r}: expected one of {', '.join(LORA_BASES)}")
        if self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError(
                f"hidden_size={self.hidden_size} and vocab_size={self.vocab_size} must be >= 1 (the backbone's)"
            )

    @property
    def num_latents(self) -> int:
        """L: latent variables of the circuit (1 for FF and CP, n for HMM, n - 1 for BTree)."""
        return len(latent_tree(self.circuit, self.window)[0])


class CircuitParams(NamedTuple):
    """A batch of circuits' log-parameters, emissions ``[B, n, r, V]``: over the whole vocabulary,
    except from :meth:`CircuitHead.compact` with a restricted vocabulary, which returns its ``N``
    columns' ids beside them."""

    circuit: str
    weights: torch.Tensor | None  # [B, r] log q(z_root); None for FF
    transitions: torch.Tensor | None  # [B, L - 1, r, r]; None for FF and CP
    emissions: torch.Tensor  # [B, n, r, V] log q(x_i | state of its parent latent)

    def core_batch(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(weights, transitions, emissions) batched in csrc/core/circuit.h's layouts: what
        ``mtprobe.ops.circuit_*`` take (FF emissions ``[B, n, V]``, CP ``[B, r, n, V]``)."""
        e = self.emissions  # [B, n, r, V]
        if self.circuit == "ff":
            return None, None, e[:, :, 0]
        if self.circuit == "cp":
            return self.weights, None, e.transpose(1, 2).contiguous()
        return self.weights, self.transitions, e

    def core_layout(self, b: int) -> list[torch.Tensor]:
        """Context ``b``'s ``[weights, transitions, emissions]`` in csrc/core/circuit.h's layouts (empty
        tensors for what a kind lacks): what the C++ drafter takes."""
        w, t, e = CircuitParams(
            self.circuit, *(None if x is None else x[b : b + 1] for x in self[1:])
        ).core_batch()
        empty = e.new_empty(0)
        return [empty if w is None else w[0], empty if t is None else t[0], e[0]]


class RestrictedVocab(NamedTuple):
    """A head's emissions restricted to ``K`` tokens (:meth:`CircuitHead.restricted_vocab`), and per
    step a few more (:meth:`widened`)."""

    ids: torch.Tensor  # [K] int64, ascending
    member: torch.Tensor  # [V] bool: ids as a mask
    lm_head: torch.Tensor  # [K, d]: the LM head's rows of those tokens
    lm_bias: torch.Tensor | None  # [K]
    table: torch.Tensor  # [n r, K, rho] projected adapters E C (lowrank) or [n r, K, d] unembeddings
    extra: torch.Tensor | None = None  # [m] int64: this step's extra tokens, none of them in ids

    def widened(self, logits: torch.Tensor, m: int) -> RestrictedVocab:
        """The same, plus the target's ``m`` most probable next tokens (``logits`` ``[V]``) that are not
        already kept. The window's first token is the target's own choice and the circuit is
        conditioned on it: a choice it could not emit would leave nothing to draft from."""
        top = logits.topk(min(m, logits.numel())).indices  # [m]
        return self._replace(extra=top[~self.member[top]])


class CircuitHead(nn.Module):
    """The head of :class:`HeadSpec` ``spec`` over an LM head ``lm_head`` (``[V, d]``, the backbone's
    output embedding, kept frozen and out of the checkpoint; its bias, if any, ``lm_bias`` ``[V]``);
    ``draft``: the draft's LoRA layers (:class:`mtprobe.heads.lora.DraftLayers`) when ``spec.lora_layers`` > 0."""

    def __init__(
        self,
        spec: HeadSpec,
        lm_head: torch.Tensor,
        lm_bias: torch.Tensor | None = None,
        draft: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if tuple(lm_head.shape) != (spec.vocab_size, spec.hidden_size):
            raise ValueError(
                f"lm_head has shape {list(lm_head.shape)}; the head's spec wants [vocab_size, hidden_size] = "
                f"[{spec.vocab_size}, {spec.hidden_size}]"
            )
        if (draft is None) != (spec.lora_layers == 0):
            raise ValueError(
                f"spec.lora_layers={spec.lora_layers} but draft layers were {'not ' if draft is None else ''}given"
            )
        self.spec = spec
        self.draft = draft
        n, r, d, v = spec.window, 1 if spec.circuit == "ff" else spec.rank, spec.hidden_size, spec.vocab_size
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)  # [V, d]
        self.register_buffer(
            "lm_bias", None if lm_bias is None else lm_bias.detach().float().clone(), persistent=False
        )  # [V]
        self.register_buffer("trained_steps", torch.zeros((), dtype=torch.long))
        # How often each token occurs in the windows the head was trained on ([V] int32; zeros in checkpoints
        # from before it was recorded): ranks the vocabulary for a restricted head (restricted_vocab).
        self.register_buffer("token_counts", torch.zeros(v, dtype=torch.int32))
        if spec.circuit != "ff":
            self.weights = nn.Linear(d, r)
            nn.init.zeros_(self.weights.weight)
            nn.init.zeros_(self.weights.bias)  # uniform over states at first
        if spec.circuit in ("hmm", "btree"):
            children = spec.num_latents - 1
            self.transitions = nn.Linear(d, children * r * r)
            nn.init.zeros_(self.transitions.weight)
            eye = torch.full((r, r), math.log(_TRANSITION_EPS))
            eye.fill_diagonal_(math.log(max(1.0 - (r - 1) * _TRANSITION_EPS, _TRANSITION_EPS)))
            with torch.no_grad():
                self.transitions.bias.copy_(eye.repeat(children, 1, 1).flatten())
        if spec.emission == "lowrank":
            rho = spec.adapter_rank
            self.down = nn.Parameter(torch.randn(n * r, rho, d) / math.sqrt(d))  # A_iz
            self.up = nn.Parameter(torch.zeros(n * r, d, rho))  # C_iz
        else:
            noise = 0.02 * torch.randn(n * r, v, d) * self.lm_head.std()
            self.unembed = nn.Parameter(self.lm_head.expand(n * r, v, d) + noise)  # [n r, V, d]
        self._projected: tuple[int, torch.Tensor] | None = None  # (version, E C) cached for inference
        # What inference builds once from the parameters, keyed by what it depends on and by
        # :meth:`_version`, so a training step in between rebuilds it.
        self._inference_cache: dict[tuple[Any, ...], tuple[int, Any]] = {}

    @property
    def r(self) -> int:
        return 1 if self.spec.circuit == "ff" else self.spec.rank

    def _version(self) -> int:
        """Changes whenever a parameter or buffer is updated in place (a training step, a loaded state
        dict). Inference tensors (a head loaded under ``torch.inference_mode()``) have no version
        counter, and cannot change outside it."""
        return sum(0 if t.is_inference() else t._version for t in (*self.parameters(), *self.buffers()))

    def _cached(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        """``build()``, kept until the parameters change (:meth:`_version`)."""
        version = self._version()
        hit = self._inference_cache.get(key)
        if hit is None or hit[0] != version:
            hit = self._inference_cache[key] = (version, build())
        return hit[1]

    def fingerprint(self) -> str:
        """The head's identity for what was built for it (a topology bank): its spec and a hash of its
        trained parameters (``cp:1a2b...``). Token counts are left out: adding them (``heads count``)
        does not change what the head drafts. Cached until the parameters change."""
        return self._cached(("fingerprint",), self._fingerprint)

    def _fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self.spec), sort_keys=True).encode())
        for name, value in sorted(self.state_dict().items()):
            if name != "token_counts":
                digest.update(name.encode())
                digest.update(value.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return f"{self.spec.circuit}:{digest.hexdigest()[:12]}"

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``E h`` (+ bias): the backbone's next-token logits from its hidden states ``[B, d]`` -> ``[B, V]``."""
        return F.linear(hidden.float(), self.lm_head, self.lm_bias)

    def _projected_up(self) -> torch.Tensor:
        """``E C_iz`` for every (i, z): ``[n r, V, rho]``; cached while the parameters do not change."""
        if self.training or torch.is_grad_enabled():
            return torch.einsum("vd,kdp->kvp", self.lm_head, self.up)
        # The parameters' version counter tells an in-place update; a head loaded under
        # torch.inference_mode() has inference tensors, which have none (nor can they change outside it).
        version = -1 if self.up.is_inference() else self.up._version
        if self._projected is None or self._projected[0] != version:
            self._projected = (version, torch.einsum("vd,kdp->kvp", self.lm_head, self.up).contiguous())
        return self._projected[1]

    def restricted_vocab(self, k: int, dtype: torch.dtype | None = None) -> RestrictedVocab:
        """The head's emissions cut down to the ``k`` tokens it saw most often in training (ties: the
        smaller id), for :meth:`forward`'s ``vocab``: the LM-head rows and projected adapters of those
        tokens, gathered once (and cached until the parameters change), in ``dtype`` (default float32;
        :meth:`forward` multiplies in it and normalises in float32). Every other token gets
        probability 0, so the drafts never hold it; the target's verification keeps the output exact
        all the same (a restricted head is only a cheaper, slightly weaker proposal). ValueError for a
        checkpoint without token counts or a ``k`` outside [1, V)."""
        v = self.spec.vocab_size
        _check_int("vocab_top_k", k)
        if not 1 <= k < v:
            raise ValueError(
                f"vocab_top_k={k} must be in [1, {v}) for this head's vocabulary of {v} tokens; None keeps "
                "the whole vocabulary"
            )
        counts = self.token_counts
        if int(counts.sum()) == 0:
            raise ValueError(
                "this head's checkpoint records no token counts (it was written before they were), so it "
                "cannot rank its vocabulary for vocab_top_k; record them with python -m mtprobe heads "
                "count DIR --features FILE (the features it was trained on), or retrain it"
            )
        return self._cached(("restricted_vocab", k, dtype), lambda: self._restrict(k, dtype or torch.float32))

    def _restrict(self, k: int, dtype: torch.dtype) -> RestrictedVocab:
        v = self.spec.vocab_size
        # Stable sort of -counts: the most frequent first, ties by id; then in id order.
        order = torch.sort(-self.token_counts.cpu(), stable=True).indices[:k]
        ids = order.sort().values.to(self.lm_head.device)  # [K]
        member = torch.zeros(v, dtype=torch.bool, device=ids.device)  # [V]
        member[ids] = True
        with torch.no_grad():
            if self.spec.emission == "lowrank":
                table = self._projected_up()[:, ids]  # [n r, K, rho]
            else:
                table = self.unembed[:, ids]  # [n r, K, d]
            bias = None if self.lm_bias is None else self.lm_bias[ids].to(dtype).contiguous()  # [K]
            lm_rows = self.lm_head[ids].to(dtype).contiguous()  # [K, d]
            return RestrictedVocab(ids, member, lm_rows, bias, table.to(dtype).contiguous())

    def inference_draft(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The draft layers folded for decoding (:meth:`mtprobe.heads.lora.DraftLayers.merged`: one product
        per linear map instead of three) in ``dtype`` (default: the backbone's), cached until the
        parameters change. ValueError for a head without draft layers."""
        if self.draft is None:
            raise ValueError("this head has no LoRA draft layers (spec.lora_layers=0): nothing to fold")
        return self._cached(("inference_draft", dtype), lambda: self.draft.merged(dtype))

    def forward(
        self, hidden: torch.Tensor, base: torch.Tensor | None = None, vocab: RestrictedVocab | None = None
    ) -> CircuitParams:
        """Circuit parameters for hidden states ``[B, d]``; ``base`` ``[B, V]``: the backbone's logits at
        the same positions when the caller has them (else computed from the LM head); ``vocab``: emit
        only these tokens (:meth:`restricted_vocab`; inference only), the rest at log-probability -inf."""
        params, columns = self.compact(hidden, base, vocab)
        if columns is None:
            return params
        e = params.emissions  # [B, n, r, N]
        full = e.new_full((*e.shape[:-1], self.spec.vocab_size), -math.inf)  # [B, n, r, V]
        return params._replace(emissions=full.index_copy_(-1, columns, e))

    def compact(
        self, hidden: torch.Tensor, base: torch.Tensor | None = None, vocab: RestrictedVocab | None = None
    ) -> tuple[CircuitParams, torch.Tensor | None]:
        """:meth:`forward` without widening a restricted head's emissions back to the vocabulary:
        ``(params, columns)``, the emissions ``[B, n, r, N]`` over the ``N`` tokens ``columns`` ``[N]``
        (ascending ids; the kept ones and the step's extra ones), every other token at probability 0.
        Without ``vocab``, ``columns`` is None and the emissions span the whole vocabulary. What the
        C++ drafter takes (its fourth tensor): no ``[n r, V]`` fill, and its top-k runs over N."""
        spec, r = self.spec, self.r
        n = spec.window
        h = hidden.float()  # [B, d]
        batch = h.shape[0]
        lowrank = spec.emission == "lowrank"
        a = F.silu(torch.einsum("bd,kpd->bkp", h, self.down)) if lowrank else None  # [B, n r, rho]

        def rows(
            lm_head: torch.Tensor, lm_bias: torch.Tensor | None, table: torch.Tensor, base: Any
        ) -> torch.Tensor:
            """Emission logits ``[B, n r, N]`` (float32) of the N tokens whose LM-head rows and table rows
            these are; the products in the tables' dtype (a restricted vocabulary's may be half precision)."""
            x = h.to(table.dtype)  # [B, d]
            if not lowrank:
                return torch.einsum("bd,kvd->bkv", x, table).float()
            if base is None:
                base = F.linear(x, lm_head, lm_bias)  # [B, N]: E h
            return base.float()[:, None, :] + torch.einsum("bkp,kvp->bkv", a.to(table.dtype), table).float()

        whole = self._projected_up() if lowrank else self.unembed  # [n r, V, rho or d]
        columns = None
        if vocab is None:
            logits = rows(self.lm_head, self.lm_bias, whole, base).log_softmax(-1)  # [B, n r, V]
        else:  # K (+ m) rows instead of V: the same arithmetic on the kept tokens
            ids = vocab.ids
            part = rows(vocab.lm_head, vocab.lm_bias, vocab.table, None if base is None else base[:, ids])
            if vocab.extra is not None and vocab.extra.numel():
                e = vocab.extra
                more = rows(
                    self.lm_head[e],
                    None if self.lm_bias is None else self.lm_bias[e],
                    whole[:, e],
                    None if base is None else base[:, e],
                )
                # The extra tokens into id order: the drafter ranks ties by column, as by id over V.
                ids, order = torch.cat([ids, e]).sort()
                part = torch.cat([part, more], -1)[..., order]
            logits, columns = part.log_softmax(-1), ids  # [B, n r, N], [N]
        emissions = logits.view(batch, n, r, -1)  # [B, n, r, V or N]
        weights = transitions = None
        if spec.circuit != "ff":
            weights = self.weights(h).log_softmax(-1)  # [B, r]
        if spec.circuit in ("hmm", "btree"):
            t = self.transitions(h).view(batch, spec.num_latents - 1, r, r)
            transitions = t.log_softmax(-1)  # [B, L - 1, r, r]
        return CircuitParams(spec.circuit, weights, transitions, emissions), columns

    @property
    def target_base(self) -> bool:
        """Whether the ``"lowrank"`` emissions build on the target's logits rather than on ``E h`` of
        what the head reads: always without draft layers (the two are one), else by ``spec.lora_base``."""
        return self.spec.emission == "lowrank" and (self.draft is None or self.spec.lora_base == "target")

    @property
    def hidden_layer(self) -> int:
        """Which of the backbone's ``hidden_states`` the head reads: -1 (the last, final-normed) or, with
        LoRA draft layers, the input of the first of them."""
        return -1 if self.draft is None else int(self.draft.first)

    def step_fn(
        self, vocab_top_k: int | None = None, dtype: torch.dtype | None = None
    ) -> Callable[[torch.Tensor, torch.Tensor, int], list[torch.Tensor]]:
        """The C++ drafter's callback, with its own state (one per drafter): ``(hidden [a, d], logits
        [V], prefix_len)`` -> ``[weights, transitions, emissions]`` in csrc/core/circuit.h's layouts,
        and with ``vocab_top_k`` a fourth tensor, the emission columns' token ids (:meth:`compact`).

        ``hidden``: the backbone's :attr:`hidden_layer` states of the tokens the step committed (the
        block's committed chain, then the accepted drafts; positions ``prefix_len`` on) for a head with
        draft layers (:func:`heads_drafter` asks the drafter for them), else only the last; the last row
        is the context the window starts after. ``logits``: the target's raw logits there. With LoRA
        draft layers, they run over all ``a`` rows with their own KV cache, which must hold exactly
        the ``prefix_len`` tokens before (RuntimeError otherwise); a prefill (``prefix_len`` 0)
        starts a new cache. The draft layers run folded (:meth:`inference_draft`); ``dtype``: theirs
        and the restricted vocabulary's tables' (:meth:`restricted_vocab`), default the backbone's and
        float32. Normalisation is always float32. The callback calls :meth:`compact`, not the module:
        hooks registered on the head (``register_forward_hook``) do not run during decoding.
        """
        cache: list[Any] = [None]
        restricted = None if vocab_top_k is None else self.restricted_vocab(vocab_top_k, dtype)
        draft = None if self.draft is None else self.inference_draft(dtype)

        def layout(
            h: torch.Tensor, base: torch.Tensor | None, vocab: RestrictedVocab | None
        ) -> list[torch.Tensor]:
            params, columns = self.compact(h, base, vocab)
            return params.core_layout(0) + ([] if columns is None else [columns])

        def step(hidden: torch.Tensor, logits: torch.Tensor, prefix_len: int) -> list[torch.Tensor]:
            with torch.no_grad():
                base = logits[None] if self.target_base else None  # [1, V]
                vocab = None if restricted is None else restricted.widened(logits, ROOT_CANDIDATES)
                if self.draft is None:
                    return layout(hidden[-1:], base, vocab)
                if prefix_len == 0:
                    cache[0] = DynamicCache()
                have = -1 if cache[0] is None else cache[0].get_seq_length()
                if have != prefix_len:
                    raise RuntimeError(
                        f"the draft layers' cache holds {have} tokens, the step starts at {prefix_len}: every "
                        "committed token must pass through the drafter's observe once, in order"
                    )
                positions = torch.arange(prefix_len, prefix_len + hidden.shape[0], device=hidden.device)
                h = draft(hidden[None], positions[None], cache[0])[0, -1:]  # [1, d]
                return layout(h, base, vocab)  # base None: the draft's own E h

        return step


def window_log_marginals(params: CircuitParams, tokens: torch.Tensor) -> torch.Tensor:
    """``log q(x_1..x_j)`` for j = 1..n, every context: tokens ``[B, n]`` -> ``[B, n]``, differentiable.

    The circuit's bottom-up pass, run for all n prefixes at once: a token past the prefix contributes
    ``log 1 = 0`` (its categorical sums to one), as in :mod:`mtprobe.reference.circuit`."""
    e = params.emissions  # [B, n, r, V]
    batch, n, r, _ = e.shape
    if tuple(tokens.shape) != (batch, n):
        raise ValueError(f"tokens have shape {list(tokens.shape)}; want [B, n] = [{batch}, {n}]")
    leaf = e.gather(-1, tokens[:, :, None, None].expand(batch, n, r, 1)).squeeze(-1)  # [B, n, r]
    steps = torch.arange(n, device=e.device)
    observed = steps[None, :] <= steps[:, None]  # [J, n]: prefix j + 1 observes tokens 0..j
    leaves = torch.where(observed[None, :, :, None], leaf[:, None], leaf.new_zeros(()))  # [B, J, n, r]
    _, children, _ = latent_tree(params.circuit, n)
    inside: list[torch.Tensor] = [leaf.new_zeros(())] * len(children)  # [B, J, r] each
    for k in reversed(range(len(children))):  # children come after their parents
        total = leaves.new_zeros(batch, n, r)
        for ch in children[k]:
            if ch < 0:
                total = total + leaves[:, :, -1 - ch]
            else:  # sum the child's state out: [B, J, r_parent, r_child] -> [B, J, r_parent]
                t = params.transitions[:, ch - 1][:, None]  # [B, 1, r, r]
                total = total + torch.logsumexp(t + inside[ch][:, :, None, :], dim=-1)
        inside[k] = total
    root = leaves.new_zeros(batch, 1, 1) if params.weights is None else params.weights[:, None, :]
    return torch.logsumexp(root + inside[0], dim=-1)  # [B, J]


def window_loss(params: CircuitParams, tokens: torch.Tensor, gamma: float) -> torch.Tensor:
    """The discounted NLL ``-sum_j gamma^(j-1) log q(x_j | x_<j) / sum_j gamma^(j-1)``, batch mean."""
    marg = window_log_marginals(params, tokens)  # [B, n]
    cond = marg - F.pad(marg[:, :-1], (1, 0))  # [B, n] log q(x_j | x_<j)
    w = gamma ** torch.arange(marg.shape[1], dtype=marg.dtype, device=marg.device)
    return -(cond * w).sum(-1).mean() / w.sum()
