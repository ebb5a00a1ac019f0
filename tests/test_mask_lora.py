"""A mask LoRA (python/mtprobe/target_model/mask_hooks.py ``mask_lora``, ``calibrate --mask-lora``): a low-rank change of
the model's projections at the mask inputs only. Token inputs, and so verification and the output, stay
exactly as they were; the calibration learns it, files carry it, and bad ones are refused by name."""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe.identity import model_identity
from mtprobe.offline.calibrate import calibrate_masks, mask_loss, score_calibration
from mtprobe.target_model import mask_hooks
from mtprobe.target_model.mask_calibration import MaskCalibration
from test_calibrate import _assert_greedy, _prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()  # test_calibrate's: the calibrations there and here learn on the same model


def _random_lora(model, rank: int = 2, scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA of every projection with nonzero A and B (a trained one has both)."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for i, layer in enumerate(mask_hooks.decoder_layers(model)):
        for name in mask_hooks.MASK_LORA_MODULES:
            lin = layer.get_submodule(name)
            lora[f"{i}.{name}.A"] = (
                torch.randn(rank, lin.in_features, generator=g) * scale / lin.in_features**0.5
            )
            lora[f"{i}.{name}.B"] = torch.randn(lin.out_features, rank, generator=g) * scale / rank**0.5
    return lora


def test_the_lora_changes_the_mask_inputs_only(model):
    # Tokens first, then two mask inputs, one causal forward: the token rows' logits are bit-identical
    # with and without the LoRA (no token attends to a mask, and the hooks leave rows before `start`),
    # the mask rows differ.
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, 7))
    x = torch.cat([model.get_input_embeddings()(ids), torch.randn(1, 2, 64) * 0.3], dim=1)  # [1, 9, hidden]
    layers = mask_hooks.decoder_layers(model)
    with torch.no_grad():
        plain = model(inputs_embeds=x).logits[0]  # [9, vocab]
        with mask_hooks.mask_lora(layers, _random_lora(model), start=7):
            adapted = model(inputs_embeds=x).logits[0]
    assert torch.equal(adapted[:7], plain[:7])
    assert (adapted[7:] - plain[7:]).abs().max() > 1e-3
    assert all(
        not layer.get_submodule(n)._forward_hooks for layer in layers for n in mask_hooks.MASK_LORA_MODULES
    )


def test_a_zero_b_changes_nothing(model):
    lora = _random_lora(model)
    zero = {k: (torch.zeros_like(t) if k.endswith(".B") else t) for k, t in lora.items()}
    ids = torch.randint(0, 96, (15,), generator=torch.Generator().manual_seed(1))
    masks = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)) * 0.3
    anchors = torch.tensor([1, 4, 9])
    with torch.no_grad():
        base, _ = mask_loss(model, masks, ids, anchors)
        same, _ = mask_loss(model, masks, ids, anchors, mask_lora=zero)
        moved, _ = mask_loss(model, masks, ids, anchors, mask_lora=lora)
    torch.testing.assert_close(same, base, rtol=0, atol=0)
    assert abs(float(moved) - float(base)) > 1e-3


@pytest.fixture(scope="module")
def lora_file(model, tmp_path_factory) -> str:
    g = torch.Generator().manual_seed(4)
    cal = MaskCalibration(
        torch.randn(2, 64, generator=g) * 0.3,
        model_identity(model),
        layer_offsets=torch.randn(2, 2, 64, generator=g) * 0.1,
        mask_lora=_random_lora(model, scale=2.0),
    )
    return str(cal.save(tmp_path_factory.mktemp("lora") / "lora.safetensors"))


