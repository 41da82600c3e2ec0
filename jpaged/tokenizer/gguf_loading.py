"""Tokenizers from GGUF metadata: the `tokenizer.*` keys of a .gguf file.

Byte-level BPE ("gpt2") is built here; SentencePiece ("llama": Llama 2, Mistral 7B
v0.1, Gemma 1-3) goes through transformers' GGUF tokenizer converter
(`jpaged.tokenizer.sentencepiece`), imported only when such a file is loaded.
"""

from __future__ import annotations

import pathlib
from functools import lru_cache
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from jpaged.formats.gguf import gguf_metadata, read_gguf

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# Pre-tokenizer split regexes for the `tokenizer.ggml.pre` values we know, copied
# from the reference tokenizer.json files (llama.cpp uses the same expressions).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEXES = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}


def gguf_tokenizer_args(source: Any) -> dict[str, Any]:
    """`Tokenizer`'s constructor arguments (keyword -> value) for the tokenizer that a
    GGUF file's `tokenizer.*` metadata describes.

    `source` is a `gguf.GGUFReader`, a path to a .gguf file, or a metadata dict
    (key -> python value, as returned by `jpaged.formats.gguf.gguf_metadata`).
    """
    meta = _as_metadata(source)
    tokens, backend, add_bos_default = _gguf_backend(meta)

    def tok_id(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        return int(v) if v is not None else None

    bos, eos, pad, unk = tok_id("bos_token_id"), tok_id("eos_token_id"), tok_id("padding_token_id"), \
        tok_id("unknown_token_id")
    # End-of-turn / end-of-message ids also stop generation (llama.cpp's "EOG" set).
    eos_ids = [i for i in (eos, tok_id("eot_token_id"), tok_id("eom_token_id")) if i is not None]
    name = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else None  # noqa: E731
    return dict(backend=backend, bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad,
                add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                chat_template=meta.get("tokenizer.chat_template"),
                special_tokens={"bos_token": name(bos), "eos_token": name(eos),
                                "pad_token": name(pad), "unk_token": name(unk)})


def _gguf_backend(meta: dict[str, Any]) -> tuple[list[str], tokenizers.Tokenizer, bool]:
    """(vocabulary, backend, whether BOS is added when the file does not say) of a GGUF vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"]) if kind in ("gpt2", "llama") else []
    if kind == "gpt2":
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre"))
        _add_gguf_added_tokens(backend, tokens, types)
        add_bos_default = False
    elif kind == "llama":
        from jpaged.tokenizer.sentencepiece import sentencepiece_backend  # imports transformers
        backend = sentencepiece_backend(meta)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say
    else:
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2' and "
            "SentencePiece 'llama'); use a Hugging Face checkpoint directory with a tokenizer.json instead")
    return tokens, backend, add_bos_default


def _as_metadata(source: Any) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, pathlib.Path)):
        return read_gguf(source)[0]
    return gguf_metadata(source)


@lru_cache(maxsize=None)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, ...]], pre: str | None
                    ) -> tokenizers.Tokenizer:
    """A GPT-2 style byte-level BPE over the GGUF vocabulary."""
    alphabet = set(_bytes_to_unicode().values())
    byte_char = _bytes_to_unicode()
    # Tokens outside the byte alphabet (rare, mislabelled specials) are respelled so the
    # BPE model accepts them; the same thing transformers' GGUF converter does.
    vocab = {t if set(t) <= alphabet else "".join(byte_char[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = None
    return backend


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` name."""
    if pre == "smollm":
        # SmolLM/SmolLM2 tokenizer.json: every digit is its own pre-token, then GPT-2's regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLIT_REGEXES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEXES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # "gpt2", "default" and unknown names: GPT-2's own regex.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens; user-defined ones plain added tokens.

    Without this, `<|im_start|>` in a prompt would be cut into byte pieces.
    """
    alphabet = set(_bytes_to_unicode().values())
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL and set(t) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    if user:
        backend.add_tokens(user)
