"""Sampling is lossless: the output distribution equals the target's, proven statistically.

Verification by sample matching: every tree node samples the target's processed distribution
and the child equal to the sample is accepted. On a tiny model with a 16-token vocabulary the
exact joint distribution of the first two generated tokens is computed by enumeration (256
cells), and many seeded mtprobe samples are compared with it by a chi-square test. The test's
power is checked too: the same test at the same sample count rejects a slightly wrong sampler.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import mtprobe
from mtprobe import _C
from mtprobe.reference.lookahead import LookaheadPool
from mtprobe.target_model.adapter import HFAdapter

V = 16
ALPHA = 1e-3  # false-alarm rate of each test; the seeds are fixed, so each run is deterministic
N_SAMPLES = 2000
SAMPLE_KW = dict(temperature=0.9, top_k=10, top_p=0.95)


def tiny_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return LlamaConfig(**{**kwargs, **overrides})


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model gains nothing from threads; they only add overhead
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    yield model
    torch.set_num_threads(threads)


def processors() -> LogitsProcessorList:
    # What HF's generate builds for SAMPLE_KW, in its order.
    return LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(10), TopPLogitsWarper(0.95)])


@torch.no_grad()
def exact_pair_distribution(model, prompt: torch.Tensor) -> torch.Tensor:
    """P(x1, x2) under the processed target distribution: [V, V]."""
    proc = processors()
    p1 = proc(prompt, model(prompt).logits[:, -1].float()).softmax(-1)[0]  # [V]
    ext = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], dim=1)  # [V, L + 1]
    p2 = proc(ext, model(ext).logits[:, -1].float()).softmax(-1)  # [V, V]
    return p1[:, None] * p2


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit, cells with expected count < 5 pooled into one.

    A sample in a cell of probability zero is impossible under ``probs``: p-value 0.
    """
    n = counts.sum().item()
    expected = probs.flatten().double() * n
    observed = counts.flatten().double()
    if observed[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * (obs.sum() / exp.sum())  # float rounding only: chisquare wants equal totals
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


class FullTreeDrafter(_C.Drafter):
    """Proposes every vocabulary token as a child of the root: a sample is always accepted."""

    def name(self):
        return "full_tree"

    def begin(self, prompt):
        pass

    def propose(self, committed, prefix_len, limits):
        c = committed.shape[0]
        b = _C.DraftBlock()
        k = V if limits.tokens_left >= 2 else 0
        b.tokens = torch.cat([committed, torch.arange(k)])
        b.parents = [i - 1 for i in range(c)] + [c - 1] * k
        b.num_committed = c
        b.num_nodes = c + k
        return b

    def observe(self, outcome):
        pass


def sample_with_loop(model, prompt: torch.Tensor, drafter, n: int, seed: int) -> torch.Tensor:
    """n two-token continuations from the C++ loop: counts [V, V]."""
    proc = processors()
    counts = torch.zeros(V, V, dtype=torch.long)
    torch.manual_seed(seed)
    for _ in range(n):
        adapter = HFAdapter(model, prompt.shape[1] + 2 + 64)
        loop = _C.DecodeLoop(
            drafter,
            adapter.forward,
            adapter.kv_buffers,
            max_new_tokens=2,
            eos_token_ids=[],
            max_positions=64,
            block_complexity=64,
            kv_capacity=prompt.shape[1] + 2 + 64,
            mask_dtype="float32",
            device="cpu",
            do_sample=True,
            process=lambda ids, s: proc(ids, s),
        )
        seq = loop.run(prompt[0]).sequence
        counts[seq[-2], seq[-1]] += 1
    return counts


def test_full_tree_drafter_sampling_is_exact(tiny):
    # Every step accepts a draft, so each pair is (accepted draft sample, bonus sample).
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    exact = exact_pair_distribution(tiny, prompt)
    counts = sample_with_loop(tiny, prompt, FullTreeDrafter(), n=N_SAMPLES, seed=1)
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, f"sampled pairs differ from the target distribution (chi-square p = {p:.2e})"


def exact_triple_distribution(model, prompt: torch.Tensor) -> torch.Tensor:
    """P(x1, x2, x3) under the processed target distribution: [V, V, V]."""
    proc = processors()
    p12 = exact_pair_distribution(model, prompt)  # [V, V]
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V * V, 2]
    ext = torch.cat([prompt.repeat(V * V, 1), pairs], dim=1)  # [V * V, L + 2]
    p3 = proc(ext, model(ext).logits[:, -1].float()).softmax(-1).view(V, V, V)
    return p12[:, :, None] * p3