@pytest.mark.parametrize("method", ["probe", "probe-k2", "probe-planned", "hybrid", "auto"])
def test_a_mask_lora_is_token_identical_to_greedy(model, lora_file, method):
    cal = dict(mask_init="calibrated", mask_path=lora_file)
    cfg = {
        "probe": mtprobe.ProbeConfig(block_complexity=10, **cal),
        "probe-k2": mtprobe.ProbeConfig(block_complexity=15, num_masks=2, **cal),
        "probe-planned": mtprobe.ProbeConfig(block_complexity=15, num_masks=2, mask_value=0.3, **cal),
        "hybrid": mtprobe.HybridConfig(block_complexity=12, **cal),
        "auto": mtprobe.AutoConfig(
            drafters=(mtprobe.PromptLookupConfig(), mtprobe.ProbeConfig(block_complexity=6, **cal))
        ),
    }[method]
    _assert_greedy(model, cfg)
    # The hooks live only inside mtprobe's own forwards.
    layers = mask_hooks.decoder_layers(model)
    assert all(
        not layer.get_submodule(n)._forward_hooks for layer in layers for n in mask_hooks.MASK_LORA_MODULES
    )


def test_decoding_applies_the_lora(model, lora_file, tmp_path):
    # The same masks and offsets with and without the LoRA draft differently step by step: decoding
    # reads the file's LoRA (and stays lossless either way, above).
    cal = MaskCalibration.load(lora_file)
    plain = str(
        MaskCalibration(cal.masks, cal.model, layer_offsets=cal.layer_offsets).save(
            tmp_path / "p.safetensors"
        )
    )
    runs = {}
    for name, path in {"lora": lora_file, "plain": plain}.items():
        cfg = mtprobe.ProbeConfig(block_complexity=10, mask_init="calibrated", mask_path=path)
        runs[name] = [
            mtprobe.generate(model, p, cfg, max_new_tokens=32).accept_lengths for p in _prompts(3, seed=2)
        ]
    assert runs["lora"] != runs["plain"]


def test_auto_refuses_two_different_mask_loras(model, lora_file, tmp_path):
    cal = MaskCalibration.load(lora_file)
    other = MaskCalibration(
        cal.masks, cal.model, layer_offsets=cal.layer_offsets, mask_lora=_random_lora(model, seed=1)
    )
    other_path = str(other.save(tmp_path / "other.safetensors"))
    cfg = mtprobe.AutoConfig(
        drafters=(
            mtprobe.ProbeConfig(block_complexity=6, mask_init="calibrated", mask_path=lora_file),
            mtprobe.HybridConfig(block_complexity=8, mask_init="calibrated", mask_path=other_path),
        )
    )
    with pytest.raises(ValueError, match="different mask LoRAs"):
        mtprobe.generate(model, torch.tensor([[5, 6, 7]]), cfg, max_new_tokens=4)


@pytest.fixture(scope="module")
def learned(model, tmp_path_factory) -> tuple[MaskCalibration, str]:
    cal = calibrate_masks(
        model,
        _prompts(6),
        num_masks=2,
        max_new_tokens=24,
        epochs=3,
        holdout=2,
        lr=0.2,
        layer_offsets=True,
        mask_lora_rank=2,
        lora_lr=0.01,
    )
    path = tmp_path_factory.mktemp("learned") / "lora.safetensors"
    cal.save(path)
    return cal, str(path)


def test_calibration_learns_a_mask_lora(model, learned):
    cal, path = learned
    assert cal.mask_lora is not None
    assert len(cal.mask_lora) == 2 * len(mask_hooks.MASK_LORA_MODULES) * len(mask_hooks.decoder_layers(model))
    assert all(cal.mask_lora[k].abs().sum() > 0 for k in cal.mask_lora if k.endswith(".B"))  # B left zero
    s = cal.stats
    assert s["mask_lora_rank"] == 2
    assert s["holdout_after"]["loss"] < s["holdout_before"]["loss"] - 0.05, s
    back = MaskCalibration.load(path)  # the file holds the LoRA in bfloat16; it loads as float32
    assert back.mask_lora.keys() == cal.mask_lora.keys()
    assert all(back.mask_lora[k].dtype == torch.float32 for k in back.mask_lora)
    assert all(torch.equal(back.mask_lora[k], cal.mask_lora[k].bfloat16().float()) for k in cal.mask_lora)
    assert torch.equal(back.masks, cal.masks) and torch.equal(back.layer_offsets, cal.layer_offsets)
    back.check(model, num_masks=2)
    _assert_greedy(
        model, mtprobe.ProbeConfig(block_complexity=15, num_masks=2, mask_init="calibrated", mask_path=path)
    )


