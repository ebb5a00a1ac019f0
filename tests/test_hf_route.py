"""transformers' generate() arguments on both routes (issue 17, items 1 and 2).

Item 1: the decoding mode is model.generate's: a model whose generation_config says do_sample=True
samples unless the call passes do_sample=False; with do_sample=False the output is token-identical
to model.generate(do_sample=False). Item 2: every GenerationConfig attribute and generate()
parameter of the installed transformers is classified in mtprobe.decode.hf_arguments.HF_ARGUMENTS; drafter
arguments map onto mtprobe's drafters, other decoding methods are refused by name.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

import mtprobe
from conftest import NullStreamer, tiny_llama
from mtprobe.decode.hf_arguments import HANDLINGS, HF_ARGUMENTS, INERT, MAPPED, REFUSED
from mtprobe.decode.hf_call import decoding_mode
from mtprobe.drafters.from_hf import resolve_config
from test_sampling import ALPHA, chi_square_pvalue, tiny_config

IDS = torch.tensor([[3, 7, 11, 5, 3, 7, 11, 5, 3, 7]])
N_NEW = 24


def run_mtprobe(model, ids, config=None, **kw):
    return mtprobe.generate(model, ids, config, **kw)


def run_hf(model, ids, config=None, **kw):
    extra = {} if config is None else {"mtprobe_config": config}
    return model.generate(
        ids, custom_generate=mtprobe.custom_generate, return_dict_in_generate=True, **extra, **kw
    )


ROUTES = {"mtprobe.generate": run_mtprobe, "model.generate": run_hf}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def greedy(tiny):
    return tiny.generate(IDS, do_sample=False, max_new_tokens=N_NEW)


# --- item 2: the table ----------------------------------------------------------------------------


def installed_arguments() -> set[str]:
    """Every public GenerationConfig attribute and named generate() parameter of this transformers,
    plus the generate() keywords it pops itself (tokenizer, assistant_tokenizer)."""
    attrs = {k for k in vars(GenerationConfig()) if not k.startswith("_")}
    params = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "inputs", "kwargs"}
    return attrs | params | {"tokenizer", "assistant_tokenizer"}


def test_every_installed_argument_is_classified():
    # Fails when transformers adds an argument (a new decoding method, a new drafter option) that
    # nobody has decided about, and when the table names one transformers no longer has.
    installed = installed_arguments()
    assert sorted(installed - set(HF_ARGUMENTS)) == [], (
        "unclassified: add them to mtprobe.decode.hf_arguments.HF_ARGUMENTS"
    )
    assert sorted(set(HF_ARGUMENTS) - installed) == [], "stale entries in HF_ARGUMENTS"
    for name, arg in HF_ARGUMENTS.items():
        assert arg.name == name and arg.handling in HANDLINGS and arg.reason


def test_every_method_selector_of_transformers_is_mapped_or_refused():
    # The attributes GenerationConfig.get_generation_mode reads to pick a method (its source names them).
    source = inspect.getsource(GenerationConfig.get_generation_mode)
    selectors = {n for n in installed_arguments() if f"self.{n}" in source} | {"assistant_model"}
    assert {"num_beams", "do_sample", "penalty_alpha", "dola_layers", "prompt_lookup_num_tokens"} <= selectors
    for name in selectors - {"do_sample", "top_k"}:  # do_sample: item 1; top_k: a processor
        assert HF_ARGUMENTS[name].handling in (MAPPED, REFUSED), name
    assert HF_ARGUMENTS["do_sample"].handling == "honoured"


def test_inert_arguments_do_not_change_the_tokens(tiny, greedy):
    out = mtprobe.generate(
        tiny,
        IDS,
        max_new_tokens=N_NEW,
        use_cache=False,
        cache_implementation="static",
        early_stopping=True,
        length_penalty=2.0,
        disable_compile=True,
    )
    assert torch.equal(out.sequences, greedy)
    assert HF_ARGUMENTS["cache_implementation"].handling == INERT


# Every refused argument, with a value that sets it, the error type and a fragment of its message.
REFUSED_CASES = {
    "num_beams": (dict(num_beams=2), NotImplementedError, "num_beams=2"),
    "output_attentions": (dict(output_attentions=True), NotImplementedError, "output_attentions=True"),
    "output_hidden_states": (dict(output_hidden_states=True), NotImplementedError, "output_hidden_states"),
    "synced_gpus": (dict(synced_gpus=True), NotImplementedError, "synced_gpus"),
    "use_mtp": (dict(use_mtp=True), ValueError, "use_mtp=True .*use a ProbeConfig"),
    "speculation_type": (dict(speculation_type="dflash"), ValueError, "speculation_type='dflash'"),
    "assistant_ensemble_weight": (dict(assistant_ensemble_weight=0.5), ValueError, "lossy"),
    "num_assistant_tokens_schedule": (
        dict(num_assistant_tokens_schedule="heuristic"),
        ValueError,
        "num_assistant_tokens_schedule='heuristic'.*'constant'",
    ),
    "assistant_confidence_threshold": (dict(assistant_confidence_threshold=0.2), ValueError, "confidence"),
    "assistant_lookbehind": (dict(assistant_lookbehind=5), ValueError, "share the target's tokenizer"),
    "target_lookbehind": (dict(target_lookbehind=5), ValueError, "share the target's tokenizer"),
    "assistant_tokenizer": (dict(assistant_tokenizer=object()), ValueError, "assistant_tokenizer is not"),
    "guidance_scale": (dict(guidance_scale=1.5), ValueError, "guidance_scale=1.5.*leave guidance_scale at 1"),
    "negative_prompt_ids": (dict(negative_prompt_ids=IDS), ValueError, "negative_prompt_ids is not"),
    "negative_prompt_attention_mask": (
        dict(negative_prompt_attention_mask=torch.ones_like(IDS)),
        ValueError,
        "negative_prompt_attention_mask is not",
    ),
    "penalty_alpha": (dict(penalty_alpha=0.6), ValueError, "contrastive search"),
    "dola_layers": (dict(dola_layers="high"), ValueError, "DoLa"),
    "num_beam_groups": (dict(num_beam_groups=2), ValueError, "group beam search"),
    "diversity_penalty": (dict(diversity_penalty=0.5), ValueError, "group beam search"),
    "constraints": (dict(constraints=[object()]), ValueError, "constrained beam search"),
    "force_words_ids": (dict(force_words_ids=[[1, 2]]), ValueError, "constrained beam search"),
}


def test_every_refused_argument_has_a_case():
    assert set(REFUSED_CASES) == {n for n, a in HF_ARGUMENTS.items() if a.handling == REFUSED}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(REFUSED_CASES))
def test_refused_arguments_raise_by_name(tiny, route, name):
    kwargs, error, match = REFUSED_CASES[name]
    if route == "model.generate" and name == "assistant_tokenizer":
        pytest.skip("transformers drops assistant_tokenizer before a callable custom_generate sees it")
    with pytest.raises(error, match=match):
        ROUTES[route](tiny, IDS, max_new_tokens=4, **kwargs)


def test_synthid_watermark_is_refused(tiny):
    from transformers.generation import SynthIDTextWatermarkingConfig

    wm = SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=2)
    with pytest.raises(ValueError, match="SynthID.*WatermarkingConfig"):
        mtprobe.generate(tiny, IDS, max_new_tokens=4, watermarking_config=wm)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_a_filled_cache_of_the_callers_is_refused(tiny, route, name):
    # transformers 5.2x renamed the argument (past_key_values warns until 5.40): both names are caught.
    from transformers import DynamicCache

    from mtprobe.target_model.adapter import cache_argument

    if name == "cache" and cache_argument(tiny) != "cache":
        pytest.skip("this transformers predates the cache= argument")
    cache = DynamicCache(config=tiny.config)
    with torch.no_grad():
        tiny(IDS, use_cache=True, **{cache_argument(tiny): cache})
    with pytest.raises(NotImplementedError, match="mtprobe manages its own KV cache"):
        ROUTES[route](tiny, IDS, max_new_tokens=4, **{name: cache})


# --- item 2: mapped arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_prompt_lookup_num_tokens_runs_prompt_lookup(tiny, greedy, route):
    explicit = mtprobe.generate(
        tiny, IDS, mtprobe.PromptLookupConfig(num_tokens=4, max_ngram_size=3), max_new_tokens=N_NEW
    )
    out = ROUTES[route](
        tiny, IDS, max_new_tokens=N_NEW, prompt_lookup_num_tokens=4, max_matching_ngram_size=3
    )
    assert torch.equal(out.sequences, greedy)
    assert out.tau > 1  # drafts from the repeated prompt are accepted
    assert out.accept_lengths == explicit.accept_lengths and out.forward_calls == explicit.forward_calls
    # An explicit configuration that agrees is accepted.
    agree = ROUTES[route](
        tiny, IDS, mtprobe.PromptLookupConfig(num_tokens=4), max_new_tokens=N_NEW, prompt_lookup_num_tokens=4
    )
    assert torch.equal(agree.sequences, greedy)


@pytest.mark.parametrize("route", ROUTES)
def test_assistant_model_runs_the_draft_model(tiny, greedy, route):
    twin = tiny_llama()  # the target's own weights: its drafts are all accepted
    out = ROUTES[route](tiny, IDS, max_new_tokens=N_NEW, assistant_model=twin, num_assistant_tokens=3)
    explicit = mtprobe.generate(
        tiny, IDS, mtprobe.DraftModelConfig(draft_model=twin, num_tokens=3), max_new_tokens=N_NEW
    )
    assert torch.equal(out.sequences, greedy)
    assert out.accept_lengths == explicit.accept_lengths
    assert max(out.accept_lengths) == 4 and out.tau > 2  # three drafts and the bonus token per step


@pytest.mark.parametrize("route", ROUTES)
def test_assistant_early_exit_runs_the_layer_truncated_self_draft(tiny, greedy, route):
    out = ROUTES[route](tiny, IDS, max_new_tokens=N_NEW, assistant_early_exit=1, num_assistant_tokens=2)
    explicit = mtprobe.generate(
        tiny, IDS, mtprobe.DraftModelConfig(num_draft_layers=1, num_tokens=2), max_new_tokens=N_NEW
    )
    assert torch.equal(out.sequences, greedy)
    assert out.accept_lengths == explicit.accept_lengths


def test_num_assistant_tokens_follows_transformers():
    gc = GenerationConfig(assistant_early_exit=1)
    draft = tiny_llama(seed=1, num_hidden_layers=1)
    # Unset: the assistant's own generation_config (what transformers reads), else transformers' default 20.
    assert resolve_config(None, GenerationConfig(), draft).num_tokens == 20
    draft.generation_config.num_assistant_tokens = 6
    assert resolve_config(None, GenerationConfig(), draft).num_tokens == 6
    assert resolve_config(None, GenerationConfig(num_assistant_tokens=4), draft).num_tokens == 4
    cfg = resolve_config(None, gc)
    assert cfg == mtprobe.DraftModelConfig(num_draft_layers=1, num_tokens=20)
    # No drafter argument: the configuration passes through unchanged, None included.
    probe = mtprobe.ProbeConfig()
    assert resolve_config(probe, GenerationConfig()) is probe
    assert resolve_config(None, GenerationConfig()) is None


@pytest.mark.parametrize("route", ROUTES)
def test_conflicting_explicit_configuration_is_named(tiny, route):
    draft = tiny_llama(seed=1, num_hidden_layers=1)
    cases = [
        (
            mtprobe.ProbeConfig(),
            dict(prompt_lookup_num_tokens=4),
            r"ProbeConfig\(.*\) and prompt_lookup_num_tokens=4",
        ),
        (
            mtprobe.PromptLookupConfig(num_tokens=5),
            dict(prompt_lookup_num_tokens=4),
            r"PromptLookupConfig\(num_tokens=5.*prompt_lookup_num_tokens=4, which means PromptLookupConfig\(num_tokens=4",
        ),
        (
            mtprobe.PromptLookupConfig(max_ngram_size=2),
            dict(max_matching_ngram_size=3),
            "max_matching_ngram_size=3",
        ),
        (
            mtprobe.StandConfig(),
            dict(assistant_model=draft),
            r"StandConfig\(.*\) and assistant_model=LlamaForCausalLM",
        ),
        (mtprobe.DraftModelConfig(), dict(assistant_model=draft), r"DraftModelConfig\(.*assistant_model="),
        (mtprobe.DraftModelConfig(num_tokens=5), dict(num_assistant_tokens=3), "num_assistant_tokens=3"),
        (
            mtprobe.DraftModelConfig(num_draft_layers=2),
            dict(assistant_early_exit=1),
            "assistant_early_exit=1",
        ),
    ]
    for config, kwargs, match in cases:
        with pytest.raises(ValueError, match="conflicting decoding methods: " + ".*" + match):
            ROUTES[route](tiny, IDS, config, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("route", ROUTES)
def test_drafter_arguments_without_their_drafter(tiny, route):
    draft = tiny_llama(seed=1, num_hidden_layers=1)
    with pytest.raises(
        ValueError, match="num_assistant_tokens=3 applies to a draft model; pass assistant_model"
    ):
        ROUTES[route](tiny, IDS, max_new_tokens=4, num_assistant_tokens=3)
    with pytest.raises(ValueError, match="max_matching_ngram_size=3 applies to prompt lookup decoding only"):
        ROUTES[route](tiny, IDS, max_new_tokens=4, max_matching_ngram_size=3)
    with pytest.raises(
        ValueError, match="prompt_lookup_num_tokens and assistant_model each select a drafter"
    ):
        ROUTES[route](tiny, IDS, max_new_tokens=4, prompt_lookup_num_tokens=3, assistant_model=draft)


# --- item 1: greedy means greedy ---------------------------------------------------------------------

V = 16
SAMPLING_GC = dict(do_sample=True, temperature=0.9, top_k=10, top_p=0.95)


@pytest.fixture(scope="module")
def sampling_model():
    """A tiny model that ships do_sample=True in its generation_config, as many instruct models do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model gains nothing from threads; they only add overhead
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for k, v in SAMPLING_GC.items():
        setattr(model.generation_config, k, v)
    yield model
    torch.set_num_threads(threads)


