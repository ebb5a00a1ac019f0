"""Why mask-token probing works: hidden-state alignment of mask tokens (seed 001, section 3.2).

At a decode step whose last generated token is x_t, the mask token m sits at position t + 1 next
to the (then unknown) next true token x_{t+1}; both "predict" x_{t+2}. In hindsight, from a greedy
sequence, ``mask_alignment`` re-creates that pair for every step: one forward of
``[x_1..x_t | x_{t+1}, m]`` with x_{t+1} and m as siblings at position t + 1 (each attends to the
prefix and itself), the mask embedding exactly as the drafter had it then (prompt mean, moved
by lambda towards every generated token so far). It records the per-layer cosine similarity of
the two hidden states, whether x_{t+2} is the mask's top-1 and whether it is among its top-K
(with one mask and K drafts, a top-K hit is exactly an accepted draft), and the final states
that the LM head multiplies.

``lemma_check`` tests Lemma 3.1 on those states. The lemma: with c = sqrt(2) c_w c_h,
cos(h_m, h_v) > delta* = 1 - (Delta_{K*}^v / 2c)^2 implies x_{t+2} is in the mask's top-K, where
Delta_{K*}^v is the next-true state's logit gap between its top-1 and its K-th token. Its proof
bounds ||h_m - h_v|| through cos and c_h, which is exact only when both norms equal c_h; the
check therefore also tests the direct form of the same argument, 2 c_w ||h_m - h_v|| <
Delta_{K*}^v, which holds for any norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class AlignmentRecord:
    """One decode position seen in hindsight."""

    position: int  # index of x_{t+1} in the sequence
    cos_per_layer: torch.Tensor  # [num_layers + 1]: embeddings, then after each decoder layer
    top1_hit: bool  # x_{t+2} is the mask's argmax
    topk_hit: bool  # x_{t+2} is among the mask's top-K: the draft would be accepted
    h_mask: torch.Tensor  # [hidden] the LM head's input at the mask
    h_next: torch.Tensor  # [hidden] the LM head's input at x_{t+1}


@torch.no_grad()
def mask_alignment(
    model: PreTrainedModel,
    sequence: torch.Tensor,  # [1, L] prompt + greedy continuation
    prompt_len: int,
    *,
    top_k: int = 14,
    mask_lambda: float = 0.1,
) -> list[AlignmentRecord]:
    """Per-layer alignment of the mask token with the next true token at every decode position."""
    if sequence.dim() != 2 or sequence.shape[0] != 1:
        raise ValueError(f"sequence must be [1, L], got shape {tuple(sequence.shape)}")
    if not 1 <= prompt_len <= sequence.shape[1] - 2:
        raise ValueError(
            f"prompt_len={prompt_len} must leave at least two generated tokens in a sequence of {sequence.shape[1]}"
        )
    embed = model.get_input_embeddings()
    dtype = embed.weight.dtype
    seq = sequence[0]
    e = embed(sequence)[0]  # [L, hidden]
    mask = e[:prompt_len].float().mean(0)  # [hidden]: soft initialisation
    head_inputs: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, inp, out: head_inputs.append(inp[0]))
    records = []
    try:
        # j indexes the next true token; its mask sibling attends seq[:j]. j = prompt_len is the
        # prefill's mask. The mask has been moved towards every token before j (in the real loop a
        # token accepted as a draft is folded in one step later: a small difference).
        for j in range(prompt_len, seq.shape[0] - 1):
            if j > prompt_len:
                mask = mask + mask_lambda * (e[j - 1].float() - mask)
            x = torch.cat([e[: j + 1], mask.to(dtype)[None]], dim=0)[None]  # [1, j + 2, hidden]
            t = j + 2
            allowed = torch.tril(torch.ones(t, t, dtype=torch.bool))
            allowed[j + 1, j] = False  # the mask and x_{j} are siblings: neither sees the other
            attn = torch.zeros(1, 1, t, t, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            pos = torch.cat([torch.arange(j + 1), torch.tensor([j])])[None]
            head_inputs.clear()
            out = model(inputs_embeds=x, attention_mask=attn, position_ids=pos, output_hidden_states=True)
            states = torch.stack([h[0, -2:] for h in out.hidden_states]).float()  # [layers + 1, 2, hidden]
            cos = torch.nn.functional.cosine_similarity(states[:, 0], states[:, 1], dim=-1)
            mask_logits = out.logits[0, -1].float()
            target = int(seq[j + 1])
            head_in = head_inputs[-1][0, -2:].float()  # [2, hidden]
            records.append(
                AlignmentRecord(
                    position=j,
                    cos_per_layer=cos,
                    top1_hit=int(mask_logits.argmax()) == target,
                    topk_hit=target in mask_logits.topk(top_k).indices.tolist(),
                    h_mask=head_in[1],
                    h_next=head_in[0],
                )
            )
    finally:
        hook.remove()
    return records


@dataclass
class LemmaReport:
    n: int
    topk_hits: int
    premise_paper: int  # cos > delta* (the lemma's condition)
    violations_paper: int  # premise holds, conclusion fails
    premise_direct: int  # 2 c_w ||h_m - h_v|| < Delta_{K*}
    violations_direct: int  # must be 0: this form is a theorem for any norms
    mean_cos: float
    mean_delta_star: float


@torch.no_grad()
def lemma_check(model: PreTrainedModel, records: list[AlignmentRecord], top_k: int = 14) -> LemmaReport:
    """Lemma 3.1 on real final hidden states (see the module docstring)."""
    w = model.get_output_embeddings().weight.float()  # [vocab, hidden]
    c_w = float(w.norm(dim=1).max())
    counts = dict(premise_paper=0, violations_paper=0, premise_direct=0, violations_direct=0, topk_hits=0)
    cos_all, delta_all = [], []
    for r in records:
        lv, lm = w @ r.h_next, w @ r.h_mask  # [vocab]
        top_v = lv.topk(top_k).values
        gap = float(top_v[0] - top_v[-1])  # Delta_{K*}^v
        i_star = int(lv.argmax())
        hit = i_star in lm.topk(top_k).indices.tolist()
        c_h = max(float(r.h_mask.norm()), float(r.h_next.norm()))
        c = 2**0.5 * c_w * c_h
        delta_star = 1 - (gap / (2 * c)) ** 2
        cos = float(torch.nn.functional.cosine_similarity(r.h_mask, r.h_next, dim=0))
        cos_all.append(cos)
        delta_all.append(delta_star)
        counts["topk_hits"] += hit
        if cos > delta_star:
            counts["premise_paper"] += 1
            counts["violations_paper"] += not hit
        if 2 * c_w * float((r.h_mask - r.h_next).norm()) < gap:
            counts["premise_direct"] += 1
            counts["violations_direct"] += not hit
    n = len(records)
    return LemmaReport(
        n=n,
        mean_cos=sum(cos_all) / max(1, n),
        mean_delta_star=sum(delta_all) / max(1, n),
        **counts,
    )
