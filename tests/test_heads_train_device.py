"""``mtprobe heads train --device ... --max-seconds ...`` (issue 43): the CPU-sized version of the GPU
command (``scripts/gpu_check.sh heads``). A wall-clock budget stops training early and the stats say
so; the head file loads on a CPU model and drafts losslessly; bad devices and budgets are one-line
usage errors; on a machine with CUDA the head trains there and still loads on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mtprobe
from mtprobe import cli, heads, models
from mtprobe.offline import heads as offline_heads
from test_cli import _save_tiny

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with a chat tokenizer, saved as a local HF folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"))


def _train(tiny: Path, out: Path, *extra: str) -> list[str]:
    """The ``heads train`` arguments of a seconds-long run on the tiny model (4 prompts, 24 new tokens)."""
    return [
        "heads",
        "train",
        "--model",
        str(tiny),
        "--out",
        str(out),
        "--num-prompts",
        "4",
        "--max-new-tokens",
        "24",
        "--window",
        "3",
        "--rank",
        "2",
        *extra,
    ]


def _stats(capsys: pytest.CaptureFixture[str]) -> dict:
    """The JSON object ``heads train`` prints: its whole stdout (the size line goes to stderr)."""
    captured = capsys.readouterr()
    assert "head file: " in captured.err
    return json.loads(captured.out)


def _assert_lossless(tiny: Path, folder: Path) -> None:
    """The head in ``folder`` loads over the tiny model as loaded on the CPU, its checkpoint holds
    float32 tensors only, and greedy decoding with it is ``model.generate``'s output."""
    model, tokenizer = models.load(tiny)
    head = heads.load_head(folder, model)
    assert head.spec.window == 3
    with safe_open(str(folder / "head.safetensors"), framework="pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    assert dtypes <= {torch.float32, torch.int64, torch.int32}, dtypes
    messages = [{"role": "user", "content": "hello world"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]  # [1, L]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    cfg = mtprobe.HeadsConfig(path=str(folder), block_complexity=8)
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize(
    "circuit", [("--circuit", "hmm"), ("--circuit", "btree", "--lora-layers", "1")], ids=["hmm", "btree-lora"]
)
def test_a_time_budget_stops_training_and_the_head_is_lossless(tiny, tmp_path, capsys, circuit):
    # As the GPU command runs them (an HMM head, a BTree head with LoRA), on the CPU and in seconds.
    out, feats = tmp_path / "head", tmp_path / "features.pt"
    argv = _train(tiny, out, *circuit, "--device", "cpu", "--steps", "100000", "--max-seconds", "0.5")
    assert cli.main([*argv, "--features", str(feats)]) == cli.EXIT_OK
    stats = _stats(capsys)
    assert stats["stopped_by_budget"] is True and stats["max_seconds"] == 0.5
    assert 1 <= stats["steps_run"] < stats["steps_asked"] == 100000
    assert stats["steps"] == stats["steps_run"]  # no --init: the head's steps are this run's
    assert stats["device"] == "cpu" and stats["dtype"] == "float32"
    assert stats["command"].startswith("python -m mtprobe heads train --model")
    assert 0 < stats["file_bytes"] == (out / "head.safetensors").stat().st_size
    saved = torch.load(feats)["features"]
    assert saved["hidden"].dtype == torch.float32 and saved["hidden"].device.type == "cpu"
    _assert_lossless(tiny, out)
    # The checkpoint records the same stats.
    head = heads.load_head(out, models.load(tiny)[0])
    assert head.stats["steps_run"] == stats["steps_run"] and head.stats["stopped_by_budget"] is True


def test_a_budget_that_is_not_reached_changes_nothing(tiny, tmp_path, capsys):
    argv = _train(tiny, tmp_path / "head", "--circuit", "cp", "--steps", "3", "--max-seconds", "600")
    assert cli.main(argv) == cli.EXIT_OK
    stats = _stats(capsys)
    assert (stats["steps_run"], stats["steps"], stats["stopped_by_budget"]) == (3, 3, False)


def test_device_auto_is_cuda_only_where_torch_sees_one(tiny, tmp_path, capsys):
    argv = _train(tiny, tmp_path / "head", "--circuit", "cp", "--steps", "2", "--device", "auto")
    assert cli.main(argv) == cli.EXIT_OK
    stats = _stats(capsys)
    assert stats["device"] == ("cuda" if CUDA else "cpu") and "max_seconds" not in stats


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--max-seconds", "0"), "--max-seconds 0.0 must be a number of seconds > 0"),
        (("--max-seconds", "-3"), "--max-seconds -3.0 must be a number of seconds > 0"),
        (("--max-seconds", "nan"), "--max-seconds nan must be a number of seconds > 0"),
        (("--dtype", "bfloat16"), "--dtype bfloat16 needs --device cuda (the device here is cpu)"),
        (("--device", "gpu"), "argument --device: invalid choice: 'gpu'"),
    ],
)
def test_bad_budgets_and_devices_are_usage_errors(tiny, tmp_path, capsys, extra, message):
    # Refused before the model loads: one line on stderr, exit status 2, no head written.
    assert cli.main(_train(tiny, tmp_path / "head", *extra)) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "head").exists()