PROMPT = torch.tensor([[1, 2, 3, 4]])


def test_decoding_mode_is_transformers_rule():
    assert decoding_mode(GenerationConfig()) == "greedy"
    assert decoding_mode(GenerationConfig(do_sample=False)) == "greedy"
    assert decoding_mode(GenerationConfig(do_sample=True)) == "sample"


@pytest.mark.parametrize("route", ROUTES)
def test_do_sample_false_is_token_identical_to_greedy(sampling_model, route):
    greedy = sampling_model.generate(PROMPT, do_sample=False, max_new_tokens=20)
    for cfg in (mtprobe.ProbeConfig(block_complexity=10), mtprobe.PromptLookupConfig(num_tokens=3)):
        out = ROUTES[route](sampling_model, PROMPT, cfg, max_new_tokens=20, do_sample=False)
        assert torch.equal(out.sequences, greedy)


def test_model_generation_config_sampling_is_followed(sampling_model, caplog):
    # model.generate(ids) samples with this model (transformers' semantics) ...
    torch.manual_seed(1)
    hf = {int(sampling_model.generate(PROMPT, max_new_tokens=1)[0, -1]) for _ in range(30)}
    assert len(hf) > 1
    # ... and so does mtprobe.generate(model, ids): its first tokens follow the processed distribution
    # the generation_config describes (temperature 0.9, top-k 10, top-p 0.95), by a chi-square test.
    from test_sampling import processors

    with torch.no_grad():
        probs = processors()(PROMPT, sampling_model(PROMPT).logits[:, -1].float()).softmax(-1)[0]  # [V]
    n = 300
    counts = torch.zeros(V, dtype=torch.long)
    torch.manual_seed(2)
    with caplog.at_level(logging.INFO, logger="mtprobe.decode.generate"):
        for _ in range(n):
            out = mtprobe.generate(sampling_model, PROMPT, max_new_tokens=1)
            counts[int(out.sequences[0, -1])] += 1
    assert (counts > 0).sum() > 1
    assert chi_square_pvalue(counts, probs) > ALPHA
    # Greedy would put all n on the argmax; a sample at this size cannot.
    assert counts[int(probs.argmax())] < n
    logged = [
        r
        for r in caplog.records
        if r.name == "mtprobe.decode.generate" and "generation_config says do_sample=True" in r.getMessage()
    ]
    assert len(logged) == n
    assert "Pass do_sample=False for greedy decoding" in logged[0].getMessage()


