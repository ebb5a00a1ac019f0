"""The ``mtprobe`` command: ``generate`` streams the greedy text and prints its statistics, ``bench``
times a user's prompts against HF greedy and checks equality, and every bad input is one line on
stderr with exit status 2.

A tiny random Llama with a word-level chat tokenizer is saved to a temporary folder (seconds);
``models.load`` reads it like any local Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtprobe
from conftest import CHAT_VOCAB, save_word_llama
from mtprobe import models
from mtprobe.cli import EXIT_DIFFERS, EXIT_OK, EXIT_USAGE, main, read_prompts
from mtprobe.specbench import methods

STATS = re.compile(
    r"^mtprobe: (?P<method>\w+) \((?P<mode>[^)]*)\): (?P<new>\d+) new tokens, tau (?P<tau>[\d.]+)"
    r".*, (?P<tps>[\d.]+) tokens/s, (?P<secs>[\d.]+) s$",
    flags=re.M,
)


def _save_tiny(folder: Path, chat: bool = True) -> Path:
    return save_word_llama(folder, chat=chat, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama + chat tokenizer saved as a local HF folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def loaded(tiny: Path):
    return models.load(tiny)


def _greedy_new_ids(loaded, prompt: str, max_new_tokens: int, chat: bool = True) -> torch.Tensor:
    model, tok = loaded
    if chat:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    ref = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
    )
    return ref[0, ids.shape[1] :]


# --- generate ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method_args",
    [
        ["--method", "probe", "--block-complexity", "10"],
        ["--method", "pld"],
        ["--method", "hybrid"],
        ["--method", "sps", "--draft-layers", "1"],
        ["--method", "ar"],
        ["--method", "hybrid", "--plan"],
    ],
    ids=["probe", "pld", "hybrid", "sps", "ar", "hybrid-plan"],
)
def test_generate_streams_the_greedy_text(tiny: Path, loaded, capsys, method_args: list[str]) -> None:
    rc = main(["generate", "--model", str(tiny), *method_args, "--max-new-tokens", "20", "hello world"])
    captured = capsys.readouterr()
    assert rc == EXIT_OK, captured.err
    new_ids = _greedy_new_ids(loaded, "hello world", 20)
    expected = loaded[1].decode(new_ids, skip_special_tokens=True)
    assert expected.strip(), "the tiny model should say something for this test to mean anything"
    assert captured.out == expected + "\n"  # TextStreamer ends the stream with a newline
    stats = STATS.search(captured.err)
    assert stats is not None, captured.err
    assert stats["method"] == method_args[1]
    assert stats["mode"] == "greedy"
    assert int(stats["new"]) == new_ids.shape[0]
    assert float(stats["tps"]) > 0 and float(stats["secs"]) > 0
    if method_args[1] == "ar":
        assert stats["tau"] == "1.00"


def test_generate_tau_is_the_methods_tau(tiny: Path, loaded, capsys) -> None:
    rc = main(
        ["generate", "--model", str(tiny), "--method", "pld", "--max-new-tokens", "24", "hello hello world"]
    )
    assert rc == EXIT_OK
    model, tok = loaded
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello hello world"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    out = mtprobe.generate(model, ids, mtprobe.PromptLookupConfig(), max_new_tokens=24)
    stats = STATS.search(capsys.readouterr().err)
    assert stats is not None
    assert stats["tau"] == f"{out.tau:.2f}"
    assert f"({out.forward_calls} forwards)" in stats.group(0)


def test_generate_no_chat_encodes_plain_text(tiny: Path, loaded, capsys) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(tiny),
            "--method",
            "pld",
            "--no-chat",
            "--max-new-tokens",
            "12",
            "the world",
        ]
    )
    assert rc == EXIT_OK
    expected = loaded[1].decode(
        _greedy_new_ids(loaded, "the world", 12, chat=False), skip_special_tokens=True
    )
    assert capsys.readouterr().out == expected + "\n"


def test_generate_sampling_is_seeded(tiny: Path, capsys) -> None:
    argv = [
        "generate",
        "--model",
        str(tiny),
        "--method",
        "probe",
        "--temperature",
        "1.5",
        "--max-new-tokens",
        "16",
    ]
    outs = []
    for seed in ("3", "3", "4"):
        assert main([*argv, "--seed", seed, "hello world"]) == EXIT_OK
        captured = capsys.readouterr()
        stats = STATS.search(captured.err)
        assert stats is not None and stats["mode"] == "sampling at temperature 1.5"
        outs.append(captured.out)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]  # seed 4 samples another text (at temperature 1.5 over 30 words)


def test_generate_reads_the_prompt_from_stdin(tiny: Path, loaded, capsys, monkeypatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world"))
    assert (
        main(["generate", "--model", str(tiny), "--method", "pld", "--max-new-tokens", "8", "-"]) == EXIT_OK
    )
    expected = loaded[1].decode(_greedy_new_ids(loaded, "hello world", 8), skip_special_tokens=True)
    assert capsys.readouterr().out == expected + "\n"


def test_python_dash_m_mtprobe_end_to_end(tiny: Path, loaded) -> None:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "mtprobe", "generate", "--model", str(tiny), "--method", "pld",
         "--max-new-tokens", "10", "hello world"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    expected = loaded[1].decode(_greedy_new_ids(loaded, "hello world", 10), skip_special_tokens=True)
    assert proc.stdout == expected + "\n"
    assert STATS.search(proc.stderr) is not None, proc.stderr
    assert "Loading weights" not in proc.stderr  # no progress bar around the statistics line


# --- bench ---------------------------------------------------------------------------------------

ROW = re.compile(r"^\| (?P<i>\d+|overall) \|(?P<cells>.*)\|$", flags=re.M)


def _rows(report: str) -> dict[str, list[str]]:
    return {m["i"]: [c.strip() for c in m["cells"].split("|")] for m in ROW.finditer(report)}


def test_bench_txt_table_and_equality(tiny: Path, loaded, capsys, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\n  the world of a world  \nhello hello hello\n", encoding="utf-8")
    out_md = tmp_path / "report" / "bench.md"
    argv = [
        "bench",
        "--prompts",
        str(prompts),
        "--model",
        str(tiny),
        "--method",
        "pld",
        "--max-new-tokens",
        "16",
    ]
    rc = main([*argv, "--repeats", "2", "--warmup", "1", "--out", str(out_md)])
    captured = capsys.readouterr()
    assert rc == EXIT_OK, captured.err
    rows = _rows(captured.out)
    assert set(rows) == {"1", "2", "3", "overall"}  # the blank line is skipped
    model, tok = loaded
    pooled: list[int] = []
    for i, text in (("1", "hello world"), ("2", "the world of a world"), ("3", "hello hello hello")):
        cells = rows[i]
        assert cells[0] == text
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
        )["input_ids"]
        out = mtprobe.generate(model, ids, mtprobe.PromptLookupConfig(), max_new_tokens=16)
        pooled += out.accept_lengths
        assert cells[1] == str(ids.shape[1])
        assert cells[2] == str(out.sequences.shape[1] - ids.shape[1])
        assert cells[5] == f"{out.tau:.3f}"
        assert float(cells[3]) > 0 and float(cells[4]) > 0
        speedup = float(cells[4]) / float(cells[3])
        assert float(cells[6].rstrip("x")) == pytest.approx(speedup, abs=0.02)
        assert cells[7] == "yes"
    assert rows["overall"][0] == "3 prompts"
    assert rows["overall"][5] == f"{sum(pooled) / len(pooled):.3f}"
    assert rows["overall"][7] == "3/3"
    assert "method: pld: `PromptLookupConfig(" in captured.out
    assert "2 timed run(s) each (median)" in captured.out
    assert out_md.read_text(encoding="utf-8").endswith(captured.out)


def test_bench_jsonl_prompt_and_turns(tiny: Path, capsys, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello world"},
        {"question_id": 7, "category": "qa", "turns": ["the world", "and then ?"]},  # Spec-Bench's shape
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n", encoding="utf-8")
    assert read_prompts(prompts) == ["hello world", "the world"]
    rc = main(["bench", "--prompts", str(prompts), "--model", str(tiny), "--method", "probe",
               "--block-complexity", "10", "--max-new-tokens", "8", "--warmup", "0"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == EXIT_OK, captured.err
    rows = _rows(captured.out)
    assert rows["1"][0] == "hello world" and rows["2"][0] == "the world"
    assert rows["overall"][7] == "2/2"


def test_bench_reports_a_method_that_differs(tiny: Path, capsys, tmp_path: Path, request) -> None:
    # The check must be able to fail: a "method" that changes its last token is caught and named.
    from mtprobe import registry

    pld = methods.get_method("pld")

    def wrong(model, input_ids, config, max_new_tokens):
        out = methods.run_method(pld, model, input_ids, config, max_new_tokens)
        new_ids = out.new_ids.clone()
        new_ids[-1] = (new_ids[-1] + 1) % CHAT_VOCAB
        return methods.MethodOutput(new_ids, out.decoding_steps, out.accept_lengths)

    # pld's registration, run by `wrong` (in place: the listing keeps its order), restored afterwards
    registry.register(dataclasses.replace(pld, runner=wrong), replace=True)
    request.addfinalizer(lambda: registry.register(pld, replace=True))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n", encoding="utf-8")
    rc = main(["bench", "--prompts", str(prompts), "--model", str(tiny), "--method", "pld",
               "--max-new-tokens", "6", "--warmup", "0"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == EXIT_DIFFERS
    row = _rows(captured.out)["1"]
    n = int(row[2])
    assert row[7] == f"**no** (from new token {n - 1})"
    assert _rows(captured.out)["overall"][7] == "0/1"
    assert "1 of 1 prompts differ from HF greedy (the first: prompt 1" in captured.err


# --- bad input -----------------------------------------------------------------------------------


def _bad(tmp_path: Path, name: str, content: str | bytes | None) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: {generate,bench,models,calibrate,heads,topology,bytelm}"),
        (["generate", "--method", "nope", "hi"], "unknown method 'nope'; available methods: ar, probe, pld"),
        (
            ["generate", "--method", "pld", "--block-complexity", "10", "hi"],
            "--block-complexity does not apply",
        ),
        (["generate", "--method", "probe", "--block-complexity", "1", "hi"], "block_complexity"),
        (["generate", "--method", "pld"], "no prompt given"),
        (["generate", "--method", "pld", "   "], "the prompt is empty"),
        (["generate", "--max-new-tokens", "0", "hi"], "expected a positive integer, got 0"),
        (["generate", "--temperature", "-1", "hi"], "--temperature must be >= 0"),
        (["generate", "--top-k", "5", "hi"], "--top-k applies to sampling only"),
        (["generate", "--dtype", "int8", "hi"], "invalid choice: 'int8'"),
        (["bench", "--method", "pld"], "the following arguments are required: --prompts"),
        (["bench", "--prompts", "{tmp}/missing.txt"], "no such file"),
        (["bench", "--prompts", "{tmp}"], "expected a .txt file"),
        (["bench", "--prompts", "FILE:empty.txt:\n  \n"], "the file holds no prompts"),
        (["bench", "--prompts", "FILE:p.csv:a,b\n"], "got a file ending in '.csv'"),
        (
            ["bench", "--prompts", 'FILE:bad.jsonl:{"prompt": "a"}\n{"prompt": \n'],
            "bad.jsonl, line 2: invalid JSON",
        ),
        (
            ["bench", "--prompts", 'FILE:keys.jsonl:\n{"text": "a"}\n'],
            'line 2: expected an object with a "prompt"',
        ),
        (["bench", "--prompts", 'FILE:turns.jsonl:{"turns": []}\n'], '"turns" must be a non-empty list'),
        (["bench", "--prompts", 'FILE:num.jsonl:{"prompt": 3}\n'], '"prompt" must be a non-empty string'),
        (["bench", "--prompts", "FILE:list.jsonl:[1]\n"], "line 1: expected an object"),
        (
            ["bench", "--prompts", "FILE:a.txt:hi\n", "--repeats", "0"],
            "--repeats: expected a positive integer",
        ),
        (["bench", "--prompts", "FILE:a.txt:hi\n", "--method", "nope"], "unknown method 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    resolved = []
    for a in argv:
        if a.startswith("FILE:"):
            _, name, content = a.split(":", 2)
            a = _bad(tmp_path, name, content)
        resolved.append(a.replace("{tmp}", str(tmp_path)))
    # None of these needs the model: every check runs before it is loaded.
    assert main([*resolved, "--model", "/nonexistent"] if resolved else []) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("mtprobe: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_bad_input_needing_the_model(tiny: Path, tmp_path: Path, capsys) -> None:
    cases = [
        (["generate", "--model", str(tmp_path / "nowhere"), "hi"], "cannot load model"),
        (
            ["generate", "--model", str(tiny), "--method", "sps", "hi"],
            "num_layers=8 must be an int in [1, 2]",
        ),
        (["generate", "--model", str(tiny), "--max-new-tokens", "300", "hi"], "exceeds the model's context"),
    ]
    no_template = _save_tiny(tmp_path / "no-template", chat=False)
    capsys.readouterr()  # what saving the model printed
    cases.append(
        (["generate", "--model", str(no_template), "--chat", "hi"], "has no chat template; pass --no-chat")
    )
    for argv, message in cases:
        assert main(argv) == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert err.startswith("mtprobe: error: ") and err.count("\n") == 1, err
        assert message in err, err


def test_no_template_defaults_to_plain_text(tmp_path: Path, capsys) -> None:
    folder = _save_tiny(tmp_path / "plain", chat=False)
    assert (
        main(["generate", "--model", str(folder), "--method", "pld", "--max-new-tokens", "6", "hello"])
        == EXIT_OK
    )
    model, tok = models.load(folder)
    ids = tok("hello", return_tensors="pt")["input_ids"]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    assert capsys.readouterr().out == tok.decode(ref[0, ids.shape[1] :], skip_special_tokens=True) + "\n"


def test_help_exits_0(capsys) -> None:
    assert main(["--help"]) == EXIT_OK
    assert "{generate,bench,models,calibrate,heads,topology,bytelm}" in capsys.readouterr().out
    assert main(["bench", "--help"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "--prompts FILE" in out and "--block-complexity" in out
