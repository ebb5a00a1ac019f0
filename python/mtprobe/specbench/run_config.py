"""The configuration of one answer-generation run (:func:`mtprobe.specbench.run.run`).

:class:`RunConfig` holds everything a run needs (the CLI ``python -m mtprobe.specbench run`` builds one
from its flags); :data:`DEFAULT_MAX_NEW_TOKENS` is Spec-Bench's default; :func:`resolve_device` turns
its ``device`` (``"auto"`` included) into a torch device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "RunConfig", "resolve_device"]

DEFAULT_MAX_NEW_TOKENS = 1024  # Spec-Bench's default


@dataclass(frozen=True)
class RunConfig:
    """Everything one answer-generation run needs; built by the CLI or directly."""

    question_file: Path
    model: str = "smollm2-135m"
    """A name in ``mtprobe.models.KNOWN_MODELS`` or a local Hugging Face folder."""
    method: str = "ar"
    method_config: Any = None
    """The method's frozen configuration dataclass; None means its defaults."""
    model_id: str | None = None
    """None derives a short one from the model, method, headline options, dtype and temperature."""
    answer_file: Path | None = None
    """None derives ``model_answer/<question file stem>/<model_id>.jsonl``."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    """0: greedy decoding; T > 0: sampling with ``do_sample=True, temperature=T`` for every method."""
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    limit: int | None = None
    question_begin: int | None = None
    question_end: int | None = None
    categories: tuple[str, ...] | None = None
    per_category: int | None = None
    """Keep only the first N questions of every category (before ``limit``): a small subset that still
    covers every task and MT-bench sub-category."""
    first_turn_only: bool = False
    """Ask only the first turn of every question (MT-bench has two): shorter runs; Spec-Bench asks all."""
    threads: int | None = None
    warmup: int = 3
    """Runs of the first pending question discarded before timing (Spec-Bench: 3)."""
    progress: bool = True
    repeats: int = 1
    """Timed runs of every question (all wall times are kept; the first run's answer is written)."""
    draft_model: str | None = None
    """For ``sps``: a known model name or local folder loaded as the draft model (same tokenizer as
    the target). None keeps the method configuration's own draft: the target's layer-truncated copy."""

    def __post_init__(self) -> None:
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1 (timed runs per question), got {self.repeats!r}")
        if self.draft_model is not None and self.method != "sps":
            raise ValueError(
                f"draft_model={self.draft_model!r} is for method 'sps' (draft-model speculative decoding), "
                f"not {self.method!r}"
            )


def resolve_device(device: str) -> torch.device:
    """``"auto"``: the GPU when there is one, else the CPU; any other name as torch reads it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
