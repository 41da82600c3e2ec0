"""Tokenizers from a Hugging Face checkpoint directory: tokenizer.json and the configs beside it."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import tokenizers


def hf_tokenizer_args(path: str | pathlib.Path) -> dict[str, Any]:
    """`Tokenizer`'s constructor arguments (keyword -> value) from a Hugging Face directory:
    `tokenizer.json` (+ tokenizer_config.json, generation_config.json, chat_template.jinja)."""
    path = pathlib.Path(path)
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = _read_json(path / "tokenizer_config.json")
    gen = _read_json(path / "generation_config.json")
    model_cfg = _read_json(path / "config.json")

    def token_str(v: Any) -> str | None:  # tokenizer_config stores strings or AddedToken dicts
        return v.get("content") if isinstance(v, dict) else v

    special = {k: token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    ids = {k: backend.token_to_id(v) if v is not None else None for k, v in special.items()}
    bos = ids["bos_token"] if ids["bos_token"] is not None else model_cfg.get("bos_token_id")
    eos_ids = [ids["eos_token"]] if ids["eos_token"] is not None else []
    for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
        eos_ids += source if isinstance(source, list) else [source] if source is not None else []

    template = cfg.get("chat_template")
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "chat_template.json").exists():
        template = _read_json(path / "chat_template.json").get("chat_template", template)
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    # tokenizer.json's post-processor usually adds BOS itself; only add it by hand
    # when the config asks for BOS and the backend does not already do it.
    add_bos = bool(cfg.get("add_bos_token", False)) and bos is not None \
        and backend.encode("a", add_special_tokens=True).ids[:1] != [bos]
    return dict(backend=backend, bos_token_id=bos, eos_token_ids=[i for i in eos_ids if i is not None],
                pad_token_id=ids["pad_token"], add_bos_token=add_bos, chat_template=template,
                special_tokens=special)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
