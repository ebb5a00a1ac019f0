"""End-to-end losslessness on real HF architectures (tiny, randomly initialised, fp32, CPU).

Every test compares against greedy ``model.generate(do_sample=False)`` token for token. Besides the
mask-probing drafter (whose drafts random weights rarely confirm), an *oracle* drafter proposes the
true greedy continuation as a chain of depth up to 4, with planted wrong tokens, wrong sibling
branches and an auxiliary embedding input, so verification accepts long paths and the KV cache
is compacted over them; the cache is then checked against a plain forward entry by entry.

A mismatch is investigated, not tolerated: ``_assert_greedy`` measures the top-2 logit margin at
the first differing position with a plain forward and xfails only on a floating-point near-tie
(margin < 1e-5); anything else fails with the evidence.
"""

from __future__ import annotations

import inspect
import random
import warnings

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import mtprobe
from mtprobe import _C
from mtprobe.drafters import mask_probe_drafter
from mtprobe.target_model.adapter import HFAdapter, max_positions
from mtprobe.target_model.mask_hooks import decoder_layers
from mtprobe.target_model.sliding import SlidingWindow, sliding_mask, sliding_window

VOCAB = 320
MAX_POS = 128
EOS = VOCAB - 1  # the models' configured EOS: a valid id, so generate() behaves as with a real model
NEAR_TIE = 1e-5  # top-2 logit margin below which a float32 mismatch is a rounding tie, not a bug
KV_ATOL = 1e-4
PROMPT_LENS = (1, 7, 40)
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")

_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POS,
    bos_token_id=0,
    eos_token_id=EOS,
    pad_token_id=EOS,
)


def _build(arch: str, attn: str = "sdpa") -> torch.nn.Module:
    if arch == "llama":
        cls, cfg = LlamaForCausalLM, LlamaConfig(**_LLAMA_LIKE)
    elif arch == "qwen2":
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(**_LLAMA_LIKE)
    elif arch == "qwen3":
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(head_dim=16, **_LLAMA_LIKE)
    elif arch == "mistral":
        cls, cfg = MistralForCausalLM, MistralConfig(sliding_window=None, **_LLAMA_LIKE)
    elif arch == "gpt2":
        cls = GPT2LMHeadModel
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=MAX_POS,
            bos_token_id=0,
            eos_token_id=EOS,
            pad_token_id=EOS,
            initializer_range=0.2,  # at GPT-2's default 0.02 greedy repeats one token forever
        )
    else:
        raise AssertionError(arch)
    cfg._attn_implementation = attn
    torch.manual_seed(1000 + ARCHS.index(arch))  # distinct weights per architecture
    model = cls(cfg).eval()
    model.generation_config.pad_token_id = EOS
    model.generation_config.eos_token_id = EOS
    return model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models on a shared machine: intra-op threads only contend (measured 50x slower at 2).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def _model(arch: str, attn: str = "sdpa") -> torch.nn.Module:
    if (arch, attn) not in _MODELS:
        _MODELS[(arch, attn)] = _build(arch, attn)
    return _MODELS[(arch, attn)]


def _prompt(length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB - 1, (1, length), generator=g)  # [1, L], never EOS


@torch.no_grad()
def _greedy(model, ids: torch.Tensor, max_new_tokens: int, **kw) -> torch.Tensor:
    return model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, **kw)  # [1, L + new]


@torch.no_grad()
def _top2_margin(model, prefix: torch.Tensor) -> float:
    logits = model(prefix).logits[0, -1].double()  # [vocab]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _assert_greedy(model, got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """got == ref token for token; on a mismatch, xfail only for a float near-tie, else fail with evidence."""
    if got.shape == ref.shape and torch.equal(got, ref):
        return
    g, r = got[0].tolist(), ref[0].tolist()
    n = min(len(g), len(r))
    first = next((i for i in range(n) if g[i] != r[i]), None)
    if first is None:
        pytest.fail(
            f"{what}: lengths differ ({len(g)} vs greedy {len(r)}) with equal common part\n got {g}\n ref {r}"
        )
    margin = _top2_margin(model, ref[:, :first])
    msg = (
        f"{what}: first difference at index {first}: mtprobe {g[first]} vs greedy {r[first]}, "
        f"top-2 logit margin there {margin:.3e}\n got {g}\n ref {r}"
    )
    if margin < NEAR_TIE:
        pytest.xfail("float32 near-tie: " + msg)
    pytest.fail(msg)