@pytest.mark.parametrize("route", ROUTES)
def test_sampling_source_is_logged_only_when_the_model_chose_it(sampling_model, tiny, route, caplog):
    def messages():
        return [r.getMessage() for r in caplog.records if r.name == "mtprobe.decode.generate"]

    with caplog.at_level(logging.INFO, logger="mtprobe.decode.generate"):
        ROUTES[route](sampling_model, PROMPT, max_new_tokens=2)
        assert any("generation_config says do_sample=True" in m for m in messages())
        caplog.clear()
        ROUTES[route](sampling_model, PROMPT, max_new_tokens=2, do_sample=True)  # the caller chose it
        ROUTES[route](sampling_model, PROMPT, max_new_tokens=2, do_sample=False)
        ROUTES[route](tiny, IDS, max_new_tokens=2)  # a greedy model
        assert not any("do_sample" in m for m in messages())


# --- num_return_sequences: several sampled sequences of one prompt --------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_num_return_sequences_samples_each_sequence_in_turn(tiny, route, monkeypatch):
    # Decoded one after another (MTPROBE_BATCH=0, or where a batch cannot run together), n sequences are n
    # generations in turn, each with its own drafter and KV cache: under one seed they are the texts n single
    # calls would sample one after another, stacked and padded as HF pads them. A third of the vocabulary
    # ends a sequence, so the sequences stop at different lengths.
    monkeypatch.setenv("MTPROBE_BATCH", "0")
    kw = dict(
        max_new_tokens=6, do_sample=True, temperature=1.5, eos_token_id=list(range(32)), pad_token_id=95
    )
    cfg = mtprobe.StandConfig(block_complexity=10)
    torch.manual_seed(4)
    out = ROUTES[route](tiny, IDS, cfg, num_return_sequences=4, **kw)
    torch.manual_seed(4)
    singles = [mtprobe.generate(tiny, IDS, cfg, **kw) for _ in range(4)]
    lengths = [s.sequences.shape[1] for s in singles]
    assert len(set(lengths)) > 1, lengths  # or the padding is not exercised
    assert out.sequences.shape == (4, max(lengths))
    for row, single, part in zip(out.sequences, singles, out.sequence_outputs, strict=True):
        n = single.sequences.shape[1]
        assert torch.equal(row[:n], single.sequences[0]) and torch.equal(part.sequences, single.sequences)
        assert (row[n:] == 95).all()
    assert out.accept_lengths == [a for s in singles for a in s.accept_lengths]
    assert out.forward_calls == sum(s.forward_calls for s in singles) - 3  # one prefill for the four
    assert out.new_tokens == sum(s.new_tokens for s in singles)
    assert out.stop_reason == ",".join(sorted({s.stop_reason for s in singles}))


