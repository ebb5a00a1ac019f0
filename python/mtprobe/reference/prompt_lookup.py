"""Reference prompt-lookup drafting rule (transformers' PromptLookupCandidateGenerator, greedy case).

For n from ``max_ngram_size`` down to 1, find the earliest occurrence of the history's last n-gram
that is followed by at least one token, and draft up to ``max_tokens`` of the tokens after it.

>>> prompt_lookup([5, 6, 7, 8, 5, 6], max_ngram_size=2, max_tokens=3)
[7, 8, 5]
>>> prompt_lookup([1, 2, 3], max_ngram_size=2, max_tokens=3)  # the last n-gram never occurred before
[]
"""

from __future__ import annotations

from collections.abc import Sequence


def prompt_lookup(seq: Sequence[int], max_ngram_size: int, max_tokens: int) -> list[int]:
    seq = list(seq)
    for n in range(min(max_ngram_size, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for i in range(len(seq) - n):  # an occurrence with at least one token after it
            if seq[i : i + n] == tail:
                return seq[i + n : i + n + max_tokens]
    return []
