"""The static forward plan (mtprobe.target_model.plan): a fixed KV buffer written at device positions, block-size
buckets with padding, and the one-read step. On the CPU it runs eager; every output must be HF
greedy's, padded or not, and the padding must be invisible to every real input."""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import cpu_decode_loop, tiny_llama
from mtprobe import _C
from mtprobe.target_model.adapter import HFAdapter
from mtprobe.target_model.plan import ForwardPlan, PlanConfig, chain_mask, padded_mask

MIN = torch.finfo(torch.float32).min


def _plan(model, config: PlanConfig | None = None, capacity: int = 64) -> ForwardPlan:
    return ForwardPlan(
        model,
        config or PlanConfig(),
        capacity,
        num_layers=model.config.num_hidden_layers,
        max_positions=model.config.max_position_embeddings,
    )


def _plan_loop(adapter: HFAdapter, drafter, *, max_new_tokens: int, block_complexity: int):
    """A C++ DecodeLoop on the CPU through ``adapter`` (float32 masks, no EOS, the tiny Llama's positions)."""
    return _C.DecodeLoop(
        drafter,
        adapter.forward,
        adapter.kv_buffers,
        max_new_tokens=max_new_tokens,
        eos_token_ids=[],
        max_positions=256,
        block_complexity=block_complexity,
        kv_capacity=adapter.cache.capacity,
        mask_dtype="float32",
        device="cpu",
    )


# --- the configuration and its bad input -------------------------------------------------------


def test_plan_config_buckets():
    cfg = PlanConfig()
    assert cfg.buckets == (1, 2, 4, 8, 16, 32, 64)
    assert [cfg.bucket(t) for t in (1, 2, 3, 5, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, None]
    assert PlanConfig(buckets=[1, 3]).buckets == (1, 3)  # a list is taken as the tuple


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buckets": (2, 4)}, "must start at 1"),
        ({"buckets": (1, 4, 4)}, "strictly ascending"),
        ({"buckets": (1, 8, 4)}, "strictly ascending"),
        ({"buckets": ()}, "non-empty tuple of ints"),
        ({"buckets": (1, 2.0)}, "non-empty tuple of ints"),
        ({"growth": 0}, "growth must be an int >= 1"),
        ({"pad": "yes"}, "pad must be True, False or None"),
        ({"cuda_graphs": 1}, "cuda_graphs must be True, False or None"),
    ],
)
def test_plan_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(**kwargs)


def test_plan_rejects_capacity_past_positions_and_graphs_on_cpu():
    model = tiny_llama()  # 256 positions
    with pytest.raises(ValueError, match=r"capacity 1000 is outside \[1, 320\].*256 positions"):
        _plan(model, capacity=1000)
    with pytest.raises(ValueError, match="capacity 0 is outside"):
        _plan(model, capacity=0)
    with pytest.raises(ValueError, match="cuda_graphs=True.*needs a model on a CUDA device"):
        _plan(model, PlanConfig(cuda_graphs=True))
    plan = _plan(model, capacity=100)
    assert plan.capacity == 256 and not plan.graphs and not plan.pad  # whole chunks of 256, eager on the CPU


def test_plan_is_bound_to_its_model_dtype_and_device():
    model, other = tiny_llama(), tiny_llama(seed=1)
    plan = _plan(model)
    with pytest.raises(ValueError, match="built for another model"):
        HFAdapter(other, 64, plan=plan)
    model.to(torch.float64)
    try:
        with pytest.raises(
            ValueError, match=r"built for torch.float32 on cpu, but the model is now torch.float64"
        ):
            HFAdapter(model, 64, plan=plan)
    finally:
        model.to(torch.float32)
    with pytest.raises(TypeError, match="plan must be a mtprobe.PlanConfig"):
        mtprobe.generate(
            model, torch.tensor([[1, 2, 3]]), mtprobe.PlainConfig(), max_new_tokens=2, plan={"pad": True}
        )


# --- masks --------------------------------------------------------------------------------------


def test_padded_mask_is_the_worked_example():
    """The module docstring's example: P = 5, a root with two children, padded to bucket 4."""
    P, tree = 5, torch.tensor([[0.0, MIN, MIN], [0.0, 0.0, MIN], [0.0, MIN, 0.0]])  # [3, 3]
    mask = torch.cat([torch.zeros(3, P), tree], dim=1).view(1, 1, 3, P + 3)
    out = padded_mask(mask, 4, P + 4)[0, 0]  # [4, 9]
    visible = (out == 0).int().tolist()
    assert visible == [
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1],  # the padding input sees only itself
    ]
    assert set(out.unique().tolist()) == {0.0, MIN}
    wide = padded_mask(mask, 4, 16)[0, 0]  # graphs: every column of the capacity, the rest hidden
    assert torch.equal(wide[:, :9], out) and bool((wide[:, 9:] == MIN).all())


