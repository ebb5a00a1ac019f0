"""Probabilistic-circuit heads (MTPC, seed 003): a small head maps the target's last hidden state to the
parameters of a circuit over the next ``window`` tokens; the C++ drafter (csrc/drafters/heads.h) drafts
from it, conditioned on the token the target already chose, and the target verifies losslessly.

The package is in three parts, whose public names it re-exports: the circuit model
(:mod:`mtprobe.heads.circuit`: :class:`HeadSpec`, :class:`CircuitHead`, :func:`window_loss`), a trained
head at inference (:mod:`mtprobe.heads.inference`: checkpoints, :func:`bundled_head`,
:func:`heads_drafter`) and its training (:mod:`mtprobe.heads.training`: :func:`compute_features`,
:func:`train_head`). The command that trains one is :mod:`mtprobe.cli.heads`::

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
from mtprobe.heads.training import (
    Features,
    base_inputs,
    compute_features,
    evaluate_head,
    features_at_layer,
    head_inputs,
    init_from,
    text_sequences,
    train_head,
    window_token_counts,
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
    "Features",
    "HeadSpec",
    "RestrictedVocab",
    "base_inputs",
    "bundled_head",
    "checkpoint_path",
    "compute_features",
    "default_gamma",
    "evaluate_head",
    "features_at_layer",
    "head_inputs",
    "heads_drafter",
    "init_from",
    "latent_tree",
    "load_cached",
    "load_head",
    "new_head",
    "output_embedding",
    "save_head",
    "text_sequences",
    "train_head",
    "window_log_marginals",
    "window_loss",
    "window_token_counts",
]
