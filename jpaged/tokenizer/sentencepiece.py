"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model == "llama"`) as a `tokenizers.Tokenizer`.

Llama 2, Mistral 7B v0.1 and Gemma 1-3 GGUFs store a SentencePiece BPE vocabulary:
tokens, scores, token types (control, byte-fallback `<0x00>`..`<0xFF>`, ...) and no
merges. Turning that into a BPE with byte fallback (merges recovered from the scores,
or from the file order for Gemma; Gemma's multi-space tokens respelled) is what
transformers' GGUF tokenizer converter does, so this module calls that converter
instead of keeping a copy of it. transformers is imported only here, only when such
a file is loaded; it does not import torch for this.

One change to the converter's output, for the plain "llama" shape (LlamaTokenizer's
`Metaspace(prepend_scheme="first")` pre-tokenizer): the space prefix is applied the
way llama.cpp and the models' own `tokenizer.json` do it, as a normalizer that
prepends "▁" to every piece of text between added tokens. `Metaspace` skips the
prefix when the text already starts with a space and after a special token, so the
converter alone tokenizes " hi" as "▁hi" where SentencePiece and llama.cpp give
"▁▁hi", and "<s>[INST]" as "<s>", "[", ... where they give "<s>", "▁[", ...
(that is where Llama 2 and Mistral chat prompts put their text). Gemma files say
`add_space_prefix = false` and Gemma's converter output is kept as it is.
"""

from __future__ import annotations

import json
from typing import Any

import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers

SPACE = "\u2581"  # SentencePiece's visible space


def sentencepiece_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """The `tokenizers.Tokenizer` of a GGUF file's SentencePiece vocabulary.

    `meta` is the file's metadata (key -> python value). Adds the control tokens as
    special added tokens and the user-defined ones as plain added tokens, like the
    byte-level path. BOS is not added by the backend (no post-processor): the GGUF
    `add_bos_token` flag is applied by `jpaged.tokenizer.tokenizer.Tokenizer`.
    Raises NotImplementedError when transformers (>= 4.45, with GGUF support) is missing.
    """
    convert, mapping = _converter()
    tokenizer_dict = {name: meta[f"tokenizer.{key}"] for key, name in mapping.items()
                      if f"tokenizer.{key}" in meta}
    architecture = str(meta.get("general.architecture", "llama"))
    backend, _ = convert(architecture, tokenizer_dict)
    if isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace):
        _llama_cpp_space_prefix(backend, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    backend.post_processor = None
    return _within_vocabulary(backend, len(meta["tokenizer.ggml.tokens"]))


def _within_vocabulary(backend: tokenizers.Tokenizer, size: int) -> tokenizers.Tokenizer:
    """`backend` without the added tokens the converter invents past the file's vocabulary
    (GemmaTokenizer adds a "<mask>" when the file has none): their ids have no embedding
    row, yet a prompt naming them would encode to them."""
    if backend.get_vocab_size(with_added_tokens=True) <= size:
        return backend
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def _converter() -> tuple[Any, dict[str, str]]:
    """transformers' `convert_gguf_tokenizer` and its GGUF key -> tokenizer_dict name map."""
    try:  # transformers 5
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                            convert_gguf_tokenizer)
    except ImportError:
        try:  # transformers 4.45+: the same function and map, in one module (not tested here)
            from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        except ImportError as e:
            raise NotImplementedError(
                "a SentencePiece GGUF tokenizer (tokenizer.ggml.model 'llama': Llama 2, Mistral, Gemma) "
                f"is built with transformers' GGUF converter, which could not be imported ({e}); "
                "install transformers, or use a Hugging Face checkpoint directory with a tokenizer.json") from e
    return convert_gguf_tokenizer, dict(GGUF_TOKENIZER_MAPPING["tokenizer"])


def _llama_cpp_space_prefix(backend: tokenizers.Tokenizer, add_space_prefix: bool) -> None:
    """Spaces as SentencePiece/llama.cpp see them: every space becomes "▁", and with
    `add_space_prefix` each text piece between added tokens gets one "▁" in front
    (llama.cpp's `llm_tokenizer_spm`: a space before the text and after each special
    token), which decoding strips once from the start again."""
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if add_space_prefix \
        else replace
    backend.pre_tokenizer = None
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
