"""What the vLLM proposer knows of a request: the history it has seen, and the drafts of its last chain
that the next history kept.

vLLM hands a proposer no request ids, only each row's token history, so a request is recognised by it:
its state is the one whose history the row's extends. Between two steps the history grows by the drafts
vLLM accepted and one token of vLLM's own (the bonus, or its correction of the first rejected draft).
"""

from __future__ import annotations

import numpy as np

from mtprobe.vllm.pricing import NEW


class SeenRequest:
    """``tokens``: the history seen so far ([n] int64); ``sent``: the chain of the last proposal;
    ``state``: the outcome of the last verified chain, which prices the next (mtprobe.vllm.pricing)."""

    def __init__(self, history: np.ndarray) -> None:
        self.tokens = history.copy()
        self.sent: list[int] = []
        self.state = NEW

    def extended_by(self, history: np.ndarray) -> bool:
        n = self.tokens.shape[0]
        return history.shape[0] >= n and np.array_equal(history[:n], self.tokens)

    def accepted(self, new: np.ndarray) -> int:
        """How many drafts of ``sent`` the tokens ``new`` added since kept: the chain's tokens they repeat,
        short of their last token, which is vLLM's own."""
        count = 0
        while count < min(len(self.sent), new.shape[0] - 1) and self.sent[count] == int(new[count]):
            count += 1
        return count
