"""The one registry of decoding methods (mtprobe.registry): a toy drafter added through it alone runs in
mtprobe.generate, config_from_dict and the Spec-Bench harness; its own errors are clear."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe import _C, registry
from mtprobe.drafters import make_drafter
from mtprobe.specbench import methods as harness

PROMPT = torch.tensor([[3, 17, 42, 5, 17, 42, 8, 9]])  # [1, 8]
NEW = 24


# --- a toy drafter: its configuration, its drafter, its factory ---------------------------------------


@dataclass(frozen=True)
class ToyConfig:
    """Draft the last committed token ``depth`` more times, as a chain below the root."""

    depth: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth={self.depth!r} must be an int >= 1")

    @property
    def block_complexity(self) -> int:
        return 1 + self.depth  # the root and the chain


class RepeatDrafter(_C.Drafter):
    """A Python drafter (the PyDrafter trampoline): repeats the last committed token."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth

    def name(self) -> str:
        return "toy-repeat"

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, committed: torch.Tensor, prefix_len: int, limits: Any) -> _C.DraftBlock:
        n = max(0, min(self.depth, limits.budget - 1, limits.max_depth, limits.tokens_left - 1))
        last = int(committed[-1])
        return _C.token_block(committed, [last] * n, list(range(-1, n - 1)))

    def observe(self, outcome: Any) -> None:
        pass


CALLS: list[dict[str, Any]] = []


def toy_drafter(model, config: ToyConfig, **build: Any) -> RepeatDrafter:
    CALLS.append(build)
    return RepeatDrafter(config.depth)


def toy_method() -> mtprobe.Method:
    return mtprobe.Method(
        name="toy",
        config_type=ToyConfig,
        drafter=toy_drafter,
        summary="a toy: the last token repeated",
        options=(mtprobe.Option("--toy-depth", "depth", int, "d", "chain depth of the toy drafter"),),
    )


@pytest.fixture
def toy():
    method = mtprobe.register_method(toy_method())
    yield method
    if "toy" in registry.names():
        mtprobe.unregister_method("toy")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def _greedy(model, n: int = NEW) -> torch.Tensor:
    return model.generate(
        PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=n, eos_token_id=None
    )


# --- the toy, through the registry alone -----------------------------------------------------------------


def test_a_drafter_added_through_the_registry_alone(toy, model):
    CALLS.clear()
    out = mtprobe.generate(model, PROMPT, ToyConfig(depth=3), max_new_tokens=NEW, eos_token_id=None)
    assert torch.equal(out.sequences, _greedy(model))
    assert out.method == "toy"
    assert sum(out.drafted_per_depth) > 0  # the toy drafted; verification kept the output greedy's
    # the factory got the shared signature's keywords
    assert set(CALLS[-1]) == {"capacity", "do_sample", "process", "fold_memory"}
    assert CALLS[-1]["capacity"] > PROMPT.shape[1] and CALLS[-1]["do_sample"] is False

    # the dict route finds it by name
    assert mtprobe.config_from_dict({"method": "toy", "depth": 3}) == ToyConfig(depth=3)
    with pytest.raises(ValueError, match=r"ToyConfig \(method 'toy'\) has no field\(s\) 'width'"):
        mtprobe.config_from_dict({"method": "toy", "width": 3})
    by_dict = mtprobe.generate(model, PROMPT, {"method": "toy"}, max_new_tokens=NEW, eos_token_id=None)
    assert torch.equal(by_dict.sequences, out.sequences)


def test_a_drafter_that_takes_the_target_is_handed_the_generations_adapter(toy, model):
    # takes_target=True: the factory gets the generation's own target adapter, built before the drafter,
    # with its KV cache (what the quantized self-draft copies entries from); the others never see it.
    from mtprobe.target_model.adapter import HFAdapter

    mtprobe.register_method(dataclasses.replace(registry.get("toy"), takes_target=True), replace=True)
    CALLS.clear()
    out = mtprobe.generate(model, PROMPT, ToyConfig(depth=3), max_new_tokens=NEW, eos_token_id=None)
    assert torch.equal(out.sequences, _greedy(model))
    target = CALLS[-1]["target"]
    assert isinstance(target, HFAdapter) and target.model is model
    assert target.cache.layers[0].is_initialized  # the very adapter the loop ran: it holds the prompt


def test_the_harness_knows_the_toy_and_its_option(toy, model):
    from mtprobe.specbench.__main__ import _build_parser

    assert "toy" in harness.available_methods() and harness.METHODS["toy"] is toy
    args = _build_parser().parse_args(
        ["run", "--question-file", "q.jsonl", "--method", "toy", "--toy-depth", "4"]
    )
    method = harness.get_method(args.method)
    assert harness.config_from_args(method, args) == ToyConfig(depth=4)
    assert "chain depth of the toy drafter; default 2 (method: toy)" == harness.option_help("--toy-depth")
    assert method.id_suffix(ToyConfig(depth=4)) == "d4"
    # the harness runs it through mtprobe.generate
    run = harness.run_method(method, model, PROMPT, ToyConfig(depth=4), 12)
    assert torch.equal(run.new_ids, _greedy(model, 12)[0, PROMPT.shape[1] :])
    assert run.decoding_steps == len(run.accept_lengths) + 1  # prefill included


