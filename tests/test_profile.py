"""mtprobe.target_model.profile: measured forward costs, their cache on disk, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

import mtprobe
from conftest import QuietMachine, tiny_llama
from mtprobe.target_model.profile import ForwardProfile, ProfileKey, profile_forward

KEY = ProfileKey(model="M:0", device="cpu", dtype="float32", threads=1)


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """The caches' behaviour must not depend on the other test worker's load (tests of a busy machine
    put BusyMachine in its place)."""
    monkeypatch.setattr(mtprobe.target_model.profile, "OtherLoad", QuietMachine)


def test_docstring_example_and_interpolation():
    p = ForwardProfile(KEY, (1, 8, 32), (64, 512), ((0.020, 0.030, 0.046), (0.024, 0.036, 0.056)))
    assert p.time(8, 64) == pytest.approx(0.030)
    assert p.time(20, 64) == pytest.approx(0.038)
    assert p.relative(32, 288) == pytest.approx(0.051 / 0.022)
    assert p.time(8, -5) == p.time(8, 64) and p.time(8, 10**6) == p.time(8, 512)  # clamped contexts
    assert p.time(56, 64) == pytest.approx(0.062)  # the last slope continues
    assert p.relative(1, 100) == 1.0


def test_a_row_of_a_batch_sees_the_batch_forward():
    p = ForwardProfile(KEY, (1, 8, 32), (64, 512), ((0.020, 0.030, 0.046), (0.024, 0.036, 0.056)))
    assert p.for_rows(1) is p
    four = p.for_rows(4)
    assert four.key == p.key and four.block_sizes == (1, 2, 8, 32)
    for c in (64, 200, 512):
        for t in (1, 2, 5, 8, 20, 32, 40):
            # Every row's block of t inputs in one forward: 4t inputs (past 32, the last segment's slope).
            assert four.time(t, c) == pytest.approx(p.time(4 * t, c))
    # Drafting costs more against one row's plain step: t(32)/t(4) for a block of 8 here, t(8)/t(1) alone.
    assert four.relative(8, 64) == pytest.approx(p.time(32, 64) / p.time(4, 64))
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="rows=.* must be an int >= 1"):
            p.for_rows(bad)


def test_profile_forward_measures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPROBE_CACHE", str(tmp_path))
    model = tiny_llama()
    p = profile_forward(model, block_sizes=(1, 4, 16), context_lengths=(8, 64), repeats=2, warmup=1)
    assert p.block_sizes == (1, 4, 16) and p.context_lengths == (8, 64)
    assert all(s > 0 for row in p.seconds for s in row)
    assert p.key == ProfileKey.of(model) and p.key.threads == torch.get_num_threads()
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1
    # The second call loads the file: its (edited) numbers come back, nothing is measured.
    data = json.loads(files[0].read_text())
    data["seconds"][0][0] = 123.0
    files[0].write_text(json.dumps(data))
    again = profile_forward(model, block_sizes=(1, 4, 16), context_lengths=(8, 64), repeats=2, warmup=1)
    assert again.seconds[0][0] == 123.0
    fresh = profile_forward(model, block_sizes=(1, 4, 16), context_lengths=(8, 64), repeats=2, refresh=True)
    assert fresh.seconds[0][0] != 123.0
    # Contexts that leave no room for the largest block in the model's 256 positions are dropped.
    short = profile_forward(model, block_sizes=(1, 4), context_lengths=(8, 252, 1000), repeats=1, cache=False)
    assert short.context_lengths == (8, 252)


def test_profile_save_load_and_check(tmp_path):
    model = tiny_llama()
    p = ForwardProfile(ProfileKey.of(model), (1, 2), (0,), ((1.0, 1.5),))
    path = p.save(tmp_path / "sub" / "p.json")
    assert ForwardProfile.load(path) == p
    p.check(model)  # the same model: accepted
    with pytest.raises(ValueError, match=r"measured for another setting \(model: profile 'LlamaForCausalLM:"):
        p.check(tiny_llama(num_hidden_layers=3))
    other_dtype = ForwardProfile(
        ProfileKey(**{**p.key.__dict__, "dtype": "bfloat16"}), (1, 2), (0,), ((1.0, 1.5),)
    )
    with pytest.raises(ValueError, match="dtype: profile 'bfloat16' vs now 'float32'"):
        other_dtype.check(model)
    other_device = ForwardProfile(
        ProfileKey(**{**p.key.__dict__, "device": "cuda (H100)"}), (1,), (0,), ((1.0,),)
    )
    with pytest.raises(ValueError, match="device: profile 'cuda \\(H100\\)'"):
        other_device.check(model)


def test_bad_profiles(tmp_path):
    with pytest.raises(ValueError, match=r"seconds\[0\]\[1\] \(block size 2, context 0\) is 0.0"):
        ForwardProfile(KEY, (1, 2), (0,), ((1.0, 0.0),))
    with pytest.raises(ValueError, match="is -1.0"):
        ForwardProfile(KEY, (1, 2), (0,), ((1.0, -1.0),))
    with pytest.raises(ValueError, match="is nan"):
        ForwardProfile(KEY, (1,), (0,), ((float("nan"),),))
    with pytest.raises(ValueError, match="block_sizes must ascend strictly and start at 1"):
        ForwardProfile(KEY, (2, 4), (0,), ((1.0, 1.0),))
    with pytest.raises(ValueError, match="context_lengths must be non-negative and ascend strictly"):
        ForwardProfile(KEY, (1,), (5, 5), ((1.0,), (1.0,)))
    with pytest.raises(
        ValueError, match=r"seconds must be \[len\(context_lengths\)\]\[len\(block_sizes\)\] = \[1\]\[2\]"
    ):
        ForwardProfile(KEY, (1, 2), (0,), ((1.0,),))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a forward profile \\(corrupt JSON"):
        ForwardProfile.load(bad)
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="not a forward profile of format 1"):
        ForwardProfile.load(bad)
    with pytest.raises(FileNotFoundError, match="no forward profile at"):
        ForwardProfile.load(tmp_path / "missing.json")
    model = tiny_llama()
    with pytest.raises(ValueError, match="block_sizes must ascend strictly and start at 1"):
        profile_forward(model, block_sizes=(2, 4), cache=False)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_forward(model, repeats=0, cache=False)
    with pytest.raises(ValueError, match="leave room for the largest block"):
        profile_forward(model, block_sizes=(1, 64), context_lengths=(300,), cache=False)


def test_public_names():
    assert mtprobe.profile_forward is profile_forward and mtprobe.ForwardProfile is ForwardProfile


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_the_packed_linear_layers_of_bench_cpu_linear_compute_the_same_model():
    # benchmarks/bench_cpu_linear.py times the model with every nn.Linear on a oneDNN-packed weight.
    # Its patch must be the same function: logits within float32's tolerance (another kernel may
    # round differently), greedy output unchanged, and mtprobe's output still greedy's on it.
    from conftest import load_benchmark
    from tolerances import tolerance

    bench = load_benchmark("bench_cpu_linear")
    model = tiny_llama(seed=3)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert bench.pack_linears(model) == linears > 0
    with torch.no_grad():
        got = model(ids).logits
    assert all(hasattr(m, "_packed") for m in model.modules() if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    packed = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
    assert torch.equal(packed, ref)
    out = mtprobe.generate(model, ids, mtprobe.StandConfig(block_complexity=10), max_new_tokens=24)
    assert torch.equal(out.sequences, packed)


def test_a_profile_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(
    tmp_path, monkeypatch, caplog
):
    import mtprobe.target_model.profile as profile
    from conftest import BusyMachine

    monkeypatch.setenv("MTPROBE_CACHE", str(tmp_path))
    monkeypatch.setattr(profile, "OtherLoad", BusyMachine)
    monkeypatch.setattr(profile, "_KEPT_BUSY", set())
    model = tiny_llama()
    grid = dict(block_sizes=(1, 4), context_lengths=(8,), repeats=1, warmup=0)
    with caplog.at_level("WARNING", logger="mtprobe"):
        busy = profile_forward(model, **grid)
    assert "other processes used 60% of the CPU while the forward profile was measured" in caplog.text
    assert busy.other_load == 0.6
    (path,) = tmp_path.glob("profiles/*.json")
    # Still busy: the cached profile serves (edited, to tell it from a new measurement).
    data = json.loads(path.read_text())
    data["seconds"][0][0] = 123.0
    path.write_text(json.dumps(data))
    assert profile_forward(model, **grid).seconds[0][0] == 123.0
    assert path in profile._KEPT_BUSY  # this process samples the machine for it once, not every call
    profile._KEPT_BUSY.clear()  # a later process
    # Quiet now: measured again and overwritten, and from then on loaded.
    monkeypatch.setattr(profile, "OtherLoad", QuietMachine)
    quiet = profile_forward(model, **grid)
    assert quiet.seconds[0][0] != 123.0 and quiet.other_load == 0.0
    assert ForwardProfile.load(path) == quiet == profile_forward(model, **grid)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "high", True])
def test_a_profile_refuses_a_bad_load(bad):
    with pytest.raises(
        ValueError, match="other_load must be None or the share of the CPU other processes used"
    ):
        ForwardProfile(KEY, (1,), (0,), ((1.0,),), bad)