def test_chain_mask_is_causal():
    m = chain_mask(3, 4, torch.float32, torch.device("cpu"))[0, 0]  # [4, 7]
    assert bool((m[:, :3] == 0).all())
    assert torch.equal(m[:, 3:] == 0, torch.ones(4, 4, dtype=torch.bool).tril())


# --- decoding through the plan -------------------------------------------------------------------


METHODS = {
    "plain": mtprobe.PlainConfig(),
    "pld": mtprobe.PromptLookupConfig(),
    "stand": mtprobe.StandConfig(block_complexity=10),
    "probe": mtprobe.ProbeConfig(block_complexity=10),
    "hybrid": mtprobe.HybridConfig(block_complexity=10),
    "lookahead": mtprobe.LookaheadConfig(),
    "auto": mtprobe.AutoConfig(),
}


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_plan_is_greedy_on_a_tiny_llama(method, pad):
    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5]])
    expected = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    # Blocks of 9-10 inputs run unpadded past the last bucket.
    plan = PlanConfig(pad=pad, buckets=(1, 2, 4, 8))
    out = mtprobe.generate(model, ids, METHODS[method], max_new_tokens=24, eos_token_id=None, plan=plan)
    assert torch.equal(out.sequences, expected)
    assert out.plan is not None and out.plan["pad"] is pad and out.plan["graphs"] == 0
    assert out.plan["eager_reason"] == "no CUDA graphs on cpu"
    # One device->host read per forward: the verdict. The built-in drafters hand their drafts over on the host.
    assert out.host_reads == out.forward_calls


@pytest.mark.parametrize("pad", [False, True])
def test_plan_is_greedy_on_smollm2(smollm2, greedy, pad):
    model, tokenizer = smollm2
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    expected = greedy(model, ids, 32)
    for method in ("plain", "hybrid"):
        cfg = mtprobe.HybridConfig(block_complexity=30) if method == "hybrid" else METHODS[method]
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=32, plan=PlanConfig(pad=pad))
        assert torch.equal(out.sequences, expected), method
        assert out.host_reads == out.forward_calls


def test_padding_is_invisible_to_real_inputs():
    """A padded forward's real rows equal the unpadded forward's, whatever the padding rows hold."""
    model = tiny_llama()
    ids = torch.tensor([3, 8, 1, 4, 9, 2, 7])
    logits = {}
    for pad in (False, True):
        plan = _plan(model, PlanConfig(pad=pad), capacity=32)
        adapter = HFAdapter(model, 32, plan=plan)
        P = 5
        adapter.forward(ids[:P], None, torch.arange(P).view(1, P), None, 0, False)  # prefill
        # A 3-input tree: root, two siblings (bucket 4: one padding input).
        tree = torch.tensor([[0.0, MIN, MIN], [0.0, 0.0, MIN], [0.0, MIN, 0.0]])
        mask = torch.cat([torch.zeros(3, P), tree], dim=1).view(1, 1, 3, P + 3)
        pos = torch.tensor([[P, P + 1, P + 1]])
        out, _ = adapter.forward(torch.tensor([2, 7, 6]), None, pos, mask, P, False)
        logits[pad] = out
        assert out.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


def test_plan_grows_by_chunks_and_stays_greedy():
    model = tiny_llama()
    ids = torch.tensor([5, 17, 9, 33, 2, 5, 17, 9])
    expected = model.generate(ids.view(1, -1), do_sample=False, max_new_tokens=40, pad_token_id=0)
    plan = _plan(model, PlanConfig(growth=16, pad=True, buckets=(1, 2, 4, 8)), capacity=16)
    assert plan.capacity == 32  # 16 entries and room for the last bucket's padding, in chunks of 16
    adapter = HFAdapter(model, 16, plan=plan)
    drafter = _C.PromptLookupDrafter(max_ngram_size=3, num_tokens=6)
    loop = _plan_loop(adapter, drafter, max_new_tokens=40, block_complexity=7)
    result = loop.run(ids)
    assert result.sequence == expected[0].tolist()
    assert plan.growths >= 1 and plan.capacity % 16 == 0 and plan.capacity >= len(result.sequence)
    assert result.host_reads == result.forward_calls


