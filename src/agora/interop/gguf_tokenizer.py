"""Rebuild a ``tokenizer.json`` from the vocabulary a GGUF file stores as ``tokenizer.ggml.*`` metadata.

Only llama.cpp's ``gpt2`` model (byte-level BPE) is converted, with the pre-tokenizer that llama.cpp selects by
``tokenizer.ggml.pre``: the merges were learned on text split that way, so a different split gives different
ids. Anything else yields ``None`` and a warning rather than a tokenizer that silently disagrees with the model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (gguf.TokenType); only these two change how text is matched.
_CONTROL = 3
_USER_DEFINED = 4

# Llama 3's split: letters with an optional leading non-letter, digits in runs of at most three, punctuation with
# trailing newlines, then whitespace. (llama.cpp's LLAMA3 pre-tokenizer; the same regex ships in Llama 3's
# tokenizer.json.)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # Every digit on its own first, then GPT-2's split. Not the same as GPT-2 alone: in "x  1" the two spaces
    # stay one piece (token "ĠĠ") instead of being cut before the digit, which is what llama.cpp does too.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _llama3() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp treats one ``tokenizer.ggml.pre`` value."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False  # a pre-token that is a vocabulary entry is taken whole, merges or not
    add_bos: bool = False  # llama.cpp's choice when the file has no tokenizer.ggml.add_bos_token


# tokenizer.ggml.pre -> how to split, for the names llama.cpp knows and that were checked against its output.
# Not "default" (also what a missing key means): llama.cpp's default split is not GPT-2's (it cuts punctuation
# runs and digit runs on their own), so it is left unconverted rather than approximated.
_LLAMA3 = PreTokenizerSpec(_llama3, ignore_merges=True, add_bos=True)
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "gpt-2": PreTokenizerSpec(_gpt2),
    "smollm": PreTokenizerSpec(_smollm),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: byte-level BPE vocabularies are spelled in these characters.

    Bytes that are already visible Latin-1 characters stand for themselves; the other 68 (controls, space,
    soft hyphen, ...) are given the code points from 256 upwards, in byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in visible}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


def build_tokenizer_json(meta: dict[str, Any], source: str) -> Optional[str]:
    """``tokenizer.json`` text for the GGUF's vocabulary, or ``None`` (with a warning saying why)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return _skip(f"{source}: the file has no tokenizer (no tokenizer.ggml.model)")
    if kind != "gpt2":
        return _skip(
            f"{source}: tokenizer.ggml.model={kind!r} is not converted (only 'gpt2', byte-level BPE, is; 'llama' "
            "is SentencePiece); load the model's tokenizer.json from its Hugging Face folder instead"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        return _skip(
            f"{source}: tokenizer.ggml.pre={pre!r} is not known here (known: {sorted(PRE_TOKENIZERS)}); a wrong "
            "pre-tokenizer would give token ids the model was not trained on"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or not merges:
        return _skip(f"{source}: the gpt2 tokenizer lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        return _skip(f"{source}: {len(tokens)} tokens but {len(types)} token types")

    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    shadowed: list[int] = []
    for index, (token, kind_of) in enumerate(zip(tokens, types)):
        if kind_of in (_CONTROL, _USER_DEFINED):
            # Matched whole in the raw text before any splitting, so it keeps its literal spelling.
            added.append(AddedToken(token, special=kind_of == _CONTROL, normalized=False))
        elif not set(token) <= letters:
            # A plain token written as text instead of in the byte alphabet: respell its UTF-8 bytes.
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        if token in vocab:
            shadowed.append(vocab[token])
        vocab[token] = index  # like llama.cpp's lookup table: the last id with a spelling is the one text maps to
    if shadowed:
        warnings.warn(
            f"{source}: {len(shadowed)} token(s) share their spelling with a later one and can never be produced "
            f"(ids {shadowed[:5]})",
            stacklevel=3,
        )

    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            return _skip(f"{source}: merge {merge!r} is not two tokens separated by one space")
        pairs.append((parts[0], parts[1]))

    spec = PRE_TOKENIZERS[pre]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=spec.ignore_merges)
    )
    tokenizer.pre_tokenizer = spec.build()
    tokenizer.decoder = decoders.ByteLevel()
    if added:
        tokenizer.add_tokens(added)  # ids come from the vocabulary, which already holds every one of them
    post = _post_processor(meta, tokens, spec.add_bos, source)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer.to_str()


def _post_processor(
    meta: dict[str, Any], tokens: list[str], default_bos: bool, source: str
) -> Optional[processors.PostProcessor]:
    # The file's flags decide; without them llama.cpp adds BOS for some pre-tokenizers (Llama 3's) and never EOS.
    wrap: dict[str, tuple[str, int]] = {}
    for which, default in (("bos", default_bos), ("eos", False)):
        if not meta.get(f"tokenizer.ggml.add_{which}_token", default):
            continue
        token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
        if token_id is None or not 0 <= token_id < len(tokens):
            warnings.warn(
                f"{source}: {which.upper()} should be added (tokenizer.ggml.add_{which}_token, or llama.cpp's "
                f"default for this pre-tokenizer) but {which}_token_id={token_id!r} is not a token; not adding it",
                stacklevel=4,
            )
            continue
        wrap[which] = (tokens[token_id], int(token_id))
    if not wrap:
        return None
    head = [wrap["bos"][0]] if "bos" in wrap else []
    tail = [wrap["eos"][0]] if "eos" in wrap else []
    single = [*head, "$A:0", *tail]
    pair = [*single, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(wrap.values()))


def _skip(message: str) -> None:
    warnings.warn(message + "; tokenizer_json is None", stacklevel=4)
    return None
