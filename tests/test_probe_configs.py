"""Every probing configuration stays lossless, and the block complexity is a hard budget.

Greedy output must be token-identical to ``model.generate(do_sample=False)`` over the
configuration space: mask tokens k = 1..4, block complexity, static and dynamic trees, the
pruner, every mask design and the lambda update.
"""

from __future__ import annotations

import importlib
import itertools
import random

import pytest
import torch

import mtprobe
from conftest import chat_ids, load_benchmark, tiny_llama
from mtprobe.drafters.mask_probe import MASK_INITS

generate_module = importlib.import_module("mtprobe.decode.sequence")  # where the adapters are made


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(eos_token_id=95)


@pytest.fixture(scope="module")
def masks_file(tiny, tmp_path_factory) -> str:
    """Four masks learned for ``tiny`` (mask_init='calibrated' takes the first k)."""
    from mtprobe.offline.calibrate import calibrate_masks

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 95, (1, 8), generator=gen) for _ in range(3)]
    path = tmp_path_factory.mktemp("masks") / "tiny.safetensors"
    calibrate_masks(tiny, prompts, num_masks=4, max_new_tokens=12, epochs=1, holdout=0).save(path)
    return str(path)


def config_space() -> list[dict]:
    """Each dimension swept with the others at defaults, plus a seeded sample of the product."""
    base = dict(block_complexity=30)
    out = [dict(base, num_masks=k) for k in (1, 2, 3, 4)]
    out += [dict(block_complexity=bc) for bc in (4, 10, 30, 60)]
    out += [dict(base, num_masks=2, tree=t) for t in ("static", "dynamic")]
    out += [dict(base, num_masks=2, prune=p) for p in (True, False)]
    out += [dict(base, mask_init=m) for m in MASK_INITS]
    out += [dict(base, mask_lambda=lam) for lam in (0.0, 0.1, 0.5, 1.0)]
    # Planned masks: on the likely ends only; a step ending elsewhere reads an ancestor's deeper masks.
    out += [
        dict(base, num_masks=k, mask_value=v) for k, v in ((1, 0.3), (2, 0.3), (3, 0.1), (4, 1.0), (2, 0.0))
    ]
    out += [
        dict(block_complexity=60, num_masks=2, tree="static", branches=(15, 4), incremental_masks=i)
        for i in (True, False)
    ]
    rng = random.Random(0)
    product = list(
        itertools.product(
            (1, 2, 3, 4), (10, 30, 60), ("static", "dynamic"), (True, False), MASK_INITS, (0.0, 0.1, 0.5)
        )
    )
    for k, bc, tree, prune, init, lam in rng.sample(product, 40):
        if bc < 2 * (k + 1) * 2:  # keep at least two tree nodes per step
            continue
        out.append(
            dict(block_complexity=bc, num_masks=k, tree=tree, prune=prune, mask_init=init, mask_lambda=lam)
        )
    return out


CONFIGS = config_space()


def record_block_sizes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    original = generate_module.HFAdapter.forward

    def forward(self, tokens, embeds, position_ids, mask, prefix_len, want_hidden):
        sizes.append(position_ids.shape[1])
        return original(self, tokens, embeds, position_ids, mask, prefix_len, want_hidden)

    monkeypatch.setattr(generate_module.HFAdapter, "forward", forward)
    return sizes


@pytest.mark.parametrize("kwargs", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_lossless_and_within_budget_on_tiny_llama(tiny, masks_file, kwargs, monkeypatch):
    if kwargs.get("mask_init") == "calibrated":
        kwargs = dict(kwargs, mask_path=masks_file)
    cfg = mtprobe.ProbeConfig(**kwargs)
    sizes = record_block_sizes(monkeypatch)
    gen = torch.Generator().manual_seed(len(sizes) + 7)
    for length in (1, 9, 33):
        prompt = torch.randint(0, 95, (1, length), generator=gen)
        ref = tiny.generate(prompt, do_sample=False, max_new_tokens=20)
        sizes.clear()
        out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=20)
        assert torch.equal(out.sequences, ref), f"{cfg} differs from greedy on a prompt of {length} tokens"
        assert max(sizes[1:], default=0) <= cfg.block_complexity, (
            f"a decode forward took {max(sizes[1:])} inputs"
        )


PROBE_CONFIGS = [
    dict(block_complexity=60, num_masks=2),  # the paper's default there: two masks, dynamic tree
    dict(block_complexity=30, num_masks=2, tree="static", branches=(7, 2)),
    dict(block_complexity=60, num_masks=3, prune=False),
    dict(block_complexity=30, num_masks=4),
    dict(block_complexity=30, mask_init="gaussian_10sigma"),
    dict(block_complexity=30, num_masks=2, mask_init="prompt_last", mask_lambda=0.0),
    dict(block_complexity=64, num_masks=3, mask_value=0.3),
]


