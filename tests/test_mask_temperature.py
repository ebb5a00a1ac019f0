"""Mask temperatures (``MaskCalibration.mask_temperature``, ``mask_hooks.scale_mask_logits``): decoding divides
mask j's logits by its fitted temperature. They shape the draft tree only: token logits, verification and
the output stay exactly as they were; the fit minimises the held-out loss; bad values are named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mtprobe
from mtprobe.identity import model_identity
from mtprobe.offline import calibrate, calibration_data
from mtprobe.offline.calibrate import calibrate_masks, fit_mask_temperature, score_calibration
from mtprobe.target_model import adapter, mask_hooks
from mtprobe.target_model.mask_calibration import MaskCalibration
from test_calibrate import _assert_greedy, _prompts, tiny_model
from test_mask_lora import calibrate_argv


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def learned(model) -> MaskCalibration:
    return calibrate_masks(
        model, _prompts(6), num_masks=2, max_new_tokens=24, epochs=3, holdout=2, lr=0.2, layer_offsets=True
    )


def test_scale_mask_logits_divides_the_mask_rows_only():
    # Rows 0-2 tokens, then masks m1 m2 m1 m2 m1: each divided by its own mask's temperature.
    logits = torch.arange(16.0).reshape(8, 2)  # [T, vocab]
    want = logits.clone()
    want[3:] /= torch.tensor([2.0, 4.0, 2.0, 4.0, 2.0])[:, None]
    rows = mask_hooks.mask_row_temperature(torch.tensor([2.0, 4.0]), 5)
    assert torch.equal(rows, torch.tensor([2.0, 4.0, 2.0, 4.0, 2.0]))
    mask_hooks.scale_mask_logits(
        logits, mask_hooks.mask_row_temperature(torch.tensor([2.0, 4.0]), 64), start=3
    )
    assert torch.equal(logits, want)  # a longer row vector (the adapter's cache) reads its first 5
    same = torch.ones(3, 2)
    mask_hooks.scale_mask_logits(same, rows, start=3)  # no mask rows: nothing to do
    assert torch.equal(same, torch.ones(3, 2))


def test_the_calibration_fits_temperatures_on_the_held_out_prompts(model, learned):
    t, fit = learned.mask_temperature, learned.stats["temperature_fit"]
    before = learned.stats["holdout_after"]  # T = 1: the scores the run reports
    assert t is not None and t.shape == (2,) and (t > 0).all()
    assert "loss_before" not in fit  # it would repeat holdout_after
    assert fit["loss_after"]["loss"] <= before["loss"]
    assert fit["loss_after"]["top1"] == before["top1"]  # a temperature never changes the argmax
    # Each mask's fitted T is a minimum: moving it away raises the held-out loss (towards the search's
    # range [1/16, 16] only, at its bounds: the tiny model's masks barely beat uniform).
    held = _prompts(6)[-2:]
    best = score_calibration(model, learned, held, max_new_tokens=24)
    assert best["loss"] == pytest.approx(fit["loss_after"]["loss"], rel=1e-5)
    data = calibration_data._continuations(model, held, 24, 1)  # score_calibration's data, built once
    offsets = learned.offsets_for(2)
    moves = 0
    for j in range(2):
        for factor in (0.8, 1.25):
            if not 1 / 16 < float(t[j]) * factor < 16:
                continue
            moved = t.clone()
            moved[j] *= factor
            other = calibrate._evaluate(model, learned.masks, data, layer_offsets=offsets, temperature=moved)
            assert other["by_mask"][j]["loss"] > best["by_mask"][j]["loss"], (j, factor, t)
            moves += 1
    assert moves >= 3, t  # at least one mask's T inside the range, checked both ways
    plain = calibrate_masks(model, _prompts(4), max_new_tokens=8, epochs=1, holdout=1, fit_temperature=False)
    assert plain.mask_temperature is None and plain.stats["temperature_fit"] is None


def test_fit_mask_temperature_and_the_file(model, learned, tmp_path):
    cal = fit_mask_temperature(model, dataclasses.replace(learned, mask_temperature=None), _prompts(6)[-2:],
                               max_new_tokens=24)  # fmt: skip
    torch.testing.assert_close(cal.mask_temperature, learned.mask_temperature)
    back = MaskCalibration.load(cal.save(tmp_path / "t.safetensors"))
    assert torch.equal(back.mask_temperature, cal.mask_temperature)
    assert torch.equal(back.temperature_for(1), cal.mask_temperature[:1])


def test_temperatures_leave_tokens_and_greedy_output_alone(model, learned, tmp_path):
    # Far from 1 on purpose: the drafts change, the output must not.
    path = str(
        dataclasses.replace(learned, mask_temperature=torch.tensor([0.2, 5.0])).save(
            tmp_path / "t.safetensors"
        )
    )
    cal = dict(mask_init="calibrated", mask_path=path)
    for cfg in (
        mtprobe.ProbeConfig(block_complexity=15, num_masks=2, **cal),
        mtprobe.ProbeConfig(block_complexity=15, num_masks=2, mask_value=0.3, **cal),
        mtprobe.HybridConfig(block_complexity=12, num_masks=2, **cal),
    ):
        _assert_greedy(model, cfg)
    plain = str(dataclasses.replace(learned, mask_temperature=None).save(tmp_path / "p.safetensors"))
    runs = {}
    for name, p in {"t": path, "plain": plain}.items():
        cfg = mtprobe.ProbeConfig(block_complexity=15, num_masks=2, mask_init="calibrated", mask_path=p)
        runs[name] = [
            mtprobe.generate(model, q, cfg, max_new_tokens=32).accept_lengths for q in _prompts(3, seed=2)
        ]
    assert runs["t"] != runs["plain"]  # decoding reads the file's temperatures


def test_auto_refuses_two_different_temperatures(model, learned, tmp_path):
    paths = [
        str(
            dataclasses.replace(learned, mask_temperature=torch.tensor([t, 1.0])).save(
                tmp_path / f"{t}.safetensors"
            )
        )
        for t in (0.5, 2.0)
    ]
    cfg = mtprobe.AutoConfig(
        drafters=tuple(
            mtprobe.ProbeConfig(block_complexity=9, num_masks=2, mask_init="calibrated", mask_path=p)
            for p in paths
        )
    )
    with pytest.raises(ValueError, match="different mask temperatures"):
        mtprobe.generate(model, torch.tensor([[5, 6, 7]]), cfg, max_new_tokens=4)


@pytest.mark.parametrize(
    "temperature, match",
    [
        (torch.tensor([1.0, 0.0]), "finite and > 0"),
        (torch.tensor([1.0, float("nan")]), "finite and > 0"),
        (torch.tensor([-1.0, 1.0]), "finite and > 0"),
        (torch.tensor([1.0]), "1 entries for 2 mask"),
        (torch.ones(2, 1), r"floating \[k\] tensor"),
        (torch.tensor([1, 2]), r"floating \[k\] tensor"),
        ([1.0, 1.0], r"floating \[k\] tensor, one per mask .* got list"),
    ],
)
def test_bad_temperatures_are_named(model, temperature, match):
    with pytest.raises(ValueError, match=match):
        MaskCalibration(torch.zeros(2, 64), model_identity(model), mask_temperature=temperature)
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 1 and temperature.shape[0] == 2:
        a = adapter.HFAdapter(model, 16)
        with pytest.raises(ValueError, match=match):
            a.set_mask_temperature(temperature)


def test_command_line(tmp_path, capsys):
    from mtprobe.cli import main
    from test_cli import _save_tiny

    first = tmp_path / "first.safetensors"
    argv = calibrate_argv(_save_tiny(tmp_path / "tiny"))
    assert main([*argv, "--out", str(first), "--epochs", "1", "--num-masks", "2", "--no-temperature"]) == 0
    assert MaskCalibration.load(first).mask_temperature is None
    out = tmp_path / "t.safetensors"
    assert main([*argv, "--out", str(out), "--init", str(first), "--temperature-only"]) == 0
    assert "mask temperatures [" in capsys.readouterr().out
    cal = MaskCalibration.load(out)
    assert cal.mask_temperature is not None and torch.equal(cal.masks, MaskCalibration.load(first).masks)
    # Named before the model loads: a folder without a model still gets these messages.
    absent = calibrate_argv(tmp_path / "no-model-here")
    assert main([*absent, "--out", str(out), "--temperature-only"]) == 2
    assert "give --init FILE" in capsys.readouterr().err
    assert (
        main([*absent, "--out", str(out), "--init", str(first), "--temperature-only", "--no-temperature"])
        == 2
    )
    assert "contradict" in capsys.readouterr().err
    kept = ["--continuations", str(tmp_path / "c.safetensors")]
    assert main([*absent, "--out", str(out), "--init", str(first), "--temperature-only", *kept]) == 2
    assert "drop one of them" in capsys.readouterr().err