@pytest.mark.parametrize("route", ROUTES)
def test_num_return_sequences_sampled_together(tiny, route):
    # Decoded together (the default where the C++ forward runs), the n sequences share one prefill and each
    # draws from a generator of its own: a seeded call repeats, and the output is laid out as above.
    kw = dict(
        max_new_tokens=6, do_sample=True, temperature=1.5, eos_token_id=list(range(32)), pad_token_id=95
    )
    cfg = mtprobe.StandConfig(block_complexity=10)
    runs = []
    for _ in range(2):
        torch.manual_seed(4)
        runs.append(ROUTES[route](tiny, IDS, cfg, num_return_sequences=4, **kw))
    out = runs[0]
    assert torch.equal(out.sequences, runs[1].sequences)
    assert {o.batch for o in out.sequence_outputs} == {4}
    lengths = [o.sequences.shape[1] for o in out.sequence_outputs]
    assert out.sequences.shape == (4, max(lengths))
    for row, part in zip(out.sequences, out.sequence_outputs, strict=True):
        n = part.sequences.shape[1]
        assert torch.equal(row[:n], part.sequences[0]) and (row[n:] == 95).all()
        assert torch.equal(part.sequences[0, : IDS.shape[1]], IDS[0])
    assert len({tuple(o.sequences[0].tolist()) for o in out.sequence_outputs}) > 1  # samples, not copies


