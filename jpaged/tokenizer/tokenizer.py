"""Tokenizers for jpaged: built from GGUF metadata or a Hugging Face `tokenizer.json`.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library, so no torch and no
transformers on the serving path) and adds what generation needs on top: the ids
that end a sequence, whether to prepend BOS, and the Jinja chat template, rendered
the same way `transformers` renders it.

GGUF vocabularies: byte-level BPE ("gpt2") is built here; SentencePiece ("llama":
Llama 2, Mistral 7B v0.1, Gemma 1-3) goes through transformers' GGUF tokenizer
converter (`jpaged.tokenizer.sentencepiece`), imported only when such a file is loaded.
"""

from __future__ import annotations

import bisect
import json
import pathlib
import re
import secrets
import unicodedata
from datetime import datetime
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
        return _compile_template(self.chat_template).render(
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
        nonce = _fresh_nonce(text)
        placeheld, contents = _with_placeholders(messages, nonce)
        if not contents:
            return text, self.encode(text, add_special_tokens=False)
        skeleton = self.apply_chat_template(placeheld, add_generation_prompt, **kwargs)
        spans = _align_contents(text, skeleton, _placeholder_regex(nonce), contents)
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
                for text in _strings(value, key):
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
        if not any(i in special and _overlaps(_strip_span(text, off), spans)
                   for i, off in zip(enc.ids, enc.offsets)):
            return enc.ids  # the common case, and exactly today's ids
        # Control tokens are looked up in the template text alone, so content cannot merge
        # with a template marker into one longer match that hides the marker.
        cuts: list[tuple[int, int, int]] = []
        for a, b in _complement(spans, len(text)):
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

    # ------------------------------------------------------------------ GGUF
    @classmethod
    def from_gguf(cls, source: Any) -> "Tokenizer":
        """Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        `source` is a `gguf.GGUFReader`, a path to a .gguf file, or a metadata dict
        (key -> python value, as returned by `jpaged.formats.gguf.gguf_metadata`).
        """
        meta = _as_metadata(source)
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

        def tok_id(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None else None

        bos, eos, pad, unk = tok_id("bos_token_id"), tok_id("eos_token_id"), tok_id("padding_token_id"), \
            tok_id("unknown_token_id")
        # End-of-turn / end-of-message ids also stop generation (llama.cpp's "EOG" set).
        eos_ids = [i for i in (eos, tok_id("eot_token_id"), tok_id("eom_token_id")) if i is not None]
        name = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else None  # noqa: E731
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad,
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   chat_template=meta.get("tokenizer.chat_template"),
                   special_tokens={"bos_token": name(bos), "eos_token": name(eos),
                                   "pad_token": name(pad), "unk_token": name(unk)})

    # -------------------------------------------------------------------- HF
    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        """Loads `tokenizer.json` (+ tokenizer_config.json, generation_config.json, chat_template.jinja)."""
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
        return cls(backend, bos_token_id=bos, eos_token_ids=[i for i in eos_ids if i is not None],
                   pad_token_id=ids["pad_token"], add_bos_token=add_bos, chat_template=template,
                   special_tokens=special)


# ------------------------------------------------------------------ helpers
def printable(text: str) -> str:
    """`text` with control characters escaped, safe to echo to a terminal.

    C0 controls other than newline and tab, DEL and C1 controls are written as Python
    escapes ("\\x1b", "\\r"), so model output or a prompt cannot move the cursor,
    rewrite a line, change colours or start an escape sequence. Other text is unchanged.
    """
    return text.translate(_CONTROL_ESCAPES)


# Every Unicode "Cc" character (C0, DEL, C1) except "\t" and "\n", mapped to its repr() escape.
_CONTROL_ESCAPES = {cp: repr(chr(cp))[1:-1] for cp in range(0xA0)
                    if unicodedata.category(chr(cp)) == "Cc" and chr(cp) not in "\t\n"}


# ------------------------------------------------- chat content tracking
def _fresh_nonce(text: str) -> str:
    """A random tag for placeholders; random so content cannot contain or forge one."""
    while True:
        nonce = secrets.token_hex(8)
        if nonce not in text:
            return nonce


def _placeholder(nonce: str, k: int) -> str:
    # Letters and digits only: survives `trim`, `tojson`, `split` and friends unchanged.
    return f"JPAGED{nonce}C{k}E"


def _placeholder_regex(nonce: str) -> re.Pattern[str]:
    return re.compile(f"JPAGED{nonce}C([0-9]+)E")


def _with_placeholders(messages: list[dict[str, Any]], nonce: str
                       ) -> tuple[list[dict[str, Any]], list[str]]:
    """Copies of `messages` with each non-empty content string replaced by a placeholder.

    Returns (copies, contents) where placeholder k stands for contents[k]. Empty
    strings stay: there is nothing in them to protect, and templates often branch on
    emptiness (an assistant turn with only tool calls).
    """
    contents: list[str] = []

    def hold(s: str) -> str:
        if not s:
            return s
        contents.append(s)
        return _placeholder(nonce, len(contents) - 1)

    copies = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            copies.append(message)  # the template reports it
            continue
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": hold(content)}
        elif isinstance(content, list):
            message = {**message, "content": [_hold_part(n, part, hold) for part in content]}
        copies.append(message)
    return copies, contents


def _hold_part(n: int, part: Any, hold: Any) -> dict[str, Any]:
    """A content part with its text held; only text parts are supported."""
    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"message {n}: content part of type {kind!r} is not supported "
                         "(only {'type': 'text', 'text': str} parts)")
    return {**part, "text": hold(part["text"])}


