"""Sanity checks on the shipped prompt set (python/mtprobe/data/prompts.jsonl)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from mtprobe.data import KINDS, PROMPTS_FILE, load_prompts

REQUIRED_LANGUAGES = {"fr", "de", "es", "zh", "ja", "ru"}


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return load_prompts()


def test_every_line_is_json() -> None:
    lines = [ln for ln in PROMPTS_FILE.read_text(encoding="utf-8").splitlines() if ln.strip()]
    assert lines, "prompts.jsonl is empty"
    for ln in lines:
        assert isinstance(json.loads(ln), dict)
    # Loader and raw file agree (no lines silently dropped).
    assert len(load_prompts()) == len(lines)


def test_at_least_20_prompts(prompts: list[dict]) -> None:
    assert len(prompts) >= 20


def test_schema(prompts: list[dict]) -> None:
    for p in prompts:
        assert set(p) == {"id", "kind", "messages"}, p.get("id")
        assert isinstance(p["id"], str) and p["id"]
        assert p["kind"] in KINDS, p["id"]
        for m in p["messages"]:
            assert m["role"] in {"system", "user", "assistant"}
            assert isinstance(m["content"], str) and m["content"].strip(), p["id"]


def test_ids_unique(prompts: list[dict]) -> None:
    dupes = [i for i, n in Counter(p["id"] for p in prompts).items() if n > 1]
    assert not dupes, dupes


def test_covers_all_kinds(prompts: list[dict]) -> None:
    missing = set(KINDS) - {p["kind"] for p in prompts}
    assert not missing, missing
    # "several" open-ended chat prompts.
    assert sum(p["kind"] == "chat" for p in prompts) >= 2


def test_non_english_languages(prompts: list[dict]) -> None:
    langs = {p["id"].split("-")[2] for p in prompts if p["kind"] == "non-english"}
    assert REQUIRED_LANGUAGES <= langs, REQUIRED_LANGUAGES - langs


def test_long_prompts_are_long(prompts: list[dict]) -> None:
    long_ = [p for p in prompts if p["kind"] == "long"]
    for p in long_:
        words = sum(len(m["content"].split()) for m in p["messages"])
        assert words >= 300, (p["id"], words)


def test_multi_turn_has_history(prompts: list[dict]) -> None:
    for p in prompts:
        if p["kind"] == "multi-turn":
            roles = [m["role"] for m in p["messages"]]
            assert "assistant" in roles and roles.count("user") >= 2, p["id"]


def test_conversations_end_with_user_turn(prompts: list[dict]) -> None:
    for p in prompts:
        assert p["messages"][-1]["role"] == "user", p["id"]
        # Turns alternate after an optional system message, as chat templates expect.
        roles = [m["role"] for m in p["messages"] if m["role"] != "system"]
        assert all(a != b for a, b in zip(roles, roles[1:], strict=False)), p["id"]


def test_prompts_are_not_too_long(prompts: list[dict]) -> None:
    # ~900 tokens budget; 4 chars/token is pessimistic for English, CJK is short here anyway.
    for p in prompts:
        chars = sum(len(m["content"]) for m in p["messages"])
        assert chars < 3600, (p["id"], chars)


def test_load_prompts_from_path_rejects_bad_lines(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "kind": "chat", "messages": []}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl, line 1"):
        load_prompts(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('\n{"id": "a", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}\n\n')
    assert [p["id"] for p in load_prompts(good)] == ["a"]
