"""A jpaged Tokenizer written as a Hugging Face tokenizer directory.

Tools outside jpaged (lm-eval, guidellm, a Python client counting tokens) load a
tokenizer with `transformers.AutoTokenizer.from_pretrained(directory)`.  The
weight cache's `tokenizer.json` is jpaged's own format (the backend plus its
generation metadata in one JSON object) and is no such file; `save_hf_tokenizer`
writes one that is (`jpaged export-tokenizer DIR`):

    tokenizer.json           the `tokenizers` backend, with a post-processor that
                             adds BOS where jpaged adds it by hand (a GGUF's
                             add_bos_token flag), so that encode() agrees
    tokenizer_config.json    the special tokens, the chat template, and the
                             generic fast tokenizer class
    special_tokens_map.json  the special tokens (older transformers read them here)
    generation_config.json   every id that ends generation (EOS, end of turn, ...)

The directory holds no weights: a tokenizer-only directory, as clients take it.
Host code: no jax, no transformers (only the test loads the result with it).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import tokenizers
from tokenizers import processors

from jpaged.tokenizer.tokenizer import Tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def save_hf_tokenizer(tokenizer: Tokenizer, directory: str | pathlib.Path,
                      model_max_length: int | None = None) -> list[pathlib.Path]:
    """Writes `tokenizer` to `directory` (created if missing) as the files above;
    returns their paths.  `model_max_length`: the longest sequence the model
    serves (transformers' truncation limit), if known."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    contents = {
        "tokenizer.json": hf_backend(tokenizer).to_str(pretty=True),
        "tokenizer_config.json": _json(tokenizer_config(tokenizer, model_max_length)),
        "special_tokens_map.json": _json(_special_tokens(tokenizer)),
        "generation_config.json": _json(_generation_config(tokenizer)),
    }
    paths = []
    for name in FILES:
        path = directory / name
        path.write_text(contents[name], encoding="utf-8")
        paths.append(path)
    return paths


def hf_backend(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """A copy of the backend that adds BOS itself when jpaged adds it by hand
    (transformers' generic fast tokenizer only runs the backend's post-processor)."""
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None:
        name = backend.id_to_token(bos)
        template = processors.TemplateProcessing(single=f"{name}:0 $A:0", pair=f"{name}:0 $A:0 {name}:1 $B:1",
                                                 special_tokens=[(name, bos)])
        existing = backend.post_processor
        backend.post_processor = template if existing is None else processors.Sequence([existing, template])
    return backend


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int | None = None) -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer (the backend does all the
    work), its special tokens, and the chat template jpaged renders."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # BOS, when the model takes one, is the backend's post-processor's to add (hf_backend).
        "add_bos_token": False,
        "add_eos_token": False,
        # jpaged decodes as the backend does: no clean-up of spaces before punctuation.
        "clean_up_tokenization_spaces": False,
        **_special_tokens(tokenizer),
    }
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def _special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    return {k: v for k in SPECIAL_KEYS if (v := tokenizer.special_tokens.get(k)) is not None}


def _generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    config: dict[str, Any] = {"eos_token_id": tokenizer.eos_token_ids}
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    if tokenizer.pad_token_id is not None:
        config["pad_token_id"] = tokenizer.pad_token_id
    return config


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=2) + "\n"