def _strings(value: Any, key: Any = None, depth: int = 0) -> list[str]:
    """Every string in a JSON-like value, dict keys included (a template may write them)."""
    if isinstance(value, str):
        return [value]
    if depth > 32:  # deeper than any message a template renders; refuse rather than recurse on
        raise ValueError(f"message field {key!r} is nested too deeply")
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k, key, depth + 1) + _strings(v, key, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v, key, depth + 1)]
    return []


def _content_variants(content: str) -> list[str]:
    """How a template may have written `content`: as is, or trimmed (`| trim`, `.strip('\\n')`)."""
    variants = [content, content.strip(), content.lstrip(), content.rstrip(),
                content.strip("\n"), content.lstrip("\n"), content.rstrip("\n")]
    return list(dict.fromkeys(variants))


def _align_contents(text: str, skeleton: str, placeholder: re.Pattern[str], contents: list[str]
                    ) -> list[tuple[int, int]] | None:
    """Spans of `text` holding message content, or None if `text` is not `skeleton` filled in.

    `skeleton` is template pieces and placeholders, t0 P t1 P ... tn; `text` must be
    t0 x t1 x ... tn with each x a variant of its placeholder's content. Variants can
    make several splits fit, so every reachable position is kept (at most a few per
    placeholder) and the first split that uses all of `text` wins, untrimmed preferred.
    """
    parts = placeholder.split(skeleton)
    pieces, slots = parts[0::2], [int(k) for k in parts[1::2]]
    if not text.startswith(pieces[0]):
        return None
    # position in text -> spans that got there, as a linked list (span, previous).
    frontier: dict[int, Any] = {len(pieces[0]): None}
    for slot, piece in zip(slots, pieces[1:]):
        reached: dict[int, Any] = {}
        for pos, path in frontier.items():
            for variant in _content_variants(contents[slot]):
                end = pos + len(variant)
                if text.startswith(variant, pos) and text.startswith(piece, end):
                    reached.setdefault(end + len(piece), ((pos, end), path))
        if not reached:
            return None
        frontier = reached
    if len(text) not in frontier:
        return None
    spans, path = [], frontier[len(text)]
    while path is not None:
        span, path = path
        if span[1] > span[0]:
            spans.append(span)
    return spans[::-1]


def _strip_span(text: str, span: tuple[int, int]) -> tuple[int, int]:
    """`span` without surrounding whitespace: what an lstrip/rstrip added token absorbed."""
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether `span` shares a character with any of the sorted, disjoint `spans`."""
    start, end = span
    k = bisect.bisect_left(spans, (end,)) - 1  # the last span starting before `end`
    return start < end and k >= 0 and spans[k][1] > start


def _complement(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The non-empty gaps between sorted, disjoint `spans` in [0, length)."""
    gaps, pos = [], 0
    for start, end in spans:
        if start > pos:
            gaps.append((pos, start))
        pos = end
    if pos < length:
        gaps.append((pos, length))
    return gaps


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


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


@lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    """Compiles a chat template in the same sandboxed Jinja setup as transformers."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