QUANTIZED_SELF_DRAFT = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=3)


@pytest.mark.parametrize(
    ("cfg", "shares"),
    [
        (mtprobe.PlainConfig(), True),
        (mtprobe.ProbeConfig(block_complexity=8), True),  # the prefill carries the masks and a tree mask
        (mtprobe.ProbeConfig(block_complexity=8, num_masks=2, mask_value=0.3), True),
        (mtprobe.StandConfig(block_complexity=10), True),  # its store reads the prefill's prompt logits
        (mtprobe.StandConfig(block_complexity=10, prompt_logits=2), True),  # 2 prompt rows' logits only
        # It copies the target's entries and drafts no chain in the prefill block: one prefill for all.
        (QUANTIZED_SELF_DRAFT, True),
    ],
    ids=["plain", "probe", "probe-2-masks", "stand", "stand-2-rows", "quantized-self-draft"],
)
def test_num_return_sequences_share_one_prefill(tiny, cfg, shares, monkeypatch):
    # Decoded one after another, the first sequence runs the prefill; the others take copies of its logits and
    # KV entries. What they sample is what they would after a prefill of their own, and the model ran n - 1
    # fewer forwards. (Together, as by default, they share it in the batched forward: test_batched_forward.)
    monkeypatch.setenv("MTPROBE_BATCH", "0")
    calls = []
    hook = tiny.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        kw = dict(max_new_tokens=5, do_sample=True, temperature=1.5)
        mtprobe.generate(tiny, IDS, cfg, num_return_sequences=2, **kw)  # what a first call measures
        calls.clear()
        torch.manual_seed(7)
        out = mtprobe.generate(tiny, IDS, cfg, num_return_sequences=3, **kw)
        shared = len(calls)
        calls.clear()
        torch.manual_seed(7)
        singles = [mtprobe.generate(tiny, IDS, cfg, **kw) for _ in range(3)]
    finally:
        hook.remove()
    for part, single in zip(out.sequence_outputs, singles, strict=True):
        assert torch.equal(part.sequences, single.sequences)
    assert shared == len(calls) - (2 if shares else 0)
    assert out.forward_calls == shared
    assert [o.forward_calls for o in out.sequence_outputs] == [
        s.forward_calls - (i > 0 and shares) for i, s in enumerate(singles)
    ]


