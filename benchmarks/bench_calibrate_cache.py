#!/usr/bin/env python
"""What a calibration step costs when its sequence's KV cache was kept versus rebuilt.

``calibrate --cache-gib`` keeps the caches of the held-out and then the first training sequences up to
a budget; a step on any other
sequence first rebuilds its cache (one forward over the sequence, no gradients). This times one
training step of ``calibrate_masks`` (``mask_loss`` forward and backward over ``--anchors`` anchors, with
the file's masks, layer offsets and mask LoRA) both ways, interleaved, on a random sequence of
``--length`` tokens, and prints the medians and their ratio.

    OMP_NUM_THREADS=2 python benchmarks/bench_calibrate_cache.py \\
        --mask-path benchmarks/results/calibrate/masks-smollm2-135m-k2-lora8.safetensors
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mtprobe import models
from mtprobe.offline import calibrate, calibration_data
from mtprobe.target_model.mask_calibration import MaskCalibration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--mask-path", required=True)
    ap.add_argument("--length", type=int, default=200, help="tokens in the sequence (prompt + continuation)")
    ap.add_argument("--prompt-length", type=int, default=72)
    ap.add_argument("--anchors", type=int, default=64, help="anchors per step (calibrate's default)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = models.load(args.model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    cal = MaskCalibration.load(args.mask_path)
    cal.check(model)
    masks = cal.masks.clone().requires_grad_(True)  # [k, hidden]
    offsets = cal.offsets_for(cal.num_masks)
    offsets = offsets.clone().requires_grad_(True) if offsets is not None else None
    lora = None
    if cal.mask_lora is not None:
        lora = {k: t.float().clone().requires_grad_(True) for k, t in cal.mask_lora.items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (args.length,), generator=g)  # [n]
    anchors = calibrate._anchors(args.length, args.prompt_length)[: args.anchors]

    def step(cache) -> None:
        loss, _ = calibrate.mask_loss(
            model, masks, ids, anchors, cache, layer_offsets=offsets, mask_lora=lora
        )
        loss.backward()

    kept = calibration_data._prefix_cache(model, ids)
    for _ in range(2):  # warm-up
        step(kept)
    times: dict[str, list[float]] = {"kept": [], "rebuilt": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        step(kept)
        times["kept"].append(time.perf_counter() - t)
        t = time.perf_counter()
        step(calibration_data._prefix_cache(model, ids))
        times["rebuilt"].append(time.perf_counter() - t)
    print(
        f"{args.model}, float32, {args.threads} threads, {platform.processor() or platform.machine()}; "
        f"{args.length} tokens, {args.anchors} anchors, {cal.num_masks} masks, "
        f"LoRA {'yes' if lora else 'no'}; cache {calibration_data._cache_bytes(kept) / 1e6:.1f} MB"
    )
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.3f} s per step ({', '.join(f'{t:.3f}' for t in ts)})")
    print(f"rebuilt / kept: {statistics.median(times['rebuilt']) / statistics.median(times['kept']):.2f}")


if __name__ == "__main__":
    main()