def _calibrated_masks(model, path, temperature=None, **learn) -> str:
    import dataclasses

    from mtprobe.offline.calibrate import calibrate_masks

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (1, 5), generator=g) for _ in range(3)]
    cal = calibrate_masks(model, prompts, max_new_tokens=8, epochs=2, holdout=0, lr=0.2, **learn)
    dataclasses.replace(cal, mask_temperature=temperature).save(path)
    return str(path)


@pytest.mark.parametrize("masks", ["prompt_mean", "calibrated", "planned", "lora"])
def test_mask_probe_sampling_is_exact(tiny, tmp_path, masks):
    # Three tokens: the prefill samples x1 and appends the masks; the first decode step drafts from
    # them, so (x2, x3) is an accepted draft and its bonus, or a rejection's resample. (Two tokens
    # would leave no room to draft: the prefill has no candidates yet.)
    prompt = torch.tensor([[2, 7, 1, 8]])
    with torch.no_grad():
        exact = exact_triple_distribution(tiny, prompt).reshape(-1)  # [V^3]
    extra = {}
    if masks == "calibrated":  # masks learned for the tiny model (python/mtprobe/offline/calibrate.py)
        extra = dict(mask_init="calibrated", mask_path=_calibrated_masks(tiny, tmp_path / "tiny.safetensors"))
    if masks == "planned":  # two masks on the likely ends only (ProbeConfig.mask_value)
        extra = dict(num_masks=2, mask_value=0.3)
    if masks == "lora":  # two planned masks with per-mask offsets, a mask LoRA and temperatures
        learn = dict(num_masks=2, layer_offsets=True, mask_lora_rank=2, lora_lr=0.01)
        temperature = torch.tensor([0.5, 2.0])
        path = _calibrated_masks(tiny, tmp_path / "lora.safetensors", temperature, **learn)
        extra = dict(num_masks=2, mask_value=0.3, mask_init="calibrated", mask_path=path)
    cfg = mtprobe.ProbeConfig(block_complexity=10, **extra)
    counts, accepted = sample_triples(tiny, prompt, cfg, seed=2)
    assert accepted > N_SAMPLES // 20, accepted  # drafts were verified and kept, or this proves little
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, f"sampled triples differ from the target distribution (chi-square p = {p:.2e})"


def sample_triples(model, prompt: torch.Tensor, cfg, seed: int) -> tuple[torch.Tensor, int]:
    """N_SAMPLES three-token continuations from mtprobe.generate: (counts [V^3], accepted drafts).

    One call with num_return_sequences=N_SAMPLES: each sequence is a generation of its own (its own
    drafter, KV cache and loop; test_hf_route checks that they are what single calls sample in turn),
    without HF's argument preparation N_SAMPLES times over."""
    torch.manual_seed(seed)
    out = mtprobe.generate(
        model, prompt, cfg, max_new_tokens=3, do_sample=True, num_return_sequences=N_SAMPLES, **SAMPLE_KW
    )
    x = out.sequences[:, -3:]  # [N_SAMPLES, 3]
    counts = torch.bincount((x[:, 0] * V + x[:, 1]) * V + x[:, 2], minlength=V**3)
    return counts, sum(out.accepted_per_depth)


