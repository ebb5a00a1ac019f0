"""Calibrated mask tokens (python/mtprobe/offline/calibrate.py): the training loss is the decode-time
placement of the masks, learning lowers it, files belong to one model, and decoding from learned
masks stays token-identical to greedy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe.identity import model_identity
from mtprobe.offline.calibrate import calibrate_masks, mask_loss
from mtprobe.target_model.mask_calibration import MaskCalibration, load_calibration


def tiny_model():
    m = tiny_llama(seed=3)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, 6 + i % 4), generator=g) for i in range(n)]


@pytest.fixture(scope="module")
def calibration(model, tmp_path_factory) -> tuple[MaskCalibration, str]:
    cal = calibrate_masks(model, _prompts(6), num_masks=2, max_new_tokens=24, epochs=3, holdout=2, lr=0.2)
    path = tmp_path_factory.mktemp("cal") / "tiny.safetensors"
    cal.save(path)
    return cal, str(path)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mask_loss_is_the_masks_placed_as_in_decoding(model, k):
    # The batched forward (cached prefix, one 4D mask for every anchor) against each anchor run on its
    # own as plain causal attention over [ids[0..p], m_1 .. m_k] at positions 0..p+k.
    torch.manual_seed(k)
    ids = torch.randint(0, 96, (17,))
    masks = torch.randn(k, 64) * 0.3
    anchors = torch.tensor([0, 3, 7, 13, 15])  # 15 + 2 = 17: mask 1 of the last anchor has no target
    loss, count = mask_loss(model, masks, ids, anchors)
    emb = model.get_input_embeddings()
    total, n = 0.0, 0
    with torch.no_grad():
        for p in anchors.tolist():
            x = torch.cat([emb(ids[: p + 1]), masks])[None]  # [1, p + 1 + k, hidden]
            logits = model(inputs_embeds=x).logits[0, p + 1 :]  # [k, vocab]
            for j in range(1, k + 1):
                if p + j + 1 < ids.shape[0]:
                    total += float(torch.nn.functional.cross_entropy(logits[j - 1], ids[p + j + 1]))
                    n += 1
    assert int(count) == n
    torch.testing.assert_close(float(loss.detach()), total / n, rtol=1e-4, atol=1e-5)


def test_calibration_lowers_the_held_out_loss(calibration):
    cal, _ = calibration
    s = cal.stats
    assert s["holdout_after"]["loss"] < s["holdout_before"]["loss"] - 0.05, s
    assert s["holdout_after"]["targets"] > 0
    assert cal.num_masks == 2 and cal.hidden_size == 64


def test_save_load_round_trip(calibration, model):
    cal, path = calibration
    back = MaskCalibration.load(path)
    assert torch.equal(back.masks, cal.masks)
    assert back.model == model_identity(model)
    assert back.stats["epochs"] == 3
    back.check(model, num_masks=2)
    assert load_calibration(path) is load_calibration(path)  # cached by path and mtime


def test_a_calibration_is_refused_for_another_model(calibration):
    cal, _ = calibration
    with pytest.raises(ValueError, match="learned for another model.*embedding_sha256"):
        cal.check(tiny_llama(seed=4))
    with pytest.raises(ValueError, match="hidden_size: file 64 vs model 32"):
        cal.check(tiny_llama(seed=3, hidden_size=32))
    with pytest.raises(ValueError, match="num_masks=3 but the calibration holds 2 mask"):
        cal.check(tiny_llama(seed=3), num_masks=3)


def test_generate_refuses_a_calibration_of_another_model(calibration):
    _, path = calibration
    other = tiny_llama(seed=5)
    cfg = mtprobe.ProbeConfig(block_complexity=10, mask_init="calibrated", mask_path=path)
    with pytest.raises(ValueError, match="learned for another model"):
        mtprobe.generate(other, torch.tensor([[5, 6, 7]]), cfg, max_new_tokens=4)


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(ValueError, match="not a mask calibration file"):
        MaskCalibration.load(bad)
    with pytest.raises(FileNotFoundError, match="does not exist; make one with python -m mtprobe calibrate"):
        MaskCalibration.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"masks": torch.zeros(1, 4)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(ValueError, match="has format 'something-else'"):
        MaskCalibration.load(other)


def test_masks_must_be_finite_and_match_the_hidden_size():
    ident = {"model_class": "M", "vocab_size": 8, "hidden_size": 4, "embedding_sha256": "0"}
    with pytest.raises(ValueError, match="NaN or infinite"):
        MaskCalibration(torch.tensor([[0.0, float("nan"), 0.0, 0.0]]), ident)
    with pytest.raises(ValueError, match=r"floating \[num_masks, hidden_size\]"):
        MaskCalibration(torch.zeros(4), ident)
    with pytest.raises(ValueError, match="lacks"):
        MaskCalibration(torch.zeros(1, 4), {"hidden_size": 4})


def test_config_checks_mask_path():
    with pytest.raises(ValueError, match="needs mask_path=FILE"):
        mtprobe.ProbeConfig(mask_init="calibrated")
    with pytest.raises(ValueError, match="mask_path is for mask_init='calibrated', not 'prompt_mean'"):
        mtprobe.ProbeConfig(mask_path="x.safetensors")
    with pytest.raises(TypeError, match="mask_path must be a str or path"):
        mtprobe.ProbeConfig(mask_init="calibrated", mask_path=3)
    from pathlib import Path

    cfg = mtprobe.HybridConfig(mask_init="calibrated", mask_path=Path("x.safetensors"))
    assert cfg.mask_path == "x.safetensors" and cfg.probe.mask_path == "x.safetensors"
    assert mtprobe.config_from_dict(cfg.to_dict()) == cfg


def test_calibrated_masks_are_kept_unless_a_step_is_given():
    # The running update pulls learned masks back toward token embeddings: off unless asked for.
    cal = dict(mask_init="calibrated", mask_path="x.safetensors")
    assert mtprobe.ProbeConfig(**cal).mask_lambda == 0.0
    assert mtprobe.HybridConfig(**cal).mask_lambda == 0.0
    assert mtprobe.ProbeConfig(mask_lambda=0.1, **cal).mask_lambda == 0.1
    assert mtprobe.ProbeConfig().mask_lambda == 0.5  # tuned on Spec-Bench's dev split (the paper's: 0.1)
    assert mtprobe.HybridConfig().mask_lambda == 0.5
    assert mtprobe.ProbeConfig.paper().mask_lambda == 0.1
    assert mtprobe.HybridConfig(**cal).to_dict()["mask_lambda"] == 0.0  # written resolved


def test_bad_calibration_arguments(model):
    with pytest.raises(ValueError, match="num_masks=5 must be between 1 and 4"):
        calibrate_masks(model, _prompts(3), num_masks=5)
    with pytest.raises(ValueError, match="leave none to train on with holdout=3"):
        calibrate_masks(model, _prompts(3), holdout=3)
    with pytest.raises(ValueError, match="epochs=0 must be an int >= 1"):
        calibrate_masks(model, _prompts(3), epochs=0, holdout=1)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: mtprobe.ProbeConfig(block_complexity=10, mask_init="calibrated", mask_path=p),
        lambda p: mtprobe.ProbeConfig(
            block_complexity=10, mask_init="calibrated", mask_path=p, mask_lambda=0.1
        ),
        lambda p: mtprobe.ProbeConfig(block_complexity=30, num_masks=2, mask_init="calibrated", mask_path=p),
        lambda p: mtprobe.HybridConfig(block_complexity=12, mask_init="calibrated", mask_path=p),
    ],
    ids=["probe", "probe_lambda0.1", "probe_k2_dynamic", "hybrid"],
)
def test_calibrated_masks_are_token_identical_to_greedy(model, calibration, make):
    _, path = calibration
    _assert_greedy(model, make(path))


def _assert_greedy(model, cfg) -> None:
    drafted = 0
    for prompt in _prompts(3, seed=9):
        ref = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32
        )
        out = mtprobe.generate(model, prompt, cfg, max_new_tokens=32)
        assert torch.equal(out.sequences, ref)
        drafted += sum(out.drafted_per_depth)
    assert drafted > 0  # the masks drafted, or the case would prove nothing


def test_the_drafter_starts_from_the_file(model, calibration):
    cal, path = calibration
    from mtprobe.drafters import mask_probe_drafter

    d = mask_probe_drafter(
        model, mtprobe.ProbeConfig(block_complexity=10, mask_init="calibrated", mask_path=path)
    )
    d.begin(torch.tensor([4, 5, 6]))
    torch.testing.assert_close(d.mask_embeddings, cal.masks[:1])

    def raw(mask_init: str, initial_masks: torch.Tensor) -> None:
        mtprobe._C.MaskProbeDrafter(
            model.get_input_embeddings().weight,
            num_masks=1,
            block_complexity=10,
            dynamic_tree=False,
            branches=[4],
            prune=True,
            mask_init=mask_init,
            gaussian_shift=0.0,
            mask_lambda=0.1,
            initial_masks=initial_masks,
        )

    with pytest.raises(ValueError, match=r"initial_masks must be \[>= 1, 64\]"):
        raw("calibrated", torch.zeros(1, 32))
    with pytest.raises(ValueError, match="initial_masks must hold finite"):
        raw("calibrated", torch.full((1, 64), float("inf")))
    with pytest.raises(ValueError, match="initial_masks are for mask_init 'calibrated'"):
        raw("prompt_mean", torch.zeros(1, 64))


def _offsets_calibration(model, tmp_path_factory, k: int) -> tuple[MaskCalibration, str]:
    """A tiny calibration with layer offsets (shared by the mask for k = 1, one set per mask for more)."""
    cal = calibrate_masks(
        model, _prompts(6), num_masks=k, max_new_tokens=24, epochs=3, holdout=2, lr=0.2, layer_offsets=True
    )
    path = tmp_path_factory.mktemp("cal") / f"tiny-k{k}-offsets.safetensors"
    cal.save(path)
    return cal, str(path)


@pytest.fixture(scope="module")
def offsets_calibration(model, tmp_path_factory) -> tuple[MaskCalibration, str]:
    return _offsets_calibration(model, tmp_path_factory, 1)


def test_layer_offset_zero_is_a_shift_of_the_mask(model):
    # The input of decoder layer 0 is the embedding itself: offsets [v, 0, ...] must score exactly as
    # masks m + v without offsets (an independent check that the offsets land where they should).
    torch.manual_seed(11)
    ids = torch.randint(0, 96, (15,))
    masks = torch.randn(2, 64) * 0.3  # [k, hidden]
    v = torch.randn(64) * 0.5  # [hidden]
    anchors = torch.tensor([1, 4, 9, 12])
    offsets = torch.zeros(2, 64)  # [num_layers, hidden]
    offsets[0] = v
    with torch.no_grad():
        shifted, n1 = mask_loss(model, masks + v, ids, anchors)
        placed, n2 = mask_loss(model, masks, ids, anchors, layer_offsets=offsets)
        deeper, _ = mask_loss(model, masks, ids, anchors, layer_offsets=offsets.roll(1, dims=0))
    assert int(n1) == int(n2)
    torch.testing.assert_close(placed, shifted, rtol=1e-5, atol=1e-6)
    assert abs(float(deeper) - float(shifted)) > 1e-3  # the same vector before layer 1 is another thing


def test_calibration_with_layer_offsets(model, offsets_calibration):
    cal, path = offsets_calibration
    assert cal.layer_offsets is not None and cal.layer_offsets.shape == (2, 64)
    assert cal.layer_offsets.abs().sum() > 0
    s = cal.stats
    assert s["layer_offsets"] is True
    assert s["holdout_after"]["loss"] < s["holdout_before"]["loss"] - 0.05, s
    back = MaskCalibration.load(path)
    assert torch.equal(back.layer_offsets, cal.layer_offsets) and torch.equal(back.masks, cal.masks)
    back.check(model, num_masks=1)
    deeper = tiny_llama(seed=3, num_hidden_layers=3)
    with torch.no_grad():
        deeper.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight)
    assert model_identity(deeper) == model_identity(model)  # same embeddings: only the depth differs
    with pytest.raises(ValueError, match="layer offsets for 2 decoder layers but the model has 3"):
        back.check(deeper)


def test_layer_offsets_must_fit_the_masks():
    ident = {"model_class": "M", "vocab_size": 8, "hidden_size": 4, "embedding_sha256": "0"}
    with pytest.raises(ValueError, match=r"layer_offsets must be a \[num_layers, 4\] tensor"):
        MaskCalibration(torch.zeros(1, 4), ident, layer_offsets=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="layer_offsets hold NaN"):
        MaskCalibration(torch.zeros(1, 4), ident, layer_offsets=torch.full((2, 4), float("inf")))


@pytest.mark.parametrize("method", ["probe", "hybrid", "auto"])
def test_layer_offsets_are_token_identical_to_greedy(model, offsets_calibration, method):
    _, path = offsets_calibration
    cal = dict(mask_init="calibrated", mask_path=path)
    cfg = {
        "probe": mtprobe.ProbeConfig(block_complexity=10, **cal),
        "hybrid": mtprobe.HybridConfig(block_complexity=12, **cal),
        "auto": mtprobe.AutoConfig(
            drafters=(mtprobe.PromptLookupConfig(), mtprobe.ProbeConfig(block_complexity=6, **cal))
        ),
    }[method]
    _assert_greedy(model, cfg)
    # The hooks live only inside mtprobe's own forwards.
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)


def test_decoding_adds_the_offsets_to_the_masks_only(model, tmp_path):
    # Offsets [v, 0] on masks m draft exactly as masks m + v without offsets (layer 0's input is the
    # embedding), while the token inputs of the same forwards get nothing: the step-by-step acceptance
    # is the same, and differs from m alone.
    torch.manual_seed(5)
    ident = model_identity(model)
    m = torch.randn(1, 64) * 0.3
    v = torch.randn(64) * 2.0
    offsets = torch.zeros(2, 64)
    offsets[0] = v
    files = {}
    for name, cal in {
        "offsets": MaskCalibration(m, ident, layer_offsets=offsets),
        "shifted": MaskCalibration(m + v, ident),
        "plain": MaskCalibration(m, ident),
    }.items():
        files[name] = str(cal.save(tmp_path / f"{name}.safetensors"))
    runs = {}
    for name, path in files.items():
        cfg = mtprobe.ProbeConfig(block_complexity=10, mask_init="calibrated", mask_path=path)
        runs[name] = [
            mtprobe.generate(model, p, cfg, max_new_tokens=32).accept_lengths for p in _prompts(3, seed=2)
        ]
    assert runs["offsets"] == runs["shifted"]
    assert runs["offsets"] != runs["plain"]


def test_auto_refuses_two_different_sets_of_offsets(model, offsets_calibration, tmp_path):
    cal, path = offsets_calibration
    other = MaskCalibration(cal.masks, cal.model, layer_offsets=cal.layer_offsets + 1.0)
    other_path = str(other.save(tmp_path / "other.safetensors"))
    cfg = mtprobe.AutoConfig(
        drafters=(
            mtprobe.ProbeConfig(block_complexity=6, mask_init="calibrated", mask_path=path),
            mtprobe.HybridConfig(block_complexity=8, mask_init="calibrated", mask_path=other_path),
        )
    )
    with pytest.raises(ValueError, match="different layer offsets"):
        mtprobe.generate(model, torch.tensor([[5, 6, 7]]), cfg, max_new_tokens=4)


def _per_mask_case(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(masks [k, hidden], offsets [k, 2, hidden] nonzero before layer 0 only, the masks they shift to)."""
    g = torch.Generator().manual_seed(seed)
    masks = torch.randn(k, 64, generator=g) * 0.3
    offsets = torch.zeros(k, 2, 64)  # [k, num_layers, hidden]
    offsets[:, 0] = torch.randn(k, 64, generator=g) * 2.0  # mask j's own shift before layer 0
    return masks, offsets, masks + offsets[:, 0]


