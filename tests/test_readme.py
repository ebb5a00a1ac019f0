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


def block_with(text: str) -> str:
    """The one python block of the README that contains ``text``."""
    found = [b for b in python_blocks() if text in b]
    assert len(found) == 1, f"{len(found)} README python blocks contain {text!r}"
    return found[0]


def test_other_drafters_example():
    use, others = python_blocks()[0], block_with("outs = {name")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=1"), "README.md (Use)", "exec"), ns)
    exec(compile(others, "README.md (Other drafters)", "exec"), ns)
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
    exec(compile(as_data, "README.md (Configurations as data)", "exec"), ns)
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    ref = model.generate(input_ids, do_sample=False, max_new_tokens=64)
    assert torch.equal(out.sequences, ref) and out.method == "pld"  # the dict ran prompt lookup
    assert mtprobe.config_from_dict(ns["cfg"].to_dict()) == ns["cfg"]
    exec(compile(stats, "README.md (Statistics)", "exec"), ns)  # every attribute it names exists
    assert sum(out.acceptance_per_depth()) >= out.tau - 1 - 1e-9  # equal unless the last step was cut


def test_command_line_examples_parse():
    """Every `mtprobe ...` line of the README's bash blocks is a valid command: its flags exist, its
    method is registered and its options build that method's configuration (nothing is run)."""
    import shlex

    from mtprobe import cli

    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    commands = [line.split("#")[0] for b in blocks for line in b.splitlines() if line.startswith("mtprobe ")]
    assert len(commands) >= 4  # generate x3, bench
    parser = cli._build_parser()
    for line in commands:
        args = parser.parse_args(shlex.split(line)[1:])
        method, config = cli._method_and_config(args)
        assert method.name == args.method, line
        assert isinstance(config, method.config_type), line


def test_auto_config_example(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "MTPROBE_CACHE", str(tmp_path)
    )  # the profile it measures goes here, not to the user's cache
    use, auto = python_blocks()[0], block_with("cfg = mtprobe.AutoConfig()")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=4"), "README.md (Use)", "exec"), ns)
    exec(
        compile(auto.replace("max_new_tokens=128", "max_new_tokens=24"), "README.md (AutoConfig)", "exec"), ns
    )
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    assert torch.equal(out.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=24))
    assert len(out.choices) == out.steps and out.timings["schedule_s"] >= 0
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1


def test_entmtp_example():
    use, entmtp = python_blocks()[0], block_with("cfg = mtprobe.EntMTPConfig(")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=4"), "README.md (Use)", "exec"), ns)
    exec(compile(entmtp.replace("max_new_tokens=128", "max_new_tokens=32"), "README.md (EntMTP)", "exec"), ns)
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
    exec(compile(memory.replace(clear, ""), "README.md (n-gram memory)", "exec"), ns)
    model, input_ids, first, again = ns["model"], ns["input_ids"], ns["first"], ns["again"]
    assert torch.equal(first.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=64))
    assert torch.equal(again.sequences, first.sequences)
    assert again.forward_calls < first.forward_calls  # "True"
    exec(compile(clear, "README.md (n-gram memory)", "exec"), ns)
    assert len(ns["mtprobe"].ngram_memory(model, ns["cfg"])) == 0


def test_circuit_heads_example():
    # The head that ships for SmolLM2 drafts, and the text is greedy's.
    use, block = python_blocks()[0], block_with("mtprobe.heads.bundled_head")
    ns: dict = {}
    exec(compile(use.replace("max_new_tokens=128", "max_new_tokens=1"), "README.md (Use)", "exec"), ns)
    exec(compile(block, "README.md (circuit heads)", "exec"), ns)
    model, input_ids, out = ns["model"], ns["input_ids"], ns["out"]
    assert torch.equal(out.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=32))
    assert out.forward_calls < 32 and out.method == "heads"
