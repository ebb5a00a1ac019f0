"""Shared fixtures: the real default model, loaded once per session."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import pytest
import torch

MAX_WORKERS = 4
"""``-n auto`` (pyproject's addopts) runs this many test processes at most: each loads the real models
(about 2 GB with Gemma), so more would trade memory for little time."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """pytest-xdist's ``-n auto``: one process per core, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


# AutoConfig's measurements stay in each test's process (no test starts from what an earlier run left on
# disk); the tests of the files turn them on in a folder of their own.
os.environ["MTPROBE_AUTO_CARRY"] = "0"

# Under pytest-xdist the workers share the cores: torch's threads are divided among them, or every
# forward of every worker would fight for all the cores at once.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # the notebook kernels and CLI runs the tests start inherit it
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(
    max(1, (os.cpu_count() or 1) // _WORKERS) if _WORKERS > 1 else max(1, torch.get_num_threads())
)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """A test that sets torch's thread count (the Spec-Bench harness's --threads) leaves it as it found
    it: forward profiles are keyed by it, so a later test would see another setting."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class QuietMachine:
    """Stands in for :class:`mtprobe.cpu.machine.OtherLoad` in the tests of the measurement caches
    (``monkeypatch.setattr(mtprobe.target_model.profile, "OtherLoad", QuietMachine)``), which must not depend on
    what the other test worker is doing."""

    share = 0.0
    busy = False

    def describe(self):
        return f"{100 * self.share:.0f}% of the CPU"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class BusyMachine(QuietMachine):
    """:class:`QuietMachine` with other processes using 60 % of the CPU."""

    share = 0.6
    busy = True


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (Q4_1-dequantized, fp32), fetched by the set-up command."""
    from mtprobe import models

    model, tokenizer = models.load("smollm2-135m", dtype=torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def greedy() -> Callable[..., torch.Tensor]:
    """``greedy(model, ids, max_new_tokens, **kwargs)``: what ``model.generate(ids, do_sample=False,
    max_new_tokens=max_new_tokens, **kwargs)`` returns, computed once per session for each model, prompt,
    length and keyword set, and handed out as a clone so that no test can change another's reference.
    The models it is used with keep their weights for the whole session."""
    # Keyed by the model object itself (weakly), so a freed model's id reused by a new one cannot hit.
    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def reference(model, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        key = (
            tuple(ids.reshape(-1).tolist()),
            tuple(ids.shape),
            max_new_tokens,
            tuple(sorted(kwargs.items())),
        )
        per_model = memo.setdefault(model, {})
        if key not in per_model:
            per_model[key] = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
        return per_model[key].clone()  # [1, prompt + new]

    return reference


CACHED_VS_FULL_BOUND = 1e-3
"""How far a float32 logit of ``model.generate``'s token-by-token greedy decoding (KV cache) may sit from
the same position's logit in one forward over the whole sequence. Measured on SmolLM2: at most 9.2e-5
over 25 prompts x 32 tokens; ``test_generate`` checks on the host at hand that it holds with room."""


@torch.no_grad()
def greedy_by_one_forward(model, ids: torch.Tensor, seq: torch.Tensor, max_new_tokens: int) -> bool:
    """True when ``seq`` [1, L + n] is provably ``model.generate(ids, do_sample=False,
    max_new_tokens=max_new_tokens)``, read from one forward over ``seq`` instead of n cached steps.

    Every new token must be the argmax of the logits before it, by a top-2 margin above twice
    :data:`CACHED_VS_FULL_BOUND`: then, by induction over the tokens, greedy decoding's own logits (at
    most the bound away) pick the same token. The length must be greedy's: ``max_new_tokens``, or fewer
    ending at the first end-of-sequence token. False is no verdict: run ``model.generate`` and compare.
    Only for models whose generation config adds no logits processor to greedy decoding (SmolLM2's).
    """
    prompt_len, new = ids.shape[1], seq.shape[1] - ids.shape[1]
    if seq.shape[0] != 1 or new < 1 or new > max_new_tokens or not torch.equal(seq[:, :prompt_len], ids):
        return False
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokens = seq[0, prompt_len:]  # [new]
    ends = [i for i, t in enumerate(tokens.tolist()) if t in eos]
    if ends and ends[0] != new - 1 or not ends and new != max_new_tokens:
        return False
    logits = model(seq).logits[0, prompt_len - 1 : -1].float()  # [new, vocab]
    top2 = logits.topk(2, dim=-1)
    return bool(
        torch.equal(top2.indices[:, 0], tokens)
        and (top2.values[:, 0] - top2.values[:, 1]).min() > 2 * CACHED_VS_FULL_BOUND
    )


class NullStreamer:
    """A streamer that takes every chunk and keeps none (for the checks that refuse a streamer)."""

    def put(self, value) -> None:
        pass

    def end(self) -> None:
        pass


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Token ids [1, L] of a conversation under the model's chat template."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
)
"""The tiny models' shape (:func:`tiny_llama`, :func:`tiny_family`): 2 layers, hidden 64, grouped-query attention."""


def tiny_llama(seed: int = 0, **overrides):
    """A small randomly initialised LlamaForCausalLM (2 layers, hidden 64), eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "max_position_embeddings": 256, **overrides})).eval()


def tiny_family(name: str, seed: int = 0, **overrides):
    """A small randomly initialised model of another Llama-family architecture, as :func:`tiny_llama`'s:
    ``"mistral"`` (no sliding window), ``"qwen2"`` (q/k/v biases), ``"qwen3"`` (per-head q/k norms, head_dim
    32 set apart from hidden / heads) or ``"gemma3"`` (Gemma 3's text model: sliding layers with a window of
    8 around a full-attention one, each type its RoPE base; its norms' weights drawn, not HF's zeros), eval
    mode."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**{"sliding_window": None, **kwargs})).eval()
    if name == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**{"use_sliding_window": False, **kwargs})).eval()
    if name == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 32, "use_sliding_window": False, **kwargs})).eval()
    if name == "gemma3":
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        cfg = Gemma3TextConfig(
            **{
                "head_dim": 16,
                "query_pre_attn_scalar": 24,
                "sliding_window": 8,
                "layer_types": layer_types,
                **kwargs,
                "num_hidden_layers": len(layer_types),
            }
        )
        model = Gemma3ForCausalLM(cfg).eval()
        with (
            torch.no_grad()
        ):  # HF initialises RMSNorm's w (scaled as 1 + w) to zeros; a trained model's are not
            for name_, p in model.named_parameters():
                if "norm" in name_:
                    p.uniform_(-0.5, 0.5)
        return model
    raise KeyError(f"tiny_family: no architecture {name!r}; one of mistral, qwen2, qwen3, gemma3")


