"""Configurations as data: to_dict / from_dict / JSON round trips, config_from_dict and its method
names (shared with the Spec-Bench registry), and the dict route of mtprobe.generate."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mtprobe
from conftest import tiny_llama
from mtprobe import registry
from mtprobe.drafters import config_from_dict, config_from_json, decoding_configs, ngram_memories

# Learned masks for tiny_llama() (written by the `tiny` fixture below, before any test decodes).
MASKS = Path(tempfile.gettempdir()) / f"mtprobe-test-config-masks-{os.getpid()}.safetensors"
# A circuit head trained for tiny_llama() (also written by the `tiny` fixture).
HEAD = Path(tempfile.gettempdir()) / f"mtprobe-test-config-head-{os.getpid()}"

# One configuration per method, every field away from its default.
NON_DEFAULT = {
    "plain": mtprobe.PlainConfig(),  # no fields: nothing to set
    "probe": mtprobe.ProbeConfig(
        block_complexity=60,
        num_masks=2,
        tree="static",
        branches=(12, 3),
        prune=False,
        mask_init="calibrated",
        mask_path=str(MASKS),
        mask_lambda=0.25,
        incremental_masks=False,
        seed=2**63 - 1,
    ),
    "pld": mtprobe.PromptLookupConfig(num_tokens=7, max_ngram_size=4, block_complexity=12),
    "sps": mtprobe.DraftModelConfig(
        num_draft_layers=3,
        num_tokens=4,
        top_branches=2,
        block_complexity=9,
        self_draft="quantized",
        draft_format="q8_0",
        stop_below=0.75,
    ),
    "stand": mtprobe.StandConfig(
        block_complexity=17,
        max_depth=6,
        max_ngram=2,
        table_size=5,
        logits_top_k=4,
        memory_size=50,
        prompt_logits=7,
    ),
    "lookahead": mtprobe.LookaheadConfig(
        ngram_size=3, window=6, guess_set_size=2, pool_from_prompt=True, block_complexity=20
    ),
    "hybrid": mtprobe.HybridConfig(
        block_complexity=45,
        num_masks=2,
        prune=False,
        mask_init="calibrated",
        mask_path=str(MASKS),
        mask_lambda=0.0,
        seed=7,
        max_depth=4,
        max_ngram=2,
        table_size=3,
        logits_top_k=6,
        memory_size=33,
        mask_value=0.25,
        grow_probed=True,
        prompt_logits=5,
    ),
    "auto": mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(num_tokens=3), mtprobe.ProbeConfig(block_complexity=12)),
        # Keyed to the tiny model of the tests below: a profile for another model is refused.
        profile=mtprobe.ForwardProfile(
            mtprobe.target_model.profile.ProfileKey.of(tiny_llama()),
            (1, 8, 32),
            (0, 64),
            ((1.0, 1.2, 1.5), (1.1, 1.3, 1.7)),
        ),
        decay=0.8,
        explore_every=5,
        carry=False,
        draft_formats=("q4_1", "mixed"),
    ),
    "heads": mtprobe.HeadsConfig(
        path=str(HEAD),
        block_complexity=13,
        top_branches=2,
        min_path_prob=0.01,
        vocab_top_k=48,
        head_dtype="bfloat16",
        bank=mtprobe.TopologyBank(
            trees=((), ((0,),), ((0,), (1,), (0, 0))), drafter="heads", num_masks=0, window=3, vocab_top_k=48
        ),
        policy="hysteretic",
        trees=(1, 2),
        thresholds=(0.2, 0.6),
        feature="top1",
        ema=0.75,
        record_steps=True,
    ),
    "entmtp": mtprobe.EntMTPConfig(
        bank=mtprobe.TopologyBank(trees=((), ((0,),), ((0,), (1,), (0, 0))), num_masks=2, mask_lambda=0.2),
        policy="ladder",
        trees=(0, 2),
        thresholds=(0.4,),
        feature="entropy",
        ema=0.25,
        record_steps=True,
        incremental_masks=False,
    ),
}


def test_every_method_has_a_non_default_case_and_one_registry():
    drafter_methods = {m.name: m.config_type for m in registry.methods() if m.drafter is not None}
    assert set(NON_DEFAULT) == set(drafter_methods)
    assert set(decoding_configs()) == set(drafter_methods.values())
    for name, cfg in NON_DEFAULT.items():
        cls = type(cfg)
        assert cls.method == name and drafter_methods[name] is cls and registry.method_of(cfg).name == name
        for f in dataclasses.fields(cls):
            if (name, f.name) == ("sps", "draft_model"):
                continue  # a live model is not serialised (test_live_draft_model_...)
            if (name, f.name) == ("probe", "mask_value"):
                continue  # needs the dynamic tree, which has no branches: its own case below
            assert getattr(cfg, f.name) != f.default, f"{name}.{f.name} is at its default"
    planned = dataclasses.replace(NON_DEFAULT["probe"], tree="dynamic", branches=None, mask_value=0.25)
    assert config_from_json(planned.to_json()) == planned and planned.to_dict()["mask_value"] == 0.25


def test_spec_bench_uses_the_same_method_names():
    from mtprobe.specbench.methods import METHODS

    for method in registry.methods():
        assert METHODS[method.name] is method, method.name


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_round_trip_dict_and_json(name):
    cfg = NON_DEFAULT[name]
    d = cfg.to_dict()
    assert d["method"] == name
    assert json.loads(json.dumps(d)) == d  # JSON types only
    cls = type(cfg)
    assert cls.from_dict(d) == cfg
    assert config_from_dict(d) == cfg
    text = cfg.to_json(indent=2)
    assert cls.from_json(text) == cfg
    assert config_from_json(text) == cfg
    # Defaults round-trip too, with the resolved fields (num_masks, tree, branches, budgets) written out.
    default = cls(path="head") if name == "heads" else cls()  # a head's checkpoint has no default
    assert cls.from_dict(default.to_dict()) == default


def test_resolved_fields_are_written():
    d = mtprobe.ProbeConfig(block_complexity=30).to_dict()
    assert d == {
        "method": "probe",
        "block_complexity": 30,
        "num_masks": 1,
        "tree": "static",
        "branches": [14],
        "prune": True,
        "mask_init": "prompt_mean",
        "mask_path": None,
        "mask_lambda": 0.5,
        "incremental_masks": True,
        "seed": 0,
        "mask_value": None,
    }
    assert mtprobe.PromptLookupConfig(num_tokens=3).to_dict()["block_complexity"] == 4


def test_partial_dict_keeps_defaults():
    assert config_from_dict({"method": "probe", "block_complexity": 60}) == mtprobe.ProbeConfig(
        block_complexity=60
    )
    assert mtprobe.StandConfig.from_dict({"max_depth": 3}) == mtprobe.StandConfig(max_depth=3)


def test_errors_are_named():
    with pytest.raises(
        ValueError, match=r"has no field\(s\) 'bc'; valid keys: method, block_complexity, num_masks"
    ):
        config_from_dict({"method": "probe", "bc": 30})
    with pytest.raises(ValueError, match="unknown method 'medusa'; known methods: probe, pld, sps, stand"):
        config_from_dict({"method": "medusa"})
    with pytest.raises(ValueError, match="needs a 'method' key"):
        config_from_dict({"block_complexity": 30})
    with pytest.raises(TypeError, match="dict with a 'method' key"):
        config_from_dict([("method", "probe")])
    with pytest.raises(ValueError, match="ProbeConfig is method 'probe'.*config_from_dict"):
        mtprobe.ProbeConfig.from_dict({"method": "pld"})
    with pytest.raises(TypeError, match="from_dict takes a dict"):
        mtprobe.ProbeConfig.from_dict("probe")
    # The dataclass's own validation runs.
    with pytest.raises(ValueError, match="block_complexity=3 is too small"):
        config_from_dict({"method": "probe", "block_complexity": 3})
    with pytest.raises(TypeError, match="block_complexity must be an int"):
        config_from_dict({"method": "stand", "block_complexity": "30"})
    with pytest.raises(TypeError, match="prune must be a bool"):
        config_from_dict({"method": "probe", "prune": 1})
    with pytest.raises(ValueError):
        config_from_json("{not json")


def test_live_draft_model_is_not_serialised_but_can_be_put_back():
    draft = tiny_llama(seed=1, num_hidden_layers=1)
    cfg = mtprobe.DraftModelConfig(draft_model=draft, num_tokens=3)
    with pytest.raises(
        ValueError, match="draft_model is a live LlamaForCausalLM.*from_dict\\(d, draft_model=model\\)"
    ):
        cfg.to_dict()
    d = dataclasses.replace(cfg, draft_model=None).to_dict()
    back = mtprobe.DraftModelConfig.from_dict(d, draft_model=draft)
    assert back == cfg and back.draft_model is draft


_ints = st.integers(min_value=1, max_value=40)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(NON_DEFAULT)),
    a=_ints,
    b=_ints,
    c=_ints,
    flag=st.booleans(),
    lam=st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
    seed=st.integers(min_value=0, max_value=2**63 - 1),
)
def test_round_trip_property(name, a, b, c, flag, lam, seed):
    # Any valid configuration survives to_json -> config_from_json unchanged; invalid ones fail on build.
    builders = {
        "probe": lambda: mtprobe.ProbeConfig(
            block_complexity=4 * a, num_masks=1 + c % 4, prune=flag, mask_lambda=lam, seed=seed
        ),
        "pld": lambda: mtprobe.PromptLookupConfig(num_tokens=a, max_ngram_size=b),
        "plain": lambda: mtprobe.PlainConfig(),
        "sps": lambda: mtprobe.DraftModelConfig(num_draft_layers=a, num_tokens=b, top_branches=1 + c % 3),
        "stand": lambda: mtprobe.StandConfig(
            block_complexity=1 + a,
            max_depth=b,
            max_ngram=c,
            table_size=a,
            memory_size=a * b if flag else None,
        ),
        "lookahead": lambda: mtprobe.LookaheadConfig(
            ngram_size=1 + a, window=b, guess_set_size=c, pool_from_prompt=flag
        ),
        "hybrid": lambda: mtprobe.HybridConfig(
            block_complexity=4 * a,
            num_masks=1 + c % 2,
            mask_lambda=lam,
            seed=seed,
            max_depth=b,
            mask_value=lam if flag else None,
        ),
        "auto": lambda: mtprobe.AutoConfig(
            drafters=(mtprobe.PromptLookupConfig(num_tokens=a), mtprobe.StandConfig(block_complexity=1 + b)),
            decay=lam,
            explore_every=c,
        ),
        "heads": lambda: mtprobe.HeadsConfig(
            path=f"heads/{a}",
            block_complexity=a,
            top_branches=b,
            min_path_prob=lam / 2,
            vocab_top_k=None if flag else 1 + c,
        ),
        "entmtp": lambda: mtprobe.EntMTPConfig(
            policy=("static", "ladder", "hysteretic")[c % 3],
            thresholds=(() if c % 3 == 0 else (lam,) * (5 if c % 3 == 1 else 2)),
            trees=((a % 6,) if c % 3 == 0 else None),
            ema=max(lam, 0.01),
            record_steps=flag,
        ),
    }
    try:
        cfg = builders[name]()
    except ValueError:
        return
    assert config_from_json(cfg.to_json()) == cfg
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


IDS = torch.tensor([[3, 7, 11, 5, 3, 7, 11, 5, 3, 7]])


@pytest.fixture(scope="module")
def tiny():
    from mtprobe import heads
    from mtprobe.offline import heads as offline_heads
    from mtprobe.offline.calibrate import calibrate_masks
    from mtprobe.offline.calibration_data import calibration_sequences

    model = tiny_llama()
    calibrate_masks(model, [IDS[:, :6], IDS[:, 2:]], num_masks=2, max_new_tokens=6, epochs=1, holdout=0).save(
        MASKS
    )
    seqs = calibration_sequences(model, [IDS[:, :6], IDS[:, 2:]], max_new_tokens=16)
    features = offline_heads.compute_features(model, [(ids, plen - 1) for ids, plen in seqs])
    head = heads.new_head(model, heads.HeadSpec("cp", 3, 2, hidden_size=64, vocab_size=96, adapter_rank=4))
    heads.save_head(head, model, HEAD, offline_heads.train_head(head, features, steps=5, holdout=0))
    yield model
    MASKS.unlink(missing_ok=True)
    shutil.rmtree(HEAD, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_dict_route_equals_config_route(tiny, name):
    cfg = NON_DEFAULT[name]
    if name == "sps":
        cfg = dataclasses.replace(cfg, num_draft_layers=1)  # the tiny target has 2 layers
    d = cfg.to_dict()

    def forget() -> None:  # a cross-request n-gram memory would carry one call's text into the next
        for memory in ngram_memories(tiny, cfg):
            memory.clear()

    greedy = tiny.generate(IDS, do_sample=False, max_new_tokens=10)
    forget()
    by_config = mtprobe.generate(tiny, IDS, cfg, max_new_tokens=10)
    forget()
    by_dict = mtprobe.generate(tiny, IDS, d, max_new_tokens=10)
    forget()
    assert torch.equal(by_dict.sequences, greedy)
    assert torch.equal(by_config.sequences, greedy)
    assert by_dict.accept_lengths == by_config.accept_lengths
    assert by_dict.forward_calls == by_config.forward_calls
    hf = tiny.generate(
        IDS,
        custom_generate=mtprobe.custom_generate,
        mtprobe_config=d,
        max_new_tokens=10,
        return_dict_in_generate=True,
    )
    assert torch.equal(hf.sequences, greedy) and hf.accept_lengths == by_config.accept_lengths


def test_dict_route_errors(tiny):
    with pytest.raises(ValueError, match="method 'ar' has no drafter .*; known methods: probe"):
        mtprobe.generate(tiny, IDS, {"method": "ar"}, max_new_tokens=4)
    with pytest.raises(ValueError, match="has no field"):
        mtprobe.generate(tiny, IDS, {"method": "pld", "num_token": 4}, max_new_tokens=4)
    with pytest.raises(TypeError, match="unknown decoding configuration str"):
        mtprobe.generate(tiny, IDS, "pld", max_new_tokens=4)
