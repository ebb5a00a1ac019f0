"""The standard Hugging Face hub cache, read without any hub client: :func:`hf_hub_cache` finds the
folder as huggingface_hub would, and a cached ``org/name[@revision]`` is looked up in its layout, so
nothing can ever be downloaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub picks it, read from the environment now:
    ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


# A hub repository id (huggingface_hub's rules, loosely): "org/name", optionally "@revision".
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?")


def _from_hub_cache(repo_id: str, revision: str | None, cache: Path) -> tuple[Path | None, str]:
    """The cached snapshot folder of ``repo_id`` (or None) and, if None, why it was not found.

    Reads the standard cache layout only (``models--org--name/refs/<rev>`` holds a commit hash,
    ``snapshots/<hash>`` the files); no hub client is involved, so nothing can be downloaded.
    """
    where = cache / ("models--" + repo_id.replace("/", "--"))
    if not where.is_dir():
        return None, f"{where} does not exist"
    rev = revision or "main"
    ref = where / "refs" / rev
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else rev  # a commit hash names itself
    folder = where / "snapshots" / commit
    if not folder.is_dir():
        return None, f"{where} exists but has no snapshot for that revision"
    if not (folder / "config.json").is_file():
        return None, f"its snapshot {folder} has no config.json"
    return folder, ""
