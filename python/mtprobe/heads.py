"""Probabilistic-circuit heads (MTPC, seed 003): a small head maps the target's last hidden state to the
parameters of a circuit over the next ``window`` tokens; the C++ drafter (csrc/drafters/heads.h) drafts
from it, conditioned on the token the target already chose, and the target verifies losslessly.

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

Train a head once per model (minutes on a CPU; the backbone's features can be cached and reused)::

    python -m mtprobe.heads train --circuit hmm --window 4 --rank 2 --out heads/hmm --features f.pt

then decode with ``mtprobe.HeadsConfig(path="heads/hmm")``. Training (:func:`train_head`) minimises the
discounted NLL of the windows that follow each position, ``-sum_j gamma^(j-1) log q(x_j | x_<j)``
(gamma 0.8, 0.9 for n > 8), with the conditionals read off the prefix marginals
(:func:`window_log_marginals`); the backbone is frozen and its features are computed once.

With ``--lora-layers k`` (:mod:`mtprobe.lora`, the paper's second axis of expressiveness) ``h`` is not
the backbone's last state but that of the draft's own LoRA-adapted copies of the last k layers, run
over the committed tokens with a cache of their own; the features are then the input of layer L - k,
and ``--init DIR`` continues a head trained without them, as the paper does.

>>> spec = HeadSpec(circuit="cp", window=3, rank=2, hidden_size=8, vocab_size=11)
>>> head = CircuitHead(spec, lm_head=torch.randn(11, 8))
>>> params = head(torch.randn(5, 8))
>>> params.weights.shape, params.emissions.shape
(torch.Size([5, 2]), torch.Size([5, 3, 2, 11]))
>>> window_log_marginals(params, torch.randint(0, 11, (5, 3))).shape  # log q(x_1..x_j), j = 1..3
torch.Size([5, 3])
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mtprobe.config import _check_int
from mtprobe.reference.circuit import KINDS, latent_tree

EMISSIONS = ("lowrank", "unembedding")
LORA_BASES = ("target", "draft")  # HeadSpec.lora_base
CHECKPOINT_FILE = "head.safetensors"
FORMAT = "mtprobe-circuit-head/1"
# A restricted head (HeadsConfig.vocab_top_k) also emits the target's this many most probable next tokens
# each step: the window starts with the target's choice (greedy: its argmax, always among them).
ROOT_CANDIDATES = 16
# Off-diagonal probability of a fresh transition matrix: near the identity (the head starts as CP),
# yet far enough from 0 that softmax gradients reach the off-diagonal entries.
_TRANSITION_EPS = 1e-3


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
            (:mod:`mtprobe.lora`); 0 reads the backbone's last hidden state (fully shared backbone).
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
    ``draft``: the draft's LoRA layers (:class:`mtprobe.lora.DraftLayers`) when ``spec.lora_layers`` > 0."""

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
                "cannot rank its vocabulary for vocab_top_k; record them with python -m mtprobe.heads "
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
        """The draft layers folded for decoding (:meth:`mtprobe.lora.DraftLayers.merged`: one product
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
        from transformers import DynamicCache

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


# --- checkpoints -------------------------------------------------------------------------------


def _lm_head(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model.get_output_embeddings()
    if out is None or not hasattr(out, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head): circuit heads need one")
    return out.weight, getattr(out, "bias", None)


def new_head(model: Any, spec: HeadSpec) -> CircuitHead:
    """An untrained head of ``spec`` over ``model``'s LM head (``spec``'s sizes must be the model's),
    with LoRA draft layers over ``model``'s last ``spec.lora_layers`` layers if any."""
    from mtprobe.lora import DraftLayers

    weight, bias = _lm_head(model)
    draft = DraftLayers(model, spec.lora_layers, spec.lora_rank) if spec.lora_layers else None
    return CircuitHead(spec, weight, bias, draft).to(weight.device)  # the head runs where the backbone does


