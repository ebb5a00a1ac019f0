"""What a generation returns: :class:`GenerateOutput`, read as transformers' own generate output, and
the one output of several sequences (a batch of prompts, ``num_return_sequences``)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

if TYPE_CHECKING:
    from mtprobe.decode.hf_call import Prompt


@dataclass(eq=False)
class GenerateOutput(ModelOutput):
    """What one mtprobe generation did.

    Attributes:
        sequences: ``[1, prompt + new]`` tokens, identical to greedy ``model.generate``; ``[batch * n,
            L + new]`` for a batch of prompts (left-padded to L tokens, as HF pads them) with
            ``num_return_sequences=n``, each prompt's n sequences together, as HF orders them.
        accept_lengths: tokens gained per decode forward (accepted drafts + bonus), one per step.
        block_sizes: inputs T of each decode step's forward (committed, drafts and auxiliary inputs),
            one per step: with the forward profile, what the step cost.
        forward_calls: target forwards, prefill included. With ``num_return_sequences``, the sequences
            share the prompt's prefill: the first runs it, the others take copies of its logits and
            KV entries, and count no prefill forward (their ``prefill_s`` is the copy's time), whether
            they are decoded one after another or together in a batch.
        timings: seconds: ``total_s`` (whole loop), ``forward_s`` (inside model forwards, prefill
            included), ``prefill_s``.
        stop_reason: ``"eos"``, ``"max_new_tokens"`` or ``"stopping_criteria"``.
        fallback_steps: decode steps whose drafts made the target's logits non-finite (NaN/inf)
            and that were re-run on the committed token alone, as plain decoding runs it.
        kv_capacity: KV entries per layer the cache held at the end: it grows with the tokens
            generated (doubling), not with ``max_new_tokens``.
        new_tokens: tokens generated (``sequences.shape[1]`` minus the prompt; the prefill's
            forward may already verify drafts, so this can exceed ``sum(accept_lengths) + 1``).
        method: the drafter that ran, by its short name (``"probe"``, ``"pld"``, ...).
        do_sample: whether this call sampled (``generation_config.do_sample`` after HF merged the
            model's generation config with the call's arguments) or decoded greedily.
        drafted_per_depth: decode steps only; index ``d - 1`` counts the draft nodes placed at depth
            ``d`` below the last committed token, over all steps.
        accepted_per_depth: index ``d - 1`` counts the steps whose verified path reached depth ``d``
            (drafts accepted; the bonus token is no draft). An EOS or stopping criterion may cut the
            last step's tokens short after verification; ``accept_lengths`` counts what was kept.
        choices: with :class:`~mtprobe.AutoConfig`, one ``(method, block size T)`` per decode step:
            the drafter whose block (or cut of it) was verified (a quantized self-draft whose format
            AutoConfig chooses with its format: ``"sps:q8_0"``), or ``("plain", 1)``; ``timings``
            then also holds ``draft_s`` (the drafters' own work) and ``schedule_s`` (the scheduler's).
            With :class:`~mtprobe.EntMTPConfig` or a ``HeadsConfig`` with a bank: ``("tree<i>", T)``,
            the bank tree the policy chose, or ``("none", 1 + k)`` for a step without candidates (the
            root and its k masks; k = 0 for a head).
        topology_log: with ``EntMTPConfig(record_steps=True)``: per step with candidates, ``positions``
            (the next root's index in ``sequences[0]``), ``candidates`` ``[n, k, m]``, ``features``
            ``[n, 4]`` (top1, path_value, entropy_ema, accept_ema) and ``trees`` (the tree chosen next).
            With ``HeadsConfig(bank=..., record_steps=True)``: ``ranks`` ``[n, window - 1]`` (the true
            continuation's child ranks, -1 for none) instead of the candidates.
        linear_routes: on a CPU, how the decode steps' linear layers ran by block size, e.g.
            ``T 1: stock; T 2-16: small-batch; T 17+: stock`` (:mod:`mtprobe.cpu.linear_routes`: measured
            once per machine and model, forced with ``MTPROBE_LINEAR_ROUTE``); empty on a GPU.
        target_forward: what ran the decode steps' target forwards: ``"native v1"`` (the C++ forward,
            :mod:`mtprobe.target_model.native_forward`) or ``"HF (reason)"``, HF's modules and why.
        exact_steps: greedy decode steps HF's forward decided after the C++ forward: a verified row (one
            that chose a token) had a top-2 score margin below
            :data:`~mtprobe.target_model.native_forward.MARGIN_BOUND`, a near-tie whose order the two
            forwards' rounding could decide differently: one more forward each, not in ``forward_calls``
            (which stays the prefill and one forward per step); its time is in ``timings``.
        batch: how many sequences' steps ran through one target forward together (a batch of prompts or
            ``num_return_sequences`` decoded at once, :mod:`mtprobe.decode.batch`); 1: decoded alone. A
            batched sequence's ``timings`` include its waits for the batch's other rows.
        host_reads: device->host reads the decode loop made (prefill included; counted on the CPU
            too, where they are plain copies): one per forward for greedy decoding and sample
            matching with the built-in drafters, which hand their drafts over on the host. The
            drafters' own reads (e.g. STAND's and probing's candidate tables) are not counted.
        plan: with ``plan=PlanConfig(...)``, how the static forward plan ran (:mod:`mtprobe.target_model.plan`):
            ``capacity``, ``buckets``, ``pad``, ``graphs`` (captured buckets), ``replays``,
            ``capture_s``, ``growths`` and ``eager_reason`` (why no graphs ran, "" when they did);
            for a batch decoded through HF's modules, its batch plan's account
            (:meth:`mtprobe.target_model.batch_plan.BatchedPlan.describe`); None without a plan.
        scores: with ``output_scores=True``, as HF's: one ``[rows, vocab]`` float32 tensor per new token,
            the scores (after the logits processors) that token was chosen from, for
            ``model.compute_transition_scores``. They come from the forward that verified the token, so
            they sit within rounding of greedy ``generate``'s own (under greedy decoding their argmax is
            the token, exactly).
            A row that ended before the longest holds zeros after its end. None without the flag.
        logits: with ``output_logits=True``: the same for the raw logits, before any processor.
        sequence_outputs: with several sequences (a batch of prompts, or ``num_return_sequences=n > 1``
            under sampling): each sequence's own output, in order, as a call on its prompt alone
            (without padding) returns it; ``sequences`` is then ``[rows, L + longest]``, each row after
            its prompt's left padding and the shorter ones padded after their end with the pad token,
            as HF pads them, and the other fields cover all the sequences (counts and timings summed,
            per-step lists concatenated, ``stop_reason`` the distinct reasons joined by ","). None for
            one sequence.

    A worked example: two decode steps, the first drafting the chain ``a -> b`` (depths 1, 2) of
    which ``a`` is accepted, the second drafting two siblings at depth 1, neither accepted:
    ``accept_lengths == [2, 1]``, ``drafted_per_depth == [3, 1]``, ``accepted_per_depth == [1]``,
    ``block_sizes == [3, 3]`` (the committed token and the drafts, without auxiliary inputs).

    A transformers ``ModelOutput``, read as HF's ``GenerateDecoderOnlyOutput`` is (pipelines take its
    sequences and scores): ``out["sequences"]``, ``out[0]``, ``"scores" in out``, ``out.keys()``,
    ``dict(out)`` and ``out.to_tuple()`` see the fields HF's output has and that are set (``sequences``,
    then ``scores`` and ``logits`` when asked for), in HF's order; ``attentions`` and ``hidden_states`` are
    None, as HF's are unless asked for (mtprobe refuses those flags). ``cache`` (``past_key_values``) is
    None: mtprobe's cache holds draft trees, not an HF cache to continue from. mtprobe's own statistics
    are attributes only.
    """

    sequences: torch.Tensor
    accept_lengths: list[int]
    forward_calls: int
    timings: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    fallback_steps: int = 0
    kv_capacity: int = 0
    method: str = ""
    do_sample: bool = False
    new_tokens: int = 0
    drafted_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    choices: list[tuple[str, int]] | None = None
    topology_log: dict[str, Any] | None = None
    linear_routes: str = ""
    target_forward: str = ""
    exact_steps: int = 0
    batch: int = 1
    plan: dict[str, Any] | None = None
    host_reads: int = 0
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    sequence_outputs: tuple[GenerateOutput, ...] | None = None

    # HF's GenerateDecoderOnlyOutput: its fields mtprobe fills, in its order; and those it leaves None.
    _HF_FIELDS: ClassVar[tuple[str, ...]] = ("sequences", "scores", "logits")
    attentions: ClassVar[None] = None
    hidden_states: ClassVar[None] = None

    def __post_init__(self) -> None:
        # ModelOutput's own check wants every field but the first to default to None; mtprobe's statistics
        # have other defaults, and only the HF fields are the mapping's (see __setattr__).
        pass

    def __setattr__(self, name: str, value: Any) -> None:
        # A ModelOutput's mapping holds its set fields; this one holds HF's only, so that keys(),
        # items(), to_tuple() and out[i] are what HF's generate output gives (a pipeline reads them).
        if name in self._HF_FIELDS and value is not None:
            OrderedDict.__setitem__(self, name, value)
        object.__setattr__(self, name, value)

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str) and key not in self.keys():
            why = (
                "mtprobe returns no cache: its own holds draft trees, not an HF cache to continue from"
                if key in ("past_key_values", "cache")
                else "mtprobe's own statistics are attributes, e.g. out.tau, out.accept_lengths"
            )
            raise KeyError(
                f"{key!r} is not in this GenerateOutput: it holds {list(self.keys())}, the fields of HF's "
                "generate output this call set (scores and logits with output_scores=True / "
                f"output_logits=True); {why}"
            )
        return super().__getitem__(key)

    @property
    def past_key_values(self) -> None:
        """None: mtprobe returns no cache (ModelOutput's would look for ``cache``)."""
        return None

    @property
    def cache(self) -> None:
        """None: mtprobe's cache holds draft trees, not an HF cache to continue from."""
        return None

    @property
    def tau(self) -> float:
        """Mean tokens gained per decode forward (τ)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def steps(self) -> int:
        """Decode forwards (prefill excluded)."""
        return len(self.accept_lengths)

    def acceptance_per_depth(self) -> list[float]:
        """Fraction of decode steps whose verified path reached depth ``d`` (index ``d - 1``): the
        curve whose sum is ``tau - 1`` when nothing was cut short by EOS or a stopping criterion."""
        return [n / max(1, self.steps) for n in self.accepted_per_depth]

    def summary(self) -> dict[str, Any]:
        """The call's statistics in one flat dict (what the log line and the CLI print)."""
        new_tokens = self.new_tokens
        total = self.timings.get("total_s", 0.0)
        drafted, accepted = sum(self.drafted_per_depth), sum(self.accepted_per_depth)
        return {
            "method": self.method,
            "do_sample": self.do_sample,
            "new_tokens": new_tokens,
            "steps": self.steps,
            "forward_calls": self.forward_calls,
            "tau": self.tau,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "draft_acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_s": new_tokens / total if total > 0 else 0.0,
            "fallback_steps": self.fallback_steps,
            "kv_capacity": self.kv_capacity,
            "stop_reason": self.stop_reason,
            "linear_routes": self.linear_routes,
            "target_forward": self.target_forward,
            "exact_steps": self.exact_steps,
            "batch": self.batch,
        }


def padding_id(cfg: GenerationConfig) -> int | None:
    """The id that fills the tail of a sequence that stopped before the longest, as HF's generate does."""
    pad = getattr(cfg, "_pad_token_tensor", None)
    if pad is None:
        pad = cfg.pad_token_id
    if pad is None:
        pad = getattr(cfg, "_eos_token_tensor", None)
        if pad is None:
            pad = cfg.eos_token_id
    if pad is None:
        return None
    return int(torch.as_tensor(pad).flatten()[0])


def stack_outputs(outputs: list[GenerateOutput], prompts: list[Prompt], pad_id: int | None) -> GenerateOutput:
    """One output for several sequences (a batch of prompts, ``num_return_sequences``): ``sequences``
    ``[n, L + longest]``, each after the left padding of its prompt (``prompts[i]``) as HF's batched
    generate returns it, the shorter ones padded with ``pad_id`` after their end; the counts and timings
    summed over the sequences, the per-step lists concatenated in order (so ``tau`` is over every step),
    each one's own output in ``sequence_outputs``."""
    padded = [p.padded(o.sequences) for o, p in zip(outputs, prompts, strict=True)]  # [1, L + new_i] each
    longest = max(x.shape[1] for x in padded)
    if pad_id is None and any(x.shape[1] < longest for x in padded):
        raise ValueError(
            "the returned sequences have different lengths and the generation config has neither "
            "pad_token_id nor eos_token_id to pad the shorter ones with: pass pad_token_id"
        )
    rows = [torch.nn.functional.pad(x, (0, longest - x.shape[1]), value=pad_id or 0) for x in padded]

    def summed(lists: list[list[int]]) -> list[int]:
        total = [0] * max((len(x) for x in lists), default=0)
        for x in lists:
            for i, v in enumerate(x):
                total[i] += v
        return total

    timings: dict[str, float] = {}
    for o in outputs:
        for key, value in o.timings.items():
            timings[key] = timings.get(key, 0.0) + value
    reasons = sorted({o.stop_reason for o in outputs})
    first = outputs[0]
    return GenerateOutput(
        sequences=torch.cat(rows),  # [n, prompt + longest]
        accept_lengths=[a for o in outputs for a in o.accept_lengths],
        forward_calls=sum(o.forward_calls for o in outputs),
        timings=timings,
        stop_reason=",".join(reasons),
        fallback_steps=sum(o.fallback_steps for o in outputs),
        kv_capacity=max(o.kv_capacity for o in outputs),
        method=first.method,
        do_sample=first.do_sample,
        new_tokens=sum(o.new_tokens for o in outputs),
        drafted_per_depth=summed([o.drafted_per_depth for o in outputs]),
        accepted_per_depth=summed([o.accepted_per_depth for o in outputs]),
        block_sizes=[t for o in outputs for t in o.block_sizes],
        choices=None if first.choices is None else [c for o in outputs for c in o.choices or []],
        linear_routes=first.linear_routes,
        target_forward=first.target_forward,
        exact_steps=sum(o.exact_steps for o in outputs),
        batch=max(o.batch for o in outputs),
        plan=first.plan,
        host_reads=sum(o.host_reads for o in outputs),
        scores=stacked_rows([o.scores for o in outputs]),
        logits=stacked_rows([o.logits for o in outputs]),
        sequence_outputs=tuple(outputs),
    )


def per_token(rows: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
    """``[new, vocab]`` (the loop's kept rows) as HF returns them: one ``[1, vocab]`` tensor per new token."""
    return None if rows is None else tuple(rows.split(1))


def stacked_rows(per_sequence: list[tuple[torch.Tensor, ...] | None]) -> tuple[torch.Tensor, ...] | None:
    """Each sequence's per-token ``[1, vocab]`` rows as HF's batched output: one ``[sequences, vocab]``
    tensor per new token of the longest, zeros where a sequence had ended."""
    if any(rows is None for rows in per_sequence):
        return None
    steps = max(len(rows) for rows in per_sequence)
    zeros = torch.zeros_like(per_sequence[0][0])  # [1, vocab]
    return tuple(
        torch.cat([rows[t] if t < len(rows) else zeros for rows in per_sequence]) for t in range(steps)
    )