@pytest.mark.parametrize(
    ("circuit", "lora", "base", "top_k", "bank"),
    [(c, 0, "target", None, False) for c in ("ff", "cp", "hmm", "btree")]
    + [
        ("btree", 1, "target", None, False),
        ("cp", 0, "target", 3 * V // 4, False),
        ("btree", 1, "draft", 3 * V // 4, False),
        ("btree", 0, "target", None, True),
    ],
)
def test_circuit_heads_sampling_is_exact(tiny, tmp_path, monkeypatch, circuit, lora, base, top_k, bank):
    # As for probing: the prefill samples x1 and the head's circuit (trained briefly on the model's own
    # text) drafts two sibling x2 candidates from q(x2 | x1), verified by rejection sampling with q.
    # lora = 1: the draft reads its own LoRA copy of the last layer (mtprobe/heads/lora.py); base: whose
    # logits its emissions build on. top_k: the head emits only 3/4 of the vocabulary and the target's two
    # most probable next tokens (q = 0 elsewhere; 16 of them would be the whole vocabulary here).
    # bank: EntMTP's static tree instead, filled with the circuit's three most probable x2 and the best
    # x3 below the first: deterministic drafts, verified by sample matching.
    from mtprobe import heads

    monkeypatch.setattr(heads, "ROOT_CANDIDATES", 2)
    from mtprobe.offline import heads as offline_heads
    from mtprobe.offline.calibration_data import calibration_sequences

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (1, 5), generator=g) for _ in range(6)]
    seqs = calibration_sequences(tiny, prompts, max_new_tokens=30)
    layer = tiny.config.num_hidden_layers - lora if lora else -1
    features = offline_heads.compute_features(tiny, [(ids, plen - 1) for ids, plen in seqs], layer=layer)
    spec = heads.HeadSpec(
        circuit,
        window=3,
        rank=1 if circuit == "ff" else 2,
        hidden_size=32,
        vocab_size=V,
        lora_layers=lora,
        lora_base=base,
    )
    torch.manual_seed(0)
    head = heads.new_head(tiny, spec)
    heads.save_head(head, tiny, tmp_path, offline_heads.train_head(head, features, steps=100, lr=3e-3))
    tree = None
    if bank:
        from mtprobe.topology import TopologyBank

        tree = TopologyBank(trees=(((0,), (1,), (2,), (0, 0)),), drafter="heads", num_masks=0, window=3)
    cfg = mtprobe.HeadsConfig(
        path=str(tmp_path), block_complexity=10, top_branches=2, vocab_top_k=top_k, bank=tree
    )
    prompt = torch.tensor([[2, 7, 1, 8]])
    with torch.no_grad():
        exact = exact_triple_distribution(tiny, prompt).reshape(-1)  # [V^3]
    counts, accepted = sample_triples(tiny, prompt, cfg, seed=3)
    assert accepted > N_SAMPLES // 20, accepted  # drafts were verified and kept, or this proves little
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, (
        f"{circuit}: sampled triples differ from the target distribution (chi-square p = {p:.2e})"
    )


@pytest.mark.parametrize("bug", ["bonus_from_root", "temperature_1.3", "top_k_9"])
def test_chi_square_rejects_a_wrong_sampler(tiny, bug):
    # The same test at the same sample count rejects the kind of bug it is there to catch: the
    # bonus token drawn from the wrong node's distribution, the wrong temperature, or top-k off by one
    # (total variation 0.03 from the exact pairs: at N_SAMPLES it was rejected under 40 of 40 seeds
    # here, at 1500 samples under 22 of 40; hence 2000).
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    exact = exact_pair_distribution(tiny, prompt)
    if bug == "bonus_from_root":
        p1 = exact.sum(1)
        wrong = p1[:, None] * p1[None, :]
    else:
        with torch.no_grad():
            ext = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
            logits1, logits2 = tiny(prompt).logits[:, -1].float(), tiny(ext).logits[:, -1].float()
        temperature, top_k = (1.3, 10) if bug == "temperature_1.3" else (0.9, 9)
        proc = LogitsProcessorList(
            [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(0.95)]
        )
        wrong = proc(prompt, logits1).softmax(-1)[0][:, None] * proc(ext, logits2).softmax(-1)
    gen = torch.Generator().manual_seed(3)
    draws = torch.multinomial(wrong.flatten(), N_SAMPLES, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=V * V).view(V, V)
    tv = 0.5 * (wrong - exact).abs().sum().item()
    assert chi_square_pvalue(counts, exact) < ALPHA, f"missed a sampler at total variation {tv:.3f}"


@pytest.mark.parametrize(
    "cfg",
    [
        mtprobe.ProbeConfig(block_complexity=10),
        mtprobe.DraftModelConfig(num_tokens=3, num_draft_layers=1),
        mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=3, num_draft_layers=1),
    ],
    ids=["probe", "layer_truncated_draft", "quantized_draft"],
)
def test_same_seed_same_text(cfg):
    # From the first call on, on a model fresh to mtprobe: what a call builds once per model (a
    # layer-truncated draft's throwaway initialisation) must not draw from the global generator.
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = torch.tensor([[1, 2, 3]])
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(
            mtprobe.generate(model, prompt, cfg, max_new_tokens=12, do_sample=True, **SAMPLE_KW).sequences
        )
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(124)
    other = mtprobe.generate(model, prompt, cfg, max_new_tokens=12, do_sample=True, **SAMPLE_KW).sequences
    assert not torch.equal(runs[0], other)  # a different seed gives a different text (V**12 choices)


