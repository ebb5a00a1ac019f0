"""The README's usage examples run as written and do what they say."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_usage_and_hf_route_examples():
    use, hf_route = python_blocks()[:2]
    ns: dict = {}
    exec(compile(use, "README.md (Use)", "exec"), ns)
    exec(compile(hf_route, "README.md (HF route)", "exec"), ns)
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    ref = model.generate(input_ids, do_sample=False, max_new_tokens=128)
    assert torch.equal(out.sequences, ref)  # "token-identical to model.generate(...)"
    assert torch.equal(ns["seq"], ref)  # "The HF route gives the same tokens"
    assert sum(out.accept_lengths) + 1 == ref.shape[1] - input_ids.shape[1]


def test_other_drafters_example():
    use, _, others = python_blocks()[:3]
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=1"), "README.md (Use)", "exec"), ns)
    exec(compile(others, "README.md (Other drafters)", "exec"), ns)
    model, input_ids = ns["model"], ns["input_ids"]
    ref = model.generate(input_ids, do_sample=False, max_new_tokens=64)
    for name, out in ns["outs"].items():
        assert torch.equal(out.sequences, ref), name
