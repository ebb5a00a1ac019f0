"""benchmarks/_common.off_grid: the full-precision stand-in of the benchmarks' figures moves every weight
off the 4/8-bit grid it was dequantized from, by less than half a step, repeatably."""

from __future__ import annotations

import argparse

import pytest
import torch

from conftest import load_benchmark, tiny_llama
from mtprobe.cpu.quantized_linear import dequantize, quantize

common = load_benchmark("_common")


def _on_the_grid(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Put every weight on the grid the wheel's SmolLM2 has (Q4_1 linears, a Q8_0 embedding) and return them."""
    embedding = model.get_input_embeddings().weight
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not embedding:
                module.weight.copy_(dequantize(quantize(module.weight, "q4_1")))
        embedding.copy_(dequantize(quantize(embedding, "q8_0")))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_every_weight_leaves_the_grid_by_less_than_half_a_step():
    model = tiny_llama(seed=4, tie_word_embeddings=True)
    before = _on_the_grid(model)
    said = common.off_grid(model, 11)
    assert said.startswith("off the grid (seed 11):")
    embedding = model.get_input_embeddings().weight
    for name, p in model.named_parameters():
        if p.dim() != 2:
            assert torch.equal(p, before[name]), name  # norms are kept
            continue
        fmt = "q8_0" if p is embedding else "q4_1"
        w = before[name].reshape(p.shape[0], -1, 32)
        step = (w.abs().amax(-1) / 127) if fmt == "q8_0" else (w.amax(-1) - w.amin(-1)) / 15  # [out, groups]
        moved = (p.detach() - before[name]).reshape(w.shape).abs()
        assert bool((moved <= step[..., None] / 2 + 1e-7).all()), name
        assert int((moved > 0).sum()) > 0.99 * p.numel(), name
        # and the draft no longer reproduces it: re-quantized, it is not the model's weight
        assert not torch.equal(dequantize(quantize(p.detach(), fmt)), p.detach()), name


def test_off_grid_is_seeded():
    a, b, c = (tiny_llama(seed=4) for _ in range(3))
    common.off_grid(a, 1), common.off_grid(b, 1), common.off_grid(c, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))


@pytest.mark.parametrize("seed", ["1", 1.0, None, True])
def test_a_seed_that_is_not_an_integer_is_refused(seed):
    with pytest.raises(TypeError, match=r"off_grid: seed must be an int \(the noise's seed\)"):
        common.off_grid(tiny_llama(seed=4), seed)
    with pytest.raises(
        argparse.ArgumentTypeError, match=r"--off-grid takes an integer seed, e.g. --off-grid 0"
    ):
        common.off_grid_seed("zero")
    assert common.off_grid_seed("7") == 7
