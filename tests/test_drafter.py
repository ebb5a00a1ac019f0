"""The custom-drafter extension point ``mtprobe._C.Drafter`` (csrc/drafters/drafter.h): the loop checks
every block a drafter returns and holds a Python drafter for as long as it runs."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import cpu_decode_loop, tiny_llama
from mtprobe import _C

PROMPT = torch.tensor([5, 17, 9, 33, 2])


class Scripted(_C.Drafter):
    """Returns what ``make(committed)`` builds: one bad block per test."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def name(self):
        return "scripted"

    def begin(self, prompt):
        pass

    def propose(self, committed, prefix_len, limits):
        return self.make(committed)

    def observe(self, outcome):
        pass


def run(make, **kwargs):
    model = tiny_llama()
    loop = cpu_decode_loop(
        model, Scripted(make), max_new_tokens=4, block_complexity=4, prompt_len=len(PROMPT), **kwargs
    )
    return loop.run(PROMPT)


def block(committed, tokens=(), parents=()):
    return _C.token_block(committed, list(tokens), list(parents))


def test_a_valid_python_drafter_runs():
    model = tiny_llama()
    ref = model.generate(PROMPT[None], do_sample=False, max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    assert run(lambda c: block(c, [7, 8], [-1, 0])).sequence == ref[0].tolist()


def with_(b, **fields):
    for key, value in fields.items():
        setattr(b, key, value)
    return b


BAD_BLOCKS = {
    "propose returned None": (
        lambda c: None,
        TypeError,
        r"Scripted.propose\(\) returned None; it must return",
    ),
    "propose returned a list": (
        lambda c: [1, 2],
        TypeError,
        r"returned list; it must return a mtprobe._C.DraftBlock",
    ),
    "float tokens": (
        lambda c: with_(block(c), tokens=c.float()),
        ValueError,
        "block.tokens must be a 1-D int64",
    ),
    "too few parents": (
        lambda c: with_(block(c, [7, 8], [-1, 0]), parents=list(range(-1, len(c)))),
        ValueError,
        "parents lists .* inputs; parents needs one entry per input",
    ),
    "parent out of range": (
        lambda c: with_(block(c, [7], [-1]), parents=[*range(-1, len(c) - 1), 99]),
        ValueError,
        "parent",
    ),
    "num_nodes past the tokens": (
        lambda c: with_(block(c, [7], [-1]), num_nodes=len(c) + 3),
        ValueError,
        r"block.num_nodes is .*; it must lie in \[num_committed, number of tokens\]",
    ),
    "num_committed wrong": (
        lambda c: with_(block(c, [7], [-1]), num_committed=len(c) + 1),
        ValueError,
        "block.num_committed is",
    ),
    "committed tokens changed": (
        lambda c: block(c + 1, [7], [-1]),
        ValueError,
        "the block must start with the committed tokens it was handed",
    ),
    "token outside the vocabulary": (
        lambda c: block(c, [10_000], [-1]),
        ValueError,
        r"carries token id 10000, outside the vocabulary \[0, 96\)",
    ),
    "negative token": (lambda c: block(c, [-3], [-1]), ValueError, "carries token id -3"),
    "embeds of the wrong rank": (
        lambda c: with_(block(c), embeds=torch.zeros(3), parents=list(range(-1, len(c) - 1)) + [len(c) - 1]),
        ValueError,
        "block.embeds must be a 2-D floating tensor",
    ),
    "draft probs of the wrong shape": (
        lambda c: with_(block(c, [7], [-1]), draft_probs=torch.ones(3, 96)),
        ValueError,
        r"block.draft_probs must be a floating \[num_nodes - num_committed, vocab\] = \[1, vocab\]",
    ),
    "over the block complexity": (
        lambda c: block(c, [7, 8, 9, 10, 11], [-1, 0, 1, 2, 3]) if len(c) == 1 else block(c),
        ValueError,
        "over the block complexity 4",
    ),
}


@pytest.mark.parametrize("case", list(BAD_BLOCKS))
def test_bad_blocks_get_a_clear_error(case):
    make, error, message = BAD_BLOCKS[case]
    with pytest.raises(error, match=message):
        run(make, vocab_size=96)


def test_a_temporary_python_drafter_outlives_its_python_name():
    # The drafter exists only as the loop's argument: the loop must keep its Python half alive
    # (without it, the overrides vanish and C++ calls a pure virtual function).
    model = tiny_llama()
    loop = cpu_decode_loop(
        model,
        Scripted(lambda c: block(c, [7], [-1])),
        max_new_tokens=4,
        block_complexity=4,
        prompt_len=len(PROMPT),
    )
    gc.collect()
    assert len(loop.run(PROMPT).sequence) == len(PROMPT) + 4


def test_token_block_checks_its_arguments():
    with pytest.raises(ValueError, match="one entry per draft"):
        _C.token_block(PROMPT, [1, 2], [-1])
    with pytest.raises(ValueError, match="a parent is -1 .* or an earlier draft"):
        _C.token_block(PROMPT, [1, 2], [-1, 1])
