"""``python -m mtprobe.specbench {run,score,compare}`` and the ``mtprobe-specbench`` console script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprobe.specbench import methods as _methods
from mtprobe.specbench.compare import compare, render_compare_markdown
from mtprobe.specbench.report import render_markdown
from mtprobe.specbench.run import RepeatMismatchError, run
from mtprobe.specbench.run_config import DEFAULT_MAX_NEW_TOKENS, RunConfig
from mtprobe.specbench.score import score


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mtprobe.specbench",
        description="Spec-Bench harness: generate answers with a decoding method, score them against ar, "
        "compare a folder of answer files.",
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
    r.add_argument(
        "--model-id",
        default=None,
        help="id written to every answer line (default: a short one such as smollm2-135m-probe-bc30; the "
        "full configuration goes into each line's 'mtprobe' metadata)",
    )
    r.add_argument("--method", default="ar", help=f"decoding method (default %(default)s). {methods_help}")
    r.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="new tokens per turn at most (default %(default)s as Spec-Bench; on CPU use less, e.g. 128)",
    )
    r.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy decoding; T > 0: every method samples with do_sample=True, temperature=T "
        "(mtprobe's sampling is exact in distribution; ar is HF generate)",
    )
    r.add_argument("--seed", type=int, default=0, help="torch seed set before every question and repeat")
    r.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs of every question (default 1); all wall times are kept and score/compare report "
        "their mean and spread; under greedy decoding every run must give the same tokens",
    )
    r.add_argument(
        "--draft-model",
        default=None,
        help="sps only: known model name or local HF folder of the draft model (same tokenizer as the "
        "target); default: the target's layer-truncated self-draft (--draft-layers)",
    )
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    r.add_argument("--limit", type=int, default=None, help="answer only the first N selected questions")
    r.add_argument("--question-begin", type=int, default=None, help="0-based index of the first question")
    r.add_argument("--question-end", type=int, default=None, help="0-based index after the last question")
    r.add_argument("--categories", default=None, help="comma list of categories or tasks (e.g. mt_bench,qa)")
    r.add_argument(
        "--per-category",
        type=int,
        default=None,
        help="answer only the first N questions of every category (a subset covering every task)",
    )
    r.add_argument(
        "--first-turn-only",
        action="store_true",
        help="ask only the first turn of every question (MT-bench questions have two; Spec-Bench asks both)",
    )
    r.add_argument(
        "--answer-file", type=Path, default=None, help="default model_answer/<bench>/<model_id>.jsonl"
    )
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
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

    c = sub.add_parser(
        "compare",
        help="every answer file of a folder side by side: one markdown table and one figure",
        description="Score every *.jsonl answer file of DIR against the ar baseline and put them side by "
        "side: compare.md (tau, speedup and tokens/s per task and overall, with the spread of repeated "
        "runs), compare.json and compare.png.",
    )
    c.add_argument("dir", type=Path, help="folder of Spec-Bench answer files (*.jsonl)")
    c.add_argument(
        "--baseline",
        default="auto",
        help="answer file of the ar method (a path, or a file name inside DIR); 'auto' (default): the one "
        "file of DIR whose metadata says method ar, or whose model_id contains '-ar'",
    )
    c.add_argument(
        "--tokenizer", "--model", dest="tokenizer", required=True, help="known model name or local folder"
    )
    c.add_argument(
        "--out-dir", type=Path, required=True, help="where compare.md, compare.json, compare.png go"
    )
    c.add_argument("--no-plots", action="store_true", help="skip the figure")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "run":
            method = _methods.get_method(args.method)
            if args.draft_model is not None and getattr(args, "draft_layers", None) is not None:
                raise ValueError(
                    "--draft-layers sets the depth of the self-draft, which --draft-model replaces; give one"
                )
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
                per_category=args.per_category,
                first_turn_only=args.first_turn_only,
                threads=args.threads,
                warmup=args.warmup,
                progress=not args.no_progress,
                repeats=args.repeats,
                draft_model=args.draft_model,
            )
            summary = run(cfg)
            print(summary.answer_file)
        elif args.command == "compare":
            table = compare(
                args.dir, args.tokenizer, args.out_dir, baseline=args.baseline, plots=not args.no_plots
            )
            print(render_compare_markdown(table))
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
    except (ValueError, NotImplementedError, FileNotFoundError, RepeatMismatchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
