"""The byte-level LM (python/mtprobe/offline/bytelm.py): its tokenizer is exactly UTF-8 bytes, training lowers the
held-out bits per byte, the saved folder loads through mtprobe.models like any HF model, and circuit
heads over 8 bytes decode on it token-identically to greedy."""

from __future__ import annotations

import json

import pytest
import torch

import mtprobe
from mtprobe import cli, models
from mtprobe.offline import bytelm
from mtprobe.offline import heads as offline_heads

TEXT = (
    "The quick brown fox jumps over the lazy dog.\n%\n"
    "A stitch in time saves nine; a fox in time saves the dog.\n%\n"
    "Pack my box with five dozen liquor jugs, said the quick brown fox.\n%\n"
    "Über-naïve café owners serve crème brûlée — fast, while the quick brown fox waits by the door of the old red barn.\n%\n"
) * 12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "fortunes"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """(folder, stats) of a tiny byte LM trained briefly on ``TEXT``."""
    model, stats = bytelm.train_byte_lm(
        [corpus], hidden_size=32, num_layers=2, num_heads=2, steps=80, seq_len=48, batch_size=8, lr=1e-2
    )
    folder = tmp_path_factory.mktemp("bytelm")
    bytelm.save_byte_lm(model, folder, stats)
    return folder, stats


def test_tokens_are_utf8_bytes():
    tok = bytelm.byte_tokenizer()
    text = "naïve 東京\n\t  x%"
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8"))  # no special token added, one id per byte
    assert tok.decode(ids) == text
    assert len(tok) == bytelm.VOCAB_SIZE and tok.eos_token_id == 256
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "ab"}], add_generation_prompt=True, tokenize=False
        )
        == "ab\n"
    )


def test_training_lowers_the_held_out_bits(trained):
    _, stats = trained
    uniform = torch.log2(torch.tensor(float(bytelm.VOCAB_SIZE))).item()  # an untrained model's 8.0 bits
    assert stats["heldout_bits_per_byte"] < uniform - 3, stats
    assert stats["train_bytes"] + stats["heldout_bytes"] == len(TEXT.encode())
    assert stats["heldout_bytes"] == int(0.05 * len(TEXT.encode()))


def test_the_folder_loads_as_a_hugging_face_model(trained):
    folder, stats = trained
    model, tok = models.load(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 257
    assert tok("fox").input_ids == list(b"fox")
    assert model.generation_config.eos_token_id == 256
    assert json.loads((folder / bytelm.INFO_FILE).read_text())["steps"] == stats["steps"]


def test_passage_prompts_come_from_their_part(corpus):
    data = TEXT.encode()
    cut = len(data) - int(0.3 * len(data))
    head, tail = data[:cut].decode("utf-8", errors="ignore"), data[cut:].decode("utf-8", errors="ignore")
    prompts = bytelm.passage_prompts([corpus], 2, holdout=0.3, prompt_bytes=20)
    assert len(prompts) == 2 and all(p in tail and len(p.encode()) <= 20 for p in prompts)
    train = bytelm.passage_prompts([corpus], 5, part="train", holdout=0.3, prompt_bytes=20, seed=1)
    assert len(train) == 5 and all(p in head for p in train)
    with pytest.raises(ValueError, match="heldout text has"):
        bytelm.passage_prompts([corpus], 10_000, holdout=0.3)
    with pytest.raises(ValueError, match="part='test'"):
        bytelm.passage_prompts([corpus], 1, part="test")


def test_circuit_heads_over_eight_bytes_are_lossless(trained, corpus, tmp_path, capsys):
    folder, _ = trained
    out = tmp_path / "btree-n8"
    rc = cli.main(
        [
            "heads",
            "train",
            "--model",
            str(folder),
            "--circuit",
            "btree",
            "--window",
            "8",
            "--rank",
            "2",
            "--emission",
            "unembedding",
            "--text",
            str(corpus),
            "--text-holdout",
            "0.05",
            "--max-text-tokens",
            "1024",
            "--passage-prompts",
            "4",
            "--num-prompts",
            "0",
            "--max-new-tokens",
            "32",
            "--steps",
            "60",
            "--lr",
            "3e-3",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["data"]["text_holdout"] == 0.05 and stats["data"]["passage_prompts"] == 4
    model, tok = models.load(folder)
    model.generation_config.eos_token_id = None  # run the full length
    ids = tok("The quick brown", return_tensors="pt").input_ids
    ref = model.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=256)
    for bc in (2, 8, 24):
        got = mtprobe.generate(
            model, ids, mtprobe.HeadsConfig(path=str(out), block_complexity=bc), max_new_tokens=40
        )
        assert torch.equal(got.sequences, ref), bc
        assert max(got.accept_lengths) > 1  # drafts were accepted: the test exercises the drafter


def test_text_sequences_hold_out_and_cap(corpus):
    tok = bytelm.byte_tokenizer()
    full = offline_heads.text_sequences(tok, [corpus], 64)
    kept = offline_heads.text_sequences(tok, [corpus], 64, holdout=0.5)
    capped = offline_heads.text_sequences(tok, [corpus], 64, max_tokens=256)
    assert len(kept) < len(full) and len(capped) == 4
    assert all(ids.numel() <= 64 for ids, _ in full)
    with pytest.raises(ValueError, match="max_tokens=10"):
        offline_heads.text_sequences(tok, [corpus], 64, max_tokens=10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 30, "num_heads": 4}, "times an even head size"),
        ({"num_layers": 0}, "num_layers=0 must be an int >= 1"),
        ({"hidden_size": 2.5}, "hidden_size=2.5"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bytelm.byte_lm_config(**kwargs)


def test_bad_training_input(corpus, tmp_path):
    with pytest.raises(ValueError, match="no text files given"):
        bytelm.train_byte_lm([])
    with pytest.raises(ValueError, match="does not exist"):
        bytelm.train_byte_lm([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="holdout=1.0"):
        bytelm.train_byte_lm([corpus], holdout=1.0)
    with pytest.raises(ValueError, match="shorten seq_len"):
        bytelm.train_byte_lm([corpus], seq_len=100_000)
    with pytest.raises(ValueError, match="steps=0"):
        bytelm.train_byte_lm([corpus], steps=0)
    with pytest.raises(ValueError, match="lr=0"):
        bytelm.train_byte_lm([corpus], lr=0)


def test_command_line(corpus, tmp_path, capsys):
    out = tmp_path / "m"
    train = ["bytelm", "train", "--out", str(out)]
    args = [*train, "--text", str(corpus), "--hidden-size", "16", "--layers", "1"]
    assert cli.main([*args, "--heads", "2", "--steps", "3", "--seq-len", "16", "--batch-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert cli.main([*train, "--text", str(tmp_path / "none")]) == cli.EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err
    assert cli.main([*args, "--heads", "3"]) == cli.EXIT_USAGE
    assert "even head size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--passage-prompts", "3"], "--passage-prompts N takes its passages from --text FILES"),
        (["--text-holdout", "1.5"], "--text-holdout 1.5 must be in"),
        (["--max-text-tokens", "10"], "--max-text-tokens 10 must be >= 256"),
    ],
)
def test_heads_command_line_text_options(tmp_path, capsys, extra, match):
    # Refused before any model is loaded.
    assert cli.main(["heads", "train", "--model", "nowhere", "--out", str(tmp_path / "h"), *extra]) == 2
    assert match in capsys.readouterr().err
