"""Reference definition of the target's own forward (``mtprobe._C.TargetForward``): a verification block of
T inputs through Llama-family decoder layers, the block's attention split as the C++ forward splits it.

Each input attends to the P cached entries (all of them) and to the block entries its mask row shows; the
two parts are attended apart and merged by their log-sum-exps (xformers' tree attention):
``out = (e^lse_p out_p + e^lse_b out_b) / (e^lse_p + e^lse_b)``, which equals one softmax over both. The
layer is HF's LlamaDecoderLayer (Qwen3's per-head q/k norm where ``q_norm`` is given); Gemma 3's where the
layer has ``attn_out_norm`` and ``mlp_out_norm`` (its norms' weights passed as the 1 + w they multiply by), its
own ``inv_freq`` where given, and a sliding window where ``windows`` gives it one (a key at position k hidden
from a query at position p where p - k >= window; a cached row's position is its index). Computed in float64,
so a test can hold the C++ forward and HF's to one reference.

``tensors``: what :func:`mtprobe.target_model.native_forward.arguments` passes the C++ forward (the layers'
``input_norm``, ``q.weight``, ... by name).

Worked example of the merge (one head, head_dim 1, q = 1, scale 1): prefix keys {0} with value 1, block keys
{ln 3} with value 3: out_p = 1, lse_p = 0; out_b = 3, lse_b = ln 3; out = (1 * 1 + 3 * 3) / (1 + 3) = 2.5,
one softmax over both keys: (1 * 1 + 3 * 3) / 4.
"""

from __future__ import annotations

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _linear(t: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    y = x @ t[f"{name}.weight"].double().T
    return y + t[f"{name}.bias"].double() if f"{name}.bias" in t else y


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def target_forward(
    embed: torch.Tensor,  # [vocab, hidden]
    layers: list[dict[str, torch.Tensor]],
    final_norm: torch.Tensor,  # [hidden]
    head: dict[str, torch.Tensor],  # "head.weight" [vocab, hidden], "head.bias"?
    inv_freq: torch.Tensor,  # [head_dim / 2]
    *,
    heads: int,
    kv_heads: int,
    eps: float,
    scale: float,
    rope_scaling: float,
    windows: list[int] | None = None,  # per layer, 0: full attention
    embed_scale: float = 1.0,
    activation: str = "silu",  # or "gelu_tanh"
    tokens: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    mask: torch.Tensor | None,  # [T, P + T] additive (0 / <= -1e30), None for a causal chain
    keys: list[
        torch.Tensor
    ],  # per layer [1, kv_heads, >= P + T, head_dim]: rows < P cached, the block's written
    values: list[torch.Tensor],
    prefix_len: int,
) -> torch.Tensor:  # [T, vocab] float64
    T, P = tokens.shape[0], prefix_len
    x = embed[tokens].double() * embed_scale  # [T, hidden]

    def rope_of(freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 1, head_dim] each
        angle = positions.double()[:, None] * freq.double()[None, :]  # [T, head_dim / 2]
        return (
            (torch.cat([angle, angle], -1).cos() * rope_scaling)[:, None, :],
            (torch.cat([angle, angle], -1).sin() * rope_scaling)[:, None, :],
        )

    if mask is None:  # a chain: each input sees the block rows up to itself
        block_visible = torch.ones(T, T, dtype=torch.bool).tril()
    else:
        block_visible = mask[:, P:] > -1e30  # [T, T]
    prefix_visible = torch.ones(T, P, dtype=torch.bool)  # [T, P]
    act = (
        torch.nn.functional.silu
        if activation == "silu"
        else lambda g: torch.nn.functional.gelu(g, approximate="tanh")
    )
    group = heads // kv_heads
    for i, t in enumerate(layers):
        cos, sin = rope_of(t.get("inv_freq", inv_freq))
        window = (windows or [0] * len(layers))[i]
        seen_b, seen_p = block_visible, prefix_visible
        if window:
            seen_b = seen_b & (positions[:, None] - positions[None, :] < window)
            seen_p = (positions[:, None] - torch.arange(P)[None, :]) < window
        h = _rms(x, t["input_norm"].double(), eps)
        q = _linear(t, "q", h).view(T, heads, -1)  # [T, heads, d]
        k = _linear(t, "k", h).view(T, kv_heads, -1)  # [T, kv_heads, d]
        v = _linear(t, "v", h).view(T, kv_heads, -1)
        if "q_norm" in t:
            q, k = _rms(q, t["q_norm"].double(), eps), _rms(k, t["k_norm"].double(), eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys[i][0, :, P : P + T] = k.transpose(0, 1).to(keys[i].dtype)
        values[i][0, :, P : P + T] = v.transpose(0, 1).to(values[i].dtype)
        kc = keys[i][0, :, :P].double().repeat_interleave(group, 0)  # [heads, P, d] the cached prefix
        vc = values[i][0, :, :P].double().repeat_interleave(group, 0)
        kb = k.transpose(0, 1).repeat_interleave(group, 0)  # [heads, T, d] the block
        vb = v.transpose(0, 1).repeat_interleave(group, 0)
        qh = q.transpose(0, 1) * scale  # [heads, T, d]
        sp = (qh @ kc.transpose(1, 2)).masked_fill(~seen_p, float("-inf"))  # [heads, T, P]
        sb = (qh @ kb.transpose(1, 2)).masked_fill(~seen_b, float("-inf"))  # [heads, T, T]
        lse_p, lse_b = sp.logsumexp(-1), sb.logsumexp(-1)  # [heads, T]
        out_p = sp.softmax(-1).nan_to_num() @ vc if P > 0 else torch.zeros_like(qh)
        out_b = sb.softmax(-1) @ vb
        lse = torch.logaddexp(lse_p, lse_b)
        att = (lse_p - lse).exp()[..., None] * out_p + (lse_b - lse).exp()[..., None] * out_b  # [heads, T, d]
        o = _linear(t, "o", att.transpose(0, 1).reshape(T, -1))
        x = x + (_rms(o, t["attn_out_norm"].double(), eps) if "attn_out_norm" in t else o)
        h = _rms(x, t["post_norm"].double(), eps)
        m = _linear(t, "down", act(_linear(t, "gate", h)) * _linear(t, "up", h))
        x = x + (_rms(m, t["mlp_out_norm"].double(), eps) if "mlp_out_norm" in t else m)
    return _linear(head, "head", _rms(x, final_norm.double(), eps))
