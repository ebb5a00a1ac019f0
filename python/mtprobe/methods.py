"""The built-in decoding methods: one :func:`mtprobe.registry.register` call each.

Each call names the method's short name, its configuration class (:mod:`mtprobe.config`), its drafter
factory (:mod:`mtprobe.drafters`), a summary and the Spec-Bench harness's CLI options for it. The
order of the calls is the order ``config_from_dict``'s errors and ``--help`` list them in. A new
drafter needs its own files and one such call (here, or in its own module:
``mtprobe.register_method``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mtprobe.config import (
    AutoConfig,
    DraftModelConfig,
    EntMTPConfig,
    HeadsConfig,
    HybridConfig,
    LookaheadConfig,
    PlainConfig,
    ProbeConfig,
    PromptLookupConfig,
    StandConfig,
    config_from_dict,
)
from mtprobe.drafters import (
    auto_drafter,
    draft_model_drafter,
    entmtp_drafter,
    heads_drafter,
    hybrid_drafter,
    lookahead_drafter,
    mask_probe_drafter,
    plain_drafter,
    prompt_lookup_drafter,
    stand_drafter,
)
from mtprobe.registry import Method, Option, register

SHARED_NGRAM_MEMORY_SIZE = 1 << 18
"""Keys of the cross-request n-gram memory that ``--shared-ngram-memory`` alone asks for."""


def _bc_option(help_text: str) -> Option:
    return Option("--block-complexity", "block_complexity", int, "bc", help_text, always_in_id=True)


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    # argparse prints an ArgumentTypeError's own message (a ValueError: "invalid _parse_bool value")
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _prompt_logits_option() -> Option:
    return Option(
        "--prompt-logits",
        "prompt_logits",
        int,
        "pl",
        "how many of the prompt's last positions seed the n-gram store with the model's distribution (the "
        "prefill computes the LM head over those only; the prompt's n-grams go in regardless); "
        "default every position",
    )


def _memory_option() -> Option:
    return Option(
        "--shared-ngram-memory",
        "memory_size",
        int,
        "mem",
        "one cross-request n-gram memory of at most this many keys (least recently used evicted; "
        f"{SHARED_NGRAM_MEMORY_SIZE} when the flag is given alone) shared by every question of the run: each "
        "finished answer's text is folded in and drafted from where the question's own store has no "
        "key (emptied after the warm-up; refuses --repeats above 1); default off",
        const=SHARED_NGRAM_MEMORY_SIZE,
    )


def _drafter_configs(text: str) -> tuple[Any, ...]:
    """``--drafters``: a JSON list of drafter configurations (``config.to_dict()``'s form), or the path of
    a ``.json`` file holding one."""
    example = '[{"method": "pld"}, {"method": "heads", "path": "DIR", "vocab_top_k": 4096}]'
    try:
        data = json.loads(Path(text).read_text() if text.endswith(".json") else text)
    except (OSError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(
            f"--drafters takes a JSON list of drafter configurations, e.g. '{example}', or a .json file of "
            f"one: {e}"
        ) from None
    if not isinstance(data, list) or not data or not all(isinstance(d, dict) for d in data):
        raise argparse.ArgumentTypeError(
            f"--drafters must be a non-empty JSON list of configuration objects, e.g. '{example}'; got {text!r}"
        )
    try:
        return tuple(config_from_dict(d) for d in data)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--drafters: {e}") from None


# The mask tokens' start, shared by probing and the hybrid's probing half.
_MASK_OPTIONS = (
    Option(
        "--mask-init",
        "mask_init",
        str,
        "init-",
        "mask design: prompt_mean, prompt_last, gaussian, gaussian_5sigma, gaussian_10sigma or "
        "calibrated (with --mask-path)",
    ),
    Option(
        "--mask-path",
        "mask_path",
        str,
        "masks-",
        "the mask calibration file of --mask-init calibrated (python -m mtprobe calibrate)",
    ),
)


# --- probe: mask-token probing (seed 001) ----------------------------------------------------------

register(
    Method(
        name="probe",
        config_type=ProbeConfig,
        drafter=mask_probe_drafter,
        summary="mask-token probing: mtprobe.generate with a ProbeConfig",
        schedulable=True,
        options=(
            _bc_option("BC, the most input tokens of one decode forward, mask tokens included"),
            Option(
                "--num-masks",
                "num_masks",
                int,
                "k",
                "k, chained mask tokens per tree node, 1 to 4; default 1",
            ),
            Option(
                "--tree",
                "tree",
                str,
                "tree-",
                "static (fixed branches, Top-1 expansion) or dynamic (the best candidates by cumulative "
                "probability); default static for 1 mask, else dynamic",
            ),
            Option(
                "--prune",
                "prune",
                _parse_bool,
                "prune-",
                "true/false: replace a draft that repeats its parent or the last token by the next best",
            ),
            *_MASK_OPTIONS,
            Option(
                "--mask-lambda",
                "mask_lambda",
                float,
                "lam",
                "lambda in [0, 1], step of the running mask update m <- m + lambda (e_new - m); 0 keeps "
                "the initial masks",
            ),
            Option(
                "--mask-value",
                "mask_value",
                float,
                "mv",
                "masks only where the step is likely to end (dynamic tree), drafts with the inputs freed, "
                "valuing the next step's probing at V tokens (default: masks on every node, seed 001's rule)",
            ),
        ),
    )
)


# --- pld: prompt lookup decoding ------------------------------------------------------------------

register(
    Method(
        name="pld",
        config_type=PromptLookupConfig,
        drafter=prompt_lookup_drafter,
        summary="prompt lookup decoding: a chain copied from an earlier occurrence of the last n-gram",
        schedulable=True,
        options=(
            Option(
                "--num-tokens",
                "num_tokens",
                int,
                "n",
                "chain depth: drafts copied after the matched n-gram per step (transformers' "
                "prompt_lookup_num_tokens); a step takes 1 + this inputs",
            ),
            Option(
                "--max-ngram-size",
                "max_ngram_size",
                int,
                "g",
                "the longest n-gram matched (transformers' max_matching_ngram_size)",
            ),
        ),
    )
)


# --- sps: draft-model speculative decoding -----------------------------------------------------------

register(
    Method(
        name="sps",
        config_type=DraftModelConfig,
        drafter=draft_model_drafter,
        summary="draft-model speculative decoding: a draft model (--draft-model; default a self-draft made "
        "of the target, --self-draft) proposes a chain, the target verifies it",
        schedulable=True,
        own_forwards=True,
        options=(
            Option(
                "--num-tokens",
                "num_tokens",
                int,
                "n",
                "K, tokens the draft model drafts per step in a chain; a step feeds the target "
                "K + top branches inputs",
                always_in_id=True,
            ),
            Option(
                "--self-draft",
                "self_draft",
                str,
                "sd",
                "the draft made of the target when --draft-model is not given: 'truncated' (its first layers) "
                "or 'quantized' (its linear weights in 4 bits, the head's in 8; a float32 CPU model)",
            ),
            Option(
                "--draft-layers",
                "num_draft_layers",
                int,
                "l",
                "layers of the target's self-draft, its first ones (default: 8 for --self-draft truncated, "
                "every layer for quantized)",
            ),
            Option(
                "--top-branches",
                "top_branches",
                int,
                "b",
                "children of the root: the chain's first draft and b - 1 siblings (1: a plain chain)",
            ),
        ),
        steps_doc="target forward calls, prefill included (the draft model's forwards are not counted)",
    )
)


# --- stand: STAND's n-gram store of the target's own distributions ----------------------------------

register(
    Method(
        name="stand",
        config_type=StandConfig,
        drafter=stand_drafter,
        summary="STAND: a draft tree from an n-gram store of the target's own next-token distributions",
        schedulable=True,
        options=(
            _bc_option("most inputs of one decode forward: the root and BC - 1 draft nodes"),
            Option("--max-depth", "max_depth", int, "d", "deepest draft (tokens after the root)"),
            _memory_option(),
            _prompt_logits_option(),
        ),
    )
)


# --- lookahead: lookahead decoding (LADE) --------------------------------------------------------------

register(
    Method(
        name="lookahead",
        config_type=LookaheadConfig,
        drafter=lookahead_drafter,
        summary="lookahead decoding: a Jacobi window and the verification of its n-grams in one forward",
        schedulable=True,
        options=(
            Option(
                "--ngram-size",
                "ngram_size",
                int,
                "L",
                "L, n-gram size, at least 2 (a step takes (L - 1)(W + G) inputs)",
                always_in_id=True,
            ),
            Option("--window", "window", int, "W", "W, Jacobi window width", always_in_id=True),
            Option(
                "--guess-set-size",
                "guess_set_size",
                int,
                "G",
                "G, n-grams verified per step",
                always_in_id=True,
            ),
        ),
    )
)


# --- hybrid: probing and STAND's n-gram store in one tree ----------------------------------------------

register(
    Method(
        name="hybrid",
        config_type=HybridConfig,
        drafter=hybrid_drafter,
        summary="hybrid: mask-token probing and STAND's n-gram store drafting one tree under one budget",
        schedulable=True,
        options=(
            _bc_option("BC, the most input tokens of one decode forward, mask tokens included"),
            Option("--num-masks", "num_masks", int, "k", "k, mask tokens per tree node (the probing half)"),
            Option("--max-depth", "max_depth", int, "d", "deepest draft of the n-gram half"),
            *_MASK_OPTIONS,
            _memory_option(),
            _prompt_logits_option(),
            Option(
                "--mask-value",
                "mask_value",
                float,
                "mv",
                "masks only where the step is likely to end, drafts with the inputs freed, valuing the "
                "next step's probing at V tokens (default: masks on every node, seed 001's rule)",
            ),
            Option(
                "--grow-probed",
                "grow_probed",
                _parse_bool,
                "grow-",
                "true/false: one best-first tree over both sources, the n-gram store drafting below probed "
                "tokens too (default false: the union of two separate trees, seed 001's hybrid)",
            ),
        ),
    )
)


# --- entmtp: a bank of static probing trees, one per step by a policy (seed 002) ---------------------------

register(
    Method(
        name="entmtp",
        config_type=EntMTPConfig,
        drafter=entmtp_drafter,
        summary="EntMTP: mask-token probing over a topology bank of static trees, the tree chosen every step by "
        "a static, ladder or hysteretic policy (seed 002)",
        schedulable=True,
        options=(
            Option("--policy", "policy", str, "", "static, ladder or hysteretic", always_in_id=True),
            Option(
                "--bank",
                "bank",
                str,
                "bank-",
                "a topology bank built with `python -m mtprobe topology` (default: the uncalibrated default "
                "bank, which fits any model)",
            ),
            Option(
                "--feature",
                "feature",
                str,
                "f-",
                "the policy's score: path_value, top1, entropy or accept (default: the bank's calibrated "
                "one, else path_value)",
            ),
        ),
    )
)


# --- heads: probabilistic-circuit heads (MTPC, seed 003) ----------------------------------------------------

register(
    Method(
        name="heads",
        config_type=HeadsConfig,
        drafter=heads_drafter,
        summary="probabilistic-circuit heads (MTPC): drafts from a trained head over the last hidden state",
        schedulable=True,
        options=(
            Option(
                "--head-path",
                "path",
                str,
                "head-",
                "the head's checkpoint folder (python -m mtprobe heads train --out DIR); required",
                always_in_id=True,
            ),
            _bc_option("BC, the most input tokens of one decode forward"),
            Option(
                "--top-branches",
                "top_branches",
                int,
                "branches",
                "under sampling: independent windows drawn from the circuit as chains below the root",
            ),
            Option(
                "--min-path-prob",
                "min_path_prob",
                float,
                "floor",
                "greedy: leave out drafts whose path probability under the circuit is below this (0: fill BC)",
            ),
            Option(
                "--vocab-top-k",
                "vocab_top_k",
                int,
                "vocab",
                "the head emits only its K most frequent training tokens (default: the whole vocabulary)",
            ),
            Option(
                "--head-dtype",
                "head_dtype",
                str,
                "hd-",
                "the dtype of the head's per-step products: float32, bfloat16 or float16 (default: the "
                "model's for the LoRA draft layers, float32 for the rest)",
            ),
            Option(
                "--bank",
                "bank",
                str,
                "bank-",
                "EntMTP over the head: a topology bank built for it with `python -m mtprobe topology --head DIR` "
                "(default: none, the best-first tree)",
            ),
            Option(
                "--policy",
                "policy",
                str,
                "",
                "with --bank: static, ladder or hysteretic (default: static, the bank's best tree)",
            ),
            Option(
                "--feature",
                "feature",
                str,
                "f-",
                "with --bank: the policy's score, path_value, top1, entropy or accept (default: the bank's "
                "calibrated one, else path_value)",
            ),
        ),
    )
)


# --- auto: per-step scheduling by measured forward cost -------------------------------------------------

register(
    Method(
        name="auto",
        config_type=AutoConfig,
        drafter=auto_drafter,
        summary="per-step choice among drafters (default prompt lookup, STAND and the quantized self-draft) and "
        "plain decoding by expected tokens per second under this machine's measured forward cost",
        options=(
            Option(
                "--drafters",
                "drafters",
                _drafter_configs,
                "",
                "the drafters to choose among: a JSON list of configurations, e.g. "
                '\'[{"method": "pld"}, {"method": "heads", "path": "DIR", "vocab_top_k": 4096}]\', or a '
                ".json file of one",
            ),
            Option(
                "--profile",
                "profile",
                str,
                "p",
                "a forward profile saved with mtprobe.ForwardProfile.save (default: measured once for the "
                "model, device, dtype and threads, and cached)",
            ),
        ),
    )
)


# --- plain: no drafts, mtprobe's own baseline -------------------------------------------------------

register(
    Method(
        name="plain",
        config_type=PlainConfig,
        drafter=plain_drafter,
        summary="plain decoding through mtprobe's own loop: no drafts, one input per step (the baseline "
        "that prices mtprobe's loop, KV cache and linear routes beside HF's generate)",
    )
)
