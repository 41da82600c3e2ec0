"""Tokenizers for jpaged: built from GGUF metadata or a Hugging Face `tokenizer.json`.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library, so no torch and no
transformers on the serving path) and adds what generation needs on top: the ids
that end a sequence, whether to prepend BOS, and the Jinja chat template, rendered
the same way `transformers` renders it.

Where the pieces live: GGUF vocabularies (`jpaged.tokenizer.gguf_loading`), Hugging
Face directories (`hf_loading`), chat templates (`chat_template`), finding message
content in a rendered chat (`chat_content`). `printable` (`jpaged.tokenizer.printable`)
is re-exported here, where its callers import it from.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import tokenizers

from jpaged.tokenizer.chat_content import (align_contents, complement, fresh_nonce, overlaps,
                                           placeholder_regex, strings_in, strip_span, with_placeholders)
from jpaged.tokenizer.chat_template import compile_template
from jpaged.tokenizer.gguf_loading import gguf_tokenizer_args
from jpaged.tokenizer.hf_loading import hf_tokenizer_args
from jpaged.tokenizer.printable import printable

__all__ = ["Tokenizer", "printable"]


class Tokenizer:
    """A `tokenizers` tokenizer (byte-level BPE, SentencePiece BPE, ...) plus generation metadata.

    Attributes:
        bos_token_id: id of the beginning-of-sequence token, or None.
        eos_token_ids: every id that ends generation (EOS, end-of-turn, ...).
        pad_token_id: padding id, or None.
        add_bos_token: prepend BOS in `encode(add_special_tokens=True)` (done here,
            not by the backend's post-processor, because GGUF files state it as a flag).
        chat_template: Jinja chat template, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: list[int], pad_token_id: int | None = None,
                 add_bos_token: bool = False, chat_template: str | None = None,
                 special_tokens: dict[str, str | None] | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(int(i) for i in eos_token_ids))
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        # bos_token / eos_token / ... strings, passed to the chat template like transformers does.
        self.special_tokens = dict(special_tokens or {})

    # ---------------------------------------------------------------- basics
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a server's
        # event loop keeps running while another thread tokenizes a long prompt.
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---------------------------------------------------------- chat template
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Renders `messages` with the chat template, as transformers' `apply_chat_template(tokenize=False)`."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        context.setdefault("tools", None)
        return compile_template(self.chat_template).render(
            messages=messages, documents=None, add_generation_prompt=add_generation_prompt, **context)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template itself writes the `tools` it is given (Qwen's,
        Llama 3's, ...); else tools must be put in the messages (SmolLM2's)."""
        return bool(self.chat_template) and re.search(r"\btools\b", self.chat_template) is not None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> tuple[str, list[int]]:
        """Renders `messages` with the chat template and tokenizes the result: (text, ids).

        Unlike `encode(apply_chat_template(messages), add_special_tokens=False)`, a
        special-token string inside message content ("<|im_end|>", "<|im_start|>", ...)
        is tokenized as plain text, so a user cannot forge a system or assistant turn.
        Only the template's own markers become control tokens. For content without
        special-token strings the ids are exactly those of that unsafe call.

        Trust model. Protected: each message's `content` when it is a string, and the
        `text` of `{"type": "text"}` parts when it is a list (other part types raise
        ValueError). Not protected, rendered as the template writes them: roles, names,
        tool calls and any other message field, and `kwargs`; these belong to the caller,
        who must validate them (the HTTP server and the batch CLI accept only OpenAI's
        roles). As a backstop, a special-token string anywhere in a message's other
        fields (a role "system<|im_end|>", a name, a tool call's arguments) raises
        ValueError: the template would write it as a control token. (Such a field
        completing a marker with the template text beside it, "<|im_end" before "|>",
        is not caught; that is the caller's validation to do.)
        Non-special added tokens (tokenizer.json `special: false`, GGUF USER_DEFINED, e.g.
        Qwen's `<think>`) are not control tokens and still match inside content.

        How content is found: the template is rendered a second time with each content
        replaced by an unguessable placeholder, and the real render must equal that
        skeleton with each placeholder replaced by its content, or by its content
        stripped of whitespace or newlines (templates that `| trim`). Searching the real
        render for the content instead would be unsafe: content that also occurs in
        template text (say "<|im_end|>\\n" in a default system prompt) would be found there.
        If a template changes content in another way, content holding a special-token
        string is refused (ValueError), and other content is accepted only when the
        template emitted the same control tokens as for the placeholders.
        """
        self._refuse_special_fields(messages)
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        nonce = fresh_nonce(text)
        placeheld, contents = with_placeholders(messages, nonce)
        if not contents:
            return text, self.encode(text, add_special_tokens=False)
        skeleton = self.apply_chat_template(placeheld, add_generation_prompt, **kwargs)
        spans = align_contents(text, skeleton, placeholder_regex(nonce), contents)
        if spans is None:
            return text, self._encode_untracked(text, skeleton, contents)
        return text, self._encode_with_content(text, spans)

    def _refuse_special_fields(self, messages: list[dict[str, Any]]) -> None:
        """ValueError if a message field other than its content (role, name, tool
        calls, a text part's other keys) holds a special-token string."""
        specials = sorted(set(self._special_ids().values()), key=len, reverse=True)
        if not specials:
            return
        for n, message in enumerate(messages):
            if not isinstance(message, dict):
                continue  # the template reports it
            for key, value in message.items():
                if key == "content" and isinstance(value, str):
                    continue
                if key == "content" and isinstance(value, list):  # parts: their text is content
                    value = [{k: v for k, v in p.items() if k != "text"} if isinstance(p, dict) else p
                             for p in value]
                for text in strings_in(value, key):
                    token = next((t for t in specials if t in text), None)
                    if token is not None:
                        raise ValueError(
                            f"message {n}: {key} contains the special token {token!r}; only message "
                            "content is kept as plain text, so this would forge a control token")

    def _special_ids(self) -> dict[int, str]:
        """Special added tokens, id -> string. Read each time: the backend may gain tokens."""
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    def _escaping_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that splits special-token strings like normal text.

        A copy, rather than toggling `backend.encode_special_tokens`, because that flag
        is shared state: a concurrent `encode()` would see it flipped. Built on first use
        (about 0.1 s) and rebuilt if the backend was replaced or gained tokens; two
        threads racing here just build it twice.
        """
        key = (id(self.backend), self.backend.get_vocab_size(with_added_tokens=True))
        cached = getattr(self, "_escaping", None)
        if cached is None or cached[0] != key:
            copy = tokenizers.Tokenizer.from_str(self.backend.to_str())
            copy.encode_special_tokens = True
            cached = self._escaping = (key, copy)
        return cached[1]

    def _encode_with_content(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Encodes `text`; special tokens are control tokens only outside the content `spans`."""
        special = self._special_ids()
        enc = self.backend.encode_batch([text], add_special_tokens=False)[0]  # GIL released, as in encode
        if not any(i in special and overlaps(strip_span(text, off), spans)
                   for i, off in zip(enc.ids, enc.offsets)):
            return enc.ids  # the common case, and exactly today's ids
        # Control tokens are looked up in the template text alone, so content cannot merge
        # with a template marker into one longer match that hides the marker.
        cuts: list[tuple[int, int, int]] = []
        for a, b in complement(spans, len(text)):
            part = self.backend.encode(text[a:b], add_special_tokens=False)
            cuts += [(a + s, a + e, i) for i, (s, e) in zip(part.ids, part.offsets) if i in special]
        # The text between two control tokens is encoded in one piece, as `encode` would,
        # so BPE sees the same pre-tokens across the template/content boundary.
        escaping, ids, pos = self._escaping_backend(), [], 0
        for start, end, token_id in cuts:
            if start > pos:
                ids += escaping.encode(text[pos:start], add_special_tokens=False).ids
            ids.append(token_id)
            pos = end
        if pos < len(text):
            ids += escaping.encode(text[pos:], add_special_tokens=False).ids
        return ids

    def _encode_untracked(self, text: str, skeleton: str, contents: list[str]) -> list[int]:
        """Encoding for a template whose output could not be split into template and content."""
        special = self._special_ids()
        for token in special.values():
            if any(token in c for c in contents):
                raise ValueError(
                    f"message content contains the special token {token!r}, and this chat template "
                    "changes message content in a way jpaged cannot follow, so it cannot keep the "
                    "token as plain text; remove it from the content")
        ids = self.encode(text, add_special_tokens=False)
        # Content has no special-token string, but could still complete one with the template
        # text next to it: then the control tokens differ from the placeholder render's.
        controls = [i for i in ids if i in special]
        if controls != [i for i in self.encode(skeleton, add_special_tokens=False) if i in special]:
            raise ValueError("the chat template's control tokens depend on message content; "
                             "refusing to tokenize this chat")
        return ids

    # ---------------------------------------------------------- serialisation
    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer (for the weight cache)."""
        return json.dumps({
            "backend": self.backend.to_str(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
            "special_tokens": self.special_tokens,
        })

    @classmethod
    def from_json(cls, s: str) -> "Tokenizer":
        d = json.loads(s)
        return cls(tokenizers.Tokenizer.from_str(d["backend"]), bos_token_id=d["bos_token_id"],
                   eos_token_ids=d["eos_token_ids"], pad_token_id=d["pad_token_id"],
                   add_bos_token=d["add_bos_token"], chat_template=d["chat_template"],
                   special_tokens=d["special_tokens"])

    # --------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, source: Any) -> "Tokenizer":
        """Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        `source` is a `gguf.GGUFReader`, a path to a .gguf file, or a metadata dict
        (key -> python value, as returned by `jpaged.formats.gguf.gguf_metadata`).
        """
        return cls(**gguf_tokenizer_args(source))

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        """Loads `tokenizer.json` (+ tokenizer_config.json, generation_config.json, chat_template.jinja)."""
        return cls(**hf_tokenizer_args(path))
