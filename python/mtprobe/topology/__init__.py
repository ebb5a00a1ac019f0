"""EntMTP (seed 002) for mask-token probing and circuit heads: a bank of static draft trees, the
offline frontiers that choose it, and the policies that switch between its trees every step.

A tree is a tuple of rank paths (the root is implicit): ``(0,)`` is the best depth-1 candidate,
``(1,)`` the second, ``(0, 0)`` the best depth-2 candidate below the best depth-1 one
(csrc/core/topology.h; the reference is :mod:`mtprobe.reference.topology`). For probing, depth d's
candidates are the d-th mask's top tokens; for a circuit head (``drafter="heads"``) the children of a
node are the head's most probable next tokens given the node's path (csrc/drafters/heads.h).

The bank, its checks and its policies are :mod:`mtprobe.topology.bank` (re-exported here); building a
bank for a model (self-rollouts, the acceptance and throughput frontiers, policy calibration) is
:func:`mtprobe.offline.topology.build_bank`, or ``python -m mtprobe topology``.

The banks are JSON files that record the model (and head) they were built for and refuse another.
"""

from mtprobe.topology.bank import (
    BANK_FORMAT,
    DRAFTERS,
    FEATURES,
    POLICIES,
    TopologyBank,
    Tree,
    chain_tree,
    check_policy,
    default_bank,
    default_branches,
    model_fingerprint,
)

__all__ = [
    "BANK_FORMAT",
    "DRAFTERS",
    "FEATURES",
    "POLICIES",
    "Tree",
    "TopologyBank",
    "chain_tree",
    "check_policy",
    "default_bank",
    "default_branches",
    "model_fingerprint",
]
