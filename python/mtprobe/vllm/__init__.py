"""mtprobe's drafters inside vLLM: the value of ``speculative_config`` for vLLM's custom proposer.

    import mtprobe, vllm
    from mtprobe.vllm import speculative_config

    llm = vllm.LLM(model=folder, speculative_config=speculative_config(mtprobe.PromptLookupConfig()))
    # or: vllm serve FOLDER --speculative-config "$(python -c '...print(json.dumps(speculative_config(cfg)))')"

vLLM (V1) builds a custom proposer from a class path (``{"method": "custom_class", "model":
"package.module.Class", ...}``) and asks it, every step, for one chain of draft tokens per request; it
verifies the chains itself, so its output stays its own. The class path :func:`speculative_config` returns
carries the mtprobe configuration (:mod:`mtprobe.vllm.proposer`), so the engine, in whatever process it
runs, drafts with exactly the configuration given. Hosted: the drafters that draft from the token history
alone (``Method.tokens_only`` is None: prompt lookup, STAND with its text store and optional
cross-request memory, draft models and the self-drafts, and ``AutoConfig`` over them). Not hosted, each a
ValueError that says why: drafters that read the target's logits of inputs of their own (probing's mask
tokens, lookahead's window), its hidden states (circuit heads), or trees (vLLM verifies chains).
"""

from mtprobe.vllm.config import default_num_tokens, speculative_config, why_not_hosted

__all__ = ["default_num_tokens", "speculative_config", "why_not_hosted"]