# --------------------------------------------------------------------------------------------
# 1. mtprobe.generate and the HF route equal greedy on every architecture
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bc", [4, 10, 30])
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_greedy(arch: str, bc: int) -> None:
    model = _model(arch)
    best_accept = 0
    for i, length in enumerate(PROMPT_LENS):
        ids = _prompt(length, seed=10 * i + length)
        ref = _greedy(model, ids, 24)
        for incremental in (True, False):
            cfg = mtprobe.ProbeConfig(block_complexity=bc, incremental_masks=incremental)
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=24)
            _assert_greedy(model, out.sequences, ref, f"{arch} BC={bc} L={length} incremental={incremental}")
            assert len(out.accept_lengths) == out.forward_calls - 1
            assert 1 + sum(out.accept_lengths) == ref.shape[1] - length  # prefill yields the first token
            assert out.stop_reason == ("eos" if ref[0, -1].item() == EOS else "max_new_tokens")
            best_accept = max(best_accept, *out.accept_lengths)
        with torch.no_grad():
            hf = model.generate(
                ids,
                custom_generate=mtprobe.custom_generate,
                mtprobe_config=mtprobe.ProbeConfig(block_complexity=bc),
                max_new_tokens=24,
            )
        _assert_greedy(model, hf, ref, f"{arch} BC={bc} L={length} HF route")
    assert best_accept >= 2, "no mask-probe draft was ever accepted: verification is not being exercised"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eager_attention_matches_greedy(arch: str) -> None:
    # The eager path is where a boolean (rather than additive) tree mask would go silently wrong.
    model = _model(arch, "eager")
    for i, length in enumerate(PROMPT_LENS):
        ids = _prompt(length, seed=77 + i)
        ref = _greedy(model, ids, 24)
        out = mtprobe.generate(model, ids, mtprobe.ProbeConfig(block_complexity=30), max_new_tokens=24)
        _assert_greedy(model, out.sequences, ref, f"{arch} eager L={length}")


# --------------------------------------------------------------------------------------------
# The oracle drafter and a hand-wired loop (as generate.py wires it, keeping the adapter)
# --------------------------------------------------------------------------------------------


class OracleDrafter(_C.Drafter):
    """Proposes the true greedy continuation as a chain, plus planted errors and wrong branches.

    ``truth`` is prompt + greedy continuation (longer than will be generated). Each step the chain
    holds the next ``depth`` true tokens (fewer near the context limit), with probability
    ``plant_prob`` one of them replaced by a wrong token; ``siblings`` wrong branches (some two
    deep) hang off random chain nodes; with ``aux`` one embedding-only input is appended. Inputs
    are shuffled into a random topological order so the accepted path is not a contiguous run.
    ``on_observe(outcome)`` is called after every step (the KV cache is compacted by then).
    """

    def __init__(
        self,
        truth: list[int],
        embedding: torch.Tensor,
        *,
        depth: int = 4,
        plant_prob: float = 0.3,
        siblings: int = 2,
        aux: bool = True,
        drafts_at_prefill: bool = True,
        seed: int = 0,
        on_observe=None,
    ) -> None:
        super().__init__()
        self.truth, self.embedding = truth, embedding
        self.depth, self.plant_prob, self.siblings, self.aux = depth, plant_prob, siblings, aux
        self.drafts_at_prefill = drafts_at_prefill
        self.rng = random.Random(seed)
        self.on_observe = on_observe
        self.steps: list[dict] = []  # one per forward: what was proposed and what came back

    def name(self) -> str:
        return "oracle"

    def begin(self, prompt: torch.Tensor) -> None:
        assert prompt.tolist() == self.truth[: prompt.numel()]
        self.steps.clear()

    def _wrong(self, *avoid: int) -> int:
        while True:
            t = self.rng.randrange(VOCAB)
            if t not in avoid:
                return t

    def propose(self, committed: torch.Tensor, prefix_len: int, limits) -> _C.DraftBlock:
        c = committed.numel()
        start = prefix_len + c  # index in truth of the first token this step decides
        assert committed.tolist() == self.truth[prefix_len:start]
        prefill = prefix_len == 0
        # Node depth below prefix_len is (c - 1) + k for the k-th draft; it must stay <= max_depth.
        room = limits.max_depth - (c - 1)
        d = min(self.depth, room, len(self.truth) - start)
        plain = prefill and not self.drafts_at_prefill  # a prefill with no extra inputs at all
        if plain:
            room = 0
        d = max(min(d, room), 0)
        chain = list(self.truth[start : start + d])
        planted = None
        if d > 0 and self.rng.random() < self.plant_prob:
            planted = self.rng.randrange(d)
            chain[planted] = self._wrong(chain[planted])
        # Draft nodes as (key, parent_key, token); key 0 is the root (last committed input).
        nodes = [(("c", k), ("c", k - 1) if k > 0 else 0, chain[k]) for k in range(d)]
        budget = limits.budget - c if not prefill else 30
        n_sib = min(self.siblings, max(0, budget - d - int(self.aux)))
        for s in range(n_sib):
            j = self.rng.randrange(min(d, room - 1) + 1) if room >= 1 else None  # attach below chain depth j
            if j is None:
                break
            parent = 0 if j == 0 else ("c", j - 1)
            tok = self._wrong(
                self.truth[start + j] if start + j < len(self.truth) else -1, chain[j] if j < d else -1
            )
            nodes.append((("s", s), parent, tok))
            if s % 2 == 1 and j + 1 < room and len(nodes) < budget - int(self.aux):
                nodes.append((("s2", s), ("s", s), self._wrong()))
        # Random topological order: a node may be placed once its parent is.
        placed = {0: c - 1}
        order: list[tuple] = []
        pending = list(nodes)
        while pending:
            ready = [n for n in pending if n[1] in placed]
            pick = self.rng.choice(ready)
            pending.remove(pick)
            placed[pick[0]] = c + len(order)
            order.append(pick)
        block = _C.DraftBlock()
        block.tokens = torch.cat([committed.cpu(), torch.tensor([n[2] for n in order], dtype=torch.long)])
        block.parents = list(range(-1, c - 1)) + [placed[n[1]] for n in order]
        block.num_committed = c
        block.num_nodes = c + len(order)
        if self.aux and room >= 1 and start < len(self.truth):
            # An embedding-only input: the true next token's embedding, under the root. It is
            # auxiliary (past num_nodes), so it must never be accepted nor kept in the cache.
            block.embeds = self.embedding[self.truth[start]].detach().clone().unsqueeze(0)  # [1, hidden]
            block.parents = block.parents + [c - 1]
        accepted = planted if planted is not None else d
        self.steps.append(
            dict(
                prefix_len=prefix_len,
                c=c,
                start=start,
                d=d,
                planted=planted,
                expected_gain=min(accepted + 1, limits.tokens_left),
                chain_inputs=[placed[("c", k)] for k in range(d)],
                tokens_left=limits.tokens_left,
                T=len(block.parents),
            )
        )
        return block

    def observe(self, outcome) -> None:
        step = self.steps[-1]
        step.update(path=list(outcome.path), new_tokens=list(outcome.new_tokens), finished=outcome.finished)
        if self.on_observe is not None:
            self.on_observe(outcome)