@pytest.mark.parametrize("kwargs", PROBE_CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_lossless_on_smollm2(smollm2, greedy, kwargs, monkeypatch):
    from mtprobe.data import load_prompts

    model, tok = smollm2
    cfg = mtprobe.ProbeConfig(**kwargs)
    mtprobe.choose_linear_routes(model)  # measured (once) before the spy, which must see decoding alone
    sizes = record_block_sizes(monkeypatch)
    # One of two prompts per configuration, in turn (each prompt under three or four configurations).
    prompt = load_prompts()[4 + PROBE_CONFIGS.index(kwargs) % 2]
    ids = chat_ids(tok, prompt["messages"])
    ref = greedy(model, ids, 32)  # computed once per prompt for the configurations
    sizes.clear()
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=32)
    assert torch.equal(out.sequences, ref), f"{cfg} differs from greedy on {prompt['id']}"
    assert max(sizes[1:], default=0) <= cfg.block_complexity


def test_deeper_trees_accept_more_than_one_draft(smollm2):
    # With two masks the tree has depth 2, so a step can gain 3 tokens (2 drafts + bonus).
    model, tok = smollm2
    ids = chat_ids(tok, [{"role": "user", "content": "Count from 1 to 40, separated by commas."}])
    out = mtprobe.generate(
        model, ids, mtprobe.ProbeConfig(block_complexity=60, num_masks=2), max_new_tokens=64
    )
    assert max(out.accept_lengths) == 3


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_complexity=5, num_masks=2), ValueError, "too small for 2 mask"),
        (dict(block_complexity=30, num_masks=5), ValueError, "between 1 and 4"),
        (
            dict(block_complexity=30, num_masks=2, tree="static", branches=(8, 2)),
            ValueError,
            "exceeds block_complexity",
        ),
        (
            dict(block_complexity=30, num_masks=2, tree="static", branches=(7,)),
            ValueError,
            "one count per mask",
        ),
        (
            dict(block_complexity=30, num_masks=2, tree="dynamic", branches=(7, 2)),
            ValueError,
            "tree='static'",
        ),
        (dict(block_complexity=30, tree="bushy"), ValueError, "tree='bushy'"),
        (dict(block_complexity=30, mask_init="zeros"), ValueError, "mask_init='zeros'"),
        (dict(block_complexity=30, mask_lambda=-0.1), ValueError, r"\[0, 1\]"),
        (dict(block_complexity=30, prune="yes"), TypeError, "prune must be a bool"),
        (
            dict(block_complexity=30, num_masks=2, tree="static", mask_value=0.3),
            ValueError,
            "plans the dynamic tree's masks; use tree='dynamic'",
        ),
        (dict(block_complexity=30, mask_value=-1), ValueError, "finite number >= 0"),
        (dict(block_complexity=30, mask_value=True), TypeError, "mask_value must be None or a number"),
    ],
)
def test_invalid_configurations_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        mtprobe.ProbeConfig(**kwargs)


@pytest.mark.parametrize("bc", [10, 30, 59, 60, 120])
def test_the_papers_settings_are_one_call_away(bc):
    # ProbeConfig.paper pins seed 001's settings, whatever ProbeConfig's own defaults become.
    cfg = mtprobe.ProbeConfig.paper(bc)
    k = 2 if bc >= 60 else 1
    assert (cfg.num_masks, cfg.tree, cfg.mask_init, cfg.mask_lambda, cfg.prune) == (
        k,
        "static" if k == 1 else "dynamic",
        "prompt_mean",
        0.1,
        True,
    )
    assert mtprobe.ProbeConfig.paper(bc, mask_lambda=0.5).mask_lambda == 0.5
    assert mtprobe.ProbeConfig.paper(bc, num_masks=1).tree == "static"
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        mtprobe.ProbeConfig.paper(bc, mask_lambda=2.0)


@pytest.mark.parametrize(
    "flag, value, match",
    [
        ("--only", "Table 9", r"--only: no table name starts with \['Table 9'\]"),
        ("--only", "Table 2: branches vs dynamic tree, BC 60;Nope", r"\['Nope'\]"),
        ("--labels", "m1 [14];lambda 9", r"--labels: no configuration is labelled \['lambda 9'\]"),
    ],
)
def test_the_ablation_script_names_a_selection_that_matches_nothing(flag, value, match):
    # Checked before the model loads; a table name holds commas, so selections split on semicolons.
    with pytest.raises(SystemExit, match=match):
        load_benchmark("ablations").main(["--question-file", "unused.jsonl", flag, value])