def test_a_plan_that_grows_captures_its_graphs_again(stand_in_graphs):
    """Growing drops the graphs (they read the old buffer) and captures the next steps' graphs into a new
    pool: PyTorch refuses a capture into a pool whose graphs were all freed (the first H200 run: every step
    after the first growth ran eager)."""
    model = tiny_llama()
    ids = torch.tensor([5, 17, 9, 33, 2, 5, 17, 9])
    expected = model.generate(ids.view(1, -1), do_sample=False, max_new_tokens=40, pad_token_id=0)
    plan = _plan(model, PlanConfig(growth=16, pad=True, buckets=(1, 2, 4, 8), cuda_graphs=True), capacity=16)
    adapter = HFAdapter(model, 16, plan=plan)
    drafter = _C.PromptLookupDrafter(max_ngram_size=3, num_tokens=6)
    loop = _plan_loop(adapter, drafter, max_new_tokens=40, block_complexity=7)
    result = loop.run(ids)
    assert result.sequence == expected[0].tolist()
    described = plan.describe()
    assert plan.growths >= 1 and described["eager_reason"] == "", described
    assert described["graphs_held"] >= 1 and described["replays"] >= 1, described


def test_plan_sampling_draws_what_the_growing_cache_draws():
    """Unpadded, the plan computes the same numbers as the growing cache: the same seed gives the same
    samples (so the existing distribution tests of sampling cover the plan too)."""
    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33]])
    for cfg in (mtprobe.StandConfig(block_complexity=8), mtprobe.PromptLookupConfig()):
        outs = []
        for plan in (None, PlanConfig()):
            torch.manual_seed(7)
            out = mtprobe.generate(
                model, ids, cfg, max_new_tokens=24, eos_token_id=None, do_sample=True, plan=plan, top_k=0
            )
            outs.append(out)
        assert torch.equal(outs[0].sequences, outs[1].sequences)
        # Sample matching reads once per forward too: the samples and the rows' maxima together.
        assert outs[1].host_reads == outs[1].forward_calls


def test_loop_counts_the_read_of_a_drafter_without_host_drafts():
    """A drafter that gives its tokens only as a tensor costs the loop a second read per step."""

    class DeviceOnly(_C.Drafter):
        def name(self):
            return "device-only"

        def begin(self, prompt):
            pass

        def propose(self, committed, prefix_len, limits):
            block = _C.DraftBlock()
            block.tokens = torch.cat([committed, torch.tensor([17])])  # one draft, always 17
            block.parents = list(range(-1, committed.shape[0] - 1)) + [committed.shape[0] - 1]
            block.num_committed = committed.shape[0]
            block.num_nodes = committed.shape[0] + 1
            return block

        def observe(self, outcome):
            pass

    model = tiny_llama()
    loop = cpu_decode_loop(model, DeviceOnly(), max_new_tokens=6, block_complexity=2, prompt_len=4)
    result = loop.run(torch.tensor([5, 17, 9, 33]))
    assert result.host_reads == 2 * result.forward_calls