@pytest.mark.parametrize("k", [2, 3])
def test_per_mask_offsets_land_on_their_own_mask(model, k):
    # Per-mask offsets [k, L, hidden] nonzero before layer 0 only must score exactly as masks m_j + v_j
    # without offsets: offset set j reaches mask j of every anchor and no other input.
    torch.manual_seed(k)
    ids = torch.randint(0, 96, (16,))
    anchors = torch.tensor([0, 2, 6, 11, 13])
    masks, offsets, shifted = _per_mask_case(k, seed=k)
    with torch.no_grad():
        want, n1 = mask_loss(model, shifted, ids, anchors)
        got, n2 = mask_loss(model, masks, ids, anchors, layer_offsets=offsets)
        swapped, _ = mask_loss(model, masks, ids, anchors, layer_offsets=offsets.flip(0))
        ce, count, hits = mask_loss(model, masks, ids, anchors, layer_offsets=offsets, per_mask=True)
    assert int(n1) == int(n2) == int(count.sum()) and count.shape == (k,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert abs(float(swapped) - float(want)) > 1e-3  # the sets are not interchangeable
    torch.testing.assert_close(float(ce.sum()) / int(count.sum()), float(got), rtol=1e-5, atol=1e-6)
    assert int(count[-1]) < int(count[0])  # the deepest mask of the last anchors has no target
    assert 0 <= int(hits.sum()) <= int(count.sum())


def test_decoding_adds_each_mask_its_own_offsets(model, tmp_path):
    # A k = 2 file with per-mask offsets drafts exactly as the masks they shift to, probing with both
    # masks and with the first only (a k-mask file serves every smaller k: offsets_for slices it).
    ident = model_identity(model)
    masks, offsets, shifted = _per_mask_case(2, seed=7)
    files = {
        "offsets": MaskCalibration(masks, ident, layer_offsets=offsets),
        "shifted": MaskCalibration(shifted, ident),
        "plain": MaskCalibration(masks, ident),
    }
    paths = {name: str(cal.save(tmp_path / f"{name}.safetensors")) for name, cal in files.items()}
    assert torch.equal(files["offsets"].offsets_for(1), offsets[:1])
    for k in (1, 2):
        runs = {}
        for name, path in paths.items():
            cfg = mtprobe.ProbeConfig(
                block_complexity=12, num_masks=k, tree="dynamic", mask_init="calibrated", mask_path=path
            )
            runs[name] = [
                mtprobe.generate(model, p, cfg, max_new_tokens=32).accept_lengths for p in _prompts(3, seed=4)
            ]
        assert runs["offsets"] == runs["shifted"], k
        assert runs["offsets"] != runs["plain"], k


@pytest.fixture(scope="module")
def per_mask_calibration(model, tmp_path_factory) -> tuple[MaskCalibration, str]:
    return _offsets_calibration(model, tmp_path_factory, 2)


def test_calibration_learns_one_set_of_offsets_per_mask(model, per_mask_calibration):
    cal, path = per_mask_calibration
    assert cal.layer_offsets.shape == (2, 2, 64)  # [k, num_layers, hidden]
    assert all(cal.layer_offsets[j].abs().sum() > 0 for j in range(2))
    assert not torch.equal(cal.layer_offsets[0], cal.layer_offsets[1])
    s = cal.stats
    assert s["holdout_after"]["loss"] < s["holdout_before"]["loss"] - 0.05, s
    assert len(s["holdout_after"]["by_mask"]) == 2 and len(s["holdout_prompt_mean"]["by_mask"]) == 2
    back = MaskCalibration.load(path)
    assert torch.equal(back.layer_offsets, cal.layer_offsets)
    back.check(model, num_masks=2)
    with pytest.raises(ValueError, match="num_masks=3 but the calibration holds 2 mask"):
        back.check(model, num_masks=3)


@pytest.mark.parametrize("method", ["probe", "hybrid"])
@pytest.mark.parametrize("k", [1, 2])
def test_per_mask_offsets_are_token_identical_to_greedy(model, per_mask_calibration, method, k):
    _, path = per_mask_calibration
    cal = dict(mask_init="calibrated", mask_path=path, num_masks=k)
    cfg = {
        "probe": mtprobe.ProbeConfig(block_complexity=12, **cal),
        "hybrid": mtprobe.HybridConfig(block_complexity=15, **cal),
    }[method]
    _assert_greedy(model, cfg)


def test_per_mask_offsets_must_be_one_set_per_mask():
    ident = {"model_class": "M", "vocab_size": 8, "hidden_size": 4, "embedding_sha256": "0"}
    with pytest.raises(ValueError, match=r"or \[2, num_layers, 4\] \(one set per mask\), got \(3, 2, 4\)"):
        MaskCalibration(torch.zeros(2, 4), ident, layer_offsets=torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="expected \\[2, hidden\\] or \\[k, 2, hidden\\]"):
        with mtprobe.target_model.mask_hooks.layer_offsets(
            torch.nn.ModuleList([torch.nn.Identity()] * 2), torch.zeros(2, 3, 4), 0
        ):
            pass


def test_adapter_checks_offsets_once_and_keeps_them_in_the_models_dtype(model):
    from mtprobe.target_model.adapter import HFAdapter

    adapter = HFAdapter(copy.deepcopy(model).to(torch.bfloat16), capacity=8)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    with pytest.raises(
        ValueError, match=rf"shape \(2, {layers + 1}, {hidden}\) .* expected \[{layers}, hidden\]"
    ):
        adapter.set_mask_layer_offsets(torch.zeros(2, layers + 1, hidden))
    adapter.set_mask_layer_offsets(torch.ones(layers, hidden))  # one set: stored as k = 1
    assert adapter._mask_offsets.shape == (1, layers, hidden)
    assert adapter._mask_offsets.dtype == torch.bfloat16  # cast once, not per layer per forward
    adapter.set_mask_layer_offsets(None)
    assert adapter._mask_offsets is None


def test_auto_refuses_one_per_mask_file_at_two_mask_counts(model, per_mask_calibration):
    _, path = per_mask_calibration
    cal = dict(mask_init="calibrated", mask_path=path)
    cfg = mtprobe.AutoConfig(
        drafters=(
            mtprobe.ProbeConfig(block_complexity=6, num_masks=1, **cal),
            mtprobe.ProbeConfig(block_complexity=9, num_masks=2, **cal),
        )
    )
    with pytest.raises(ValueError, match="different layer offsets .*num_masks=1.*num_masks=2"):
        mtprobe.generate(model, torch.tensor([[5, 6, 7]]), cfg, max_new_tokens=4)


def test_decoder_layers_of_a_model_without_them():
    from mtprobe.target_model.mask_hooks import decoder_layers

    model = tiny_llama(seed=1)
    assert decoder_layers(model) is model.model.layers
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:1])  # not num_hidden_layers of them
    with pytest.raises(ValueError, match="found no list of its 2 decoder layers"):
        decoder_layers(model)