# --- the other drafters: rejection sampling (draft model) and sample matching (PLD, STAND) ------


@pytest.fixture(scope="module")
def tiny_draft():
    torch.manual_seed(5)
    cfg = tiny_config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(cfg).eval()


def sample_pairs(model, prompt: torch.Tensor, cfg, seed: int) -> torch.Tensor:
    """N_SAMPLES two-token continuations from mtprobe.generate: counts [V, V]."""
    torch.manual_seed(seed)
    out = mtprobe.generate(
        model, prompt, cfg, max_new_tokens=2, do_sample=True, num_return_sequences=N_SAMPLES, **SAMPLE_KW
    )
    x = out.sequences[:, -2:]  # [N_SAMPLES, 2]
    return torch.bincount(x[:, 0] * V + x[:, 1], minlength=V * V).view(V, V)


# For lookahead, a prompt whose bigrams cover about half the mass of the first two sampled tokens
# (found by searching over the tiny model's pair distribution): pooled from the prompt, they are
# verified at the first decode step and accepted about half the time.
LOOKAHEAD_PROMPT = [4, 2, 9, 2, 2, 2, 13, 2, 6, 2, 12, 6, 9, 1, 12, 4, 2]


@pytest.mark.parametrize(
    "name",
    [
        "plain",
        "draft_model_independent",
        "draft_model_tree",
        "draft_model_self_1_layer",
        "draft_model_self_quantized",
        "prompt_lookup",
        "stand",
        "stand_memory",
        "lookahead",
        "hybrid",
        "auto",
        "auto_draft_model",
        "entmtp_ladder",
        "entmtp_hysteretic",
    ],
)
def test_other_drafters_sampling_is_exact(tiny, tiny_draft, name):
    # The prompt repeats so that PLD and STAND find matches and draft at the first decode step.
    prompt = torch.tensor([LOOKAHEAD_PROMPT if name == "lookahead" else [4, 2, 9, 4, 2, 9, 4, 2]])
    cfg = {
        "plain": mtprobe.PlainConfig(),  # no drafts: the bonus token alone, drawn from the target
        "draft_model_independent": mtprobe.DraftModelConfig(draft_model=tiny_draft, num_tokens=3),
        "draft_model_tree": mtprobe.DraftModelConfig(draft_model=tiny_draft, num_tokens=2, top_branches=3),
        "draft_model_self_1_layer": mtprobe.DraftModelConfig(num_draft_layers=1, num_tokens=3),
        # Nearly the target: most drafts are accepted, so acceptance (not only rejection) is exercised.
        "draft_model_self_quantized": mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=3),
        "prompt_lookup": mtprobe.PromptLookupConfig(num_tokens=3),
        "stand": mtprobe.StandConfig(block_complexity=10),
        # A cross-request memory filled by the earlier samples' text, which later samples draft from.
        "stand_memory": mtprobe.StandConfig(block_complexity=10, memory_size=64),
        "hybrid": mtprobe.HybridConfig(block_complexity=10),
        "lookahead": mtprobe.LookaheadConfig(ngram_size=2, window=3, guess_set_size=4, pool_from_prompt=True),
        # A flat forward profile: the scheduler verifies the drafts it is offered, so they matter.
        "auto": mtprobe.AutoConfig(
            drafters=(mtprobe.PromptLookupConfig(num_tokens=3), mtprobe.StandConfig(block_complexity=10)),
            profile=mtprobe.ForwardProfile(
                mtprobe.target_model.profile.ProfileKey.of(tiny), (1, 64), (0,), ((1.0, 1.0),)
            ),
        ),
        # The quantized self-draft beside prompt lookup: asked when its forecast beats prompt lookup's
        # cut, its sampled chain verified by rejection sampling.
        "auto_draft_model": mtprobe.AutoConfig(
            drafters=(
                mtprobe.PromptLookupConfig(num_tokens=3),
                mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=3),
            ),
            profile=mtprobe.ForwardProfile(
                mtprobe.target_model.profile.ProfileKey.of(tiny), (1, 64), (0,), ((1.0, 1.0),)
            ),
        ),
        # Thresholds that switch trees on the tiny model's scores, so several shapes are verified.
        "entmtp_ladder": mtprobe.EntMTPConfig(
            policy="ladder", feature="top1", thresholds=(0.05, 0.1, 0.15, 0.2, 0.3)
        ),
        "entmtp_hysteretic": mtprobe.EntMTPConfig(policy="hysteretic", feature="top1", thresholds=(0.1, 0.2)),
    }[name]
    exact = exact_pair_distribution(tiny, prompt)
    if name == "lookahead":  # the guesses must matter, or the test would prove nothing
        pool = LookaheadPool(2, 4)
        for i in range(1, len(LOOKAHEAD_PROMPT)):
            pool.add(LOOKAHEAD_PROMPT[i - 1 : i + 1])
        covered = sum(float(exact[t, g]) for t in range(V) for (g,) in pool.lookup(t))
        assert covered > 0.3, covered
    if name == "stand_memory":
        mtprobe.ngram_memory(tiny, cfg).clear()
    counts = sample_pairs(tiny, prompt, cfg, seed=7)
    if name == "stand_memory":  # the memory drafted, or the case would prove nothing beyond "stand"
        assert mtprobe.ngram_memory(tiny, cfg).hits > N_SAMPLES // 2
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, f"{name}: sampled pairs differ from the target distribution (chi-square p = {p:.2e})"