@pytest.mark.skipif(CUDA, reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_cuda_says_what_would_do(tiny, tmp_path, capsys):
    assert cli.main(_train(tiny, tmp_path / "head", "--device", "cuda")) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--device cuda: this torch" in err and "sees no CUDA device" in err
    assert "--device cpu" in err and err.count("\n") == 1, err


def test_a_head_trained_over_a_bfloat16_copy_is_written_over_the_float32_model(
    tiny, tmp_path, capsys, monkeypatch
):
    # The GPU path but for the transfer, on the CPU: with the device check let through, --dtype
    # bfloat16 trains over a bfloat16 copy of the backbone. The file must still be float32, name the
    # float32 model (whose identity hashes its unrounded weights) and hold its LoRA layers' frozen
    # norms as the float32 model has them.
    from mtprobe.cli import heads as heads_cli

    monkeypatch.setattr(heads_cli, "resolve_device", lambda args: torch.device("cpu"))
    model, tokenizer = models.load(tiny)
    with torch.no_grad():  # norms that bfloat16 rounds (the tiny model's are ones)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out, feats = tmp_path / "head", tmp_path / "features.pt"
    argv = _train(folder, out, "--circuit", "btree", "--lora-layers", "1", "--dtype", "bfloat16")
    argv += ["--steps", "5", "--num-prompts", "2", "--max-new-tokens", "8"]  # bfloat16 is slow on a CPU
    assert cli.main([*argv, "--features", str(feats)]) == cli.EXIT_OK
    assert _stats(capsys)["dtype"] == "bfloat16"
    saved = torch.load(feats)["features"]
    assert saved["hidden"].dtype == saved["last"].dtype == torch.float32
    _assert_lossless(folder, out)
    with safe_open(str(out / "head.safetensors"), framework="pt") as f:
        norm = f.get_tensor("draft.norm.weight")  # [d] the backbone's final norm, copied, frozen
    assert not torch.equal(norm, norm.bfloat16().float())  # a float32 value bfloat16 would round
    assert torch.equal(norm, models.load(folder)[0].model.norm.weight.detach())


def test_train_head_refuses_a_budget_that_is_not_positive():
    with pytest.raises(ValueError, match=r"max_seconds=0 must be > 0 \(None: no time budget\)"):
        offline_heads.train_head(None, None, steps=1, max_seconds=0)  # checked before anything is read


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_head_trained_on_cuda_loads_and_drafts_on_the_cpu(tiny, tmp_path, capsys, dtype):
    out, feats = tmp_path / "head", tmp_path / "features.pt"
    argv = _train(tiny, out, "--circuit", "btree", "--lora-layers", "1", "--device", "cuda", "--dtype", dtype)
    assert cli.main([*argv, "--steps", "40", "--max-seconds", "60", "--features", str(feats)]) == cli.EXIT_OK
    stats = _stats(capsys)
    assert (stats["device"], stats["dtype"], stats["steps_run"]) == ("cuda", dtype, 40)
    saved = torch.load(feats)["features"]
    assert saved["hidden"].dtype == torch.float32 and saved["hidden"].device.type == "cpu"
    _assert_lossless(tiny, out)
