"""Tokenizers and data modules against plain-Python references."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest
import torch

from bb_lightning.data import PromptsDataModule, TextDataModule
from bb_lightning.data.tokenizer import ByteTokenizer, load_tokenizer

EOS = ByteTokenizer.eos_token_id


def _reference_rows(docs: list[str], seq_len: int, eos: int = EOS) -> torch.Tensor:
    stream: list[int] = []
    for d in docs:
        stream += [*d.encode("utf-8"), eos]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.int32).view(n, seq_len)


def _corpus(tmp_path: Path) -> tuple[list[str], list[str]]:
    """Two .txt files and one .jsonl; returns (patterns, documents in reading order)."""
    (tmp_path / "b.txt").write_text("second file, déjà vu ✓\n" * 7)
    (tmp_path / "a.txt").write_text("first file\nwith two lines\n" * 5)
    rows = [{"text": f"row {i}: " + "x" * (i * 13)} for i in range(6)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = [(tmp_path / "a.txt").read_text(), (tmp_path / "b.txt").read_text()]
    docs += [r["text"] for r in rows]
    return [str(tmp_path / "*.txt"), str(tmp_path / "*.jsonl")], docs


def test_byte_tokenizer_round_trip() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and isinstance(load_tokenizer("byte"), ByteTokenizer)
    text = "naïve café — ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated UTF-8 sequence is replaced
    assert tok.vocab_size == 259
    assert tok.decode([*b"ab", 300, *b"c", -1]) == "ab\ufffdc\ufffd"  # ids beyond the vocab


def test_packing_equals_reference(tmp_path: Path) -> None:
    patterns, docs = _corpus(tmp_path)
    dm = TextDataModule(patterns, seq_len=32, val_fraction=0.2, seed=0)
    dm.setup("fit")
    assert dm.rows is not None and dm.train_indices is not None and dm.val_indices is not None
    want = _reference_rows(docs, 32)
    assert torch.equal(dm.rows, want)
    # The split is a partition of the rows, with the requested share held out.
    both = torch.cat([dm.train_indices, dm.val_indices]).sort().values
    assert torch.equal(both, torch.arange(len(want)))
    assert len(dm.val_indices) == round(len(want) * 0.2)
    # Batches carry the rows as LongTensors.
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"][0], want[dm.val_indices[0]].long())


def test_max_tokens_and_max_files(tmp_path: Path) -> None:
    patterns, docs = _corpus(tmp_path)
    dm = TextDataModule(patterns, seq_len=16, max_tokens=100)
    dm.setup()
    assert dm.rows is not None
    assert torch.equal(dm.rows, _reference_rows(docs, 16)[:6])  # 100 tokens -> 6 rows of 16
    one = TextDataModule(patterns, seq_len=16, max_files=1)
    one.setup()
    assert one.rows is not None
    assert torch.equal(one.rows, _reference_rows(docs[:1], 16))


def _epoch_order(dm: TextDataModule, epoch: int) -> list[list[int]]:
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return [b["input_ids"][:, 0].tolist() + b["input_ids"][:, 1].tolist() for b in loader]


def test_order_is_fixed_by_seed_and_epoch(tmp_path: Path) -> None:
    patterns, _ = _corpus(tmp_path)

    def module(seed: int) -> TextDataModule:
        dm = TextDataModule(patterns, seq_len=8, batch_size=4, seed=seed)
        dm.setup()
        return dm

    a, b, c = module(0), module(0), module(1)
    assert _epoch_order(a, 0) == _epoch_order(b, 0)
    assert _epoch_order(a, 3) == _epoch_order(b, 3)
    assert _epoch_order(a, 0) != _epoch_order(a, 1)
    assert _epoch_order(a, 0) != _epoch_order(c, 0)


def test_cache_dir_reuses_packed_rows(tmp_path: Path) -> None:
    patterns, docs = _corpus(tmp_path)
    cache = tmp_path / "cache"
    first = TextDataModule(patterns, seq_len=32, cache_dir=str(cache))
    first.setup()
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"
    second = TextDataModule(patterns, seq_len=32, cache_dir=str(cache))
    second.setup()
    assert second.rows is not None and torch.equal(second.rows, _reference_rows(docs, 32))
    assert list(cache.iterdir()) == files


def test_stdlib_sources_with_byte_tokenizer() -> None:
    pattern = os.path.join(os.path.dirname(os.__file__), "*.py")
    files = sorted(glob.glob(pattern))[:4]
    docs = [Path(f).read_text(encoding="utf-8") for f in files]
    dm = TextDataModule(pattern, seq_len=256, max_files=4, batch_size=2)
    dm.setup()
    assert dm.rows is not None
    assert torch.equal(dm.rows, _reference_rows(docs, 256))
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (2, 256)


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"pattern '.*nothing-\*\.txt' matches no file"):
        TextDataModule(str(tmp_path / "nothing-*.txt")).setup()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        TextDataModule(str(bad), seq_len=2).setup()
    notext = tmp_path / "notext.jsonl"
    notext.write_text('{"text": "ok"}\n\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"notext\.jsonl:3: row has no string field 'text'"):
        TextDataModule(str(notext), seq_len=2).setup()
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ValueError, match=r"5 tokens from 1 file\(s\) < seq_len=64"):
        TextDataModule(str(short), seq_len=64).setup()
    with pytest.raises(ValueError, match=r"val_fraction=1\.0"):
        TextDataModule(str(short), val_fraction=1.0)


def _prompts(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_prompts_left_padded(tmp_path: Path) -> None:
    path = _prompts(
        tmp_path,
        [
            json.dumps({"id": "q1", "prompt": "hello"}),
            json.dumps({"prompt": "hi"}),
            json.dumps({"id": 7, "prompt": "x" * 20}),
            json.dumps({"id": "q4", "prompt": "abc"}),
        ],
    )
    dm = PromptsDataModule(str(path), batch_size=3, max_prompt_len=10)
    dm.setup()
    batches = list(dm.predict_dataloader())
    assert [len(b["id"]) for b in batches] == [3, 1]
    b = batches[0]
    assert b["id"] == ["q1", "2", "7"]
    pad = ByteTokenizer.pad_token_id
    assert b["input_ids"].tolist() == [list(b"hello"), [pad] * 3 + list(b"hi"), [pad] * 5]
    assert b["attention_mask"].tolist() == [[1] * 5, [0, 0, 0, 1, 1], [0] * 5]
    assert b["error"][:2] == [None, None]
    assert b["error"][2] == "prompt has 20 tokens > max_prompt_len=10"


def test_prompts_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no prompt"):
        PromptsDataModule(str(empty)).setup()
    path = _prompts(tmp_path, [json.dumps({"prompt": "ok"}), "{not json"])
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2: not valid JSON"):
        PromptsDataModule(str(path)).setup()
    path = _prompts(tmp_path, [json.dumps({"id": "a", "text": "wrong field"})])
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1: row has no string field 'prompt'"):
        PromptsDataModule(str(path)).setup()


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        # the same id on two lines, also as an integer and a string
        ([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}],
         r"prompts\.jsonl:3: id 'a' is also the id of line 1; ids must be unique"),
        ([{"id": 7, "prompt": "x"}, {"id": "7", "prompt": "y"}],
         r"prompts\.jsonl:2: id '7' is also the id of line 1"),
        # ids that are not a string or an integer
        ([{"id": 1.5, "prompt": "x"}], r"prompts\.jsonl:1: id 1\.5 is a JSON number; an id must"),
        ([{"id": True, "prompt": "x"}], r"prompts\.jsonl:1: id true is a JSON boolean"),
        ([{"prompt": "x"}, {"id": [1], "prompt": "x"}], r"prompts\.jsonl:2: id \[1\] is a JSON array"),
    ],
)  # fmt: skip
def test_prompt_ids_refused(tmp_path: Path, rows: list[dict[str, object]], match: str) -> None:
    path = _prompts(tmp_path, [json.dumps(r) for r in rows])
    with pytest.raises(ValueError, match=match):
        PromptsDataModule(str(path)).setup()


def test_prompt_ids_made_for_rows_without_one_are_unique(tmp_path: Path) -> None:
    rows = [
        json.dumps({"prompt": "p1"}),  # "1" and "line-1" are given below
        json.dumps({"id": 1, "prompt": "p2"}),
        "",  # a blank line counts as a line
        json.dumps({"id": None, "prompt": "p4"}),  # null: no id
        json.dumps({"id": "line-1", "prompt": "p5"}),
        json.dumps({"id": "", "prompt": "p6"}),  # an empty string is an id
    ]
    dm = PromptsDataModule(str(_prompts(tmp_path, rows)), batch_size=8)
    dm.setup()
    assert dm.records is not None
    assert [r["id"] for r in dm.records] == ["line-1-2", "1", "4", "line-1", ""]
    assert [bytes(r["input_ids"]).decode() for r in dm.records] == ["p1", "p2", "p4", "p5", "p6"]


def test_prompts_file_not_utf8_or_unreadable_json(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2: not UTF-8 text"):
        PromptsDataModule(str(path)).setup()
    path.write_text('{"id": ' + "9" * 5000 + ', "prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1: JSON this program cannot read"):
        PromptsDataModule(str(path)).setup()
    path.write_text("[" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1: JSON this program cannot read"):
        PromptsDataModule(str(path)).setup()
    for row in ('{"prompt": "a\\ud800b"}', '{"id": "\\udc00", "prompt": "x"}'):
        path.write_text('{"prompt": "ok \\ud83d\\ude00"}\n' + row + "\n")  # a pair is fine
        with pytest.raises(ValueError, match=r"prompts\.jsonl:2: the (prompt|id) holds a lone"):
            PromptsDataModule(str(path)).setup()
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "fine"}\n{"text": "\\ud800"}\n')
    with pytest.raises(ValueError, match=r"text\.jsonl: a document holds a lone UTF-16"):
        TextDataModule(str(text), seq_len=2).setup()


def test_hf_tokenizer_from_local_dir(tmp_path: Path) -> None:
    """A word-level tokenizer built offline, saved and loaded back by load_tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "</s>", "the", "cat", "sat", "on", "mat"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
    )
    fast.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.encode("the cat sat", add_special_tokens=False) == [3, 4, 5]

    (tmp_path / "d.txt").write_text("the cat sat on the mat " * 4)
    dm = TextDataModule(str(tmp_path / "d.txt"), tokenizer=str(tmp_path / "tok"), seq_len=5)
    dm.setup()
    assert dm.rows is not None
    stream = [3, 4, 5, 6, 3, 7] * 4 + [2]
    assert dm.rows.flatten().tolist() == stream  # 25 tokens: 5 rows of 5
    assert dm.vocab_size == len(words)