def test_a_forward_that_cannot_be_captured_runs_eager_with_the_reason_logged(caplog):
    """The capture path on a CPU model fails (no CUDA stream): the plan logs why, runs every step eager
    (padded, as graphs would have), and the output stays greedy."""
    model = tiny_llama()
    ids = torch.tensor([5, 17, 9, 33, 2, 5, 17, 9])
    expected = model.generate(ids.view(1, -1), do_sample=False, max_new_tokens=12, pad_token_id=0)
    plan = _plan(model, PlanConfig(pad=True), capacity=32)
    plan.graphs, plan.eager_reason = True, ""  # as on a GPU
    adapter = HFAdapter(model, 32, plan=plan)
    drafter = _C.PromptLookupDrafter(max_ngram_size=3, num_tokens=4)
    loop = _plan_loop(adapter, drafter, max_new_tokens=12, block_complexity=5)
    with caplog.at_level("WARNING", logger="mtprobe"):
        result = loop.run(ids)
    assert result.sequence == expected[0].tolist()
    assert plan.eager_reason and plan.captures == 0 and plan.replays == 0
    assert [r.message for r in caplog.records if "could not be captured" in r.message] != []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_plan_captures_cuda_graphs_and_stays_greedy():
    model = tiny_llama().cuda()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5]], device="cuda")
    expected = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    for cfg in (mtprobe.PlainConfig(), mtprobe.HybridConfig(block_complexity=10), mtprobe.AutoConfig()):
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=24, eos_token_id=None, plan=PlanConfig())
        assert torch.equal(out.sequences, expected), type(cfg).__name__
        # The model keeps its plan across calls: the later configurations may capture nothing new.
        assert out.plan["eager_reason"] == "" and out.plan["graphs_held"] >= 1 and out.plan["replays"] >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_plan_grows_and_captures_again():
    # The first H200 run's failure with real graphs: a capture after the plan grew hit the allocator's assertion.
    model = tiny_llama().cuda()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9]], device="cuda")
    plan, cfg = PlanConfig(growth=16, buckets=(1, 2, 4, 8)), mtprobe.PromptLookupConfig()
    for n in (8, 40):  # the model's plan, kept from the first call, grows at the second
        expected = model.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=0)
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=n, eos_token_id=None, plan=plan)
        assert torch.equal(out.sequences, expected)
    assert out.plan["growths"] >= 1 and out.plan["eager_reason"] == "" and out.plan["replays"] >= 1, out.plan


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_failed_capture_leaves_the_callers_stream(monkeypatch):
    # torch.cuda.graph enters its capture stream before capture_begin; one that raises never leaves it.
    from mtprobe.target_model import plan as plan_module

    def fails(owner, step, device):
        torch.cuda.set_stream(torch.cuda.Stream(device))
        raise RuntimeError("capture_begin failed")

    monkeypatch.setattr(ForwardPlan, "_capture", fails)
    owner = _plan(tiny_llama().cuda(), PlanConfig(), capacity=32)
    before = torch.cuda.current_stream()
    assert plan_module.try_capture(owner, ("k",), None, lambda: None, "a test's forward", 0.0) is None
    assert torch.cuda.current_stream() == before and owner.eager_reason.startswith("RuntimeError")


@pytest.mark.parametrize("method", ["plain", "pld", "probe", "hybrid", "auto", "lookahead"])
def test_the_graph_path_is_greedy_with_a_stand_in_capture(stand_in_graphs, method):
    """Everything of the graph path but the CUDA capture itself, on the CPU: static buffers per bucket,
    keys over the whole capacity with the columns past the block hidden, write positions in a static
    tensor, outputs copied out before the next replay."""
    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5]])
    expected = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    plan = PlanConfig(cuda_graphs=True, buckets=(1, 2, 4, 8, 16))
    out = mtprobe.generate(model, ids, METHODS[method], max_new_tokens=24, eos_token_id=None, plan=plan)
    assert torch.equal(out.sequences, expected)
    assert out.plan["eager_reason"] == "" and out.plan["pad"] and out.plan["graphs"] >= 1
    # Every decode step replays its bucket's graph but those past the last bucket, which run eager.
    assert out.plan["replays"] == sum(t <= 16 for t in out.block_sizes) >= 1


def test_the_graph_path_with_hidden_states_and_a_real_model(stand_in_graphs, smollm2, greedy, tmp_path):
    """SmolLM2 through the stand-in graphs, and a drafter that reads the target's hidden states (a circuit
    head, untrained: its drafts are poor, the output must be greedy all the same) beside ones that do not."""
    from mtprobe import heads

    model, tokenizer = smollm2
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    expected = greedy(model, ids, 24)
    # AutoConfig's candidates with the self-draft's chains held at 12 (not the default's), so that 24
    # tokens take more than the prefill's step and a decode step replays, whatever the default chain.
    auto = mtprobe.AutoConfig(
        drafters=(
            mtprobe.PromptLookupConfig(),
            mtprobe.StandConfig(block_complexity=10, prompt_logits=0),
            mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=12),
        )
    )
    for cfg in (mtprobe.HybridConfig(block_complexity=30), auto):
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=24, plan=PlanConfig(cuda_graphs=True))
        assert torch.equal(out.sequences, expected), type(cfg).__name__
        assert out.plan["graphs"] >= 1 and out.plan["replays"] >= 1
    tiny = tiny_llama(seed=5)
    torch.manual_seed(0)
    spec = heads.HeadSpec(circuit="cp", hidden_size=64, vocab_size=96, window=3, rank=2)
    head = heads.new_head(tiny, spec)
    head.trained_steps.fill_(1)  # untrained on purpose: only the hidden states' path is under test here
    heads.save_head(head, tiny, tmp_path, {})
    small_ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9]])
    reference = tiny.generate(
        small_ids, do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=None
    )
    cfg = mtprobe.HeadsConfig(path=str(tmp_path), block_complexity=10)
    out = mtprobe.generate(
        tiny, small_ids, cfg, max_new_tokens=16, eos_token_id=None, plan=PlanConfig(cuda_graphs=True)
    )
    assert torch.equal(out.sequences, reference)
    assert out.plan["graphs"] >= 1 and out.plan["replays"] >= 1