# Since sampled rows are decoded together (mtprobe.decode.batch), num_return_sequences=N_SAMPLES above runs
# in groups of MAX_ROWS rows, each drawing from a generator of its own: the tests above prove that path for
# every drafter a batch runs together. The two below prove rows of different prompts in one batch, and the
# one-after-another path that a single sequence (or a batch that cannot run together) takes.
BATCH_CONFIGS = {
    "prompt_lookup": lambda: mtprobe.PromptLookupConfig(num_tokens=3),
    # rejection sampling: the draft's own draws take the row's generator too
    "draft_model_self_quantized": lambda: mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=3),
}
DRAFT_VOCAB_4 = "draft_model_self_quantized, a draft vocabulary of 4 rows"
# The draft's head scanned in 4 bits for its best 4 rows (self_draft.SCAN_ENV; V = 16 rows, so the scan runs): its
# q is their 8-bit logits and the other rows' 4-bit ones.
HEAD_SCAN_4 = "draft_model_self_quantized, its head scanned for 4 rows"


@pytest.mark.parametrize(
    ("name", "forward"),
    [*((name, "cpp") for name in BATCH_CONFIGS), (HEAD_SCAN_4, "cpp"), ("prompt_lookup", "hf")],
)
def test_each_row_of_a_batch_of_prompts_samples_exactly(tiny, name, forward, monkeypatch):
    # "hf": the rows meet at HF's modules on a batch plan (mtprobe.target_model.batch_plan), padded to one block.
    from mtprobe.decode.batch import MAX_ROWS
    from mtprobe.target_model import self_draft

    if forward == "hf":
        monkeypatch.setenv("MTPROBE_NATIVE_FORWARD", "0")
        monkeypatch.setenv("MTPROBE_BATCH", "1")  # drafting rows together on the CPU too
    if name == HEAD_SCAN_4:
        monkeypatch.setenv(self_draft.SCAN_ENV, "4")
        name = "draft_model_self_quantized"

    prompts = torch.tensor([[4, 2, 9, 4, 2, 9, 4, 2], [7, 1, 3, 7, 1, 3, 7, 1]])
    batch = prompts.repeat(N_SAMPLES // 2, 1)  # [N_SAMPLES, 8]: the two prompts alternate, row by row
    torch.manual_seed(11)
    out = mtprobe.generate(
        tiny,
        batch,
        BATCH_CONFIGS[name](),
        attention_mask=torch.ones_like(batch),
        max_new_tokens=2,
        do_sample=True,
        **SAMPLE_KW,
    )
    assert max(o.batch for o in out.sequence_outputs) == MAX_ROWS  # groups of rows, both prompts in each
    pairs = out.sequences[:, -2:].view(N_SAMPLES // 2, 2, 2)  # [sample, prompt, token]
    for i in range(2):
        x = pairs[:, i]
        counts = torch.bincount(x[:, 0] * V + x[:, 1], minlength=V * V).view(V, V)
        p = chi_square_pvalue(counts, exact_pair_distribution(tiny, prompts[i : i + 1]))
        assert p > ALPHA, f"{name}, prompt {i}: sampled pairs differ from its distribution (p = {p:.2e})"


@pytest.mark.parametrize("name", [*BATCH_CONFIGS, DRAFT_VOCAB_4, HEAD_SCAN_4])
def test_sequences_sampled_one_after_another_are_exact(tiny, name, monkeypatch):
    from mtprobe.decode import batch as batch_module
    from mtprobe.target_model import self_draft

    monkeypatch.setenv(batch_module.ENV, "0")  # torch's default generator, one sequence at a time
    if name == DRAFT_VOCAB_4:  # the draft's q has no mass past ids 0-3 and the sequence's own tokens
        monkeypatch.setenv(self_draft.VOCAB_ENV, "4")
    if name == HEAD_SCAN_4:
        monkeypatch.setenv(self_draft.SCAN_ENV, "4")
    prompt = torch.tensor([[4, 2, 9, 4, 2, 9, 4, 2]])
    config = BATCH_CONFIGS["draft_model_self_quantized" if name in (DRAFT_VOCAB_4, HEAD_SCAN_4) else name]()
    counts = sample_pairs(tiny, prompt, config, seed=7)
    p = chi_square_pvalue(counts, exact_pair_distribution(tiny, prompt))
    assert p > ALPHA, f"{name}: sampled pairs differ from the target distribution (chi-square p = {p:.2e})"


@pytest.mark.parametrize("told_q", ["true_q", "wrong_q"])
def test_rejection_rule_with_sibling_drafts_is_exact(told_q):
    # verify_rejection alone: a root with three children drawn i.i.d. from q (SpecInfer's multi-draft
    # case); the first output token must be distributed as p_0 whatever q is. Told a q other than the
    # one the drafts came from, the rule is no longer exact, and the same test must notice.
    gen = torch.Generator().manual_seed(9)
    vocab, n = 6, 20000
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.0, 0.2])
    q = torch.tensor([0.3, 0.05, 0.3, 0.05, 0.2, 0.1])
    q_told = q if told_q == "true_q" else torch.tensor([0.2, 0.15, 0.2, 0.15, 0.2, 0.1])
    p = torch.cat([p0[None], torch.full((3, vocab), 1 / vocab)])  # [4, vocab]
    parents = torch.tensor([-1, 0, 0, 0])
    counts = torch.zeros(vocab, dtype=torch.long)
    for _ in range(n):
        drafts = torch.multinomial(q, 3, replacement=True, generator=gen)
        tokens = torch.cat([torch.tensor([0]), drafts])
        uniforms = torch.rand(5, generator=gen, dtype=torch.float64)
        path, token = mtprobe.ops.verify_rejection(tokens, parents, p, q_told.expand(3, vocab), uniforms)
        first = int(tokens[path[1]]) if len(path) > 1 else int(token)
        counts[first] += 1
    pval = chi_square_pvalue(counts, p0)
    if told_q == "true_q":
        assert pval > ALPHA, f"first tokens differ from p_0 (chi-square p = {pval:.2e}): {counts.tolist()}"
    else:
        assert pval < ALPHA, f"missed a rejection rule told the wrong q (p = {pval:.2e}): {counts.tolist()}"