class RecordingDrafter(_C.Drafter):
    """Delegates to a C++ drafter and records every step's outcome (for checks after the run)."""

    def __init__(self, inner: _C.Drafter) -> None:
        super().__init__()
        self.inner = inner
        self.steps: list[dict] = []

    def name(self) -> str:
        return "recording:" + self.inner.name()

    def begin(self, prompt: torch.Tensor) -> None:
        self.steps.clear()
        self.inner.begin(prompt)

    def propose(self, committed, prefix_len, limits):
        block = self.inner.propose(committed, prefix_len, limits)
        self.steps.append(dict(prefix_len=prefix_len, c=committed.numel(), T=block.num_inputs))
        return block

    def observe(self, outcome) -> None:
        self.steps[-1].update(
            path=list(outcome.path), new_tokens=list(outcome.new_tokens), finished=outcome.finished
        )
        self.inner.observe(outcome)


class _Run:
    """One hand-wired DecodeLoop run that keeps the adapter (and its TreeKVCache) for inspection."""

    def __init__(
        self, model, ids: torch.Tensor, drafter_factory, *, max_new_tokens: int, eos: list[int], bc: int = 30
    ) -> None:
        self.model = model
        capacity = ids.shape[1] + max_new_tokens + bc
        self.adapter = HFAdapter(model, capacity)
        self.max_position = -1
        self.drafter = drafter_factory(self)

        def forward(tokens, embeds, position_ids, mask, prefix_len, want_hidden):
            self.max_position = max(self.max_position, int(position_ids.max()))
            return self.adapter.forward(tokens, embeds, position_ids, mask, prefix_len, want_hidden)

        self.loop = _C.DecodeLoop(
            self.drafter,
            forward,
            self.adapter.kv_buffers,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos,
            max_positions=max_positions(model),
            block_complexity=bc,
            kv_capacity=capacity,
            mask_dtype="float32",
            device="cpu",
        )

    @torch.no_grad()
    def run(self, ids: torch.Tensor):
        self.result = self.loop.run(ids[0])
        self.sequences = torch.tensor(self.result.sequence, dtype=torch.long).unsqueeze(0)  # [1, L + new]
        return self.result


