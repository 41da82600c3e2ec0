"""The grammar sandbox's worker process (`python -m jpaged.structured.sandbox_worker`):
compiles one constraint per message with llguidance and answers None or the
error (jpaged.structured.sandbox is the parent's side and says why)."""

from __future__ import annotations

import os
import resource
import signal
import threading
from typing import Any

from jpaged.structured import limits
from jpaged.structured.grammar import compile_check
from jpaged.structured.sandbox import WORKER_MEMORY, _receive, _send
from jpaged.structured.spec import StructuredOutputs


def _serve(stdin: Any, stdout: Any, setup: tuple[Any, ...]) -> None:
    """The worker's loop: the tokenizer (`setup`), then one constraint per message,
    each answered None (it compiles) or its error, until the parent closes the pipe."""
    import llguidance
    tokenizer_json, vocab_size, eos, _ = setup
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
    _send(stdout, "ready")
    while True:
        try:
            fields, parent_limits = _receive(stdin, None)
        except EOFError:
            return
        limits.LIMITS = limits.Limits(**parent_limits)  # llguidance's limits as the parent sets them
        spec = StructuredOutputs(**fields)
        try:
            compile_check(tokenizer, spec, vocab_size)
            reply = None
        except ValueError as e:
            reply = str(e)
        _send(stdout, reply)


def main() -> None:
    # The protocol keeps its own copy of stdout; fd 1 becomes stderr, so that nothing
    # native prints can corrupt a message.
    stdin, stdout = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    except (ValueError, OSError):
        pass
    setup = _receive(stdin, None)
    threading.stack_size(setup[3])  # see the module docstring
    worker = threading.Thread(target=_serve, args=(stdin, stdout, setup), name="jpaged-grammar-sandbox")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