def test_an_auto_config_with_the_quantized_self_draft_shares_one_prefill(tiny):
    # AutoConfig's choices follow measured times, so its texts are not compared with single calls here.
    auto = mtprobe.AutoConfig(drafters=(mtprobe.PromptLookupConfig(num_tokens=3), QUANTIZED_SELF_DRAFT))
    calls = []
    hook = tiny.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        # What a first call measures (with the hook too: a hooked model runs HF's forward, profiled apart).
        mtprobe.generate(tiny, IDS, auto, max_new_tokens=2, do_sample=True)
        calls.clear()
        out = mtprobe.generate(tiny, IDS, auto, max_new_tokens=4, do_sample=True, num_return_sequences=3)
    finally:
        hook.remove()
    assert sum(int(c["position_ids"][0, 0]) == 0 for c in calls) == 1  # one prefill for the three
    assert out.sequences.shape[0] == 3


def test_shared_prefill_serves_only_the_same_prefill(tiny):
    # Other inputs, another hidden layer or another prefill cut: no copy, the adapter runs the model.
    from mtprobe.target_model.adapter import HFAdapter, SharedPrefill

    share = SharedPrefill()
    tokens, pos = IDS[0], torch.arange(IDS.shape[1])[None]  # [L], [1, L]

    def prefill(adapter: HFAdapter, toks: torch.Tensor) -> torch.Tensor:
        return adapter.forward(toks, None, pos[:, : toks.shape[0]], None, 0, False)[0]

    first = HFAdapter(tiny, 16, shared_prefill=share)
    logits = prefill(first, tokens)  # [L, vocab]
    again = HFAdapter(tiny, 4, shared_prefill=share)  # a smaller cache: reserved to fit
    assert torch.equal(prefill(again, tokens), logits) and again.prefill_shared and share.taken == 1
    for layer, kept in zip(again.cache.layers, first.cache.layers, strict=True):
        assert layer.length == tokens.shape[0]
        assert torch.equal(layer.keys[:, :, : layer.length], kept.keys[:, :, : layer.length])
    other = tokens.clone()
    other[-1] = 1
    assert not torch.equal(prefill(HFAdapter(tiny, 16, shared_prefill=share), other), logits)
    deeper = HFAdapter(tiny, 16, shared_prefill=share)
    deeper.hidden_layer = 1
    cut = HFAdapter(tiny, 16, shared_prefill=share)
    cut.prefill_logits_from = 5
    for adapter in (deeper, cut):
        prefill(adapter, tokens)
        assert not adapter.prefill_shared
    assert share.taken == 1


