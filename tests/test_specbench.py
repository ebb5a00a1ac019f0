"""Spec-Bench harness: question files, method registry, answer generation, resume, scoring, CLI.

Generation tests use a tiny randomly initialised Llama saved with a word-level tokenizer in a
temporary folder (seconds); one end-to-end test runs the real SmolLM2 on the project's own mini
question file and checks that probe answers are identical to ar answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import save_word_llama, word_tokenizer
from mtprobe import ProbeConfig
from mtprobe.specbench import (
    MT_BENCH_CATEGORIES,
    TASKS,
    RunConfig,
    get_method,
    load_answers,
    load_questions,
    run,
    score,
    select_questions,
)
from mtprobe.specbench.__main__ import main
from mtprobe.specbench.answers import read_answer_file
from mtprobe.specbench.methods import GreedyConfig, run_method
from mtprobe.specbench.questions import task_of

MINI = Path(__file__).parent / "data" / "specbench_mini.jsonl"
CHOICE_KEYS = {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama + chat tokenizer saved as a local HF folder."""
    return save_word_llama(tmp_path_factory.mktemp("tiny-llama"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_cli(*args: str) -> int:
    return main(["run", "--question-file", str(MINI), "--no-progress", "--warmup", "0", *args])


# --- question files ------------------------------------------------------------------------------


def test_mini_file_covers_every_category() -> None:
    qs = load_questions(MINI)
    cats = {q.category for q in qs}
    assert set(MT_BENCH_CATEGORIES) <= cats
    assert {task_of(c) for c in cats} == set(TASKS)
    assert any(len(q.turns) == 2 and q.task == "mt_bench" for q in qs)
    assert len({q.question_id for q in qs}) == len(qs)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"question_id": 2, "category": "qa", "turns": ["x"]', "invalid JSON"),
        ('{"question_id": 2, "category": "qa"}', "missing 'turns'"),
        ('{"question_id": 2, "category": "qa", "turns": []}', "'turns' is empty"),
        ('{"question_id": 2, "category": "qa", "turns": "x"}', "'turns' must be a list"),
        ('{"question_id": 2, "category": "qa", "turns": ["x", 3]}', r"'turns'\[1\] must be a string"),
        ('{"question_id": "2", "category": "qa", "turns": ["x"]}', "'question_id' must be an int"),
        ('{"question_id": 2, "category": 5, "turns": ["x"]}', "'category' must be a non-empty string"),
        ('{"category": "qa", "turns": ["x"]}', "missing 'question_id'"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"question_id": 1, "category": "qa", "turns": ["x"]}', "repeats the one on line 1"),
    ],
)
def test_question_file_errors_name_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=message) as exc:
        load_questions(f)
    assert f"{f}, line 3:" in str(exc.value)


def test_empty_question_file(tmp_path: Path) -> None:
    f = tmp_path / "q.jsonl"
    f.write_text("\n")
    with pytest.raises(ValueError, match="no questions"):
        load_questions(f)


def test_select_questions() -> None:
    qs = load_questions(MINI)
    assert [q.category for q in select_questions(qs, categories=["qa", "rag"])] == ["qa", "rag"]
    assert {q.category for q in select_questions(qs, categories=["mt_bench"])} == set(MT_BENCH_CATEGORIES)
    assert len(select_questions(qs, limit=2)) == 2
    assert [q.question_id for q in load_questions(MINI, begin=1, end=3)] == [
        qs[1].question_id,
        qs[2].question_id,
    ]
    with pytest.raises(ValueError, match="unknown category 'poetry'"):
        select_questions(qs, categories=["poetry"])


# --- methods -------------------------------------------------------------------------------------


def test_method_registry() -> None:
    with pytest.raises(ValueError, match="unknown method 'nope'; available methods: ar, probe, pld"):
        get_method("nope")
    probe = get_method("probe")
    cfg = probe.make_config({"block_complexity": 10})
    assert cfg == ProbeConfig(block_complexity=10)
    assert probe.id_suffix(cfg) == "bc10"  # the headline option; the rest only when not the default
    assert probe.id_suffix(ProbeConfig(block_complexity=60, num_masks=2)) == "bc60-k2-tree-dynamic"
    assert probe.id_suffix(ProbeConfig(block_complexity=30, prune=False)) == "bc30-prune-off"
    assert get_method("ar").make_config() == GreedyConfig()
    for name in ("ar", "probe", "pld", "stand", "lookahead", "hybrid", "sps"):
        get_method(name).check_temperature(0.7)  # every method samples
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            probe.check_temperature(bad)


def test_cli_rejects_unknown_method_foreign_option_and_sampling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "a.jsonl")
    assert _run_cli("--method", "nope", "--answer-file", out) == 1
    assert "available methods: ar, probe, pld" in capsys.readouterr().err
    assert _run_cli("--method", "ar", "--block-complexity", "10", "--answer-file", out) == 1
    assert "--block-complexity does not apply to method 'ar'" in capsys.readouterr().err
    assert _run_cli("--method", "ar", "--temperature", "-0.5", "--answer-file", out) == 1
    assert "temperature must be a finite number >= 0 (0: greedy decoding, > 0: sampling), got -0.5" in (
        capsys.readouterr().err
    )
    assert _run_cli("--method", "ar", "--repeats", "0", "--answer-file", out) == 1
    assert "repeats must be an int >= 1" in capsys.readouterr().err
    assert _run_cli("--method", "probe", "--draft-model", "x", "--answer-file", out) == 1
    assert "draft_model='x' is for method 'sps'" in capsys.readouterr().err
    assert _run_cli("--method", "sps", "--draft-model", "x", "--draft-layers", "2", "--answer-file", out) == 1
    assert "--draft-layers sets the depth of the self-draft, which --draft-model replaces" in (
        capsys.readouterr().err
    )
    assert not Path(out).exists()


def test_unknown_model_raises(tmp_path: Path) -> None:
    cfg = RunConfig(question_file=MINI, model="no-such-model", answer_file=tmp_path / "a.jsonl", warmup=0)
    with pytest.raises(ValueError, match="unknown model|cannot load model") as exc:
        run(cfg)
    assert "smollm2-135m" in str(exc.value)


# --- answer generation ---------------------------------------------------------------------------


def _check_lines(lines: list[dict], questions: dict, model_id: str) -> None:
    for line in lines:
        # Spec-Bench's keys, plus the run's metadata
        assert set(line) == {
            "question_id",
            "category",
            "answer_id",
            "model_id",
            "choices",
            "tstamp",
            "mtprobe",
        }
        q = questions[line["question_id"]]
        assert line["category"] == q.category
        assert line["model_id"] == model_id
        assert isinstance(line["answer_id"], str) and len(line["answer_id"]) >= 16
        assert isinstance(line["tstamp"], float)
        (choice,) = line["choices"]
        assert set(choice) == CHOICE_KEYS | {"wall_times"} and choice["index"] == 0
        assert choice["wall_times"][0] == choice["wall_time"]
        n = len(q.turns)
        for key in ("turns", "decoding_steps", "new_tokens", "wall_time"):
            assert len(choice[key]) == n, key
        assert all(isinstance(t, str) and t == t.strip() for t in choice["turns"])
        assert all(1 <= k <= 8 for k in choice["new_tokens"])
        assert all(w > 0 for w in choice["wall_time"])