def test_the_lora_is_stored_in_the_dtype_asked(learned, tmp_path):
    cal, _ = learned
    exact = MaskCalibration.load(cal.save(tmp_path / "f32.safetensors", lora_dtype=torch.float32))
    assert all(torch.equal(exact.mask_lora[k], cal.mask_lora[k]) for k in cal.mask_lora)
    from safetensors import safe_open

    with safe_open(str(cal.save(tmp_path / "bf16.safetensors")), framework="pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {stored[k] for k in stored if k.startswith("mask_lora.")} == {"BF16"}  # the default
    assert stored["masks"] == stored["layer_offsets"] == "F32"
    with pytest.raises(ValueError, match="lora_dtype=torch.int8 must be torch.float32, torch.bfloat16"):
        cal.save(tmp_path / "bad.safetensors", lora_dtype=torch.int8)


def test_score_calibration_repeats_the_held_out_scores(model, learned):
    # The learned fixture held out _prompts(6)[-2:], generated one at a time: scoring the calibration
    # there gives the calibration's own held-out scores, and the soft start its "prompt mean" row.
    cal, path = learned
    held = _prompts(6)[-2:]
    after = score_calibration(model, cal, held, max_new_tokens=24)  # with its fitted temperatures
    assert after["loss"] == pytest.approx(cal.stats["temperature_fit"]["loss_after"]["loss"], rel=1e-5)
    assert after["top1"] == cal.stats["holdout_after"]["top1"]
    soft = score_calibration(model, None, held, num_masks=2, max_new_tokens=24)
    assert soft["loss"] == pytest.approx(cal.stats["holdout_prompt_mean"]["loss"], rel=1e-5)
    stored = score_calibration(model, MaskCalibration.load(path), held, max_new_tokens=24)
    assert stored["loss"] == pytest.approx(after["loss"], abs=0.01)  # bfloat16 rounding of the LoRA only
    # Mask 1 never sees mask 2: its scores alone are its row of the two-mask scores.
    one = score_calibration(model, cal, held, num_masks=1, max_new_tokens=24)
    assert "by_mask" not in one
    assert one["loss"] == pytest.approx(after["by_mask"][0]["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="num_masks=3 but the calibration holds 2"):
        score_calibration(model, cal, held, num_masks=3)
    with pytest.raises(ValueError, match="num_masks=0 must be an int between 1 and 4"):
        score_calibration(model, cal, held, num_masks=0)


def test_calibration_starts_from_init(model, learned):
    # Started from a calibration, the run's held-out "before" is that calibration's "after".
    cal, _ = learned
    again = calibrate_masks(
        model, _prompts(6), num_masks=2, max_new_tokens=24, epochs=1, holdout=2, lr=0.01,
        layer_offsets=True, mask_lora_rank=2, lora_lr=0.001, init=cal,
    )  # fmt: skip
    assert again.stats["holdout_before"]["loss"] == pytest.approx(
        cal.stats["holdout_after"]["loss"], rel=1e-5
    )
    with pytest.raises(ValueError, match="not of rank 3"):
        calibrate_masks(model, _prompts(3), num_masks=2, max_new_tokens=8, epochs=1, holdout=1, layer_offsets=True,
                        mask_lora_rank=3, init=cal)  # fmt: skip


def test_a_lora_for_another_model_is_refused(learned):
    cal, _ = learned
    deeper = tiny_llama(seed=3, num_hidden_layers=1)
    with torch.no_grad():
        deeper.get_input_embeddings().weight.copy_(tiny_llama(seed=3).get_input_embeddings().weight)
    with pytest.raises(
        ValueError, match="LoRA does not fit the model: .* adapts decoder layer 1 but the model has 1"
    ):
        MaskCalibration(cal.masks, cal.model, mask_lora=cal.mask_lora).check(deeper)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda lo: {**lo, "0.self_attn.q_proj.C": lo["0.self_attn.q_proj.A"]}, "expected '<layer>.<module>.A'"),
        (lambda lo: {**lo, "0.attn.c_proj.A": lo["0.self_attn.q_proj.A"]}, "module one of"),
        (lambda lo: {k: t for k, t in lo.items() if k != "0.mlp.up_proj.B"}, "has no partner"),
        (lambda lo: {**lo, "0.mlp.up_proj.B": lo["0.mlp.up_proj.B"].T}, r"expected A \[rank, 64\] and B \[.*, rank\]"),
        (lambda lo: {**lo, "7.mlp.up_proj.A": lo["0.mlp.up_proj.A"], "7.mlp.up_proj.B": lo["0.mlp.up_proj.B"]},
         "adapts decoder layer 7 but the model has 2"),
        (lambda lo: {}, "at least one adapted linear"),
    ],
)  # fmt: skip
def test_bad_loras_are_named(model, edit, match):
    with pytest.raises(ValueError, match=match):
        mask_hooks.checked_mask_lora(edit(_random_lora(model)), mask_hooks.decoder_layers(model))


