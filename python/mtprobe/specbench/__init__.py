"""Spec-Bench harness: answer generation and scoring in Spec-Bench's own formats.

Command line (also the console script ``mtprobe-specbench``)::

    python -m mtprobe.specbench run --question-file question.jsonl --model smollm2-135m --method ar
    python -m mtprobe.specbench run --question-file question.jsonl --model smollm2-135m --method probe \\
        --block-complexity 30
    python -m mtprobe.specbench score --baseline ar.jsonl --answers probe.jsonl --model smollm2-135m \\
        --out-dir results/
    python -m mtprobe.specbench run ... --method probe --repeats 3          # timing spread
    python -m mtprobe.specbench run ... --method ar --temperature 1        # lossless sampling
    python -m mtprobe.specbench compare answers/ --tokenizer smollm2-135m --out-dir results/

Modules: :mod:`~mtprobe.specbench.questions` (question files), :mod:`~mtprobe.specbench.methods`
(registry of decoding methods), :mod:`~mtprobe.specbench.run_config` (a run's configuration),
:mod:`~mtprobe.specbench.metadata` (the run's metadata on every answer line, setups compared),
:mod:`~mtprobe.specbench.answers` (answer files read, resumed and written),
:mod:`~mtprobe.specbench.run` (the answer-generation loop), :mod:`~mtprobe.specbench.score`
(Spec-Bench's speed methodology and losslessness), :mod:`~mtprobe.specbench.report` (the score
report, its markdown, JSON and plots), :mod:`~mtprobe.specbench.compare` (a folder of answer files
side by side), :mod:`~mtprobe.specbench.plots` (the figures).
"""

from mtprobe.specbench.answers import load_answers
from mtprobe.specbench.methods import METHODS, Method, MethodOutput, Option, get_method, register
from mtprobe.specbench.questions import MT_BENCH_CATEGORIES, TASKS, Question, load_questions, select_questions
from mtprobe.specbench.report import ScoreReport
from mtprobe.specbench.run import RunSummary, run
from mtprobe.specbench.run_config import RunConfig
from mtprobe.specbench.score import score

__all__ = [
    "METHODS",
    "MT_BENCH_CATEGORIES",
    "TASKS",
    "Method",
    "MethodOutput",
    "Option",
    "Question",
    "RunConfig",
    "RunSummary",
    "ScoreReport",
    "get_method",
    "load_answers",
    "load_questions",
    "register",
    "run",
    "score",
    "select_questions",
]