def test_num_return_sequences_returns_the_stacked_tensor_on_the_hf_route(tiny):
    torch.manual_seed(2)
    seqs = tiny.generate(
        IDS, custom_generate=mtprobe.custom_generate, max_new_tokens=5, do_sample=True, num_return_sequences=3
    )
    assert isinstance(seqs, torch.Tensor) and seqs.shape == (3, IDS.shape[1] + 5)
    assert (seqs[:, : IDS.shape[1]] == IDS).all()


@pytest.mark.parametrize("route", ROUTES)
def test_num_return_sequences_bad_input(tiny, route):
    with pytest.raises(ValueError, match="num_return_sequences"):  # greedy: n copies of one text
        ROUTES[route](tiny, IDS, max_new_tokens=4, do_sample=False, num_return_sequences=2)

    with pytest.raises(ValueError, match="streamer takes one sequence"):
        ROUTES[route](
            tiny, IDS, max_new_tokens=4, do_sample=True, num_return_sequences=2, streamer=NullStreamer()
        )


def test_a_prefill_that_skips_the_prompts_logits_returns_zeros_in_their_rows(tiny):
    # prefill_logits_from = k: rows 0..k-1 are not computed (logits_to_keep) but keep their places as
    # zeros; the rows from k on are the full prefill's.
    from mtprobe.target_model.adapter import HFAdapter

    tokens = torch.tensor([3, 7, 11, 5, 9, 2, 4])
    pos = torch.arange(tokens.shape[0]).view(1, -1)
    full = HFAdapter(tiny, 16).forward(tokens, None, pos, None, 0, False)[0]  # [L, vocab]
    cut = HFAdapter(tiny, 16)
    cut.prefill_logits_from = 5
    logits = cut.forward(tokens, None, pos, None, 0, False)[0]
    assert logits.shape == full.shape
    assert not logits[:5].any()
    torch.testing.assert_close(logits[5:], full[5:])
