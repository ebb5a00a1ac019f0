"""mtprobe: lossless multi-token decoding of HuggingFace causal LMs.

    cfg = mtprobe.ProbeConfig(block_complexity=30)
    out = mtprobe.generate(model, input_ids, cfg, max_new_tokens=128)

or through HF: ``model.generate(**inputs, custom_generate=mtprobe.custom_generate, mtprobe_config=cfg)``.

A new drafter registers its method once: ``mtprobe.register_method(mtprobe.Method(name=..., config_type=...,
drafter=..., summary=..., options=(mtprobe.Option(...), ...)))`` (:mod:`mtprobe.registry`).
"""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from mtprobe import _C, heads, models, ops  # noqa: F401
from mtprobe.cpu.linear_routes import LinearRoutes
from mtprobe.decode import GenerateOutput, custom_generate, generate
from mtprobe.drafters import (  # importing mtprobe.drafters registers the built-in methods
    AutoConfig,
    DraftModelConfig,
    EntMTPConfig,
    HeadsConfig,
    HybridConfig,
    LookaheadConfig,
    PlainConfig,
    ProbeConfig,
    PromptLookupConfig,
    StandConfig,
    config_from_dict,
    config_from_json,
    ngram_memory,
)
from mtprobe.registry import Method, Option
from mtprobe.registry import register as register_method
from mtprobe.registry import unregister as unregister_method
from mtprobe.state import release
from mtprobe.target_model.plan import PlanConfig
from mtprobe.target_model.profile import ForwardProfile, choose_linear_routes, profile_forward
from mtprobe.topology import TopologyBank

NgramMemory = _C.NgramMemory  # the cross-request n-gram memory of STAND and the hybrid
__version__ = "0.1.0"
__all__ = [
    "PlainConfig",
    "ProbeConfig",
    "PromptLookupConfig",
    "StandConfig",
    "LookaheadConfig",
    "HybridConfig",
    "DraftModelConfig",
    "EntMTPConfig",
    "HeadsConfig",
    "AutoConfig",
    "TopologyBank",
    "ForwardProfile",
    "profile_forward",
    "LinearRoutes",
    "PlanConfig",
    "choose_linear_routes",
    "config_from_dict",
    "config_from_json",
    "Method",
    "Option",
    "register_method",
    "unregister_method",
    "GenerateOutput",
    "generate",
    "custom_generate",
    "NgramMemory",
    "ngram_memory",
    "release",
    "models",
    "heads",
    "ops",
    "__version__",
]