@torch.no_grad()
def _reference_kv(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [1, H_kv, n, D] of a plain causal forward over ``tokens``."""
    out = model(torch.tensor([tokens]), use_cache=True)
    pkv = out.cache if hasattr(out, "cache") else out.past_key_values  # renamed in transformers 5.2x
    return [(layer.keys, layer.values) for layer in pkv.layers]


def _kv_error(cache, ref, n: int) -> float:
    """Max |cache - ref| over the first n entries of every layer's keys and values."""
    err = 0.0
    for layer, (k, v) in zip(cache.layers, ref, strict=True):
        assert layer.keys.shape[2] >= n and k.shape[2] >= n
        err = max(err, (layer.keys[:, :, :n] - k[:, :, :n]).abs().max().item())
        err = max(err, (layer.values[:, :, :n] - v[:, :, :n]).abs().max().item())
    return err


def _final_kv_error(run: _Run, kv_ref) -> float:
    """The cache after a run against a plain forward of the final sequence minus its last token.

    The last step is not compacted (the sequence ended): its committed root sits right after the
    prefix, its accepted drafts where the block put them (prefix_len + input index)."""
    last = run.drafter.steps[-1]
    p, c, kept = last["prefix_len"], last["c"], len(last["new_tokens"])
    assert p + c + kept - 1 == kv_ref[0][0].shape[2]
    err = _kv_error(run.adapter.cache, kv_ref, p + c)
    for j in range(1, kept):
        src, dst = p + last["path"][j], p + c - 1 + j
        for layer, (k, v) in zip(run.adapter.cache.layers, kv_ref, strict=True):
            err = max(err, (layer.keys[:, :, src] - k[:, :, dst]).abs().max().item())
            err = max(err, (layer.values[:, :, src] - v[:, :, dst]).abs().max().item())
    return err


def _oracle_run(
    model,
    ids,
    *,
    max_new_tokens: int,
    eos: list[int] | None = None,
    seed: int = 0,
    check_kv: bool = True,
    **drafter_kw,
):
    """Runs the oracle drafter; checks the compacted cache against a plain forward after every step."""
    # Past the end (drafts may look beyond it), but never past the context limit.
    extra = min(max_new_tokens + 8, max_positions(model) - ids.shape[1])
    truth = _greedy(model, ids, extra, eos_token_id=None)[0].tolist()
    ref_kv = _reference_kv(model, truth) if check_kv else None
    kv_errors: list[float] = []
    holder: dict = {}

    def on_observe(outcome) -> None:
        if check_kv and not outcome.finished:
            # After compaction the cache holds the sequence minus its last (bonus) token.
            n = outcome.prefix_len + holder["run"].drafter.steps[-1]["c"] + len(outcome.path) - 1
            kv_errors.append(_kv_error(holder["run"].adapter.cache, ref_kv, n))

    def factory(run):
        holder["run"] = run
        return OracleDrafter(
            truth, model.get_input_embeddings().weight, seed=seed, on_observe=on_observe, **drafter_kw
        )

    run = _Run(model, ids, factory, max_new_tokens=max_new_tokens, eos=eos or [])
    run.run(ids)
    return run, truth, kv_errors


def _check_oracle_steps(run: _Run, truth: list[int]) -> None:
    """Every step gained exactly the drafts up to the first wrong one plus the bonus, all true tokens."""
    steps = run.drafter.steps
    for s in steps:
        assert s["new_tokens"] == truth[s["start"] : s["start"] + len(s["new_tokens"])], s
        if not s["finished"]:
            assert len(s["new_tokens"]) == s["expected_gain"], s
            # The accepted path is the chain's inputs, in order, wherever the shuffle put them.
            assert s["path"][1:] == s["chain_inputs"][: len(s["path"]) - 1], s
    gains = [len(s["new_tokens"]) for s in steps[1:]]
    assert list(run.result.accept_lengths) == gains


# --------------------------------------------------------------------------------------------
# 2. Oracle drafter: long accepted paths, still greedy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_drafter_long_accepts(arch: str) -> None:
    model = _model(arch)
    for seed, length in enumerate((1, 20)):
        ids = _prompt(length, seed=500 + seed)
        ref = _greedy(model, ids, 32, eos_token_id=None)
        run, truth, kv_errors = _oracle_run(model, ids, max_new_tokens=32, seed=seed)
        _assert_greedy(model, run.sequences, ref, f"{arch} oracle L={length}")
        _check_oracle_steps(run, truth)
        acc = list(run.result.accept_lengths)
        assert max(acc) == 5, f"no full depth-4 acceptance: {acc}"
        assert sum(a >= 3 for a in acc) >= 2, acc
        assert any(s["planted"] is not None and s["planted"] < s["d"] - 1 for s in run.drafter.steps), (
            "no partial accept"
        )
        assert max(kv_errors) <= KV_ATOL, f"compacted KV differs from a plain forward by {max(kv_errors):.2e}"


def test_oracle_drafter_chain_only_without_extras() -> None:
    # Pure chains (ordinary causal attention, no siblings or aux inputs, no drafts at prefill):
    # the loop's chain fast path (mask None) over multi-token accepts.
    model = _model("llama")
    ids = _prompt(9, seed=3)
    ref = _greedy(model, ids, 30, eos_token_id=None)
    run, truth, kv_errors = _oracle_run(
        model, ids, max_new_tokens=30, siblings=0, aux=False, plant_prob=0.0, drafts_at_prefill=False
    )
    _assert_greedy(model, run.sequences, ref, "llama oracle chain")
    _check_oracle_steps(run, truth)
    assert list(run.result.accept_lengths)[:-1] == [5] * (len(run.result.accept_lengths) - 1)
    assert max(kv_errors) <= KV_ATOL


# --------------------------------------------------------------------------------------------
# 3. The TreeKVCache after a run equals a plain forward's cache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_kv_cache_after_mask_probe_run(arch: str) -> None:
    model = _model(arch)
    ids = _prompt(13, seed=31)
    ref = _greedy(model, ids, 24, eos_token_id=None)

    def factory(run):
        inner = mask_probe_drafter(model, mtprobe.ProbeConfig(block_complexity=30))
        return RecordingDrafter(inner)

    run = _Run(model, ids, factory, max_new_tokens=24, eos=[])
    run.run(ids)
    _assert_greedy(model, run.sequences, ref, f"{arch} hand-wired mask probe")
    seq = run.sequences[0].tolist()
    kv_ref = _reference_kv(model, seq[:-1])
    cache = run.adapter.cache
    last = run.drafter.steps[-1]
    assert all(layer.length == last["prefix_len"] + last["T"] for layer in cache.layers)
    err = _final_kv_error(run, kv_ref)
    assert err <= KV_ATOL, f"{arch}: TreeKVCache differs from a plain forward by {err:.2e}"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tree_kv_cache_after_oracle_run(arch: str) -> None:
    # Same end-of-run check after long accepted paths (the per-step check runs inside _oracle_run).
    model = _model(arch)
    ids = _prompt(5, seed=41)
    run, truth, kv_errors = _oracle_run(model, ids, max_new_tokens=27, seed=7)
    seq = run.sequences[0].tolist()
    assert seq == truth[: len(seq)]
    kv_ref = _reference_kv(model, seq[:-1])
    assert len(run.drafter.steps[-1]["new_tokens"]) >= 3  # the run ends on a long, uncompacted path
    err = _final_kv_error(run, kv_ref)
    assert max([err, *kv_errors]) <= KV_ATOL, f"{arch}: TreeKVCache differs from a plain forward by {err:.2e}"


# --------------------------------------------------------------------------------------------
# 4. The context limit
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_near_context_limit(arch: str) -> None:
    model = _model(arch)
    ids = _prompt(120, seed=120)
    ref = _greedy(model, ids, 8, eos_token_id=None)
    assert ref.shape[1] == MAX_POS
    for bc in (4, 30):
        out = mtprobe.generate(
            model, ids, mtprobe.ProbeConfig(block_complexity=bc), max_new_tokens=8, eos_token_id=None
        )
        _assert_greedy(model, out.sequences, ref, f"{arch} BC={bc} at the context limit")
    # The oracle drafts as deep as allowed: no input may sit at a position >= the limit.
    run, truth, kv_errors = _oracle_run(model, ids, max_new_tokens=8, seed=1)
    _assert_greedy(model, run.sequences, ref, f"{arch} oracle at the context limit")
    _check_oracle_steps(run, truth[:MAX_POS])
    assert run.max_position == MAX_POS - 1  # drafted right up to the last position, never past it
    assert max(kv_errors, default=0.0) <= KV_ATOL


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_over_context_limit_raises(arch: str) -> None:
    model = _model(arch)
    ids = _prompt(121, seed=121)
    with pytest.raises(ValueError, match=r"121.*\b9\b|\b9\b.*121") as info:
        mtprobe.generate(model, ids, mtprobe.ProbeConfig(), max_new_tokens=9)
    assert "128" in str(info.value)
    with pytest.raises(ValueError, match=r"121.*\b9\b"):
        with torch.no_grad():
            model.generate(
                ids,
                custom_generate=mtprobe.custom_generate,
                mtprobe_config=mtprobe.ProbeConfig(),
                max_new_tokens=9,
            )


# --------------------------------------------------------------------------------------------
# 5. EOS inside an accepted block
# --------------------------------------------------------------------------------------------


def _eos_case(model, want_offset: set[int]):
    """A prompt and an EOS id whose first occurrence in the greedy continuation falls at a chosen
    offset inside the oracle's blocks. With depth-4 chains, no errors and no drafts at prefill,
    prefill yields continuation index 0 and step s >= 1 covers indices 5(s-1)+1 .. 5s: drafts at
    offsets 1..4, the bonus at offset 0 (mod 5)."""
    for seed in range(200):
        ids = _prompt(3 + seed % 11, seed=900 + seed)
        cont = _greedy(model, ids, 30, eos_token_id=None)[0, ids.shape[1] :].tolist()
        for i in range(6, len(cont)):
            if i % 5 in want_offset and cont[i] not in cont[:i]:
                return ids, cont[i], i
    pytest.skip("no greedy continuation with a fresh token at the wanted offset")  # pragma: no cover


@pytest.mark.parametrize("where", ["mid_block", "last_draft", "bonus"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_eos_inside_accepted_block(arch: str, where: str) -> None:
    model = _model(arch)
    offsets = {"mid_block": {1, 2, 3}, "last_draft": {4}, "bonus": {0}}[where]
    ids, eos, index = _eos_case(model, offsets)
    ref = _greedy(model, ids, 30, eos_token_id=eos)
    assert ref.shape[1] == ids.shape[1] + index + 1 and ref[0, -1].item() == eos  # greedy stops on it
    run, truth, _ = _oracle_run(
        model, ids, max_new_tokens=30, eos=[eos], siblings=1, plant_prob=0.0, drafts_at_prefill=False
    )
    _assert_greedy(model, run.sequences, ref, f"{arch} oracle EOS at continuation index {index}")
    assert run.result.stop_reason == "eos"
    last = run.drafter.steps[-1]
    assert last["finished"]
    # The whole chain verified; the EOS (a draft, or the bonus) cut the step's tokens right after it.
    assert last["d"] == 4 and len(last["path"]) == 5, last
    assert len(last["new_tokens"]) == (index % 5 or 5), last
    # The mask-probing route, through both entry points, stops at the same place.
    out = mtprobe.generate(
        model, ids, mtprobe.ProbeConfig(block_complexity=10), max_new_tokens=30, eos_token_id=eos
    )
    _assert_greedy(model, out.sequences, ref, f"{arch} mtprobe.generate EOS")
    assert out.stop_reason == "eos"
    with torch.no_grad():
        hf = model.generate(
            ids,
            custom_generate=mtprobe.custom_generate,
            mtprobe_config=mtprobe.ProbeConfig(block_complexity=10),
            max_new_tokens=30,
            eos_token_id=eos,
        )
    _assert_greedy(model, hf, ref, f"{arch} HF route EOS")


@pytest.mark.parametrize("arch", ARCHS)
def test_mask_layer_offsets_reach_every_architecture(arch: str) -> None:
    """Calibrated layer offsets (mtprobe.offline.calibrate --layer-offsets) find each architecture's decoder
    layers (GPT-2's ``transformer.h`` by the fallback) and change the mask inputs' logits only."""
    model = _model(arch)
    layers = decoder_layers(model)
    assert len(layers) == 2
    if arch == "gpt2":
        assert layers is model.transformer.h
    torch.manual_seed(5)
    hidden = model.get_input_embeddings().weight.shape[1]
    tokens = torch.randint(0, EOS, (6,))  # [n_tok]
    embeds = torch.randn(2, hidden) * 0.1  # [n_emb, hidden]: two mask inputs after the tokens
    positions = torch.arange(8)[None]  # [1, T]
    adapter = HFAdapter(model, capacity=16)
    with torch.no_grad():
        plain, _ = adapter.forward(tokens, embeds, positions, None, 0, False)  # [T, vocab]
        adapter.set_mask_layer_offsets(torch.randn(2, hidden))
        offset, _ = adapter.forward(tokens, embeds, positions, None, 0, False)
    torch.testing.assert_close(offset[:6], plain[:6], rtol=0, atol=0)  # the tokens never see them
    assert (offset[6:] - plain[6:]).abs().max() > 1e-3
    assert all(not layer._forward_pre_hooks for layer in layers)


def test_models_are_distinct_and_not_degenerate() -> None:
    # Guards the test setup: different weights per architecture and some variety in greedy output.
    seen = set()
    for arch in ARCHS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cont = _greedy(_model(arch), _prompt(7, seed=17), 24, eos_token_id=None)[0, 7:].tolist()
        assert len(set(cont)) >= 3, (arch, cont)
        seen.add(tuple(cont))
    assert len(seen) == len(ARCHS)


# --------------------------------------------------------------------------------------------
# 6. Sliding-window attention: the tree mask honours the window
# --------------------------------------------------------------------------------------------

WINDOW = 6
SLIDING_ARCHS = ("gemma3", "mistral", "qwen2")


def _build_sliding(arch: str, attn: str = "sdpa", window: int = WINDOW) -> torch.nn.Module:
    """Tiny models whose window the tests' sequences outgrow many times over: Gemma 3 (per-layer-type
    dict mask, sliding and global layers mixed), Mistral (one window on every layer), Qwen 2
    (``use_sliding_window`` with ``max_window_layers``)."""
    kw = dict(_LLAMA_LIKE, num_hidden_layers=3)
    if arch == "gemma3":
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        cfg = Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=window, layer_types=layer_types, **kw
        )
        cls = Gemma3ForCausalLM
    elif arch == "mistral":
        cls, cfg = MistralForCausalLM, MistralConfig(sliding_window=window, **kw)
    elif arch == "qwen2":
        cfg = Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=1, **kw)
        cls = Qwen2ForCausalLM
    else:
        raise AssertionError(arch)
    cfg._attn_implementation = attn
    torch.manual_seed(2000 + SLIDING_ARCHS.index(arch))
    model = cls(cfg).eval()
    model.generation_config.pad_token_id = EOS
    model.generation_config.eos_token_id = EOS
    return model


def _sliding_model(arch: str, attn: str = "sdpa") -> torch.nn.Module:
    key = (f"sliding-{arch}", attn)
    if key not in _MODELS:
        _MODELS[key] = _build_sliding(arch, attn)
    return _MODELS[key]


def _repetitive_prompt(length: int, seed: int) -> torch.Tensor:
    ids = _prompt(length, seed)
    return torch.cat([ids, ids[:, : length // 2]], dim=1)  # [1, 1.5 L]: repeats for PLD / STAND to find


_SLIDING_METHODS = {
    "probe-static": mtprobe.ProbeConfig(block_complexity=30),
    "probe-dynamic": mtprobe.ProbeConfig(block_complexity=30, num_masks=2),
    "pld": mtprobe.PromptLookupConfig(),
    "stand": mtprobe.StandConfig(),
    "lookahead": mtprobe.LookaheadConfig(),
    "hybrid": mtprobe.HybridConfig(),
}


def test_sliding_window_layouts() -> None:
    gemma = _sliding_model("gemma3")
    assert sliding_window(gemma) == SlidingWindow(WINDOW, per_layer_type=True)
    assert sliding_window(_sliding_model("mistral")) == SlidingWindow(WINDOW, per_layer_type=False)
    assert sliding_window(_sliding_model("qwen2")) == SlidingWindow(WINDOW, per_layer_type=True)
    # Configured but off: Qwen 2 without use_sliding_window, Mistral with None, Gemma 3 all global.
    off = Qwen2Config(use_sliding_window=False, sliding_window=WINDOW, **_LLAMA_LIKE)
    assert sliding_window(Qwen2ForCausalLM(off)) is None
    assert sliding_window(_model("mistral")) is None
    assert sliding_window(_model("llama")) is None
    all_full = Gemma3TextConfig(
        head_dim=16, sliding_window=WINDOW, layer_types=["full_attention"] * 2, **_LLAMA_LIKE
    )
    assert sliding_window(Gemma3ForCausalLM(all_full)) is None
    # A layer type the mask does not know is refused, not silently treated as global.
    odd = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, sliding_window=WINDOW, **_LLAMA_LIKE))
    odd.config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        sliding_window(odd)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SlidingWindow(0, per_layer_type=True)


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_sliding_mask_equals_hf_masks_on_a_chain(arch: str) -> None:
    """For a causal block (a chain) our window over HF's full mask is exactly HF's own sliding mask."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from mtprobe.target_model.cache import TreeKVCache

    model = _sliding_model(arch, "eager")  # eager: HF materialises the additive masks
    cfg = model.config
    checked = 0
    for prefix_len, t in ((0, 9), (3, 1), (5, 4), (17, 6), (40, 12)):
        cache = TreeKVCache(cfg.num_hidden_layers, prefix_len + t)
        cache.set_length(prefix_len)
        x = torch.zeros(1, t, cfg.hidden_size)  # [1, T, hidden]
        pos = torch.arange(prefix_len, prefix_len + t).unsqueeze(0)  # [1, T]
        name = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
        kw = dict(config=cfg, inputs_embeds=x, attention_mask=None, position_ids=pos, **{name: cache})
        full = create_causal_mask(**kw)  # [1, 1, T, P + T]
        hf_sliding = create_sliding_window_causal_mask(**kw)  # [1, 1, T, P + T]
        assert full.shape == hf_sliding.shape == (1, 1, t, prefix_len + t)
        ours = sliding_mask(full, pos, prefix_len, WINDOW)
        assert torch.equal(ours, hf_sliding), (arch, prefix_len, t)
        checked += int(not torch.equal(full, hf_sliding))  # the window actually hid something
    assert checked >= 3


def test_sliding_mask_on_a_tree() -> None:
    """Tree nodes sit at prefix_len + depth; a key is visible iff it is the query's ancestor (or in
    the prefix) and fewer than ``window`` positions behind it: a brute-force check on random trees."""
    min_ = torch.finfo(torch.float32).min
    rng = random.Random(5)
    for _ in range(20):
        prefix_len, t, window = rng.randrange(0, 20), rng.randrange(1, 16), rng.randrange(1, 9)
        parents = [-1] + [rng.randrange(i) for i in range(1, t)]
        depth = [0] * t
        for i in range(1, t):
            depth[i] = depth[parents[i]] + 1
        pos = [prefix_len + d for d in depth]

        def ancestors(i: int, parents: list[int] = parents) -> set[int]:
            out = set()
            while i >= 0:
                out.add(i)
                i = parents[i]
            return out

        full = torch.full((1, 1, t, prefix_len + t), min_)
        want = torch.full((1, 1, t, prefix_len + t), min_)
        for q in range(t):
            for k in range(prefix_len):
                full[0, 0, q, k] = 0.0
                if pos[q] - k < window:
                    want[0, 0, q, k] = 0.0
            for a in ancestors(q):
                full[0, 0, q, prefix_len + a] = 0.0
                if pos[q] - pos[a] < window:
                    want[0, 0, q, prefix_len + a] = 0.0
        got = sliding_mask(full, torch.tensor([pos]), prefix_len, window)
        assert torch.equal(got, want), (prefix_len, t, window, parents)
    with pytest.raises(ValueError, match="expected prefix_len \\+ T = 3 \\+ 2"):
        sliding_mask(torch.zeros(1, 1, 2, 4), torch.tensor([[3, 4]]), 3, 2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_sliding_window_matches_greedy(arch: str, attn: str) -> None:
    model = _sliding_model(arch, attn)
    for length in (3, 20):  # a prompt inside the window and one past it; 40 new tokens go far past both
        ids = _repetitive_prompt(length, seed=300 + length)
        ref = _greedy(model, ids, 40, eos_token_id=None)
        assert len(set(ref[0, ids.shape[1] :].tolist())) >= 5, "degenerate greedy text tests nothing"
        for name, cfg in _SLIDING_METHODS.items():
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=40, eos_token_id=None)
            _assert_greedy(model, out.sequences, ref, f"{arch} {attn} {name} L={ids.shape[1]}")
    with torch.no_grad():
        hf = model.generate(
            ids,
            custom_generate=mtprobe.custom_generate,
            mtprobe_config=mtprobe.ProbeConfig(block_complexity=10),
            max_new_tokens=40,
            eos_token_id=None,
        )
    _assert_greedy(model, hf, ref, f"{arch} {attn} HF route")


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_window_oracle_long_accepts(arch: str) -> None:
    """Depth-4 chains under a window of 4: accepted paths span the whole window, so the window also
    cuts between tree nodes, not only into the prefix."""
    model = _build_sliding(arch, window=4)
    ids = _prompt(9, seed=610)
    ref = _greedy(model, ids, 40, eos_token_id=None)
    # The cache is not checked here: HF's own cache for these models keeps only the window.
    run, truth, _ = _oracle_run(model, ids, max_new_tokens=40, seed=3, check_kv=False)
    _assert_greedy(model, run.sequences, ref, f"{arch} oracle window 4")
    _check_oracle_steps(run, truth)
    assert max(run.result.accept_lengths) == 5


def test_ignoring_the_window_would_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control that gives the tests above their teeth: with the window dropped from the tree
    mask (the adapter told there is none) the same runs stop matching greedy."""
    import mtprobe.target_model.adapter

    monkeypatch.setattr(mtprobe.target_model.adapter, "sliding_window", lambda m: None)
    for arch in SLIDING_ARCHS:
        model = _sliding_model(arch)
        ids = _repetitive_prompt(20, seed=320)
        ref = _greedy(model, ids, 40, eos_token_id=None)
        wrong = []  # a chain-shaped block goes without a tree mask (the model windows it): trees matter
        for name, cfg in _SLIDING_METHODS.items():
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=40, eos_token_id=None)
            wrong += [name] if not torch.equal(out.sequences, ref) else []
        assert len(wrong) >= 2, f"{arch}: only {wrong} went wrong without the window"
    # The oracle's chains under a window of 4 diverge from the true continuation too.
    model = _build_sliding("gemma3", window=4)
    ids = _prompt(9, seed=610)
    with pytest.raises(AssertionError):  # the oracle checks every committed token against greedy
        _oracle_run(model, ids, max_new_tokens=40, seed=3, check_kv=False)