# A word-level chat tokenizer and a tiny Llama saved with it as a local HF folder: what models.load,
# the command line and the Spec-Bench harness read like any Hugging Face folder, built in seconds.
CHAT_WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "the", "a", "is", "of"]
CHAT_VOCAB = 32  # the words above plus unused ids w12..w31
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def word_tokenizer(chat: bool = True):
    """A PreTrainedTokenizerFast over CHAT_WORDS (and w12..w31), with CHAT_TEMPLATE unless ``chat`` is
    False."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(CHAT_WORDS)} | {
        f"w{i}": i for i in range(len(CHAT_WORDS), CHAT_VOCAB)
    }
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def save_word_llama(folder, *, seed: int = 0, chat: bool = True, **overrides):
    """A random Llama over :func:`word_tokenizer`'s vocabulary (2 layers, hidden 32; ``overrides`` for
    LlamaConfig) saved with that tokenizer in ``folder``, returned."""
    kwargs = dict(
        vocab_size=CHAT_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=1024,
        initializer_range=0.02,  # LlamaConfig's own, which these folders were always made with
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    tiny_llama(seed, **{**kwargs, **overrides}).save_pretrained(folder)
    word_tokenizer(chat).save_pretrained(folder)
    return folder


def cpu_decode_loop(model, drafter, *, max_new_tokens: int, block_complexity: int, prompt_len: int, **kwargs):
    """A C++ DecodeLoop over ``model`` on the CPU (float32 masks, no EOS), its KV cache sized for
    the prompt, the new tokens and one block; ``kwargs`` override the rest (do_sample, process, ...).
    The adapter stays alive through the forward callback the loop holds."""
    from mtprobe import _C
    from mtprobe.target_model.adapter import HFAdapter

    capacity = prompt_len + max_new_tokens + block_complexity
    adapter = HFAdapter(model, capacity)
    options = dict(
        max_new_tokens=max_new_tokens,
        eos_token_ids=[],
        max_positions=model.config.max_position_embeddings,
        block_complexity=block_complexity,
        kv_capacity=capacity,
        mask_dtype="float32",
        device="cpu",
    )
    options.update(kwargs)
    return _C.DecodeLoop(drafter, adapter.forward, adapter.kv_buffers, **options)


def load_benchmark(name: str):
    """The module of benchmarks/<name>.py (benchmarks/ is scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    if str(folder) not in sys.path:  # the scripts import benchmarks/_common.py as a sibling
        sys.path.insert(0, str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class _StandInPool:
    """A stand-in for a CUDA graph memory pool (``torch.cuda.graph_pool_handle()``): the graphs captured into it."""

    def __init__(self) -> None:
        self.graphs: list[weakref.ref] = []


class _StandInGraph:
    """A CPU stand-in for CUDA graph capture with a graph's semantics: the outputs are the tensors of the
    capture run, and a replay recomputes the step from the same static buffers into those same tensors. Its
    pools keep PyTorch's rule: a capture into a pool whose graphs were all freed fails, as
    CUDACachingAllocator's assertion ``use_count > 0`` does."""

    @staticmethod
    def capture(plan, step, device):
        if plan._pool is None:
            plan._pool = _StandInPool()
        pool = plan._pool
        if pool.graphs and all(g() is None for g in pool.graphs):
            raise RuntimeError(
                "it->second->use_count > 0 INTERNAL ASSERT FAILED (stand-in: a capture into a pool whose "
                "graphs were all freed)"
            )
        outputs = step()
        slots = plan.cache.slots
        baked = dict(
            vars(slots)
        )  # a graph keeps the buffers it was captured with (write positions, rows, ...)

        def replay():
            vars(slots).update(baked)
            logits, hidden = step()
            outputs[0].copy_(logits)
            if hidden is not None:
                outputs[1].copy_(hidden)

        pool.graphs.append(weakref.ref(replay))
        return replay, outputs


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """mtprobe.target_model.plan's graph path on the CPU, with _StandInGraph for the CUDA capture."""
    from mtprobe.target_model.plan import ForwardPlan

    monkeypatch.setattr(ForwardPlan, "_CAPTURABLE", ("cuda", "cpu"))
    monkeypatch.setattr(ForwardPlan, "_capture", _StandInGraph.capture)