def test_a_model_keeps_its_plan_and_graphs_across_calls(stand_in_graphs):
    """Captures are paid once per model and bucket: the next call with an equal PlanConfig reuses the
    plan (its KV buffer and graphs); another configuration, dtype or a released model gets a new one."""
    from mtprobe.state import kept as has_state
    from mtprobe.state import state_of
    from mtprobe.target_model import plan as plan_module

    model = tiny_llama()
    plan_module.release(model)
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5]])
    expected = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    cfg = PlanConfig(cuda_graphs=True, buckets=(1, 2, 4, 8, 16))

    def run(config=cfg, method="pld"):
        out = mtprobe.generate(model, ids, METHODS[method], max_new_tokens=24, eos_token_id=None, plan=config)
        assert torch.equal(out.sequences, expected)
        return out

    first = run()
    kept = state_of(model).plan
    second = run()
    assert state_of(model).plan is kept and not kept.busy
    assert first.plan["graphs"] >= 1 and second.plan["graphs"] == 0  # nothing captured again
    assert second.plan["graphs_held"] == first.plan["graphs_held"] and second.plan["replays"] > 0
    run(method="hybrid")  # another drafter, same plan: its buckets are captured once, then replayed
    assert state_of(model).plan is kept
    run(PlanConfig(cuda_graphs=True, buckets=(1, 4, 16)))  # another configuration: another plan
    assert state_of(model).plan is not kept
    plan_module.release(model)
    assert not has_state(model) or state_of(model).plan is None


def test_layer_offsets_run_eager_in_their_call_only(stand_in_graphs):
    model = tiny_llama()
    plan = _plan(model, PlanConfig(cuda_graphs=True), capacity=32)
    adapter = HFAdapter(model, 32, plan=plan)
    x = torch.tensor([3, 8, 1, 4, 9])
    adapter.forward(x, None, torch.arange(5).view(1, 5), None, 0, False)
    pos = torch.tensor([[5]])
    adapter.forward(torch.tensor([2]), None, pos, None, 5, False)
    assert plan.replays == 1 and plan.describe()["eager_reason"] == ""
    adapter.set_mask_layer_offsets(torch.zeros(model.config.num_hidden_layers, model.config.hidden_size))
    mask = torch.zeros(1, 1, 2, 8)
    mask[0, 0, 0, 7] = MIN  # the root does not see its mask input
    adapter.forward(torch.tensor([2]), torch.zeros(1, 64), torch.tensor([[6, 7]]), mask, 6, False)
    assert plan.replays == 1 and "layer offsets" in plan.describe()["eager_reason"]
    plan.start_call()
    assert plan.describe()["eager_reason"] == ""  # the next call may run its graphs again


def test_mask_temperatures_keep_the_graphs(stand_in_graphs):
    # A temperature divides the mask rows of a forward's logits after it ran: graphs still replay, the
    # token rows are untouched.
    model = tiny_llama()
    plan = _plan(model, PlanConfig(cuda_graphs=True), capacity=32)
    adapter = HFAdapter(model, 32, plan=plan)
    adapter.forward(torch.tensor([3, 8, 1, 4, 9]), None, torch.arange(5).view(1, 5), None, 0, False)
    mask = torch.zeros(1, 1, 2, 7)
    mask[0, 0, 0, 6] = MIN  # the root does not see its mask input
    args = (torch.tensor([2]), torch.full((1, 64), 0.1), torch.tensor([[5, 6]]), mask, 5, False)
    plain, _ = adapter.forward(*args)
    plain = plain.clone()  # [2, vocab]; a replay's output buffer is the next replay's
    replays = plan.replays
    adapter.set_mask_temperature(torch.tensor([2.0]))
    scaled, _ = adapter.forward(*args)
    assert plan.replays == replays + 1 and plan.describe()["eager_reason"] == ""
    assert torch.equal(scaled[0], plain[0])
    torch.testing.assert_close(scaled[1], plain[1] / 2)