def save_head(head: CircuitHead, model: Any, out_dir: str | os.PathLike[str], stats: dict[str, Any]) -> Path:
    """Write ``head`` to ``out_dir/head.safetensors`` with its spec, ``model``'s identity and ``stats``."""
    from safetensors.torch import save_file

    from mtprobe.calibrate import model_identity

    if int(head.trained_steps) < 1:
        raise ValueError("this head has not been trained (0 steps); train it before saving it")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    meta = {
        "format": FORMAT,
        "spec": json.dumps(asdict(head.spec)),
        "model": json.dumps(model_identity(model)),
        "stats": json.dumps(stats),
    }
    path = out / CHECKPOINT_FILE
    save_file(tensors, str(path), metadata=meta)
    return path


def _checkpoint_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p / CHECKPOINT_FILE if p.is_dir() else p


def load_head(path: str | os.PathLike[str], model: Any) -> CircuitHead:
    """The trained head in ``path`` (a folder written by ``python -m mtprobe.heads train``, or its
    head.safetensors) over ``model``'s LM head. FileNotFoundError for a missing checkpoint; ValueError
    for a damaged one or one trained for another backbone or vocabulary."""
    from safetensors import safe_open

    from mtprobe.calibrate import model_identity

    p = _checkpoint_path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"circuit head checkpoint {str(p)!r} does not exist; train one with python -m mtprobe.heads train "
            "--model ... --out DIR"
        )
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, want {FORMAT!r}")
        raw = json.loads(meta["spec"])
        if raw.get("lora_layers", 0) > 0:
            raw.setdefault("lora_base", "draft")  # what LoRA heads were before lora_base existed
        spec = HeadSpec(**raw)
        identity = json.loads(meta["model"])
        stats = json.loads(meta.get("stats", "{}"))
    except Exception as e:  # safetensors and json raise their own types for a damaged file
        raise ValueError(f"{str(p)!r} is not a readable mtprobe circuit-head checkpoint: {e}") from e
    mine = model_identity(model)
    if identity != mine:
        differs = [k for k in mine if identity.get(k) != mine[k]]
        raise ValueError(
            f"the circuit head {str(p)!r} was trained for another backbone: {', '.join(differs)} differ "
            f"(checkpoint {identity}, this model {mine}); train a head for this model"
        )
    head = new_head(model, spec)
    state.setdefault("token_counts", head.token_counts)  # written before they were recorded: none
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{str(p)!r} does not match its own spec {spec}: {e}") from e
    head.stats = stats  # type: ignore[attr-defined]
    return head.eval()


# Heads shipped with the package (python/mtprobe/data/heads/), trained by this module's own command for a
# known model; benchmarks/results/heads/README.md gives the command and what they measure.
BUNDLED_HEADS = {"smollm2-135m": "smollm2-135m-btree-r2-n4"}


def bundled_head(model_name: str = "smollm2-135m") -> str:
    """The folder of the head mtprobe ships for the known model ``model_name``, for
    ``HeadsConfig(path=...)``; ValueError naming the models that have one otherwise.

    >>> Path(bundled_head()).name
    'smollm2-135m-btree-r2-n4'
    """
    if model_name not in BUNDLED_HEADS:
        raise ValueError(
            f"no circuit head ships for {model_name!r}; heads ship for {', '.join(map(repr, BUNDLED_HEADS))}. "
            "Train one with python -m mtprobe.heads train --model ... --out DIR"
        )
    from importlib import resources

    return str(resources.files("mtprobe.data").joinpath("heads").joinpath(BUNDLED_HEADS[model_name]))


_CACHE: dict[tuple[Any, ...], CircuitHead] = {}