def test_sampling_on_the_weights_codes_is_exact(tiny, monkeypatch):
    """A model whose weights are 4- and 8-bit values: the C++ forward runs its blocks of a few inputs on their
    codes (mtprobe.target_model.weight_codes), and sampling stays exact."""
    import copy

    from mtprobe.cpu import quantized_linear as ql
    from mtprobe.decode import batch as batch_module
    from mtprobe.target_model import native_forward as nf
    from mtprobe.target_model import weight_codes

    if weight_codes.quantized_rows() < 4:
        pytest.skip("this CPU runs no block of 4 inputs on the codes")
    model = copy.deepcopy(tiny)
    head = model.get_output_embeddings()
    with torch.no_grad():  # every linear weight onto the Q4_1 grid, the head onto Q8_0's
        for _, module in nf._linears(model):
            fmt = "q8_0" if module is head else "q4_1"
            module.weight.copy_(ql.dequantize(ql.quantize(module.weight, fmt)))
    monkeypatch.setenv(batch_module.ENV, "0")  # one sequence at a time: blocks of 1 to 4 inputs
    prompt = torch.tensor([[4, 2, 9, 4, 2, 9, 4, 2]])
    counts = sample_pairs(model, prompt, mtprobe.PromptLookupConfig(num_tokens=3), seed=7)
    assert nf.describe(model) == nf.VERSION + nf.CODES
    p = chi_square_pvalue(counts, exact_pair_distribution(model, prompt))
    assert p > ALPHA, f"sampled pairs differ from the target distribution (chi-square p = {p:.2e})"
