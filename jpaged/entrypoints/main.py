"""The `jpaged` command: one subcommand per entry point.

    jpaged batch [flags]   a batch of prompts (JSONL) through the engine (jpaged.entrypoints.batch)
    jpaged serve [flags]   an OpenAI-compatible HTTP server (jpaged.entrypoints.serve)
    jpaged export-tokenizer DIR [flags]   the model's tokenizer for transformers' AutoTokenizer
                           (jpaged.entrypoints.export_tokenizer)

`jpaged <command> --help` lists a command's flags; every config field is a flag
as --config.<field>=<value>.  Only the chosen command's module is imported (each
defines its own absl flags), and nothing imports jax before the config is checked.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "batch": ("jpaged.entrypoints.batch", "run a batch of prompts (JSONL) and print completions and a summary"),
    "serve": ("jpaged.entrypoints.serve", "serve an OpenAI-compatible HTTP API"),
    "export-tokenizer": ("jpaged.entrypoints.export_tokenizer",
                         "write the model's tokenizer as a Hugging Face tokenizer directory (AutoTokenizer)"),
}


def usage() -> str:
    lines = ["usage: jpaged <command> [flags]", "", "commands:"]
    lines += [f"  {name:<17}{about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "`jpaged <command> --help` lists the command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    name = argv[1]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[name][0])
    # The command sees itself as the program ("jpaged batch") and only its own flags.
    module.main([f"jpaged {name}", *argv[2:]])


if __name__ == "__main__":
    main()
