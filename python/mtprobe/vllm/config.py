"""Which mtprobe configurations vLLM can host, and the ``speculative_config`` dict that carries one.

vLLM instantiates a custom proposer from a class path alone (``Class(vllm_config)``), and its
``speculative_config`` has no field for a proposer's own settings. The configuration therefore rides in
the class name: ``mtprobe.vllm.proposer.<ConfigClass>_<hex>``, the hex being the zlib-compressed JSON of
``config.to_dict()`` (with ``"price_steps": false`` added when the steps' pricing is turned off);
:mod:`mtprobe.vllm.proposer` rebuilds the configuration from it when the engine imports the name.
Nothing is written to disk and the dict works as it stands with ``vllm serve --speculative-config``.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from mtprobe import registry
from mtprobe.drafters.base import as_decoding_config, check_decoding_config, config_from_dict, leaves

# The module whose attributes are the configured proposer classes (see mtprobe.vllm.proposer).
PROPOSER_MODULE = "mtprobe.vllm.proposer"
# The key class_path adds to the configuration's JSON when the steps' pricing is off.
PRICE_STEPS = "price_steps"


def why_not_hosted(config: Any) -> str:
    """Why vLLM cannot draft with ``config`` through mtprobe's proposer ("" when it can): a drafter that
    needs more than the token history (``Method.tokens_only``), a live draft model or profile object
    (the engine rebuilds the configuration from JSON), or a configuration that is not JSON."""
    method = check_decoding_config(config)
    reasons = []
    for c in leaves(config):
        why = registry.method_of(c).tokens_only
        if why is not None:
            reasons.append(f"{type(c).__name__}: {why}")
        elif getattr(c, "draft_model", None) is not None:
            reasons.append(
                f"{type(c).__name__}: a draft model object cannot cross into vLLM's engine, which builds the "
                "proposer from a class path; use self_draft='quantized' (or 'truncated') instead"
            )
    if method.name == "auto" and config.profile is not None and not isinstance(config.profile, str):
        reasons.append(
            "AutoConfig: a ForwardProfile object cannot cross into vLLM's engine; pass the path of a saved one"
        )
    if not reasons:
        try:
            json.dumps(config.to_dict())
        except TypeError as e:
            reasons.append(f"{type(config).__name__} does not serialise to JSON ({e})")
    return "; ".join(reasons)


def default_num_tokens(config: Any) -> int:
    """The longest chain ``config``'s drafters make (``num_tokens`` of prompt lookup and draft models,
    ``max_depth`` of STAND; the largest among a scheduler's): vLLM's ``num_speculative_tokens``."""
    depths = [getattr(c, "num_tokens", None) or getattr(c, "max_depth", None) or 0 for c in leaves(config)]
    return max([d for d in depths if isinstance(d, int)] or [1])


def speculative_config(
    config: Any, *, num_speculative_tokens: int | None = None, price_steps: bool = True
) -> dict[str, Any]:
    """``vllm.LLM(..., speculative_config=...)``'s value that drafts with ``config`` (a decoding
    configuration or its ``to_dict()`` form): ``{"method": "custom_class", "model": <class path>,
    "num_speculative_tokens": k}``, k the longest chain ``config`` drafts unless given. ValueError naming
    the drafter and the reason when vLLM cannot host it (:func:`why_not_hosted`).

    ``price_steps`` (default): each step sends only the drafts expected to raise the batch's tokens per
    second, by vLLM's step times and the drafts' acceptance as measured while it runs
    (:mod:`mtprobe.vllm.pricing`); False sends every row the whole chain its drafter makes."""
    if not isinstance(price_steps, bool):
        raise ValueError(f"price_steps={price_steps!r} must be True or False")
    config = as_decoding_config(config)
    reason = why_not_hosted(config)
    if reason:
        raise ValueError(f"vLLM cannot draft with {type(config).__name__} through mtprobe: {reason}")
    k = default_num_tokens(config) if num_speculative_tokens is None else num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens!r} must be a positive int (the longest chain a "
            "step verifies), or None for the configuration's own"
        )
    return {"method": "custom_class", "model": class_path(config, price_steps), "num_speculative_tokens": k}


def class_path(config: Any, price_steps: bool = True) -> str:
    """The proposer class path that carries ``config`` and ``price_steps`` (see the module's docstring)."""
    data = config.to_dict()
    if not price_steps:
        data[PRICE_STEPS] = False
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return f"{PROPOSER_MODULE}.{type(config).__name__}_{zlib.compress(text.encode(), 9).hex()}"


def config_of(name: str) -> tuple[Any, bool]:
    """The configuration a proposer class name of :func:`class_path` carries, and its ``price_steps``;
    ValueError for a name that is not one."""
    kind, _, payload = name.rpartition("_")
    try:
        data = json.loads(zlib.decompress(bytes.fromhex(payload)))
        price_steps = data.pop(PRICE_STEPS, True) if isinstance(data, dict) else True
        config = config_from_dict(data)
    except (ValueError, zlib.error) as e:
        raise ValueError(
            f"{name!r} is not a proposer class of mtprobe.vllm.speculative_config (<ConfigClass>_<hex of the "
            f"zlib-compressed JSON configuration>): {e}"
        ) from None
    if type(config).__name__ != kind:
        raise ValueError(f"{name!r} names {kind} but carries a {type(config).__name__}")
    return config, price_steps is not False
