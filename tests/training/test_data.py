"""Readers (formats, file:line errors, --skip-malformed) and token batching (budget, order, shards, resume)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.training.conftest import call_command, run_cli, train_args
from training.batching import BatchStream, Position, bucket_batches, epoch_batches, shard, sorted_batches
from training.data import (
    DataError,
    MalformedLineError,
    read_documents,
    read_labeled,
    read_lines,
    read_pairs,
)


def test_read_pairs_tsv_and_jsonl(tmp_path):
    tsv = tmp_path / "a.tsv"
    tsv.write_text("hello\thola\n\nbye\tadiós\r\n", encoding="utf-8")
    pairs = read_pairs(tsv).records
    assert [(p.source, p.target, p.line) for p in pairs] == [("hello", "hola", 1), ("bye", "adiós", 3)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"source": "a\tb", "target": "c"}) + "\n", encoding="utf-8")
    assert read_pairs(jsonl).records[0].source == "a\tb"


@pytest.mark.parametrize(
    ("suffix", "bad_line", "reason"),
    [
        (".tsv", "one\ttwo\tthree", "expected 2 tab-separated fields"),
        (".tsv", "only one field", "expected 2 tab-separated fields"),
        (".tsv", "source\t  ", "empty target"),
        (".jsonl", '{"source": "x"', "invalid JSON"),
        (".jsonl", '["x", "y"]', "expected a JSON object"),
        (".jsonl", '{"source": "x", "target": 3}', "'target' must be a non-empty string"),
    ],
)
def test_malformed_pair_names_file_and_line(tmp_path, suffix, bad_line, reason):
    good = "a\tb" if suffix == ".tsv" else json.dumps({"source": "a", "target": "b"})
    path = tmp_path / f"data{suffix}"
    path.write_text(f"{good}\n{good}\n{bad_line}\n{good}\n", encoding="utf-8")
    with pytest.raises(MalformedLineError, match=reason) as info:
        read_pairs(path)
    assert str(info.value).startswith(f"{path}:3: ")
    result = read_pairs(path, skip_malformed=True)
    assert (len(result.records), result.skipped) == (3, 1)


def test_invalid_utf8_line_is_malformed(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_bytes(b"a\tb\nbad \xff\tbyte\n")
    with pytest.raises(MalformedLineError, match=r"data.tsv:2: not valid UTF-8"):
        read_pairs(path)


def test_missing_empty_and_unknown_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_pairs(tmp_path / "missing.tsv")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported format"):
        read_pairs(tmp_path / "data.csv")
    (tmp_path / "empty.tsv").write_text("\n\n")
    with pytest.raises(DataError, match="no examples"):
        read_pairs(tmp_path / "empty.tsv")


def test_read_labeled_formats(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    rows = [{"text": "x", "label": 1}, {"text_a": "p", "text_b": "q", "label": "same"}]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = read_labeled(jsonl).records
    assert (a.text, a.label, a.text_b) == ("x", "1", None)
    assert (b.text, b.text_b, b.label) == ("p", "q", "same")
    jsonl.write_text(json.dumps({"text": "x", "label": True}) + "\n")
    with pytest.raises(MalformedLineError, match=r"a.jsonl:1: field 'label'"):
        read_labeled(jsonl)


def test_read_documents_from_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.py").write_text("print(1)\n")
    (tmp_path / "sub" / "a.txt").write_text("hello\n")
    (tmp_path / "skip.md").write_text("ignored\n")
    docs = read_documents(tmp_path).records
    assert [d.path.name for d in docs] == ["b.py", "a.txt"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\nfine\n\xfe\xfe\n")
    with pytest.raises(MalformedLineError, match=r"bad.txt:3: not valid UTF-8"):
        read_documents(bad)
    result = read_documents(bad, skip_malformed=True)
    assert (result.records[0].text, result.skipped) == ("fine\nfine\n", 1)
    with pytest.raises(DataError, match="at least two"):
        from training.tasks.pretrain import read_segments

        read_segments(tmp_path / "sub" / "a.txt", False)
    assert read_lines(tmp_path / "sub" / "a.txt").records == ["hello"]


def test_unknown_valid_label_names_line(data, tmp_path):
    valid = tmp_path / "valid.tsv"
    valid.write_text("the cat\tanimal\nthe box\tbox-label\n")
    args = train_args("classifier", data, tmp_path / "ckpt", "--max-steps", "1")
    args[args.index("--valid") + 1] = str(valid)
    with pytest.raises(DataError, match=r"valid.tsv:2: label 'box-label' is not one of"):
        call_command(*args)


def test_skip_malformed_trains_and_reports(data, tmp_path, caplog):
    train = tmp_path / "train.tsv"
    train.write_text(data["s2s_train"].read_text() + "broken line\n")
    args = train_args("seq2seq", data, tmp_path / "ckpt", "--max-steps", "1")
    args[args.index("--train") + 1] = str(train)
    with pytest.raises(MalformedLineError, match=r"train.tsv:301: "):
        call_command(*args)
    run_cli(*args, "--skip-malformed")
    assert "skipped 1 malformed line(s)" in caplog.text


# ---- batching -------------------------------------------------------------------------------------


def _lengths(n: int = 200, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 40) for _ in range(n)]


def test_batches_respect_the_token_budget_and_cover_everything():
    lengths = _lengths()
    for batches in (bucket_batches(lengths, 100, random.Random(1)), sorted_batches(lengths, 100)):
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) * max(lengths[i] for i in b) <= 100
            assert max(lengths[i] for i in b) - min(lengths[i] for i in b) <= 5  # bucketed: similar lengths
    assert bucket_batches([500], 100, random.Random(0)) == [[0]]  # an over-long example still gets a batch


def test_epoch_order_is_deterministic_and_varies_by_epoch():
    lengths = _lengths()
    assert epoch_batches(lengths, 100, seed=3, epoch=0) == epoch_batches(lengths, 100, seed=3, epoch=0)
    assert epoch_batches(lengths, 100, seed=3, epoch=0) != epoch_batches(lengths, 100, seed=3, epoch=1)
    assert epoch_batches(lengths, 100, seed=3, epoch=0) != epoch_batches(lengths, 100, seed=4, epoch=0)


def test_shards_are_disjoint_and_equal():
    batches = [[i] for i in range(11)]
    shards = [shard(batches, r, 3) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    flat = [b[0] for s in shards for b in s]
    assert len(set(flat)) == 9


def _collate(examples, generator):
    return (list(examples), torch.rand((), generator=generator).item())


def test_stream_resumes_from_a_position():
    lengths = _lengths(60)
    examples = list(range(60))
    stream = BatchStream(examples, lengths, _collate, 100, seed=1)
    per_epoch = stream.batches_per_epoch()
    seen = [next(stream) for _ in range(per_epoch + 3)]  # into the second epoch
    assert stream.position == Position(1, 3)
    resumed = BatchStream(examples, lengths, _collate, 100, seed=1, position=Position(1, 1))
    assert [next(resumed) for _ in range(2)] == seen[per_epoch + 1 :]
