"""Loading a causal LM strictly offline: :func:`resolve` turns a known name, a local folder or a cached
hub id into a folder, and :func:`load` reads the model and tokenizer from it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from mtprobe.models.cache import fetch
from mtprobe.models.hub import _HUB_ID, _from_hub_cache, hf_hub_cache
from mtprobe.models.specs import DEFAULT_MODEL, KNOWN_MODELS, _known_names

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Any of these in a folder means AutoTokenizer has something to load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"invalid dtype {dtype!r}; valid strings are {', '.join(map(repr, _DTYPES))}")


def resolve(name_or_path: str | os.PathLike[str], *, revision: str | None = None) -> Path:
    """The local folder of a model: a known name (fetched first if needed), a local Hugging Face
    folder with ``config.json``, or a hub id ``org/name`` (``org/name@rev``, or ``revision=``) found
    in the Hugging Face cache (:func:`hf_hub_cache`) without any network access.

    A known name wins over a same-named folder, and a folder over a same-named hub id. Raises
    ValueError naming the known names, the folder tried and the cache searched when none matches.
    """
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ValueError(
            f"revision must be a non-empty string (a branch, tag or commit hash), got {revision!r}"
        )
    if isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS:
        if revision is not None:
            raise ValueError(f"{name_or_path!r} is a known model name; revision= applies to hub ids only")
        return fetch(name_or_path)
    folder = None
    # "" would silently mean the working directory; treat it as invalid instead.
    if isinstance(name_or_path, (str, os.PathLike)) and os.fspath(name_or_path):
        folder = Path(name_or_path).expanduser()
    if folder is not None and (folder / "config.json").is_file():
        return folder
    looked = [f"the known model names ({_known_names()})"]
    if folder is not None:
        state = "has no config.json" if folder.is_dir() else "does not exist"
        looked.append(f"the local folder {folder.absolute()} ({state})")
    hub = _HUB_ID.fullmatch(name_or_path) if isinstance(name_or_path, str) else None
    if hub is not None:
        rev = hub["rev"]
        if rev is not None and revision is not None and rev != revision:
            raise ValueError(f"{name_or_path!r} names revision {rev!r} but revision={revision!r} was passed")
        rev = rev or revision
        cache = hf_hub_cache()
        found, why = _from_hub_cache(hub["repo"], rev, cache)
        if found is not None:
            return found
        looked.append(
            f"the Hugging Face cache {cache} for {hub['repo']!r} at revision {rev or 'main'!r} ({why}; "
            "offline: nothing is downloaded, put the model in that cache or set HF_HUB_CACHE / HF_HOME)"
        )
    else:
        looked.append(
            "no Hugging Face cache: it is not a hub id of the form 'org/name' or 'org/name@revision'"
        )
    raise ValueError(
        f"cannot load model {name_or_path!r}: expected a known model name, a local Hugging Face model folder "
        "containing config.json, or a hub id cached locally. Looked in:\n  - " + "\n  - ".join(looked)
    )


def load(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, strictly offline, and return ``(model, tokenizer)``.

    ``name_or_path`` is a key of :data:`KNOWN_MODELS` (fetched first if needed), a local Hugging
    Face folder, or a hub id ``org/name`` (``org/name@rev`` or ``revision=``) already in the Hugging
    Face cache (see :func:`resolve`); the folder must hold ``config.json``, a causal-LM model and a
    tokenizer (every mtprobe use encodes text). Any ``AutoModelForCausalLM`` architecture loads.
    ``dtype`` is a floating ``torch.dtype`` or one of ``"float32"``, ``"bfloat16"``, ``"float16"``.
    The model is returned in eval mode on ``device``. Raises ValueError for an unknown name or id
    (saying where it looked), a folder that is not a causal LM, or a missing tokenizer.
    """
    torch_dtype = _resolve_dtype(dtype)  # validate before any (slow) fetch
    folder = resolve(name_or_path, revision=revision)

    # Check the cheap things first so that errors come before loading hundreds of MB of weights.
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{folder} holds a {config.model_type!r} model ({type(config).__name__}), which is not a "
            f"causal language model supported by transformers' AutoModelForCausalLM"
        )
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(
            f"{folder} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); mtprobe.models.load "
            f"needs the tokenizer saved in the model folder (tokenizer.save_pretrained(folder))"
        )

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load the tokenizer from {folder}: {e}") from e
    model = AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch_dtype, local_files_only=True
    )
    model.to(device)
    model.eval()
    return model, tokenizer