def load_cached(path: str | os.PathLike[str], model: Any) -> CircuitHead:
    """:func:`load_head`, cached by file (path, size, modification time) and model (generate builds its
    drafter per call)."""
    p = _checkpoint_path(path)
    st = p.stat() if p.is_file() else None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, id(model)) if st else None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    head = load_head(path, model)
    if key is not None:
        _CACHE.clear()  # one head at a time is the common case; keep memory bounded
        _CACHE[key] = head
    return head


def heads_drafter(
    head: CircuitHead,
    *,
    do_sample: bool = False,
    top_branches: int = 1,
    min_path_prob: float = 0.0,
    vocab_top_k: int | None = None,
    dtype: torch.dtype | None = None,
    **entmtp: Any,
) -> Any:
    """The C++ drafter over a trained ``head`` (ValueError for an untrained one). The block-complexity
    budget is the decode loop's (StepLimits), not the drafter's; ``min_path_prob``, ``vocab_top_k``
    and ``dtype`` (``head_dtype``): see :class:`mtprobe.HeadsConfig`; ``entmtp``: the bank's compiled trees, policy,
    feature, ema and record (:func:`mtprobe.drafters.heads_drafter` builds them from a HeadsConfig)."""
    from mtprobe import _C

    if int(head.trained_steps) < 1:
        raise ValueError(
            "this circuit head has not been trained (0 steps): its drafts would be noise; train it with "
            "python -m mtprobe.heads train, or load a checkpoint with mtprobe.heads.load_head"
        )
    if dtype is not None and head.draft is None and vocab_top_k is None:
        raise ValueError(
            f"head_dtype={str(dtype).removeprefix('torch.')!r} sets the dtype of a head's LoRA draft layers and "
            "of its restricted vocabulary's tables, and this head has neither (lora_layers=0, vocab_top_k=None): "
            "it would change nothing; set vocab_top_k=K too, or leave head_dtype=None"
        )
    head.eval()
    spec = head.spec
    return _C.HeadsDrafter(
        head.step_fn(vocab_top_k, dtype),
        circuit=spec.circuit,
        window=spec.window,
        rank=head.r,
        vocab=spec.vocab_size,
        do_sample=do_sample,
        top_branches=top_branches,
        committed_rows=head.draft is not None,  # only draft layers read the rows before the last
        min_path_prob=min_path_prob,
        **entmtp,
    )


# --- training ----------------------------------------------------------------------------------