def test_an_unregistered_configuration_is_a_clear_error(toy, model):
    mtprobe.unregister_method("toy")
    assert "toy" not in harness.METHODS
    with pytest.raises(TypeError, match="unknown decoding configuration ToyConfig.*register_method"):
        mtprobe.generate(model, PROMPT, ToyConfig(), max_new_tokens=4)
    with pytest.raises(TypeError, match="unknown decoding configuration ToyConfig"):
        make_drafter(model, ToyConfig())  # no fall-through to some other drafter
    with pytest.raises(ValueError, match="unknown method 'toy'; known methods: probe, pld"):
        mtprobe.config_from_dict({"method": "toy"})
    with pytest.raises(TypeError, match=r"registered: ProbeConfig \(probe\), PromptLookupConfig \(pld\)"):
        registry.method_of(ToyConfig())


def test_a_harness_baseline_is_not_a_drafter(model):
    with pytest.raises(
        TypeError, match="GreedyConfig is method 'ar', a Spec-Bench harness baseline with no drafter"
    ):
        mtprobe.generate(model, PROMPT, harness.GreedyConfig(), max_new_tokens=4)
    with pytest.raises(ValueError, match="method 'ar' has no drafter"):
        mtprobe.config_from_dict({"method": "ar"})


def test_every_built_in_method_is_one_registration():
    drafters = {m.name: m for m in registry.methods() if m.drafter is not None}
    assert list(drafters)[:10] == [
        "probe",
        "pld",
        "sps",
        "stand",
        "lookahead",
        "hybrid",
        "entmtp",
        "heads",
        "auto",
        "plain",
    ]
    for name, method in drafters.items():
        assert method.config_type.method == name
        assert harness.METHODS[name] is method
    assert {m.name for m in registry.methods() if m.drafter is None} >= {"ar", "hf-pld"}
    schedulable = {m.name for m in registry.methods() if m.schedulable}
    assert schedulable >= {"probe", "pld", "stand", "lookahead", "hybrid", "entmtp", "heads", "sps"}
    assert not schedulable & {"auto", "ar", "hf-pld"}
    assert {m.name for m in registry.methods() if m.own_forwards} == {"sps"}  # the draft model's
    # a subclass of a registered configuration is that method
    sub = dataclasses.make_dataclass("Sub", [], bases=(mtprobe.PromptLookupConfig,), frozen=True)
    assert registry.method_of(sub()).name == "pld"


# --- the registry's own errors -------------------------------------------------------------------------


def test_registration_errors(toy):
    with pytest.raises(ValueError, match="method 'toy' is already registered .*replace=True"):
        mtprobe.register_method(toy_method())

    @dataclass(frozen=True)
    class Other:
        block_complexity: int = 3

    with pytest.raises(ValueError, match="ToyConfig is already registered as method 'toy'"):
        mtprobe.register_method(dataclasses.replace(toy_method(), name="toy2"))
    with pytest.raises(ValueError, match="ProbeConfig declares method = 'probe'.*register it as 'probe'"):
        mtprobe.register_method(dataclasses.replace(registry.get("probe"), name="probe2"))

    @dataclass
    class Mutable:
        block_complexity: int = 3

    with pytest.raises(TypeError, match="config_type must be a frozen dataclass"):
        mtprobe.Method(name="m", config_type=Mutable, drafter=toy_drafter, summary="")
    with pytest.raises(TypeError, match="config_type must be a frozen dataclass"):
        mtprobe.Method(name="m", config_type=dict, drafter=toy_drafter, summary="")
    with pytest.raises(ValueError, match="needs drafter=factory"):
        mtprobe.Method(name="m", config_type=Other, summary="")
    with pytest.raises(ValueError, match="non-empty string without spaces"):
        mtprobe.Method(name="a b", config_type=Other, drafter=toy_drafter, summary="")
    with pytest.raises(
        ValueError, match="own_forwards=True tells AutoConfig how to schedule it; set schedulable"
    ):
        mtprobe.Method(name="m", config_type=Other, drafter=toy_drafter, summary="", own_forwards=True)

    @dataclass(frozen=True)
    class NoBudget:
        depth: int = 1

    with pytest.raises(TypeError, match="NoBudget has no block_complexity field"):
        mtprobe.Method(name="m", config_type=NoBudget, drafter=toy_drafter, summary="")
    with pytest.raises(ValueError, match="option --width sets field 'width', which Other does not have"):
        mtprobe.Method(
            name="m",
            config_type=Other,
            drafter=toy_drafter,
            summary="",
            options=(mtprobe.Option("--width", "width", int, "w", "?"),),
        )
    with pytest.raises(ValueError, match="long option"):
        mtprobe.Option("-w", "width", int, "w", "?")
    with pytest.raises(TypeError, match="register takes a mtprobe.Method"):
        mtprobe.register_method(Other)


def test_lookup_errors():
    with pytest.raises(ValueError, match="unknown method 'nope'; registered methods: probe, pld, sps"):
        registry.get("nope")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        mtprobe.unregister_method("nope")
    with pytest.raises(TypeError, match="unknown decoding configuration str.*registered: ProbeConfig"):
        registry.method_of("pld")


def test_replace_keeps_the_position(toy):
    names = registry.names()
    pld = registry.get("pld")
    replaced = mtprobe.register_method(dataclasses.replace(pld, summary="another summary"), replace=True)
    try:
        assert registry.names() == names and registry.get("pld") is replaced
    finally:
        mtprobe.register_method(pld, replace=True)
    assert registry.get("pld") is pld
