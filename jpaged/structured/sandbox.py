"""The first compile of a constraint, in a worker process that may die.

llguidance compiles natively: a constraint beyond what `limits` can foresee
could still overflow its stack (SIGSEGV) or run for minutes.  So the first
compile of a constraint this process has not seen (its grammar text, llguidance's
validation, a matcher and its first mask: `grammar.compile_check`) runs in
a worker: a fresh interpreter (`python -m jpaged.structured.sandbox_worker`: no fork
of the parent's jax state, no import of it) that loads the tokenizer once and
then compiles one constraint after another.  A worker that dies makes that
constraint's error ("crashed the grammar compiler") and is started again for
the next; one that runs past the time budget is killed, and the constraint's
error says so.  The worker compiles on a thread with half the stack the
parent's threads have, so a constraint that compiled there compiles in the
parent (the same code on the same input) with room to spare.

`CompileSandbox` is the parent's side: LIMITS.concurrent_compiles workers
(one sandbox per tokenizer, shared by the process's engines: see
grammar.GrammarCompiler), each started on first use and reused.  A caller waits for a free worker at
most LIMITS.compile_seconds, and its compile then has LIMITS.compile_seconds.  Host code: no jax.
"""

from __future__ import annotations

import os
import dataclasses
import json
import queue
import resource
import select
import signal
import struct
import subprocess
import sys
import time
from typing import Any

from jpaged.structured import limits

START_SECONDS = 120.0          # a worker's start (an interpreter, llguidance, the tokenizer): not the budget's
WORKER_MEMORY = 8 << 30        # a worker's address space: a compile that needs more dies, contained
_HEADER = struct.Struct("<Q")  # each message: its JSON's length, then the JSON (never pickle: a worker
MAX_REPLY = 1 << 20            # that native code corrupted must not run code here, nor fill this memory)


class CompileSandbox:
    """Compiles constraints in worker processes (see the module docstring)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], workers: int):
        self._setup = (tokenizer_json, vocab_size, list(eos_token_ids), _worker_stack_bytes())
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()  # the warmest worker first
        self.workers = [_Worker(self._setup) for _ in range(max(1, workers))]
        for w in self.workers:
            self._idle.put(w)

    def compile(self, spec: Any, wait_until: float) -> str | None:
        """None when `spec` compiles in a worker within LIMITS.compile_seconds; else
        why not: its error, a crash, the budget.  Raises Busy when no worker came
        free by `wait_until` (time.monotonic()): not the constraint's fault, so not
        to be remembered as its error."""
        try:
            worker = self._idle.get(timeout=max(0.0, wait_until - time.monotonic()))
        except queue.Empty:
            raise Busy(busy_message(len(self.workers))) from None
        try:
            return worker.compile(spec, time.monotonic() + limits.LIMITS.compile_seconds)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for w in self.workers:
            w.stop()


class Busy(Exception):
    """No worker came free within the budget, or none would start: not the
    constraint's fault."""


def busy_message(workers: int) -> str:
    return (f"the grammar compiler is busy: {workers} constraints compiled for the whole "
            f"{limits.LIMITS.compile_seconds:g} s budget (concurrent_compiles, compile_seconds); retry later")


class _Worker:
    """One worker process, started on first use and again after it dies."""

    def __init__(self, setup: tuple[Any, ...]):
        self._setup = setup
        self._proc: subprocess.Popen[bytes] | None = None

    def compile(self, spec: Any, deadline: float) -> str | None:
        if self._proc is None or self._proc.poll() is not None:
            started = time.monotonic()
            self._start()
            deadline += time.monotonic() - started  # the start is the worker's cost, not the constraint's
        assert self._proc is not None
        try:
            _send(self._proc.stdin, [dataclasses.asdict(spec), dataclasses.asdict(limits.LIMITS)])
            reply = _receive(self._proc.stdout, deadline, MAX_REPLY)
        except TimeoutError:
            self.stop()
            return (f"the {spec.kind} constraint did not compile within {limits.LIMITS.compile_seconds:g} s "
                    "(compile_seconds)")
        except (OSError, EOFError, ValueError):
            return f"the {spec.kind} constraint crashed the grammar compiler ({self._death()})"
        if reply is not None and not isinstance(reply, str):
            return f"the {spec.kind} constraint crashed the grammar compiler (it answered {type(reply).__name__})"
        return reply

    def _start(self) -> None:
        """Starts the process and sends it the tokenizer; Busy (no constraint's fault)
        when it does not come up."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [_package_root(), *filter(None, [os.environ.get("PYTHONPATH")])]))
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "jpaged.structured.sandbox_worker"], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        except OSError as e:
            raise Busy(f"the grammar compiler is unavailable (it did not start: {e})") from None
        try:
            _send(self._proc.stdin, self._setup)
            reply = _receive(self._proc.stdout, time.monotonic() + START_SECONDS, MAX_REPLY)
        except (OSError, EOFError, TimeoutError, ValueError):
            reply = f"it did not start: {self._death()}"
        if reply != "ready":
            self.stop()
            raise Busy(f"the grammar compiler is unavailable ({reply})")

    def _death(self) -> str:
        """How the process ended (it is reaped)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return "no process"
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


def _worker_stack_bytes() -> int:
    """Half the stack this process's threads get (pthreads' default is the soft
    RLIMIT_STACK; glibc takes 2 MiB when it is unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    threads = soft if 0 < soft != resource.RLIM_INFINITY else 2 << 20
    return max(threads // 2, 512 << 10)


def _package_root() -> str:
    import jpaged
    return os.path.dirname(os.path.dirname(os.path.abspath(jpaged.__file__)))


# ------------------------------------------------------------------ framing
def _send(pipe: Any, obj: Any) -> None:
    data = json.dumps(obj).encode("utf-8", "surrogatepass")
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


def _receive(pipe: Any, deadline: float | None, max_size: int | None = None) -> Any:
    """The next message; TimeoutError past `deadline`, EOFError when the writer is
    gone, ValueError for one over `max_size` bytes or not JSON."""
    (size,) = _HEADER.unpack(_read(pipe, _HEADER.size, deadline))
    if max_size is not None and size > max_size:
        raise ValueError(f"a message of {size} bytes")
    return json.loads(_read(pipe, size, deadline).decode("utf-8", "surrogatepass"))


def _read(pipe: Any, size: int, deadline: float | None) -> bytes:
    fd, chunks, left = pipe.fileno(), [], size
    while left:
        if deadline is not None:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
