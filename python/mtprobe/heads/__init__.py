"""Probabilistic-circuit heads (MTPC, seed 003): a small head maps the target's last hidden state to the
parameters of a circuit over the next ``window`` tokens; the C++ drafter (csrc/drafters/heads.h) drafts
from it, conditioned on the token the target already chose, and the target verifies losslessly.

The package re-exports the public names of the circuit model (:mod:`mtprobe.heads.circuit`:
:class:`HeadSpec`, :class:`CircuitHead`, :func:`window_loss`) and of a trained head at inference
(:mod:`mtprobe.heads.inference`: checkpoints, :func:`bundled_head`, :func:`heads_drafter`); the LoRA draft
layers are :mod:`mtprobe.heads.lora`. Training a head is offline, a floor above
(:mod:`mtprobe.offline.heads`: :func:`~mtprobe.offline.heads.compute_features`,
:func:`~mtprobe.offline.heads.train_head`), and not re-exported here. The command that trains one is
:mod:`mtprobe.cli.heads`::

    python -m mtprobe heads train --circuit hmm --window 4 --rank 2 --out heads/hmm --features f.pt

then decode with ``mtprobe.HeadsConfig(path="heads/hmm")``.
"""

from mtprobe.heads.circuit import (
    EMISSIONS,
    KINDS,
    LORA_BASES,
    ROOT_CANDIDATES,
    CircuitHead,
    CircuitParams,
    HeadSpec,
    RestrictedVocab,
    default_gamma,
    latent_tree,
    window_log_marginals,
    window_loss,
)
from mtprobe.heads.inference import (
    BUNDLED_HEADS,
    CHECKPOINT_FILE,
    FORMAT,
    bundled_head,
    checkpoint_path,
    heads_drafter,
    load_cached,
    load_head,
    new_head,
    output_embedding,
    save_head,
)

__all__ = [
    "BUNDLED_HEADS",
    "CHECKPOINT_FILE",
    "EMISSIONS",
    "FORMAT",
    "KINDS",
    "LORA_BASES",
    "ROOT_CANDIDATES",
    "CircuitHead",
    "CircuitParams",
    "HeadSpec",
    "RestrictedVocab",
    "bundled_head",
    "checkpoint_path",
    "default_gamma",
    "heads_drafter",
    "latent_tree",
    "load_cached",
    "load_head",
    "new_head",
    "output_embedding",
    "save_head",
    "window_log_marginals",
    "window_loss",
]
