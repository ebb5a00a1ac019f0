"""mtprobe: lossless multi-token decoding of HuggingFace causal LMs.

    cfg = mtprobe.ProbeConfig(block_complexity=30)
    out = mtprobe.generate(model, input_ids, cfg, max_new_tokens=128)

or through HF: ``model.generate(**inputs, custom_generate=mtprobe.custom_generate, mtprobe_config=cfg)``.
"""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from mtprobe import _C, ops  # noqa: F401
from mtprobe.config import (
    AutoConfig,
    DraftModelConfig,
    EntMTPConfig,
    HeadsConfig,
    HybridConfig,
    LookaheadConfig,
    ProbeConfig,
    PromptLookupConfig,
    StandConfig,
    config_from_dict,
    config_from_json,
)
from mtprobe.drafters import ngram_memory
from mtprobe.generate import GenerateOutput, custom_generate, generate
from mtprobe.profile import ForwardProfile, profile_forward

NgramMemory = _C.NgramMemory  # the cross-request n-gram memory of STAND and the hybrid
__version__ = "0.1.0"
__all__ = [
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
    "config_from_dict",
    "config_from_json",
    "GenerateOutput",
    "generate",
    "custom_generate",
    "NgramMemory",
    "ngram_memory",
    "models",
    "heads",
    "ops",
    "__version__",
]


def __getattr__(name: str):
    import importlib

    # models pulls in the GGUF conversion path; load it on first use. mtprobe.topology also runs as
    # `python -m mtprobe.topology`, which must find it not yet imported.
    if name in ("models", "heads"):
        return importlib.import_module(f"mtprobe.{name}")
    if name == "TopologyBank":
        return importlib.import_module("mtprobe.topology").TopologyBank
    raise AttributeError(f"module 'mtprobe' has no attribute {name!r}")