def test_command_line(tmp_path, capsys):
    from mtprobe import models
    from mtprobe.cli import main
    from test_cli import _save_tiny

    folder = _save_tiny(tmp_path / "tiny")
    out = tmp_path / "masks.safetensors"
    argv = ["calibrate", "--model", str(folder), "--out", str(out), "--num-prompts", "4", "--holdout", "1"]
    kept = ["--continuations", str(tmp_path / "seqs.safetensors")]
    assert main([*argv, "--max-new-tokens", "8", "--epochs", "1", "--num-masks", "2", *kept]) == 0
    printed = capsys.readouterr()
    assert "held-out top-1 of the masks" in printed.out and str(out) in printed.out
    assert "wrote 4 greedy continuations" in printed.err  # progress goes to stderr
    model, _ = models.load(folder)
    cal = MaskCalibration.load(out)
    cal.check(model, num_masks=2)
    assert cal.stats["prompts"] == 3 and cal.stats["holdout_prompts"] == 1
    assert cal.layer_offsets is None
    deep = tmp_path / "deep.safetensors"
    assert (
        main(
            [
                *argv[:4],
                str(deep),
                *argv[5:],
                "--max-new-tokens",
                "8",
                "--epochs",
                "1",
                "--layer-offsets",
                "--cache-gib",
                "0",
                *kept,
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "read 4 greedy continuations" in err and "kept the KV caches of 0 of 4 sequences" in err
    assert MaskCalibration.load(deep).layer_offsets.shape == (model.config.num_hidden_layers, cal.hidden_size)
    capsys.readouterr()
    assert main([*argv, "--epochs", "0"]) == 2  # a usage error, naming the bad value
    assert "epochs=0 must be an int >= 1" in capsys.readouterr().err
    assert main([*argv, "--cache-gib", "-1"]) == 2
    assert "cache_gib=-1.0 must be a number >= 0" in capsys.readouterr().err


def test_command_line_with_corpus_prompts(tmp_path, capsys):
    # --corpus-prompts: passages of local text files become more prompts, placed before the set's so
    # that the held-out prompts stay the set's last ones; --gen-batch-size generates several at once.
    from mtprobe.cli import main
    from test_cli import _save_tiny

    folder = _save_tiny(tmp_path / "tiny")
    corpus = tmp_path / "fortunes"
    corpus.write_text(
        "\n%\n".join(f"Passage {i}: " + "a quiet sentence of plain words. " * 3 for i in range(5))
    )
    out = tmp_path / "masks.safetensors"
    argv = ["calibrate", "--model", str(folder), "--out", str(out), "--num-prompts", "2", "--holdout", "1"]
    argv += ["--max-new-tokens", "6", "--epochs", "1", "--gen-batch-size", "3"]
    assert main([*argv, "--corpus-prompts", str(corpus), "--num-corpus-prompts", "3"]) == 0
    stats = MaskCalibration.load(out).stats
    assert stats["prompts"] == 4 and stats["holdout_prompts"] == 1  # 3 corpus + 2 set prompts, 1 held out
    assert stats["gen_batch_size"] == 3
    assert stats["sources"] == {
        "prompts": "built-in",
        "num_prompts": 2,
        "corpus_prompts": ["fortunes"],
        "num_corpus_prompts": 3,
    }
    capsys.readouterr()
    for bad, says in (
        (["--corpus-prompts", str(tmp_path / "nothing")], "no such file; give local text files"),
        (["--corpus-prompts", str(corpus), "--num-corpus-prompts", "0"], "must be >= 1"),
        (["--gen-batch-size", "0"], "--gen-batch-size 0 must be >= 1"),
    ):
        assert main([*argv, *bad]) == 2
        assert says in capsys.readouterr().err
    empty = tmp_path / "short"
    empty.write_text("too short")
    # Refused before the model loads: a model that is not there.
    assert main([*argv, "--corpus-prompts", str(empty), "--model", str(tmp_path / "no-model")]) == 2
    assert "no passage of 60 to 600 characters" in capsys.readouterr().err


RESULT_MASKS = sorted(
    (Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "calibrate").glob("masks-*.safetensors")
)


@pytest.mark.parametrize("path", RESULT_MASKS, ids=lambda p: p.name)
def test_the_committed_masks_belong_to_smollm2(smollm2, path):
    # The masks benchmarks/results/calibrate/README.md measured: each is accepted for SmolLM2 with the
    # mask count its name says, and its header records held-out scores better than seed 001's masks.
    model, _ = smollm2
    cal = load_calibration(path)
    cal.check(model, num_masks=int(path.stem.split("-k")[1][0]))
    s = cal.stats
    assert s["holdout_after"]["loss"] < s["holdout_prompt_mean"]["loss"]
    assert s["holdout_after"]["top1"] > s["holdout_prompt_mean"]["top1"]


def test_continuations_are_kept_in_a_file(model, tmp_path, monkeypatch):
    from mtprobe.offline import calibration_data

    prompts = _prompts(3)
    path = tmp_path / "seqs" / "c.safetensors"  # a folder that does not exist yet
    made = calibration_data.calibration_sequences(model, prompts, 12, batch_size=2, path=path)
    want = calibration_data.calibration_sequences(model, prompts, 12, batch_size=2)
    assert [(t.tolist(), s) for t, s in made] == [(t.tolist(), s) for t, s in want]

    def no_generation(*args, **kwargs):
        raise AssertionError("the file should have been read")

    monkeypatch.setattr(calibration_data, "_generated_sequences", no_generation)
    read = calibration_data.calibration_sequences(model, prompts, 12, batch_size=2, path=path)
    assert [(t.tolist(), s) for t, s in read] == [(t.tolist(), s) for t, s in want]
    assert all(t.dtype == torch.long for t, _ in read)
    # calibrate_masks reads it too: a second run on the same prompts generates nothing.
    cal = calibrate_masks(model, prompts, max_new_tokens=12, gen_batch_size=2, epochs=1, holdout=1,
                          continuations=path)  # fmt: skip
    assert cal.masks.shape == (1, 64)
    for kwargs, match in (
        (dict(prompts=prompts, max_new_tokens=13, batch_size=2), "max_new_tokens=12, this run wants 13"),
        (dict(prompts=prompts, max_new_tokens=12, batch_size=1), "batch_size=2, this run wants 1"),
        (dict(prompts=_prompts(3, seed=1), max_new_tokens=12, batch_size=2), "other prompts"),
        (dict(prompts=prompts[:2], max_new_tokens=12, batch_size=2), "other prompts .3 of them"),
    ):
        with pytest.raises(ValueError, match=match):
            calibration_data.calibration_sequences(model, **kwargs, path=path)
    broken = tmp_path / "broken.safetensors"
    broken.write_text("not a safetensors file")
    with pytest.raises(ValueError, match="not a file of calibration continuations"):
        calibration_data.calibration_sequences(model, prompts, 12, path=broken)
    other = tiny_llama(seed=4)
    with pytest.raises(ValueError, match="model=.*delete the file or give another path"):
        calibration_data.calibration_sequences(other, prompts, 12, batch_size=2, path=path)
    # A file with another file's tensors (no ids) is refused by name, not with safetensors' own error.
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"masks": torch.zeros(1, 4)}, str(foreign))
    with pytest.raises(ValueError, match="not a file of calibration continuations.*SafetensorError"):
        calibration_data.calibration_sequences(model, prompts, 12, path=foreign)


def test_an_interrupted_continuations_write_leaves_no_file(model, tmp_path, monkeypatch):
    from mtprobe.offline import calibration_data

    def interrupted(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(calibration_data, "save_file", interrupted)
    path = tmp_path / "c.safetensors"
    with pytest.raises(KeyboardInterrupt):
        calibration_data.calibration_sequences(model, _prompts(2), 6, path=path)
    assert not path.exists()  # the next run generates again instead of refusing a half file
    monkeypatch.undo()
    seqs = calibration_data.calibration_sequences(model, _prompts(2), 6, path=path)
    assert path.is_file() and len(seqs) == 2


def test_caches_past_the_budget_are_rebuilt_and_learn_the_same_masks(model):
    from mtprobe.offline import calibration_data

    prompts = _prompts(5)
    data = calibration_data._continuations(model, prompts, 16, 1)
    one = calibration_data._cache_bytes(data[0][2])
    assert one > 0 and data.num_kept == 5
    part = calibration_data._continuations(model, prompts, 16, 1, cache_bytes=2.5 * one)
    assert part.num_kept == 2 and len(part) == 5
    for (ids, start, cache), (ids2, start2, kept) in zip(part, data, strict=True):
        assert torch.equal(ids, ids2) and start == start2
        assert calibration_data._cache_bytes(cache) == calibration_data._cache_bytes(kept)
    tail = part[3:]  # a slice keeps its own kept caches: none here
    assert len(tail) == 2 and tail.num_kept == 0 and torch.equal(tail[0][0], data[3][0])
    assert part[1:].num_kept == 1 and torch.equal(part[-1][0], data[4][0])
    with pytest.raises(IndexError):
        part[5]
    held = calibration_data.Continuations.build(model, part.sequences, 2.5 * one, first=[-1, 4])
    assert (
        held.num_kept == 2 and held[3:].num_kept == 1 and held[4:].num_kept == 1
    )  # the last, then the first
    assert held[:1].num_kept == 1
    kw = dict(num_masks=2, max_new_tokens=12, epochs=1, holdout=1, mask_lora_rank=2, fit_temperature=False)
    torch.manual_seed(0)
    all_kept = calibrate_masks(model, prompts, **kw)
    torch.manual_seed(0)
    none_kept = calibrate_masks(model, prompts, cache_gib=0, **kw)
    assert torch.equal(all_kept.masks, none_kept.masks)
    assert all(torch.equal(t, none_kept.mask_lora[k]) for k, t in all_kept.mask_lora.items())
    for bad in (-1, float("nan"), "8", True):
        with pytest.raises(ValueError, match="cache_gib=.* must be a number >= 0"):
            calibrate_masks(model, prompts, cache_gib=bad, max_new_tokens=4)