def test_tree_attention_refuses_beyond_the_window() -> None:
    import mtprobe.tree_attention

    mtprobe.tree_attention.register()
    model = _build_sliding("gemma3", attn=mtprobe.tree_attention.NAME)
    ids = _prompt(3, seed=1)
    # Inside the window the ancestor-bits attention is exact (nothing to hide)...
    out = mtprobe.generate(model, ids, mtprobe.ProbeConfig(block_complexity=4), max_new_tokens=WINDOW - 3)
    assert out.sequences.shape[1] == WINDOW
    # ...past it, a clear refusal that says what would work.
    with pytest.raises(NotImplementedError, match=r"sliding window \(6\).*'sdpa' or 'eager'"):
        mtprobe.generate(model, ids, mtprobe.ProbeConfig(block_complexity=4), max_new_tokens=WINDOW)


# --------------------------------------------------------------------------------------------
# The static forward plan (mtprobe.target_model.plan) on every architecture, padded to its buckets: sliding
# windows (dict masks on Gemma 3 and Qwen 2) and absolute positions (GPT-2) included.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "stand-in-graphs"])
@pytest.mark.parametrize("arch", ARCHS + tuple(f"sliding-{a}" for a in SLIDING_ARCHS))
def test_padded_plan_matches_greedy(arch: str, graphs: bool, request) -> None:
    # graphs: the graph path (keys over the whole capacity, static buffers per bucket) with the CPU
    # stand-in for the CUDA capture (conftest.stand_in_graphs).
    if graphs:
        request.getfixturevalue("stand_in_graphs")
    model = _sliding_model(arch.split("-")[1]) if arch.startswith("sliding-") else _model(arch)
    plan = mtprobe.PlanConfig(pad=True, growth=32, buckets=(1, 2, 4, 8, 16, 32), cuda_graphs=graphs)
    for i, length in enumerate((7, 40)):
        ids = _repetitive_prompt(length, seed=7 * i + length)
        ref = _greedy(model, ids, 24)
        for name in ("probe-dynamic", "hybrid", "pld"):
            out = mtprobe.generate(model, ids, _SLIDING_METHODS[name], max_new_tokens=24, plan=plan)
            _assert_greedy(model, out.sequences, ref, f"{arch} {name} L={ids.shape[1]} padded plan")
            assert out.plan is not None and out.plan["pad"]
            # Every decode step replays its bucket's graph (none past the last bucket here: BC <= 30).
            assert out.plan["replays"] == (out.steps if graphs else 0)