@dataclass
class Features:
    """The frozen backbone's features of a set of token sequences, concatenated."""

    hidden: torch.Tensor  # [N, d] float32, the backbone's hidden_states[layer] at every position
    ids: torch.Tensor  # [N] int64, the token at every position
    starts: torch.Tensor  # [S] int64, where each sequence begins in the concatenation
    first: torch.Tensor  # [S] int64, per sequence: the first position whose window is trained on
    layer: int = -1  # -1: the last hidden state (final norm); else the input of LoRA draft layers
    last: torch.Tensor | None = None  # [N, d] float32: the last hidden state too when layer != -1

    def sequence_of(self, pos: torch.Tensor) -> torch.Tensor:
        """The sequence each position ``[M]`` belongs to ``[M]``."""
        return torch.searchsorted(self.starts, pos, right=True) - 1

    @property
    def ends(self) -> torch.Tensor:
        """[S] int64: where each sequence ends (exclusive) in the concatenation."""
        return torch.cat([self.starts[1:], torch.tensor([self.ids.numel()])])

    def windows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [M], windows [M, n]): every position p >= first of its sequence with n tokens after it."""
        anchors = [
            torch.arange(s + f, e - n)
            for s, f, e in zip(self.starts, self.first, self.ends, strict=True)
            if e - n > s + f
        ]
        if not anchors:
            raise ValueError(f"no sequence is long enough for a window of {n} tokens")
        pos = torch.cat(anchors)  # [M]
        return pos, self.ids[pos[:, None] + 1 + torch.arange(n)]  # [M, n]


def compute_features(
    model: Any,
    sequences: Sequence[tuple[torch.Tensor, int]],
    progress: Callable[[str], None] | None = None,
    layer: int = -1,
) -> Features:
    """The backbone's ``hidden_states[layer]`` (default: the last) over each ``(ids [L], first)``
    sequence; windows are trained from position ``first`` on (the prompt's last token for
    self-distillation, 0 for a corpus)."""
    hidden, last, ids, starts, first, at = [], [], [], [], [], 0
    device = next(model.parameters()).device
    for i, (seq, f) in enumerate(sequences):
        if progress is not None and (i % 10 == 0 or i + 1 == len(sequences)):
            progress(f"features {i + 1}/{len(sequences)}")
        with torch.no_grad():
            out = model(seq[None].to(device), output_hidden_states=True)
        hidden.append(out.hidden_states[layer][0].float().cpu())  # [L, d]
        if layer != -1:  # the target's logits at each anchor, for heads whose emissions build on them
            last.append(out.hidden_states[-1][0].float().cpu())  # [L, d]
        ids.append(seq.cpu())
        starts.append(at)
        first.append(f)
        at += seq.numel()
    return Features(
        torch.cat(hidden),
        torch.cat(ids),
        torch.tensor(starts),
        torch.tensor(first),
        layer,
        torch.cat(last) if last else None,
    )


def features_at_layer(
    model: Any, features: Features, layer: int, progress: Callable[[str], None] | None = None
) -> Features:
    """``features``'s sequences again, with the backbone's ``hidden_states[layer]`` and, for a layer
    other than the last, the last hidden state too (``features`` itself if it already holds them)."""
    if features.layer == layer and (layer == -1 or features.last is not None):
        return features
    seqs = [
        (features.ids[s:e], int(f))
        for s, e, f in zip(features.starts, features.ends, features.first, strict=True)
    ]
    return compute_features(model, seqs, progress, layer)


def head_inputs(head: CircuitHead, features: Features, pos: torch.Tensor) -> torch.Tensor:
    """What ``head`` reads at positions ``pos`` ``[M]`` -> ``[M, d]``: the cached features, or, with LoRA
    draft layers, their output over each anchor's sequence up to the anchor (differentiable)."""
    device = head.lm_head.device
    if head.draft is None:
        return features.hidden[pos].to(device)
    if features.layer != head.hidden_layer:
        raise ValueError(
            f"the features hold hidden_states[{features.layer}]; this head's LoRA draft layers read "
            f"hidden_states[{head.hidden_layer}] (features_at_layer makes them)"
        )
    seq = features.sequence_of(pos)
    rows = []
    for s in seq.unique().tolist():
        mine = (seq == s).nonzero().flatten()  # anchors in this sequence
        start = int(features.starts[s])
        end = int(pos[mine].max()) + 1  # causal: nothing after the last anchor matters
        h = features.hidden[start:end].to(device)[None]  # [1, T, d]
        h = head.draft(h, torch.arange(end - start, device=device)[None])[0]  # [T, d]
        rows.append((mine.to(device), h[pos[mine].to(device) - start]))
    order = torch.argsort(torch.cat([m for m, _ in rows]))  # back to the order of pos
    return torch.cat([r for _, r in rows])[order]  # [M, d]


def base_inputs(head: CircuitHead, features: Features, pos: torch.Tensor) -> torch.Tensor | None:
    """The backbone's last hidden states ``[M, d]`` at positions ``pos`` ``[M]`` when ``head``'s emissions
    build on the target's logits and it reads another layer (LoRA draft layers); None otherwise (the
    head computes its base from what it reads, or has none)."""
    if head.draft is None or not head.target_base:
        return None
    if features.last is None:
        raise ValueError(
            "this LoRA head's emissions build on the target's logits (lora_base='target'), but the features "
            "hold no last hidden state: make them with compute_features(..., layer=head.hidden_layer)"
        )
    return features.last[pos].to(head.lm_head.device)


