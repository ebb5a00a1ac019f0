"""PyTorch reference definitions of mtprobe's ops: short, readable, slow; the C++ ops are tested against them.

Nothing here imports from mtprobe outside this subpackage, so the definitions stand on their own.
"""

from .draft_tree import dynamic_tree, expand_tree, merge_trees, static_tree
from .kv_compact import check_compaction, compact_kv
from .panel_linear import pack_panels, panel_linear
from .prompt_lookup import prompt_lookup
from .quantized_linear import (
    quantized_activations,
    quantized_linear,
    quantized_linear_int8,
    searched_q4_1,
    searched_q8_0,
)
from .small_batch_linear import small_batch_linear
from .stand import NgramStore, build_stand_tree
from .target_forward import target_forward
from .tree_mask import (
    check_parents,
    tree_ancestors,
    tree_attention,
    tree_attention_mask,
    tree_depths,
    tree_position_ids,
)
from .verify import verify_greedy, verify_rejection

__all__ = [
    "NgramStore",
    "build_stand_tree",
    "check_compaction",
    "check_parents",
    "compact_kv",
    "dynamic_tree",
    "expand_tree",
    "merge_trees",
    "pack_panels",
    "panel_linear",
    "prompt_lookup",
    "searched_q4_1",
    "searched_q8_0",
    "quantized_activations",
    "quantized_linear",
    "quantized_linear_int8",
    "small_batch_linear",
    "static_tree",
    "target_forward",
    "tree_ancestors",
    "tree_attention",
    "tree_attention_mask",
    "tree_depths",
    "tree_position_ids",
    "verify_greedy",
    "verify_rejection",
]