def test_bad_files_and_arguments(model):
    ident = model_identity(model)
    bad = _random_lora(model)
    bad["0.mlp.up_proj.A"] = torch.full_like(bad["0.mlp.up_proj.A"], float("nan"))
    with pytest.raises(ValueError, match="mask_lora holds NaN"):
        MaskCalibration(torch.zeros(1, 64), ident, mask_lora=bad)
    with pytest.raises(ValueError, match="non-empty dict of tensors"):
        MaskCalibration(torch.zeros(1, 64), ident, mask_lora={"0.mlp.up_proj.A": [1.0]})
    with pytest.raises(ValueError, match="lora_lr=0 must be > 0"):
        calibrate_masks(model, _prompts(3), holdout=1, mask_lora_rank=2, lora_lr=0)
    with pytest.raises(ValueError, match="mask_lora_rank=-1 must be an int >= 0"):
        calibrate_masks(model, _prompts(3), holdout=1, mask_lora_rank=-1)


def calibrate_argv(folder) -> list[str]:
    """``mtprobe calibrate`` on a saved tiny model, as small as a run gets: 4 prompts, 1 held out, 8 tokens."""
    return [
        "calibrate",
        "--model",
        str(folder),
        "--num-prompts",
        "4",
        "--holdout",
        "1",
        "--max-new-tokens",
        "8",
    ]


def test_command_line(tmp_path, capsys):
    from mtprobe.cli import main
    from test_cli import _save_tiny

    first = tmp_path / "first.safetensors"
    out = tmp_path / "lora.safetensors"
    argv = calibrate_argv(_save_tiny(tmp_path / "tiny"))
    assert main([*argv, "--out", str(first), "--epochs", "1", "--num-masks", "2", "--layer-offsets"]) == 0
    assert main([*argv, "--out", str(out), "--epochs", "1", "--num-masks", "2", "--layer-offsets",
                 "--mask-lora", "2", "--init", str(first)]) == 0  # fmt: skip
    cal = MaskCalibration.load(out)
    assert cal.mask_lora is not None and cal.stats["init"] is not None and cal.stats["mask_lora_rank"] == 2
    capsys.readouterr()
    assert main([*argv, "--out", str(out), "--init", str(tmp_path / "missing.safetensors")]) == 2
    assert "--init: mask calibration file" in capsys.readouterr().err