def test_run_ar_writes_specbench_lines(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "ar.jsonl"
    # writing, roleplay (two turns each) and reasoning (one turn)
    assert (
        _run_cli(
            "--model",
            str(tiny),
            "--method",
            "ar",
            "--max-new-tokens",
            "8",
            "--limit",
            "3",
            "--answer-file",
            str(out),
        )
        == 0
    )
    lines = _lines(out)
    questions = {q.question_id: q for q in load_questions(MINI)}
    model_id = f"{tiny.name}-ar"
    assert [line["question_id"] for line in lines] == [1, 2, 3]
    _check_lines(lines, questions, model_id)
    assert [len(line["choices"][0]["turns"]) for line in lines] == [2, 2, 1]
    for line in lines:
        c = line["choices"][0]
        assert c["decoding_steps"] == c["new_tokens"]
        assert c["accept_lengths"] == [1] * sum(c["new_tokens"])


def test_run_probe_writes_specbench_lines(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "probe.jsonl"
    args = ("--model", str(tiny), "--method", "probe", "--block-complexity", "10", "--max-new-tokens", "8")
    assert _run_cli(*args, "--categories", "writing,qa", "--answer-file", str(out)) == 0
    lines = _lines(out)
    questions = {q.question_id: q for q in load_questions(MINI)}
    _check_lines(
        lines,
        questions,
        f"{tiny.name}-probe-bc10",
    )
    assert [line["category"] for line in lines] == ["writing", "qa"]
    for line in lines:
        c = line["choices"][0]
        turns = len(c["turns"])
        # steps = forward calls with prefill; accept_lengths: one per decode forward, prefill excluded
        assert sum(c["decoding_steps"]) == len(c["accept_lengths"]) + turns
        assert sum(c["accept_lengths"]) == sum(c["new_tokens"]) - turns


def test_run_heads_with_a_floor_and_a_small_vocabulary_answers_as_ar_does(tiny: Path, tmp_path: Path) -> None:
    # --method heads with every option the harness exposes; greedy answers are ar's, word for word.
    from mtprobe import cli

    head = tmp_path / "head"
    train = [
        "heads",
        "train",
        "--model",
        str(tiny),
        "--out",
        str(head),
        "--num-prompts",
        "4",
        "--max-new-tokens",
        "16",
    ]
    assert cli.main([*train, "--steps", "10", "--circuit", "cp", "--rank", "2", "--window", "3"]) == 0
    common = ("--model", str(tiny), "--max-new-tokens", "8", "--categories", "writing,qa")
    ar, out = tmp_path / "ar.jsonl", tmp_path / "heads.jsonl"
    assert _run_cli(*common, "--method", "ar", "--answer-file", str(ar)) == 0
    method = (
        "--method",
        "heads",
        "--head-path",
        str(head),
        "--block-complexity",
        "6",
        "--min-path-prob",
        "0.05",
        "--vocab-top-k",
        "8",
        "--head-dtype",
        "bfloat16",
    )
    assert _run_cli(*common, *method, "--answer-file", str(out)) == 0
    lines = _lines(out)
    _check_lines(
        lines,
        {q.question_id: q for q in load_questions(MINI)},
        f"{tiny.name}-heads-head-head-bc6-floor0.05-vocab8-hd-bfloat16",
    )
    assert [x["choices"][0]["turns"] for x in lines] == [x["choices"][0]["turns"] for x in _lines(ar)]
    assert lines[0]["mtprobe"]["method_config"]["min_path_prob"] == 0.05
    assert lines[0]["mtprobe"]["method_config"]["vocab_top_k"] == 8
    assert lines[0]["mtprobe"]["method_config"]["head_dtype"] == "bfloat16"
    # EntMTP over the head: a bank of its trees and a policy.
    from mtprobe.topology import TopologyBank

    bank = TopologyBank(trees=((), ((0,),), ((0,), (1,), (0, 0))), drafter="heads", num_masks=0, window=3)
    bank_file = bank.save(tmp_path / "heads-bank.json")
    out = tmp_path / "heads-bank.jsonl"
    method = ("--method", "heads", "--head-path", str(head), "--bank", str(bank_file), "--policy", "static")
    assert _run_cli(*common, *method, "--feature", "top1", "--answer-file", str(out)) == 0
    lines = _lines(out)
    name = f"{tiny.name}-heads-head-head-bc30-bank-heads-bank-static-f-top1"
    _check_lines(lines, {q.question_id: q for q in load_questions(MINI)}, name)
    assert [x["choices"][0]["turns"] for x in lines] == [x["choices"][0]["turns"] for x in _lines(ar)]
    config = lines[0]["mtprobe"]["method_config"]
    assert config["bank"] == str(bank_file) and config["policy"] == "static" and config["trees"] == [2]
    assert (
        sum(sum(x["choices"][0]["accept_lengths"]) - len(x["choices"][0]["accept_lengths"]) for x in lines)
        > 0
    )


def test_second_turn_sees_first_answer(tiny: Path) -> None:
    from mtprobe import models
    from mtprobe.specbench.run import answer_question

    model, tok = models.load(tiny)
    seen: list[torch.Tensor] = []
    ar = get_method("ar")

    def spy_run(m, ids, c, n):
        seen.append(ids)
        return run_method(ar, m, ids, c, n)

    spy = dataclasses.replace(ar, runner=spy_run)
    q = load_questions(MINI)[0]
    with torch.inference_mode():
        choice = answer_question(model, tok, spy, GreedyConfig(), q, 8)
    first, second = seen
    convo = [
        {"role": "user", "content": q.turns[0]},
        {"role": "assistant", "content": choice["turns"][0]},
        {"role": "user", "content": q.turns[1]},
    ]
    expected = tok.apply_chat_template(convo, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    assert torch.equal(second, expected)
    assert second.shape[1] > first.shape[1]


def test_resume_skips_done_questions(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "ar.jsonl"
    args = (
        "--model",
        str(tiny),
        "--max-new-tokens",
        "8",
        "--answer-file",
        str(out),
        "--categories",
        "qa,rag,stem",
    )
    assert _run_cli(*args, "--limit", "2") == 0
    before = {line["question_id"]: line["answer_id"] for line in _lines(out)}
    assert len(before) == 2
    assert _run_cli(*args) == 0
    after = {line["question_id"]: line["answer_id"] for line in _lines(out)}
    assert len(after) == 3
    assert all(after[q] == a for q, a in before.items())  # the done ones were not regenerated
    cfg = RunConfig(
        question_file=MINI,
        model=str(tiny),
        max_new_tokens=8,
        answer_file=out,
        categories=("qa", "rag", "stem"),
    )
    summary = run(cfg)
    assert (summary.written, summary.skipped) == (0, 3)


def test_mismatched_model_id_is_refused(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a.jsonl"
    common = ("--model", str(tiny), "--max-new-tokens", "8", "--answer-file", str(out), "--limit", "1")
    assert _run_cli(*common, "--model-id", "first-id") == 0
    assert _run_cli(*common, "--model-id", "second-id") == 1
    err = capsys.readouterr().err
    assert "'first-id'" in err and "'second-id'" in err
    assert len(_lines(out)) == 1


def _resume_args(tiny: Path, out: Path) -> tuple[str, ...]:
    return (
        "--model",
        str(tiny),
        "--max-new-tokens",
        "8",
        "--answer-file",
        str(out),
        "--categories",
        "qa,rag,stem",
    )


def test_resume_after_truncated_last_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An interrupted run leaves its last line without the newline: the complete lines are kept, the
    # cut-off one is dropped from the file and its question answered again.
    out = tmp_path / "ar.jsonl"
    args = _resume_args(tiny, out)
    assert _run_cli(*args, "--limit", "2") == 0
    first, second = out.read_text().splitlines()
    out.write_text(first + "\n" + second[: len(second) // 2])
    kept = json.loads(first)
    assert read_answer_file(out) == {kept["question_id"]: kept}
    capsys.readouterr()
    assert _run_cli(*args) == 0
    assert "line 2" in capsys.readouterr().err
    text = out.read_text()
    assert text.endswith("\n") and second[: len(second) // 2] not in text
    lines = _lines(out)
    assert [line["question_id"] for line in lines] == sorted(line["question_id"] for line in lines)
    after = {line["question_id"]: line for line in lines}
    assert len(after) == 3
    assert after[kept["question_id"]] == kept  # the complete line, untouched
    redone = json.loads(second)["question_id"]
    assert after[redone]["answer_id"] != json.loads(second)["answer_id"]  # answered again
    assert after[redone]["choices"][0]["turns"] == json.loads(second)["choices"][0]["turns"]  # greedy


def test_resume_after_complete_last_line_without_newline(tiny: Path, tmp_path: Path) -> None:
    # A complete last line that lacks its newline (an edited file) is kept, and the next answer goes on
    # a line of its own instead of being glued to it.
    out = tmp_path / "ar.jsonl"
    args = _resume_args(tiny, out)
    assert _run_cli(*args, "--limit", "1") == 0
    (only,) = out.read_text().splitlines()
    out.write_text(only)
    assert _run_cli(*args, "--limit", "2") == 0
    lines = _lines(out)
    assert len(lines) == 2 and json.loads(only) in lines


@pytest.mark.parametrize("where", ["middle", "last_with_newline"])
def test_corrupt_answer_line_is_an_error(tiny: Path, tmp_path: Path, where: str) -> None:
    # Only an unfinished last line is a truncation; a damaged complete line is an error naming the
    # file and the line, and the file is left as it was.
    out = tmp_path / "ar.jsonl"
    args = _resume_args(tiny, out)
    assert _run_cli(*args, "--limit", "2") == 0
    first, second = out.read_text().splitlines()
    if where == "middle":
        text, lineno = first[: len(first) // 2] + "\n" + second + "\n", 1
    else:
        text, lineno = first + "\n" + second[: len(second) // 2] + "\n", 2
    out.write_text(text)
    cfg = RunConfig(
        question_file=MINI,
        model=str(tiny),
        max_new_tokens=8,
        answer_file=out,
        categories=("qa", "rag", "stem"),
        warmup=0,
        progress=False,
    )
    with pytest.raises(ValueError, match=f"line {lineno}: not a Spec-Bench answer line") as exc:
        run(cfg)
    assert str(out) in str(exc.value)
    assert out.read_text() == text


# --- scoring -------------------------------------------------------------------------------------


def _answer(qid: int, cat: str, model_id: str, turns, steps, new, wall, accept) -> dict:
    choice = {"index": 0, "turns": turns, "decoding_steps": steps, "new_tokens": new, "wall_time": wall}
    choice["accept_lengths"] = accept
    return {
        "question_id": qid,
        "category": cat,
        "answer_id": "x",
        "model_id": model_id,
        "choices": [choice],
        "tstamp": 0.0,
    }


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def hand_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    """ar and probe answer files with hand-picked numbers; texts use the tiny tokenizer's words."""
    tok_dir = tmp_path / "tok"
    word_tokenizer().save_pretrained(tok_dir)
    ar = _write(
        tmp_path / "ar.jsonl",
        [
            # text tokens 2 + 1 = 3 in 1.5 s -> 2.0 tok/s
            _answer(1, "writing", "m-ar", ["hello world", "hello"], [2, 1], [3, 2], [1.0, 0.5], [1] * 5),
            # 4 tokens in 1 s -> 4.0 tok/s
            _answer(2, "qa", "m-ar", ["hello world hello world"], [5], [5], [1.0], [1] * 5),
            # 1 token in 0.5 s -> 2.0 tok/s; not in the probe file
            _answer(3, "rag", "m-ar", ["world"], [2], [2], [0.5], [1] * 2),
        ],
    )
    probe = _write(
        tmp_path / "probe.jsonl",
        [
            # (3 + 2) new tokens in 1.0 s -> 5.0 tok/s, same texts
            _answer(1, "writing", "m-probe", ["hello world", "hello"], [1, 1], [3, 2], [0.5, 0.5], [3, 1]),
            # 5 in 0.5 s -> 10.0 tok/s; text differs from character 12 on
            _answer(2, "qa", "m-probe", ["hello world world world"], [2], [5], [0.5], [2, 2]),
            # 2 in 1.0 s -> 2.0 tok/s; not in the ar file
            _answer(4, "translation", "m-probe", ["hello"], [1], [2], [1.0], [1]),
        ],
    )
    return ar, probe, tok_dir


def test_score_hand_computed(hand_files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    ar, probe, tok_dir = hand_files
    report = score(ar, [probe], str(tok_dir), tmp_path / "out", plots=False)
    m = report.method("m-probe")
    overall = m.group("overall")
    # Spec-Bench: mean of per-question speeds (5 + 10 + 2) / 3 vs (2 + 4 + 2) / 3; tau pooled 9 / 5
    assert overall.questions == 3 and overall.baseline_questions == 3
    assert overall.tokens_per_second == pytest.approx(17 / 3)
    assert overall.baseline_tokens_per_second == pytest.approx(8 / 3)
    assert overall.speedup == pytest.approx(17 / 8)
    assert overall.tau == pytest.approx(1.8)
    # forward calls over the common questions 1 and 2: (2 + 1 + 5) / (1 + 1 + 2)
    assert overall.matched == 2
    assert overall.forward_reduction == pytest.approx(2.0)
    assert (overall.identical_turns, overall.compared_turns) == (2, 3)

    mt = m.group("mt_bench")
    assert (mt.tokens_per_second, mt.baseline_tokens_per_second) == (pytest.approx(5.0), pytest.approx(2.0))
    assert mt.speedup == pytest.approx(2.5) and mt.tau == pytest.approx(2.0)
    assert mt.forward_reduction == pytest.approx(1.5)
    assert m.group("writing") == dataclasses.replace(mt, group="writing")
    qa = m.group("qa")
    assert qa.speedup == pytest.approx(2.5) and qa.forward_reduction == pytest.approx(2.5)
    assert (qa.identical_turns, qa.compared_turns) == (0, 1)
    rag = m.group("rag")
    assert (
        rag.questions == 0
        and rag.speedup is None
        and rag.tau is None
        and rag.baseline_tokens_per_second == 2.0
    )
    tr = m.group("translation")
    assert tr.speedup is None and tr.baseline_questions == 0 and tr.tau == 1.0
    assert [g.group for g in m.groups] == ["mt_bench", "translation", "qa", "rag", "overall", "writing"]

    assert not m.lossless
    (mm,) = m.mismatches
    assert (mm.question_id, mm.category, mm.turn, mm.position) == (2, "qa", 1, 12)
    assert (m.only_in_baseline, m.only_in_method) == ((3,), (4,))

    md = (tmp_path / "out" / "report.md").read_text()
    assert "| m-probe | 3 | 1.800 | 5.67 | 2.67 | 2.125x | 2.000x | 2/3 |" in md
    assert "| ar (baseline) | 3 | 1.000 | 2.67 | 2.67 | 1.000x | 1.000x | — |" in md
    assert "| mt_bench | 1 | 2.000 | 5.00 | 2.00 | 2.500x | 1.500x | 2/2 |" in md
    assert "| rag | 0 | n/a | n/a | 2.00 | n/a | n/a | 0/0 |" in md
    assert "| writing | 1 | 2.000 | 5.00 | 2.00 | 2.500x | 1.500x | 2/2 |" in md
    assert "question 2 (qa), turn 1: first difference at character 12" in md
    assert "questions only in the baseline: 3; only in `m-probe`: 4" in md
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["methods"][0]["groups"]["overall"]["speedup"] == pytest.approx(17 / 8)
    assert results["methods"][0]["lossless"] is False

    # Spec-Bench's literal count (len(tokenizer(text).input_ids) - 1; this tokenizer adds no BOS):
    # baseline speeds (1 / 1.5, 3 / 1, 0 / 0.5) -> mean 11 / 9
    literal = (
        score(ar, [probe], tok_dir.as_posix(), literal_token_count=True).method("m-probe").group("overall")
    )
    assert literal.baseline_tokens_per_second == pytest.approx(11 / 9)
    assert literal.speedup == pytest.approx(51 / 11)


def test_score_lossless_and_plots(hand_files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ar, _, tok_dir = hand_files
    out = tmp_path / "out"
    assert (
        main(
            [
                "score",
                "--baseline",
                str(ar),
                "--answers",
                str(ar),
                "--model",
                str(tok_dir),
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    md = (out / "report.md").read_text()
    assert "`m-ar`: 4/4 turns identical over 3 common questions: lossless" in md
    assert "Every answer file holds the same question ids as the baseline." in md
    for name in ("tau_by_category.png", "speedup_by_category.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in md


def test_answer_file_with_idxs_for_decoding_steps(tmp_path: Path) -> None:
    # Spec-Bench's earlier inference scripts wrote the decoding steps as "idxs"; its speed.py never
    # reads them, so such files are scored too.
    row = _answer(1, "qa", "m", ["a b"], [3], [4], [1.0], [2, 1])
    row["choices"][0]["idxs"] = row["choices"][0].pop("decoding_steps")
    (a,) = load_answers(_write(tmp_path / "a.jsonl", [row])).values()
    assert a.decoding_steps == (3,) and a.new_tokens == (4,)
    row["choices"][0].pop("idxs")
    with pytest.raises(ValueError, match="needs a list 'decoding_steps'"):
        load_answers(_write(tmp_path / "b.jsonl", [row]))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r["choices"][0].__setitem__("wall_time", [1.0]), "has 1 entries for 2 turns"),
        (lambda r: r.pop("choices"), "missing 'choices'"),
        (lambda r: r["choices"][0].__setitem__("wall_time", [0.0, 0.0]), "sums to 0"),
    ],
)
def test_answer_file_errors_name_line(tmp_path: Path, mutate, message: str) -> None:
    good = _answer(1, "qa", "m", ["a"], [1], [1], [1.0], [1])
    bad = _answer(2, "writing", "m", ["a", "b"], [1, 1], [1, 1], [1.0, 1.0], [1, 1])
    mutate(bad)
    f = _write(tmp_path / "a.jsonl", [good, bad])
    with pytest.raises(ValueError, match=message) as exc:
        load_answers(f)
    assert f"{f}, line 2:" in str(exc.value)


# --- sampling, draft model, ids, metadata, repeats, compare, help ----------------------------------


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer random Llama with the tiny model's tokenizer: a draft model for ``sps``."""
    folder = tmp_path_factory.mktemp("tiny-draft")
    return save_word_llama(
        folder,
        seed=1,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_default_model_ids_are_short() -> None:
    from mtprobe import DraftModelConfig, HybridConfig, PromptLookupConfig
    from mtprobe.specbench.metadata import default_model_id

    probe, ar = get_method("probe"), get_method("ar")
    assert (
        default_model_id("smollm2-135m", probe, ProbeConfig(block_complexity=30)) == "smollm2-135m-probe-bc30"
    )
    assert default_model_id("smollm2-135m", ar, GreedyConfig(), temperature=1.0) == "smollm2-135m-ar-t1"
    assert default_model_id("smollm2-135m", ar, GreedyConfig(), dtype="bfloat16") == "smollm2-135m-ar-bf16"
    assert default_model_id("m", get_method("pld"), PromptLookupConfig()) == "m-pld"
    assert default_model_id("m", get_method("pld"), PromptLookupConfig(num_tokens=4)) == "m-pld-n4"
    assert default_model_id("m", get_method("hybrid"), HybridConfig(block_complexity=60)) == "m-hybrid-bc60"
    sps = get_method("sps")
    assert default_model_id("m", sps, DraftModelConfig()) == "m-sps-n5"
    assert (
        default_model_id("m", sps, DraftModelConfig(), draft_model="/x/tiny-draft")
        == "m-sps-n5-draft-tiny-draft"
    )
    # max_new_tokens lives in the metadata, not in the id
    assert default_model_id("m", ar, GreedyConfig(), max_new_tokens=8) == "m-ar"


def test_help_texts_match_the_configurations() -> None:
    from mtprobe.specbench.methods import METHODS, _id_value, option_help

    # every option's help carries its own method's text and that method's default
    for method in METHODS.values():
        for option in method.options:
            text = option_help(option.flag)
            assert option.help in text, (method.name, option.flag)
            f = next(f for f in dataclasses.fields(method.config_type) if f.name == option.field)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if default is not None:
                assert f"default {_id_value(default).lower()}" in text or default is True or default is False
    # the two that were wrong: a shared flag describes each method separately, with its own default
    num_tokens = option_help("--num-tokens")
    assert "pld: chain depth" in num_tokens and "default 10" in num_tokens
    assert "sps: K, tokens the draft model drafts per step" in num_tokens and "default 5" in num_tokens
    num_masks = option_help("--num-masks")
    assert "probe: k, chained mask tokens per tree node, 1 to 4; default 1" in num_masks
    assert "hybrid: k, mask tokens per tree node (the probing half); default 1" in num_masks
    help_text = " ".join(subprocess_help("run").split())
    assert "T > 0: every method samples with do_sample=True" in help_text
    assert "only 0 (greedy) is implemented" not in help_text


def subprocess_help(command: str) -> str:
    import argparse
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main([command, "--help"])
    assert isinstance(buf.getvalue(), str) and argparse
    return buf.getvalue()


def test_sampling_run_and_score(tiny: Path, tmp_path: Path) -> None:
    common = (
        "--model",
        str(tiny),
        "--max-new-tokens",
        "8",
        "--categories",
        "writing,qa",
        "--temperature",
        "1",
    )
    assert _run_cli(*common, "--method", "ar", "--answer-file", str(tmp_path / "ar.jsonl")) == 0
    assert (
        _run_cli(
            *common,
            "--method",
            "probe",
            "--block-complexity",
            "10",
            "--answer-file",
            str(tmp_path / "p.jsonl"),
        )
        == 0
    )
    lines = _lines(tmp_path / "p.jsonl")
    assert {line["model_id"] for line in lines} == {f"{tiny.name}-probe-bc10-t1"}
    assert all(line["mtprobe"]["temperature"] == 1.0 and line["mtprobe"]["do_sample"] for line in lines)
    # same seed, same samples: a re-run into another file repeats the texts
    assert (
        _run_cli(
            *common,
            "--method",
            "probe",
            "--block-complexity",
            "10",
            "--answer-file",
            str(tmp_path / "p2.jsonl"),
        )
        == 0
    )
    assert [line["choices"][0]["turns"] for line in _lines(tmp_path / "p2.jsonl")] == [
        line["choices"][0]["turns"] for line in lines
    ]
    report = score(tmp_path / "ar.jsonl", [tmp_path / "p.jsonl"], str(tiny), tmp_path / "out", plots=False)
    m = report.methods[0]
    assert m.sampled and m.temperature == 1.0 and m.lossless is None and m.mismatches == ()
    overall = m.group("overall")
    assert overall.compared_turns == 0 and overall.tau >= 1.0 and overall.speedup > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert (
        "sampled at temperature 1: the texts are samples, so equality with the baseline is not checked" in md
    )
    assert "tests/test_sampling.py" in md
    assert "not compared (sampled)" in md
    assert json.loads((tmp_path / "out" / "results.json").read_text())["methods"][0]["lossless"] is None


def test_sps_with_a_draft_model(tiny: Path, tiny_draft: Path, tmp_path: Path) -> None:
    common = ("--model", str(tiny), "--max-new-tokens", "8", "--categories", "writing,qa")
    assert _run_cli(*common, "--method", "ar", "--answer-file", str(tmp_path / "ar.jsonl")) == 0
    out = tmp_path / "sps.jsonl"
    assert (
        _run_cli(
            *common,
            "--method",
            "sps",
            "--num-tokens",
            "3",
            "--draft-model",
            str(tiny_draft),
            "--answer-file",
            str(out),
        )
        == 0
    )
    lines = _lines(out)
    assert {line["model_id"] for line in lines} == {f"{tiny.name}-sps-n3-draft-{tiny_draft.name}"}
    meta = lines[0]["mtprobe"]
    assert meta["draft_model"] == str(tiny_draft) and meta["method_config"]["draft_model"] == str(tiny_draft)
    assert meta["method_config"]["num_tokens"] == 3
    # greedy speculative decoding with another draft model is still the target's greedy output
    report = score(tmp_path / "ar.jsonl", [out], str(tiny), plots=False)
    assert report.methods[0].lossless is True
    # without --draft-model: the layer-truncated self-draft, as before
    self_out = tmp_path / "self.jsonl"
    assert _run_cli(*common, "--method", "sps", "--draft-layers", "1", "--answer-file", str(self_out)) == 0
    self_line = _lines(self_out)[0]
    assert self_line["model_id"] == f"{tiny.name}-sps-n5-l1"
    assert self_line["mtprobe"]["draft_model"] is None
    assert self_line["mtprobe"]["method_config"]["num_draft_layers"] == 1


def test_metadata_round_trip_and_resume_check(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import mtprobe
    from mtprobe.specbench.metadata import config_dict

    out = tmp_path / "probe.jsonl"
    args = ("--model", str(tiny), "--method", "probe", "--block-complexity", "10", "--answer-file", str(out))
    assert _run_cli(*args, "--max-new-tokens", "8", "--limit", "1", "--threads", "1") == 0
    (line,) = _lines(out)
    meta = line["mtprobe"]
    assert meta["method"] == "probe" and meta["method_config"] == config_dict(
        ProbeConfig(block_complexity=10)
    )
    assert meta["method_config"]["branches"] == [4]  # B = 10 // 2 nodes: 4 drafts
    assert (meta["max_new_tokens"], meta["temperature"], meta["dtype"], meta["device"]) == (
        8,
        0.0,
        "float32",
        "cpu",
    )
    assert meta["threads"] == 1 and meta["repeats"] == 1 and meta["model_path"] == str(tiny)
    assert (
        meta["versions"]["mtprobe"] == mtprobe.__version__ and meta["versions"]["torch"] == torch.__version__
    )
    assert meta["machine"]["cpu_count"] == os.cpu_count()
    (answer,) = load_answers(out).values()
    assert answer.meta == meta and answer.temperature == 0.0
    # the id is the same at another max_new_tokens, but the metadata tells the runs apart
    capsys.readouterr()
    assert _run_cli(*args, "--max-new-tokens", "4") == 1
    err = capsys.readouterr().err
    assert "answers of another configuration (max_new_tokens: file 8, this run 4)" in err
    assert len(_lines(out)) == 1
    # the same answers timed with other threads or repeats would mix two setups' timings in one file
    for extra, detail in (
        (("--threads", "2"), "threads: file 1, this run 2"),
        (("--threads", "1", "--repeats", "2"), "repeats: file 1, this run 2"),
    ):
        assert _run_cli(*args, "--max-new-tokens", "8", "--limit", "2", *extra) == 1
        assert f"answers timed on another setup ({detail})" in capsys.readouterr().err
    assert len(_lines(out)) == 1
    # a selection of no questions is an error, not an empty run
    assert _run_cli(*args, "--max-new-tokens", "8", "--categories", ",") == 1
    assert "no questions selected" in capsys.readouterr().err
    # an old line without metadata is still read and scored
    old = {k: v for k, v in line.items() if k != "mtprobe"}
    old["choices"] = [{k: v for k, v in line["choices"][0].items() if k != "wall_times"}]
    _write(tmp_path / "old.jsonl", [old])
    (a,) = load_answers(tmp_path / "old.jsonl").values()
    assert a.meta is None and a.runs == (tuple(old["choices"][0]["wall_time"]),)


def test_repeats_keep_every_wall_time(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "ar.jsonl"
    assert (
        _run_cli(
            "--model",
            str(tiny),
            "--max-new-tokens",
            "8",
            "--limit",
            "2",
            "--repeats",
            "3",
            "--answer-file",
            str(out),
        )
        == 0
    )
    for line in _lines(out):
        c = line["choices"][0]
        assert len(c["wall_times"]) == 3 and c["wall_times"][0] == c["wall_time"]
        assert all(len(w) == len(c["turns"]) and all(t > 0 for t in w) for w in c["wall_times"])
        assert line["mtprobe"]["repeats"] == 3
    overall = score(out, [out], str(tiny), plots=False).methods[0].group("overall")
    assert overall.repeats == 3 and overall.tokens_per_second_std is not None
    assert overall.tokens_per_second_min <= overall.tokens_per_second <= overall.tokens_per_second_max


def test_score_spread_hand_computed(tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    word_tokenizer().save_pretrained(tok_dir)
    base = _answer(1, "qa", "m-ar", ["hello world hello world"], [4], [4], [2.0], [1] * 4)
    base["choices"][0]["wall_times"] = [[2.0], [1.0]]  # 4 text tokens: 2 and 4 tokens/s
    mine = _answer(1, "qa", "m-probe", ["hello world hello world"], [2], [4], [1.0], [2, 1])
    mine["choices"][0]["wall_times"] = [[1.0], [2.0]]  # 4 and 2 tokens/s
    ar, probe = _write(tmp_path / "ar.jsonl", [base]), _write(tmp_path / "p.jsonl", [mine])
    report = score(ar, [probe], str(tok_dir), tmp_path / "out", plots=False)
    g = report.methods[0].group("overall")
    assert g.repeats == 2
    assert g.tokens_per_second == pytest.approx(3.0) and g.tokens_per_second_std == pytest.approx(2**0.5)
    assert (g.tokens_per_second_min, g.tokens_per_second_max) == (2.0, 4.0)
    # speedup 3 / 3; spread over the four pairings 4/2, 4/4, 2/2, 2/4
    assert g.speedup == pytest.approx(1.0)
    assert g.speedup_std == pytest.approx((1.1875 / 3) ** 0.5)
    assert (g.speedup_min, g.speedup_max) == (0.5, 2.0)
    assert report.baseline_groups[-1].tokens_per_second_std == pytest.approx(2**0.5)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| m-probe | 1 | 1.500 | 3.00 ± 1.41 | 3.00 | 1.000x ± 0.629 | 2.000x | 1/1 |" in md
    assert "Timed runs per question: 2." in md


def test_greedy_repeat_must_reproduce_the_tokens(
    tiny: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from mtprobe import registry
    from mtprobe.specbench.methods import MethodOutput
    from mtprobe.specbench.run import RepeatMismatchError

    ar = get_method("ar")
    calls = {"n": 0}

    def flaky(model, ids, config, n, **kw):
        # a broken method: its second call answers with other tokens
        calls["n"] += 1
        out = run_method(ar, model, ids, config, n, **kw)
        if calls["n"] == 2:
            return MethodOutput(torch.flip(out.new_ids, [0]) + 1, out.decoding_steps, out.accept_lengths)
        return out

    @dataclasses.dataclass(frozen=True)
    class FlakyConfig:
        """Nothing to configure."""

    registry.register(dataclasses.replace(ar, name="flaky", config_type=FlakyConfig, runner=flaky))
    request.addfinalizer(lambda: registry.unregister("flaky"))
    out = tmp_path / "flaky.jsonl"
    cfg = RunConfig(
        question_file=MINI,
        model=str(tiny),
        method="flaky",
        max_new_tokens=8,
        categories=("qa",),
        answer_file=out,
        repeats=2,
        warmup=0,
        progress=False,
    )
    with pytest.raises(
        RepeatMismatchError,
        match=r"question \d+ \(qa\): timed run 2 of 2 produced other tokens than the first run in turn 1",
    ) as exc:
        run(cfg)
    assert "under greedy decoding: the method is not deterministic" in str(exc.value)
    assert not out.exists() or not _lines(out)  # nothing written for that question
    calls["n"] = 10  # behaves from now on: the same run succeeds
    assert run(cfg).written == 1


def _meta(method: str, temperature: float = 0.0, repeats: int = 1) -> dict:
    return {
        "method": method,
        "model": "tiny",
        "dtype": "float32",
        "device": "cpu",
        "threads": 2,
        "temperature": temperature,
        "max_new_tokens": 8,
        "repeats": repeats,
    }


def _compare_folder(folder: Path) -> Path:
    folder.mkdir()
    rows = {
        # model_id, wall time of each of 2 runs, accept_lengths (4 new tokens: prefill's + their sum)
        "ar": ("tiny-ar", [2.0, 1.0], [1, 1, 1]),
        "probe-bc10": ("tiny-probe-bc10", [1.0, 0.5], [2, 1]),
        "pld": ("tiny-pld", [1.5, 1.0], [1, 1, 1]),
    }
    for name, (model_id, walls, accept) in rows.items():
        lines = []
        for qid, cat, text in (
            (1, "writing", "hello world hello world"),
            (2, "qa", "hello world hello world"),
        ):
            a = _answer(qid, cat, model_id, [text], [len(accept) + 1], [4], [walls[0]], accept)
            if name == "ar":  # Spec-Bench's ar: one step and one accepted token per new token
                a["choices"][0]["accept_lengths"], a["choices"][0]["decoding_steps"] = [1] * 4, [4]
            a["choices"][0]["wall_times"] = [[w] for w in walls]
            a["mtprobe"] = _meta(name.split("-")[0], repeats=2)
            lines.append(a)
        _write(folder / f"{name}.jsonl", lines)
    return folder


def test_compare_folder_table_and_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from mtprobe.specbench.compare import compare

    tok_dir = tmp_path / "tok"
    word_tokenizer().save_pretrained(tok_dir)
    folder = _compare_folder(tmp_path / "answers")
    out = tmp_path / "cmp"
    assert main(["compare", str(folder), "--tokenizer", str(tok_dir), "--out-dir", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "(compare.png)" in md
    assert md.startswith("# Spec-Bench comparison (answers)\n\ntiny, float32, cpu, 2 questions")
    # short names; the baseline found by its metadata; per task and overall with the spread of the 2 runs
    assert "| ar | `ar.jsonl` | 0 | — | 2 |" in md
    assert "| probe-bc10 | `probe-bc10.jsonl` | 0 | `ar.jsonl` | 2 |" in md
    # probe: 4 tokens in 1.0 and 0.5 s -> 4 and 8 tokens/s; ar: 2 and 4
    # speedup 6 / 3, spread over the pairings 4/2, 4/4, 8/2, 8/4; forward calls 4 -> 3 per question
    assert "| **overall** | probe-bc10 | 2 | 1.500 | 2.000x ± 1.258 | 6.00 ± 2.83 | 1.333x | 2/2 |" in md
    assert "| qa | pld | 1 | 1.000 | 1.111x ± 0.569 | 3.33 ± 0.94 | 1.000x | 1/1 |" in md
    assert "| writing | ar | 1 | 1.000 | 1.000x | 3.00 ± 1.41 | 1.000x | baseline |" in md
    c = compare(folder, str(tok_dir))
    assert [r.name for r in c.rows] == ["ar", "pld", "probe-bc10"]
    assert c.order == ("mt_bench", "qa", "overall", "writing")  # tasks, overall, MT-bench sub-categories
    data = json.loads((out / "compare.json").read_text())
    assert data["rows"][2]["groups"]["overall"]["speedup"] == pytest.approx(2.0)


def test_score_and_compare_name_a_setup_that_differs(tmp_path: Path) -> None:
    from mtprobe.specbench.compare import compare, render_compare_markdown
    from mtprobe.specbench.report import render_markdown
    from mtprobe.specbench.score import score

    tok_dir = tmp_path / "tok"
    word_tokenizer().save_pretrained(tok_dir)
    folder = _compare_folder(tmp_path / "answers")
    same = render_compare_markdown(compare(folder, str(tok_dir)))
    assert "another setup" not in same
    pld = folder / "pld.jsonl"
    rows = _lines(pld)
    for row in rows:
        row["mtprobe"].update(dtype="bfloat16", device="cuda:0", threads=16)
    _write(pld, rows)
    note = "(dtype: baseline 'float32', method 'bfloat16'; device: baseline 'cpu', method 'cuda'; threads: baseline 2, method 16)"
    md = render_compare_markdown(compare(folder, str(tok_dir)))
    assert f"- `pld` ran on another setup than its baseline {note}" in md
    assert "`probe-bc10` ran on another setup" not in md
    report = render_markdown(score(folder / "ar.jsonl", [pld], str(tok_dir)))
    assert f"- `tiny-pld` ran on another setup than the baseline {note}" in report


def test_compare_pairs_sampled_runs_with_sampled_ar(tmp_path: Path) -> None:
    from mtprobe.specbench.compare import compare

    tok_dir = tmp_path / "tok"
    word_tokenizer().save_pretrained(tok_dir)
    folder = _compare_folder(tmp_path / "answers")
    hot = _answer(1, "qa", "tiny-probe-bc10-t1", ["hello"], [1], [2], [1.0], [1])
    hot["mtprobe"] = _meta("probe", temperature=1.0)
    _write(folder / "probe-t1.jsonl", [hot])
    with pytest.raises(ValueError, match="no ar answer file at temperature 1 to compare probe-t1.jsonl with"):
        compare(folder, str(tok_dir))
    hot_ar = _answer(1, "qa", "tiny-ar-t1", ["hello world"], [2], [2], [2.0], [1, 1])
    hot_ar["mtprobe"] = _meta("ar", temperature=1.0)
    _write(folder / "ar-t1.jsonl", [hot_ar])
    c = compare(folder, str(tok_dir))
    # answered 1 question where the others answered 2: its name and the title say so
    row = next(r for r in c.rows if r.name == "probe-bc10-t1 (1 q)")
    assert "2 questions at most" in c.title
    assert row.baseline.name == "ar-t1.jsonl" and row.lossless is None and row.temperature == 1.0
    assert row.group("overall").speedup == pytest.approx(2.0)  # 2 tok/s vs 1 tok/s


def test_compare_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mtprobe.specbench.compare import compare

    tok_dir = tmp_path / "tok"
    word_tokenizer().save_pretrained(tok_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(empty), "--tokenizer", str(tok_dir), "--out-dir", str(tmp_path / "o")]) == 1
    assert "holds no answer files (*.jsonl)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not a folder"):
        compare(tmp_path / "missing", str(tok_dir))
    folder = _compare_folder(tmp_path / "answers")
    with pytest.raises(ValueError, match="baseline 'nope.jsonl' is neither a file nor a file of"):
        compare(folder, str(tok_dir), baseline="nope.jsonl")
    (folder / "ar.jsonl").rename(folder / "ar.jsonl.bak")
    with pytest.raises(ValueError, match="no ar answer file at temperature 0"):
        compare(folder, str(tok_dir))
    c = compare(folder, str(tok_dir), baseline=folder / "pld.jsonl")  # any file may be named the baseline
    assert c.rows[0].name == "pld" and c.rows[0].is_baseline
    two = _answer(1, "qa", "tiny-ar-2", ["hello"], [1], [1], [1.0], [1])
    two["mtprobe"] = _meta("ar")
    _write(folder / "ar2.jsonl", [two])
    _write(folder / "ar3.jsonl", [two])
    with pytest.raises(ValueError, match="several ar answer files at temperature 0 .*pass --baseline FILE"):
        compare(folder, str(tok_dir))


# --- end to end on the real model ----------------------------------------------------------------


def test_smollm2_probe_is_lossless_on_mini_file(smollm2, tmp_path: Path) -> None:
    model, tok = smollm2
    common = dict(question_file=MINI, model="smollm2-135m", max_new_tokens=12, warmup=0, progress=False)
    ar = run(RunConfig(**common, method="ar", answer_file=tmp_path / "ar.jsonl"), model=model, tokenizer=tok)
    cfg = ProbeConfig(block_complexity=30)
    probe = run(
        RunConfig(**common, method="probe", method_config=cfg, answer_file=tmp_path / "probe.jsonl"),
        model=model,
        tokenizer=tok,
    )
    n = len(load_questions(MINI))
    assert ar.written == probe.written == n
    assert probe.model_id == "smollm2-135m-probe-bc30"
    report = score(ar.answer_file, [probe.answer_file], tok, tmp_path / "out", plots=False)
    m = report.methods[0]
    overall = m.group("overall")
    assert m.mismatches == (), m.mismatches
    assert overall.matched == n and overall.identical_turns == overall.compared_turns == 16
    assert overall.tau >= 1.0
    assert overall.forward_reduction >= 1.0


def test_module_entry_point() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "mtprobe.specbench", "score", "--help"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--baseline" in proc.stdout and "--literal-token-count" in proc.stdout


def test_hf_prompt_lookup_counts_its_steps_like_mtprobe_prompt_lookup() -> None:
    """hf-pld (transformers' own prompt lookup, a peer baseline) reports the steps mtprobe's
    prompt lookup takes: the same rule drafts the same chains, so the accept lengths agree."""
    import mtprobe
    from conftest import tiny_llama

    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17]])
    method = get_method("hf-pld")
    out = run_method(method, model, ids, method.make_config({"num_tokens": 4}), 24)
    ref = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(out.new_ids, ref[0, ids.shape[1] :])
    ours = mtprobe.generate(
        model, ids, mtprobe.PromptLookupConfig(num_tokens=4), max_new_tokens=24, pad_token_id=0
    )
    assert out.accept_lengths == ours.accept_lengths and out.decoding_steps == ours.forward_calls
    with pytest.raises(NotImplementedError, match="sampling is not implemented for method 'hf-pld'"):
        method.check_temperature(1.0)


def test_auto_method_runs_in_the_harness(tmp_path: Path) -> None:
    import mtprobe
    from conftest import tiny_llama
    from mtprobe.target_model.profile import ForwardProfile, ProfileKey

    model = tiny_llama()
    path = ForwardProfile(ProfileKey.of(model), (1, 64), (0,), ((1.0, 1.0),)).save(tmp_path / "p.json")
    method = get_method("auto")
    cfg = method.make_config({"profile": str(path)})
    assert isinstance(cfg, mtprobe.AutoConfig) and method.id_suffix(cfg).startswith("p")
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33, 2]])
    out = run_method(method, model, ids, cfg, 12)
    ref = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(out.new_ids, ref[0, ids.shape[1] :])
    # --drafters: the drafters to choose among, as JSON or a .json file; the id names their methods.
    from mtprobe.drafters.auto import drafter_configs as _drafter_configs

    listed = '[{"method": "stand", "block_complexity": 6}, {"method": "pld", "num_tokens": 3}]'
    (tmp_path / "d.json").write_text(listed)
    for given in (listed, str(tmp_path / "d.json")):
        drafters = _drafter_configs(given)
        assert drafters == (mtprobe.StandConfig(block_complexity=6), mtprobe.PromptLookupConfig(num_tokens=3))
    cfg = method.make_config({"profile": str(path), "drafters": drafters})
    assert method.id_suffix(cfg) == "stand+pld-pp"
    assert torch.equal(run_method(method, model, ids, cfg, 12).new_ids, ref[0, ids.shape[1] :])
    for bad, match in [
        ("[]", "non-empty JSON list"),
        ("stand", "takes a JSON list of drafter configurations"),
        (str(tmp_path / "none.json"), "No such file"),
        ('[{"method": "nope"}]', "--drafters: .*'nope'"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            _drafter_configs(bad)


def test_hybrid_grow_probed_flag(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grown.jsonl"
    args = ("--model", str(tiny), "--max-new-tokens", "8", "--method", "hybrid", "--limit", "1")
    assert _run_cli(*args, "--grow-probed", "true", "--answer-file", str(out)) == 0
    line = _lines(out)[0]
    assert line["mtprobe"]["method_config"]["grow_probed"] is True
    assert line["model_id"].endswith("-hybrid-bc30-grow-on")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _run_cli(*args, "--grow-probed", "maybe", "--answer-file", str(tmp_path / "x.jsonl"))
    assert "argument --grow-probed: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_shared_ngram_memory_across_questions(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mtprobe import StandConfig, models, ngram_memory

    def cli(out: Path, *args: str) -> int:
        return _run_cli("--model", str(tiny), "--max-new-tokens", "12", "--answer-file", str(out), *args)

    # the flag alone: the default size; the id and the metadata say the memory was on
    out = tmp_path / "stand.jsonl"
    assert cli(out, "--method", "stand", "--shared-ngram-memory", "--limit", "2") == 0
    for line in _lines(out):
        assert line["model_id"].endswith("-stand-bc30-mem262144")
        assert line["mtprobe"]["method_config"]["memory_size"] == 262144
    out = tmp_path / "hybrid.jsonl"
    assert cli(out, "--method", "hybrid", "--shared-ngram-memory", "64", "--limit", "1") == 0
    assert _lines(out)[0]["mtprobe"]["method_config"]["memory_size"] == 64
    assert "-hybrid-bc30-mem64" in _lines(out)[0]["model_id"]
    capsys.readouterr()
    # bad input
    assert cli(tmp_path / "x.jsonl", "--method", "stand", "--shared-ngram-memory", "0") == 1
    assert "memory_size=0 must be >= 1" in capsys.readouterr().err
    assert cli(tmp_path / "x.jsonl", "--method", "stand", "--shared-ngram-memory", "--repeats", "2") == 1
    assert "use repeats 1 (--repeats 1) with --shared-ngram-memory" in capsys.readouterr().err
    assert cli(tmp_path / "x.jsonl", "--method", "ar", "--shared-ngram-memory") == 1
    assert "--shared-ngram-memory does not apply to method 'ar'" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()

    # One memory for all the run's questions, emptied at the start and after the warm-up.
    model, tok = models.load(tiny)
    config = StandConfig(memory_size=100_000)
    memory = ngram_memory(model, config)

    def answers(name: str, **kwargs) -> list[dict]:
        cfg = RunConfig(
            question_file=MINI,
            model=str(tiny),
            method="stand",
            method_config=config,
            max_new_tokens=12,
            first_turn_only=True,
            progress=False,
            answer_file=tmp_path / f"{name}.jsonl",
            **kwargs,
        )
        run(cfg, model=model, tokenizer=tok)
        return _lines(tmp_path / f"{name}.jsonl")

    answers("one", limit=1, warmup=0)
    keys_one = len(memory)
    assert keys_one > 0  # the last (only) answer is in it
    answers("three", limit=3, warmup=0)
    assert len(memory) > keys_one  # all three answers, and only this run's
    warm = answers("warm", limit=1, warmup=2)
    cold = answers("cold", limit=1, warmup=0)
    # the warm-up's answers to the same question were forgotten before the timed run
    assert warm[0]["choices"][0]["accept_lengths"] == cold[0]["choices"][0]["accept_lengths"]
    assert warm[0]["choices"][0]["turns"] == cold[0]["choices"][0]["turns"]


def test_stand_prompt_logits_flag(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--prompt-logits sets StandConfig.prompt_logits (in the id and the metadata); a negative count is
    refused with the configuration's message, and other methods refuse the flag."""

    def cli(out: Path, *args: str) -> int:
        return _run_cli("--model", str(tiny), "--max-new-tokens", "12", "--answer-file", str(out), *args)

    out = tmp_path / "stand.jsonl"
    assert cli(out, "--method", "stand", "--prompt-logits", "0", "--limit", "1") == 0
    line = _lines(out)[0]
    assert line["model_id"].endswith("-stand-bc30-pl0")
    assert line["mtprobe"]["method_config"]["prompt_logits"] == 0
    capsys.readouterr()
    assert cli(tmp_path / "x.jsonl", "--method", "stand", "--prompt-logits", "-1") == 1
    assert "prompt_logits=-1 must be >= 0" in capsys.readouterr().err
    assert cli(tmp_path / "x.jsonl", "--method", "pld", "--prompt-logits", "4") == 1
    assert "--prompt-logits does not apply to method 'pld'" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
