"""The usage examples of README.md and docs/*.md run as written and do what they say."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

import mtprobe.models

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# README first: its first two python blocks are the quickstart's "Use" and "HF route" examples.
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path = README) -> list[str]:
    """The ```python blocks of one Markdown file, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def block_with(text: str) -> str:
    """The one python block of README.md and docs/*.md that contains ``text``."""
    found = [b for path in DOCS for b in python_blocks(path) if text in b]
    assert len(found) == 1, f"{len(found)} python blocks of README.md and docs/*.md contain {text!r}"
    return found[0]


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
    use, others = python_blocks()[0], block_with("outs = {name")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=1"), "README.md (Use)", "exec"), ns)
    exec(compile(others, "docs/methods.md (every configuration)", "exec"), ns)
    model, input_ids = ns["model"], ns["input_ids"]
    ref = model.generate(input_ids, do_sample=False, max_new_tokens=64)
    for name, out in ns["outs"].items():
        assert torch.equal(out.sequences, ref), name


def test_config_dict_and_statistics_examples():
    import mtprobe

    use, as_data, stats = (
        python_blocks()[0],
        block_with('{"method": "pld"'),
        block_with("out.drafted_per_depth"),
    )
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=8"), "README.md (Use)", "exec"), ns)
    exec(compile(as_data, "docs/usage.md (configurations as data)", "exec"), ns)
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    ref = model.generate(input_ids, do_sample=False, max_new_tokens=64)
    assert torch.equal(out.sequences, ref) and out.method == "pld"  # the dict ran prompt lookup
    assert mtprobe.config_from_dict(ns["cfg"].to_dict()) == ns["cfg"]
    exec(compile(stats, "docs/usage.md (statistics)", "exec"), ns)  # every attribute it names exists
    assert sum(out.acceptance_per_depth()) >= out.tau - 1 - 1e-9  # equal unless the last step was cut


def test_command_line_examples_parse():
    """Every `mtprobe ...` and `python -m mtprobe ...` command of the bash blocks of README.md and
    docs/*.md is a valid command: its program and flags exist, and for `generate` and `bench` its method
    is registered and its options build that method's configuration (nothing is run)."""
    import shlex

    from mtprobe import cli

    blocks = [
        b
        for path in DOCS
        for b in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)
    ]
    # One command per line once backslash continuations are joined; comments dropped.
    lines = [line.split("#")[0] for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    commands = [
        shlex.split(line)[3 if line.startswith("python") else 1 :]
        for line in lines
        if line.startswith(("mtprobe ", "python -m mtprobe "))
    ]
    programs = {argv[0] for argv in commands}
    assert {"generate", "bench", "calibrate", "heads", "topology"} <= programs, programs
    parser = cli._build_parser()
    for argv in commands:
        args = parser.parse_args(argv)
        if args.command in ("generate", "bench"):
            method, config = cli._method_and_config(args)
            assert method.name == args.method, argv
            assert isinstance(config, method.config_type), argv


def test_auto_config_example(tmp_path, monkeypatch):
    # The profile it measures goes to a fresh cache, not the user's; the converted model and the linear
    # routes measured for it are the user's, as in every other test (converting the model again from the
    # wheel took half the test's time, timing the routes again a quarter of the rest).
    for shared in ("models", "linear_routes"):
        (mtprobe.models.cache_root() / shared).mkdir(parents=True, exist_ok=True)
        (tmp_path / shared).symlink_to(mtprobe.models.cache_root() / shared, target_is_directory=True)
    monkeypatch.setenv("MTPROBE_CACHE", str(tmp_path))
    # A coarse grid: the full one is 273 timed forwards (about 47 s on one core), and what is checked here
    # (the example runs, decodes losslessly, caches the profile it measured) does not depend on its size.
    coarse = functools.partial(
        mtprobe.profile_forward, block_sizes=(1, 4, 16, 64), context_lengths=(64, 256), repeats=1, warmup=1
    )
    monkeypatch.setattr(mtprobe.drafters.auto, "profile_forward", coarse)
    use, auto = python_blocks()[0], block_with("cfg = mtprobe.AutoConfig()")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=4"), "README.md (Use)", "exec"), ns)
    exec(
        compile(
            auto.replace("max_new_tokens=128", "max_new_tokens=24"), "docs/methods.md (AutoConfig)", "exec"
        ),
        ns,
    )
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    assert torch.equal(out.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=24))
    assert len(out.choices) == out.steps and out.timings["schedule_s"] >= 0
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1


def test_entmtp_example():
    use, entmtp = python_blocks()[0], block_with("cfg = mtprobe.EntMTPConfig(")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=4"), "README.md (Use)", "exec"), ns)
    exec(
        compile(
            entmtp.replace("max_new_tokens=128", "max_new_tokens=32"), "docs/methods.md (EntMTP)", "exec"
        ),
        ns,
    )
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    assert torch.equal(out.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=32))
    assert len(out.choices) == out.steps
    bank = ns["cfg"].resolved_bank
    for name, t in out.choices:  # ("tree<i>", T) with T the tree's inputs, as the comment says
        assert name == "none" or t == bank.block_size(int(name.removeprefix("tree")))


def test_ngram_memory_example():
    use, memory = python_blocks()[0], block_with("memory_size=1 << 18")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=1"), "README.md (Use)", "exec"), ns)
    clear = "mtprobe.ngram_memory(model, cfg).clear()"
    assert clear in memory
    exec(compile(memory.replace(clear, ""), "docs/methods.md (n-gram memory)", "exec"), ns)
    model, input_ids, first, again = ns["model"], ns["input_ids"], ns["first"], ns["again"]
    assert torch.equal(first.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=64))
    assert torch.equal(again.sequences, first.sequences)
    assert again.forward_calls < first.forward_calls  # "True"
    exec(compile(clear, "docs/methods.md (n-gram memory)", "exec"), ns)
    assert len(ns["mtprobe"].ngram_memory(model, ns["cfg"])) == 0


def test_circuit_heads_example():
    # The head that ships for SmolLM2 drafts, and the text is greedy's.
    use, block = python_blocks()[0], block_with("mtprobe.heads.bundled_head")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=1"), "README.md (Use)", "exec"), ns)
    exec(compile(block, "docs/methods.md (circuit heads)", "exec"), ns)
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    assert torch.equal(out.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=32))
    assert out.forward_calls < 32 and out.method == "heads"