def _head_params(head: CircuitHead, hidden: torch.Tensor, base_hidden: torch.Tensor | None) -> CircuitParams:
    return head(hidden, None if base_hidden is None else head.base_logits(base_hidden))


def text_sequences(
    tokenizer: Any,
    paths: Sequence[str],
    length: int,
    *,
    holdout: float = 0.0,
    max_tokens: int | None = None,
) -> list[tuple[torch.Tensor, int]]:
    """Chunks of ``length`` tokens of local text files (a corpus installable offline), without the last
    ``holdout`` of each file's characters (what a byte LM trained by :mod:`mtprobe.bytelm` held out),
    at most ``max_tokens`` tokens in all (yet one chunk of every file at least), evenly spaced chunks
    of every file."""
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout={holdout} must be in [0, 1)")
    if max_tokens is not None and max_tokens < length:
        raise ValueError(f"max_tokens={max_tokens} must be >= the sequence length {length}")
    per_file = None if max_tokens is None else max(length, max_tokens // len(paths))
    out = []
    for p in paths:
        text = Path(p).read_text(encoding="utf-8", errors="replace")
        text = text[: len(text) - int(holdout * len(text))]
        ids = tokenizer(text, return_tensors="pt").input_ids[0]  # [T]
        starts = list(range(0, ids.numel() - length // 2, length))
        if per_file is not None and len(starts) * length > per_file:  # evenly spaced chunks of the file
            keep = per_file // length
            starts = [starts[i * len(starts) // keep] for i in range(keep)]
        out += [(ids[s : s + length], 0) for s in starts]
    return out


def window_token_counts(features: Features, window: int, vocab_size: int) -> torch.Tensor:
    """``[V]`` int32: how often each token occurs in ``features``'s windows of ``window`` tokens (what
    a head trained on them records in ``token_counts``, to rank its vocabulary)."""
    _, win = features.windows(window)  # [M, n]
    if int(win.max()) >= vocab_size:
        raise ValueError(
            f"the features hold token id {int(win.max())}, outside the head's vocabulary of {vocab_size}: "
            "they come from another tokenizer"
        )
    return torch.bincount(win.flatten(), minlength=vocab_size).to(torch.int32)  # half the bytes of int64


def train_head(
    head: CircuitHead,
    features: Features,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-4,
    gamma: float | None = None,
    seed: int = 0,
    holdout: float = 0.1,
    progress: bool = False,
) -> dict[str, Any]:
    """Adam on the discounted window NLL over ``features``'s windows; returns the training stats
    (train and held-out loss, held-out top-1 of the first draft position, time)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    gamma = default_gamma(head.spec.window) if gamma is None else gamma
    pos, win = features.windows(head.spec.window)
    head.token_counts.copy_(window_token_counts(features, head.spec.window, head.spec.vocab_size))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pos.numel(), generator=g)
    n_hold = int(holdout * pos.numel()) if pos.numel() >= 10 else 0
    hold, train = perm[:n_hold], perm[n_hold:]
    device = head.lm_head.device
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    head.train()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="train head", unit="step")
    start, losses = time.perf_counter(), []
    if head.draft is not None:
        # LoRA draft layers run over whole sequences: a few sequences per step, several anchors each.
        train_seq = features.sequence_of(pos[train])  # [M_train]
        seqs = train_seq.unique()
        of_seq = {int(s): train[(train_seq == s).nonzero().flatten()] for s in seqs}  # its anchors
        per_seq = min(8, batch_size)
    for _ in range(steps):
        if head.draft is None:
            idx = train[torch.randint(train.numel(), (batch_size,), generator=g)]
        else:
            chosen = seqs[torch.randint(seqs.numel(), (max(1, batch_size // per_seq),), generator=g)]
            idx = torch.cat(
                [
                    of_seq[s][torch.randint(of_seq[s].numel(), (per_seq,), generator=g)]
                    for s in chosen.tolist()
                ]
            )
        hidden, target = head_inputs(head, features, pos[idx]), win[idx].to(device)
        loss = window_loss(_head_params(head, hidden, base_inputs(head, features, pos[idx])), target, gamma)
        opt.zero_grad()
        loss.backward()
        opt.step()
        head.trained_steps += 1
        losses.append(loss.item())
        if bar is not None:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            bar.update()
    if bar is not None:
        bar.close()
    head.eval()
    stats: dict[str, Any] = {
        "steps": int(head.trained_steps),
        "train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "windows": int(pos.numel()),
        "seconds": round(time.perf_counter() - start, 1),
        "gamma": gamma,
        "lr": lr,
        "batch_size": batch_size,
    }
    if n_hold:
        with torch.no_grad():
            held = head_inputs(head, features, pos[hold])
        stats.update(evaluate_head(head, held, win[hold], gamma, base_inputs(head, features, pos[hold])))
    return stats


def init_from(head: CircuitHead, trained: CircuitHead) -> None:
    """Copy ``trained``'s circuit parameters into ``head`` (same spec but for the LoRA layers, whose
    adapters stay as they are); ValueError naming the difference otherwise."""
    lora = ("lora_layers", "lora_rank", "lora_base")
    mine = {k: v for k, v in asdict(head.spec).items() if k not in lora}
    theirs = {k: v for k, v in asdict(trained.spec).items() if k not in lora}
    if mine != theirs:
        differs = [k for k in mine if mine[k] != theirs[k]]
        raise ValueError(f"--init head differs in {', '.join(differs)}: {theirs} against {mine}")
    state = {k: v for k, v in trained.state_dict().items() if not k.startswith("draft.")}
    missing, unexpected = head.load_state_dict(state, strict=False)  # token_counts: train_head's own
    if unexpected or any(not k.startswith("draft.") for k in missing):
        raise ValueError(f"--init head does not fit: missing {missing}, unexpected {unexpected}")


def evaluate_head(
    head: CircuitHead,
    hidden: torch.Tensor,
    windows: torch.Tensor,
    gamma: float,
    base_hidden: torch.Tensor | None = None,
) -> dict[str, float]:
    """Held-out discounted NLL, and how often the most probable second token given the true first is
    the true second (what a one-draft greedy tree accepts); ``base_hidden``: :func:`base_inputs`'s."""
    from mtprobe.ops import circuit_next_token_log_probs

    losses, hits = 0.0, 0
    with torch.no_grad():
        for s in range(0, hidden.shape[0], 256):
            device = head.lm_head.device
            b = None if base_hidden is None else base_hidden[s : s + 256].to(device)
            params, w = _head_params(head, hidden[s : s + 256].to(device), b), windows[s : s + 256].to(device)
            losses += float(window_loss(params, w, gamma)) * w.shape[0]
            core = (None if x is None else x.cpu() for x in params.core_batch())  # the ops run on the CPU
            nxt = circuit_next_token_log_probs(params.circuit, *core, w[:, :1].cpu())  # [b, V]
            hits += int((nxt.argmax(-1) == w[:, 1].cpu()).sum())
    return {"heldout_loss": losses / hidden.shape[0], "heldout_top1_next": hits / hidden.shape[0]}


def _count(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from mtprobe import models

    if not _checkpoint_path(args.head).is_file():
        parser.error(f"{args.head}: no circuit-head checkpoint there")
    if not Path(args.features).is_file():
        parser.error(f"--features {args.features}: no such file")
    model, _ = models.load(args.model)
    head = load_head(args.head, model)
    features = Features(**torch.load(args.features)["features"])
    head.token_counts.copy_(window_token_counts(features, head.spec.window, head.spec.vocab_size))
    head.stats.setdefault("data", {})["token_counts_from"] = os.path.basename(args.features)  # type: ignore[attr-defined]
    path = save_head(head, model, args.head, head.stats)  # type: ignore[attr-defined]
    seen = int((head.token_counts > 0).sum())
    print(f"{path}: token counts of {int(head.token_counts.sum())} window tokens, {seen} distinct")
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    from mtprobe.calibrate import calibration_sequences
    from mtprobe.data import (
        add_calibration_arguments,
        add_corpus_arguments,
        calibration_prompts,
        corpus_argument_error,
        corpus_prompts,
        print_progress,
    )

    parser = argparse.ArgumentParser(prog="python -m mtprobe.heads", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a circuit head on the frozen backbone's features")
    add_calibration_arguments(p)
    p.add_argument("--circuit", choices=KINDS, default="cp")
    p.add_argument("--window", type=int, default=4, help="n: the next token and n - 1 drafts")
    p.add_argument("--rank", type=int, default=4, help="r: latent states (1 for ff)")
    p.add_argument("--emission", choices=EMISSIONS, default="lowrank")
    p.add_argument("--adapter-rank", type=int, default=16)
    p.add_argument(
        "--lora-layers",
        type=int,
        default=0,
        help="k: give the draft LoRA-adapted copies of the backbone's last k layers (0: read its last state)",
    )
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument(
        "--lora-base",
        choices=LORA_BASES,
        default="target",
        help="with --lora-layers: the emissions build on the target's logits (free at decode time) or on "
        "the draft's own (a second LM-head pass per step)",
    )
    p.add_argument(
        "--init",
        default=None,
        help="start from this trained head (same circuit, window, rank and emissions; e.g. one without "
        "LoRA, continued with --lora-layers K as in the paper)",
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=None, help="discount (default 0.8, 0.9 for n > 8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of each greedy continuation")
    p.add_argument("--text", nargs="*", default=[], help="local text files to train on as well (a corpus)")
    p.add_argument(
        "--text-holdout",
        type=float,
        default=0.0,
        help="leave out the last fraction of every --text file (e.g. 0.05: what mtprobe.bytelm held out)",
    )
    p.add_argument("--max-text-tokens", type=int, default=None, help="at most this many --text tokens")
    p.add_argument(
        "--passage-prompts",
        type=int,
        default=0,
        help="self-distil on N more prompts: the first 96 bytes of passages of the --text files (their "
        "training part), continued as plain text without a chat template (for base models such as "
        "mtprobe.bytelm's)",
    )
    add_corpus_arguments(p)
    p.add_argument("--no-self", action="store_true", help="skip the model's own greedy continuations")
    p.add_argument("--features", default=None, help="cache the backbone's features in this file")
    p.add_argument("--seed", type=int, default=0)
    c = sub.add_parser(
        "count",
        help="record in a head's checkpoint how often each token occurs in its training windows (heads "
        "trained before train recorded it), for HeadsConfig(vocab_top_k=...)",
    )
    c.add_argument("head", help="the head's folder (rewritten in place)")
    c.add_argument(
        "--features", required=True, help="the features file the head was trained on (train --features)"
    )
    c.add_argument("--model", default="smollm2-135m", help="the backbone the head belongs to")
    args = parser.parse_args(argv)
    if args.command == "count":
        return _count(parser, args)

    try:  # the architecture's own checks, before any model is loaded
        HeadSpec(
            args.circuit,
            args.window,
            args.rank,
            args.emission,
            args.adapter_rank,
            1,
            1,
            args.lora_layers,
            args.lora_rank,
        )
        if args.init is not None and not _checkpoint_path(args.init).is_file():
            raise ValueError(f"--init {args.init}: no circuit-head checkpoint there")
        if args.steps < 1 or args.batch_size < 1:
            raise ValueError(f"steps={args.steps} and batch_size={args.batch_size} must be >= 1")
        if not 0.0 <= args.text_holdout < 1.0:
            raise ValueError(f"--text-holdout {args.text_holdout} must be in [0, 1)")
        if args.passage_prompts and not args.text:
            raise ValueError("--passage-prompts N takes its passages from --text FILES; give them")
        if args.max_text_tokens is not None and args.max_text_tokens < 256:
            raise ValueError(f"--max-text-tokens {args.max_text_tokens} must be >= 256 (one sequence)")
        error = corpus_argument_error(args)
        if error:
            raise ValueError(error)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    model, tokenizer, prompts = calibration_prompts(args)
    layer = -1
    if args.lora_layers:
        from mtprobe.lora import decoder_of

        try:
            layers = len(decoder_of(model).layers)
            if args.lora_layers > layers:
                raise ValueError(f"--lora-layers {args.lora_layers} exceeds the model's {layers} layers")
        except ValueError as e:
            parser.error(str(e))
        layer = layers - args.lora_layers  # the draft layers' input
    data = {
        "self": not args.no_self,
        "prompts": args.prompts or "built-in",
        "num_prompts": args.num_prompts,
        "corpus_prompts": [os.path.basename(c) for c in args.corpus_prompts],
        "num_corpus_prompts": args.num_corpus_prompts if args.corpus_prompts else 0,
        "max_new_tokens": args.max_new_tokens,
        "gen_batch_size": args.gen_batch_size,
        "text": [os.path.basename(t) for t in args.text],
        "text_holdout": args.text_holdout,
        "max_text_tokens": args.max_text_tokens,
        "passage_prompts": args.passage_prompts,
    }
    if args.features and Path(args.features).is_file():
        print_progress(f"features from {args.features} (its data options replace this command's)")
        saved = torch.load(args.features)
        features, data = Features(**saved["features"]), saved["data"]
        features = features_at_layer(model, features, layer, print_progress)
    else:
        seqs: list[tuple[torch.Tensor, int]] = []
        if args.passage_prompts:
            from mtprobe.bytelm import passage_prompts

            texts = passage_prompts(
                args.text, args.passage_prompts, part="train", holdout=args.text_holdout, seed=args.seed
            )
            prompts = prompts + [tokenizer(t, return_tensors="pt").input_ids for t in texts]
        if args.corpus_prompts:
            prompts = prompts + corpus_prompts(
                tokenizer, args.corpus_prompts, args.num_corpus_prompts, args.seed
            )
        if not args.no_self:
            seqs += [
                (ids, plen - 1)
                for ids, plen in calibration_sequences(
                    model, prompts, args.max_new_tokens, print_progress, batch_size=args.gen_batch_size
                )
            ]
        if args.text:
            seqs += text_sequences(
                tokenizer, args.text, 256, holdout=args.text_holdout, max_tokens=args.max_text_tokens
            )
        if not seqs:
            parser.error("no training data: drop --no-self or give --text FILES")
        features = compute_features(model, seqs, print_progress, layer)
        if args.features:
            torch.save({"features": asdict(features), "data": data}, args.features)
    weight, _ = _lm_head(model)
    spec = HeadSpec(
        circuit=args.circuit,
        window=args.window,
        rank=args.rank,
        emission=args.emission,
        adapter_rank=args.adapter_rank,
        hidden_size=int(weight.shape[1]),
        vocab_size=int(weight.shape[0]),
        lora_layers=args.lora_layers,
        lora_rank=args.lora_rank,
        lora_base=args.lora_base,
    )
    torch.manual_seed(args.seed)
    head = new_head(model, spec)
    if args.init is not None:
        init_from(head, load_head(args.init, model))
        data["init"] = os.path.basename(os.path.normpath(args.init))
    stats = train_head(
        head,
        features,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        gamma=args.gamma,
        seed=args.seed,
        progress=True,
    )
    stats["data"] = data
    path = save_head(head, model, args.out, stats)
    print(json.dumps({"checkpoint": str(path), **stats}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
