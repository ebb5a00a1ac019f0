"""mtprobe's hooks sit on the user's model while it decodes: calibrated masks' layer offsets and LoRA,
the quantized self-draft's watch for the target's cache. Another thread running the same model at the
same time (a server's workers, a notebook's background generation) must see the model alone."""

from __future__ import annotations

import threading

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe.target_model import mask_hooks
from test_mask_lora import _random_lora


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def in_another_thread(fn):
    """``fn()`` run on a thread of its own, its result returned (or its exception raised) here."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@torch.no_grad()
def test_mask_hooks_change_this_threads_forwards_only(model):
    torch.manual_seed(0)
    x = model.get_input_embeddings()(torch.randint(0, 96, (1, 9)))  # [1, 9, hidden]
    layers = mask_hooks.decoder_layers(model)
    offsets = torch.randn(len(layers), 64) * 0.5  # [num_layers, hidden]
    plain = model(inputs_embeds=x).logits  # [1, 9, vocab]
    with (
        mask_hooks.layer_offsets(layers, offsets, start=5),
        mask_hooks.mask_lora(layers, _random_lora(model), start=5),
    ):
        mine = model(inputs_embeds=x).logits
        other = in_another_thread(lambda: model(inputs_embeds=x).logits)
    assert (mine[0, 5:] - plain[0, 5:]).abs().max() > 1e-3  # the hooks act here
    assert torch.equal(other, plain)  # and nowhere else


def test_a_generation_with_calibrated_masks_leaves_another_threads_generate_alone(model):
    # Thread A decodes with offsets and a LoRA at its masks; a pre-hook of the test's holds A inside one of
    # its mask forwards (its hooks registered) while thread B runs HF greedy on the same model.
    ids = torch.tensor([[3, 7, 11, 5, 3, 7, 11, 5]])
    want = model.generate(ids, do_sample=False, max_new_tokens=6)
    layers = mask_hooks.decoder_layers(model)
    offsets = torch.randn(len(layers), 64) * 0.5
    seen = {}
    main = threading.get_ident()

    def hold(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        if threading.get_ident() == main and h.shape[1] > 1 and "other" not in seen:
            seen["other"] = in_another_thread(lambda: model.generate(ids, do_sample=False, max_new_tokens=6))

    handle = layers[0].register_forward_pre_hook(hold, with_kwargs=True)
    try:
        with (
            mask_hooks.layer_offsets(layers, offsets, start=4),
            mask_hooks.mask_lora(layers, _random_lora(model), start=4),
        ):
            model(ids)  # this thread's forward, the hooks registered: B runs inside it
    finally:
        handle.remove()
    assert torch.equal(seen["other"], want)


def test_two_threads_decode_with_the_quantized_self_draft_at_once(model):
    # Each thread's draft takes its own target's entries: both texts are greedy's.
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=3)
    prompts = [torch.tensor([[3, 7, 11, 5, 3, 7, 11, 5]]), torch.tensor([[9, 4, 2, 8, 1]])]
    want = [model.generate(p, do_sample=False, max_new_tokens=24) for p in prompts]
    results = [None, None]
    start = threading.Barrier(2)

    def run(i):
        start.wait()
        results[i] = mtprobe.generate(model, prompts[i], cfg, max_new_tokens=24, do_sample=False).sequences

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, w) for r, w in zip(results, want, strict=True))
