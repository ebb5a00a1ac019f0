"""``python -m mtprobe.specbench {run,score}`` and the ``mtprobe-specbench`` console script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprobe.specbench import methods as _methods
from mtprobe.specbench.run import DEFAULT_MAX_NEW_TOKENS, RunConfig, run
from mtprobe.specbench.score import render_markdown, score


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mtprobe.specbench",
        description="Spec-Bench harness: generate answers with a decoding method, then score them vs ar.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    methods_help = "; ".join(
        f"{m.name}: {m.summary} (decoding_steps = {m.steps_doc})" for m in _methods.METHODS.values()
    )
    r = sub.add_parser(
        "run",
        help="generate answers in Spec-Bench's format (appends to the answer file, resumes)",
        description="Generate answers in Spec-Bench's format; questions already answered are skipped.",
    )
    r.add_argument("--question-file", type=Path, required=True, help="Spec-Bench question .jsonl")
    r.add_argument(
        "--model", default="smollm2-135m", help="known model name or local HF folder (default %(default)s)"
    )
    r.add_argument("--model-id", default=None, help="id written to every answer line (default: derived)")
    r.add_argument("--method", default="ar", help=f"decoding method (default %(default)s). {methods_help}")
    r.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="new tokens per turn at most (default %(default)s as Spec-Bench; on CPU use less, e.g. 128)",
    )
    r.add_argument("--temperature", type=float, default=0.0, help="only 0 (greedy) is implemented")
    r.add_argument("--seed", type=int, default=0, help="torch seed set before every question")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    r.add_argument("--limit", type=int, default=None, help="answer only the first N selected questions")
    r.add_argument("--question-begin", type=int, default=None, help="0-based index of the first question")
    r.add_argument("--question-end", type=int, default=None, help="0-based index after the last question")
    r.add_argument("--categories", default=None, help="comma list of categories or tasks (e.g. mt_bench,qa)")
    r.add_argument(
        "--answer-file", type=Path, default=None, help="default model_answer/<bench>/<model_id>.jsonl"
    )
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    r.add_argument("--warmup", type=int, default=3, help="discarded runs of the first question (default 3)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    _methods.add_method_arguments(r)

    s = sub.add_parser(
        "score",
        help="Spec-Bench speed report + losslessness check against the ar answers",
        description="Score answer files against an ar baseline with Spec-Bench's speed.py methodology.",
    )
    s.add_argument("--baseline", type=Path, required=True, help="answer file of the ar method")
    s.add_argument(
        "--answers", type=Path, nargs="+", required=True, help="answer files of the methods to score"
    )
    s.add_argument(
        "--tokenizer", "--model", dest="tokenizer", required=True, help="known model name or local folder"
    )
    s.add_argument("--out-dir", type=Path, required=True, help="where report.md, results.json and plots go")
    s.add_argument(
        "--literal-token-count",
        action="store_true",
        help="count baseline tokens exactly as Spec-Bench: len(tokenizer(text).input_ids) - 1",
    )
    s.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "run":
            method = _methods.get_method(args.method)
            cfg = RunConfig(
                question_file=args.question_file,
                model=args.model,
                method=method.name,
                method_config=_methods.config_from_args(method, args),
                model_id=args.model_id,
                answer_file=args.answer_file,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                seed=args.seed,
                dtype=args.dtype,
                device=args.device,
                limit=args.limit,
                question_begin=args.question_begin,
                question_end=args.question_end,
                categories=tuple(args.categories.split(",")) if args.categories else None,
                threads=args.threads,
                warmup=args.warmup,
                progress=not args.no_progress,
            )
            summary = run(cfg)
            print(summary.answer_file)
        else:
            report = score(
                args.baseline,
                args.answers,
                args.tokenizer,
                args.out_dir,
                literal_token_count=args.literal_token_count,
                plots=not args.no_plots,
            )
            print(render_markdown(report))
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
