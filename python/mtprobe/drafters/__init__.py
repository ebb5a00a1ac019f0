"""The drafters: one module per decoding method, named as its C++ drafter in ``csrc/drafters/``.

Each module holds the method's configuration (a frozen dataclass that validates itself), its drafter
factory and its one :func:`mtprobe.registry.register` call, which also declares what the method needs
of the shared decode path (hidden states, the target's cache, a cross-request memory, ...). Importing
this package registers them all, in the order ``--help`` and ``config_from_dict``'s errors list them:

========================  ==============  =====================================================
module                    method          configuration
========================  ==============  =====================================================
``mask_probe``            ``probe``       :class:`ProbeConfig` (seed 001, the core)
``prompt_lookup``         ``pld``         :class:`PromptLookupConfig`
``draft_model``           ``sps``         :class:`DraftModelConfig` (and the self-drafts)
``stand``                 ``stand``       :class:`StandConfig`
``lookahead``             ``lookahead``   :class:`LookaheadConfig`
``hybrid``                ``hybrid``      :class:`HybridConfig`
``entmtp``                ``entmtp``      :class:`EntMTPConfig` (seed 002)
``heads``                 ``heads``       :class:`HeadsConfig` (seed 003)
``auto``                  ``auto``        :class:`AutoConfig` (per-step scheduling)
``plain``                 ``plain``       :class:`PlainConfig`
========================  ==============  =====================================================

:mod:`~mtprobe.drafters.base` holds what they share; :mod:`~mtprobe.drafters.from_hf` maps transformers'
drafter arguments onto them.
"""

# The registration order is the import order below.
from mtprobe.drafters.mask_probe import ProbeConfig, mask_probe_drafter  # isort: skip
from mtprobe.drafters.prompt_lookup import PromptLookupConfig, prompt_lookup_drafter  # isort: skip
from mtprobe.drafters.draft_model import DraftModelConfig, draft_model_drafter  # isort: skip
from mtprobe.drafters.stand import StandConfig, ngram_memory, stand_drafter  # isort: skip
from mtprobe.drafters.lookahead import LookaheadConfig, lookahead_drafter  # isort: skip
from mtprobe.drafters.hybrid import HybridConfig, hybrid_drafter  # isort: skip
from mtprobe.drafters.entmtp import EntMTPConfig, entmtp_drafter  # isort: skip
from mtprobe.drafters.heads import HeadsConfig, heads_drafter  # isort: skip
from mtprobe.drafters.auto import AutoConfig, auto_candidates, auto_drafter  # isort: skip
from mtprobe.drafters.plain import PlainConfig, plain_drafter  # isort: skip
from mtprobe.drafters.base import (  # isort: skip
    ConfigData,
    as_decoding_config,
    check_decoding_config,
    config_from_dict,
    config_from_json,
    decoding_configs,
    hidden_layer,
    make_drafter,
    mask_adaptation,
    max_prompt_logit_rows,
    ngram_memories,
    drafts_row_by_row,
)

__all__ = [
    "AutoConfig",
    "ConfigData",
    "DraftModelConfig",
    "EntMTPConfig",
    "HeadsConfig",
    "HybridConfig",
    "LookaheadConfig",
    "PlainConfig",
    "ProbeConfig",
    "PromptLookupConfig",
    "StandConfig",
    "as_decoding_config",
    "auto_candidates",
    "auto_drafter",
    "check_decoding_config",
    "config_from_dict",
    "config_from_json",
    "decoding_configs",
    "draft_model_drafter",
    "entmtp_drafter",
    "heads_drafter",
    "hidden_layer",
    "hybrid_drafter",
    "lookahead_drafter",
    "make_drafter",
    "mask_adaptation",
    "mask_probe_drafter",
    "max_prompt_logit_rows",
    "ngram_memories",
    "ngram_memory",
    "plain_drafter",
    "prompt_lookup_drafter",
    "drafts_row_by_row",
    "stand_drafter",
]
