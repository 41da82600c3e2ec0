"""`jpaged batch`: runs a batch of prompts through jpaged and prints completions and a summary.

    jpaged batch [--config my_config.py] [--config.block_size=32 --config.scheduler=static ...] \
        [--prompts prompts.jsonl] [--output out.jsonl [--resume]]

(also `python scripts/serve_batch.py ...` in a checkout).  Without --config the
engine runs the package's default config (jpaged.entrypoints.cli_config: the
embedded SmolLM2-135M-Instruct), on the 8 demo prompts without --prompts.

A prompts line is {"prompt": "a user message"} or {"messages": [...]}, rendered
with the model's chat template, with optional per-request max_tokens,
temperature, top_p, top_k, seed, stop (a string or a list of strings),
stop_token_ids, n (parallel samples), ignore_eos, cache_salt (prefix-cache
namespace: no KV reuse across salts), logprobs and prompt_logprobs, and model:
the config's model (or absent) for the base model, or the name of a LoRA
adapter of lora_modules, which the request then runs (another name is that
line's error, as vLLM's run_batch).  A line is read by the HTTP server's body
models (jpaged.entrypoints.batch_requests): the same checks and messages.

Nothing is lost to bad input or an interruption: the config and every request
line are checked before the model loads (a bad config, or a --prompts /
--output / --summary_json that is not a regular file, exits 2 with one line; a
bad request line becomes that line's error result), each result is written and
flushed to --output as it finishes, a result the terminal cannot show is
echoed with escapes (a failure to print is said on stderr, and the run goes
on), a failed write (a full disk) stops the run with one line saying how many
results were written (exit 1), SIGINT/SIGTERM stop the batch after the current
step and keep what finished, and --resume skips the requests already in
--output (a line that failed, its constraint included, is there as its
error).  --output is locked while a run writes it: a second run on the same
file exits 2 with one line.  Memory settings (num_blocks, kv_memory_fraction, swap_space_gb) are
checked against this machine once the weights are loaded, before the KV pool
is allocated.

Multi-host (JAX's distributed runtime): start the same command on every host with
--num_processes, --process_id and --coordinator_address (host:port of process 0),
or the JAX_NUM_PROCESSES / JAX_PROCESS_ID / JAX_COORDINATOR_ADDRESS variables;
the mesh spans every process's devices, process 0 schedules and writes, the
others run its steps.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.resources
import json
import os
import signal
import stat
import sys
import threading
import time
from typing import Any, Collection, TextIO

from absl import app, flags, logging

from jpaged.core.config import ConfigError, apply_overrides, default_config, validate_config
from jpaged.core.lora_adapters import parse_lora_modules
from jpaged.core.sequence import default_sampling_params
from jpaged.entrypoints import cli
from jpaged.entrypoints.batch_requests import ParsedRequest, parse_request, read_request_file
from jpaged.entrypoints.cli import UsageError
from jpaged.tokenizer.tokenizer import printable


@dataclasses.dataclass(frozen=True)
class Args:
    """The command line besides --config (see define_flags)."""

    prompts: str | None = None
    output: str | None = None
    resume: bool = False
    summary_json: str | None = None
    precompile: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def define_flags() -> tuple[flags.FlagHolder, dict[str, flags.FlagHolder]]:
    """Defines the command's absl flags (once per process): --config and those of Args."""
    config = cli.define_config_flag()
    holders = {
        "prompts": flags.DEFINE_string("prompts", None, "JSONL file of requests (default: 8 demo prompts)."),
        "output": flags.DEFINE_string("output", None, "Write one JSON line per request here, as each finishes."),
        "resume": flags.DEFINE_bool("resume", False, "Skip the requests whose index is already in --output "
                                    "and append the rest (after an interrupted run)."),
        "summary_json": flags.DEFINE_string("summary_json", None, "Write the summary table as JSON here."),
        "precompile": flags.DEFINE_bool("precompile", False,
                                        "Build the power-of-two step buckets (and the largest) before the "
                                        "first request, loading them from <cache_dir>/programs when "
                                        "config.compilation_cache is on; a step between two of them runs "
                                        "padded to the next while its own bucket builds in the background "
                                        "(default: each bucket is built the first time a step needs it, "
                                        "unless a larger one is ready)."),
        "coordinator_address": flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of "
                                                   "process 0 (default: $JAX_COORDINATOR_ADDRESS)."),
        "num_processes": flags.DEFINE_integer("num_processes", None, "Multi-host: processes in the run "
                                              "(default: $JAX_NUM_PROCESSES or 1)."),
        "process_id": flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (default: "
                                           "$JAX_PROCESS_ID or 0); only process 0 reads prompts and writes."),
    }
    cli.register_key_flags([config, *holders.values()])
    return config, holders


# ------------------------------------------------------------------ files
PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")  # their "files" are the kernel's, not data


def check_regular_file(flag: str, path: str | None) -> None:
    """UsageError unless `path` is missing (to be created, or reported by the read)
    or a regular file outside /proc, /sys and /dev: a FIFO would block the open,
    /dev/zero never ends, /proc/version is the kernel's.  Checked before any
    file is opened and before the model loads."""
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
        real = os.path.realpath(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: cannot use {path}: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(mode):
        kind = "a directory"
    elif stat.S_ISFIFO(mode):
        kind = "a FIFO (named pipe)"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        kind = "a device"
    elif stat.S_ISSOCK(mode):
        kind = "a socket"
    elif not stat.S_ISREG(mode):
        kind = "not a regular file"
    elif any(real == d or real.startswith(d + "/") for d in PSEUDO_FILESYSTEMS):
        kind = f"a file of the kernel's {real.split('/')[1]} filesystem"
    else:
        return
    raise UsageError(f"{flag}: {printable(path)} is {kind}; a regular file is needed")


class OutputFailed(Exception):
    """--output could not be written (a full disk, say): one line, exit status 1."""


class ResultWriter:
    """--output: one JSON line per result, flushed as it is written; counts them.
    A failed write raises OutputFailed saying how many results are safe on disk."""

    def __init__(self, f: TextIO | None, path: str | None):
        self.f, self.path, self.written = f, path, 0

    def write(self, record: dict[str, Any]) -> None:
        if self.f is None:
            return
        try:
            write_result(self.f, record)
        except OSError as e:
            n = self.written
            raise OutputFailed(f"--output: cannot write {self.path}: {e.strerror or e}; {n} result"
                               f"{'' if n == 1 else 's'} of this run written there (free space, then rerun "
                               "with --resume to finish the rest)") from None
        self.written += 1

    def close(self) -> None:
        if self.f is not None:
            try:
                self.f.close()
            except OSError:  # the unflushed tail of a failed write: OutputFailed said so
                pass


# ------------------------------------------------------------------ output
def open_output(path: str | None, prompts: str | None, resume: bool) -> tuple[TextIO | None, set[int]]:
    """Opens and locks --output before anything loads (a bad path, or a file another
    run holds, costs nothing) and, with --resume, returns the indices already
    written there."""
    if path is None:
        if resume:
            raise UsageError("--resume: needs --output")
        return None, set()
    if prompts is not None and os.path.exists(path) and os.path.exists(prompts) and os.path.samefile(path, prompts):
        raise UsageError(f"--output: {path} is the prompts file; writing there would destroy the input")
    try:  # opened without truncating: a file another run is writing is left as it is
        f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666), "a", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--output: cannot write {path}: {e.strerror}") from None
    try:
        lock_output(f, path)
        if not resume:
            f.truncate(0)
        return f, _finished_indices(path) if resume else set()
    except BaseException:
        f.close()
        raise


def lock_output(f: TextIO, path: str) -> None:
    """Holds an exclusive lock on --output until `f` closes (the process ends): a
    second run on the same file (a --resume beside a live run) would write its
    results twice."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"--output: {path} is being written by another jpaged batch (it holds the file's "
                         "lock); wait for that run to end, then rerun with --resume") from None
    except OSError:  # a filesystem without locks: nothing to hold
        pass


def open_summary(path: str | None) -> TextIO | None:
    try:
        return open(path, "w") if path else None
    except OSError as e:
        raise UsageError(f"--summary_json: cannot write {path}: {e.strerror}") from None


def _finished_indices(path: str) -> set[int]:
    """Indices of the complete lines of an earlier run's output; a torn last
    line (the process died mid-write) is cut off so appending starts clean."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise UsageError(f"--output: cannot read {path} to resume: {e.strerror}") from None
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    done = set()
    for line in complete.splitlines():
        try:
            done.add(int(json.loads(line)["index"]))
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"--output: {path} has a line that is not a jpaged result; "
                             "refusing to append to it") from None
    return done


def write_result(f: TextIO | None, record: dict[str, Any]) -> None:
    if f is not None:
        line = json.dumps(record, ensure_ascii=False)
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (from a prompt's "\\ud800"): JSON escapes it
            line = json.dumps(record)
        f.write(line + "\n")
        f.flush()  # on disk (in the OS) now: a kill later loses nothing written


def error_record(request: ParsedRequest) -> dict[str, Any]:
    from jpaged.engine.llm import RequestOutput
    record = {f.name: None for f in dataclasses.fields(RequestOutput)}
    record.update(index=request.index, text="", token_ids=[], prompt_token_ids=[], samples=[],
                  finish_reason="error", error=request.error, num_cached_tokens=0,
                  warnings=request.warnings)
    return record


# ---------------------------------------------------------------- requests
def demo_prompts() -> list[str]:
    """The demo queue run when no --prompts file is given: 8 prompts (short answers
    and long ones) shipped in the package; benchmarks/harness.py reads them too."""
    text = importlib.resources.files("jpaged.entrypoints").joinpath("demo_prompts.jsonl").read_text("utf-8")
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def read_requests(path: str | None, llm_defaults: Any, base_model: str | None = None,
                  adapters: Collection[str] = ()) -> list[ParsedRequest]:
    if path is None:
        return [parse_request({"prompt": p}, llm_defaults, i) for i, p in enumerate(demo_prompts())]
    try:
        return read_request_file(path, llm_defaults, base_model, adapters)
    except OSError as e:
        raise UsageError(f"--prompts: cannot read {path}: {e.strerror}") from None


def echo(text: str, file: TextIO | None = None) -> None:
    """print(), with control characters escaped (neither a prompt nor an answer may
    move the cursor or recolour the terminal) and what the terminal's encoding
    cannot show (a lone surrogate, or any non-ASCII on an ASCII terminal) written
    as a backslash escape rather than raising."""
    file = sys.stdout if file is None else file
    encoding = getattr(file, "encoding", None) or "utf-8"
    try:
        text = printable(text).encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:  # an encoding Python does not know
        text = ascii(printable(text))[1:-1]
    print(text, file=file)


def print_result(index: int, request: ParsedRequest, out: Any = None) -> None:
    """Echoes a request and its answer (see `echo`)."""
    if out is None:
        echo(f"\n--- line {index + 1} [error]\n>>> ERROR: {request.error or ''}")
        return
    echo(f"\n--- line {index + 1} [{out.finish_reason}, {len(out.token_ids)} tokens, "
         f"TTFT {out.ttft_ms or 0:.0f} ms, latency {out.latency_ms or 0:.0f} ms]")
    echo(request.text)
    echo(">>> " + (out.text if out.error is None else f"ERROR: {out.error}"))


def report_result(index: int, request: ParsedRequest, out: Any = None) -> None:
    """print_result; a failure to print (a closed or broken terminal) is that line's
    problem alone, said on stderr: the result is already in --output."""
    try:
        print_result(index, request, out)
    except (OSError, ValueError) as e:
        try:
            print(f"error: line {index + 1}: its result could not be printed: {type(e).__name__}: "
                  f"{ascii(str(e))[1:-1]}", file=sys.stderr)
        except (OSError, ValueError):
            pass


# -------------------------------------------------------------------- main
class StopOnSignal:
    """SIGINT/SIGTERM set an event the engine checks before each step; a second
    SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        self.event.set()


def run(config_file: Any, args: Args = Args()) -> int:
    """The command: `config_file` (a ConfigDict or mapping of fields) over
    default_config(); returns the exit status."""
    t_start = time.perf_counter()
    logging.set_verbosity(logging.WARNING)  # orbax's and XLA's INFO lines are not for users
    config = apply_overrides(default_config(), config_file)  # a misspelt field names the right one
    validate_config(config)
    if process_id(args) != 0:
        return follow(config, args)
    for flag, path in (("--prompts", args.prompts), ("--output", args.output), ("--summary_json", args.summary_json)):
        check_regular_file(flag, path)
    # A line's "model" names the base model or an adapter of lora_modules, which every engine loads at start.
    requests = read_requests(args.prompts, default_sampling_params(config), config.model,
                             parse_lora_modules(config.lora_modules))
    out_file, done = open_output(args.output, args.prompts, args.resume)
    writer = ResultWriter(out_file, args.output)
    try:
        return _run(config, args, requests, writer, done, t_start)
    except OutputFailed as e:  # every result written before it is whole on disk
        echo(f"error: {e}", sys.stderr)
        return 1
    finally:
        writer.close()


def _run(config: Any, args: Args, requests: list[ParsedRequest], writer: ResultWriter, done: set[int],
         t_start: float) -> int:
    summary_file = open_summary(args.summary_json)
    stopper = StopOnSignal()  # from here on a signal stops the batch cleanly, even mid-load
    todo = [r for r in requests if r.index not in done]
    for r in todo:
        for w in r.warnings:
            echo(f"warning: {w}", sys.stderr)
        if r.error:
            echo(f"error: {r.error}", sys.stderr)
            writer.write(error_record(r))
    good = [r for r in todo if not r.error]
    if done:
        print(f"resuming: {len(requests) - len(todo)} of {len(requests)} requests already in {args.output}")

    t0 = time.perf_counter()
    from jpaged.entrypoints.metrics import format_memory  # jax loads here: every check above ran without it
    from jpaged.engine.router import create_engine
    try:
        start_distributed(args)
        llm = create_engine(config)
    except ConfigError:  # e.g. a tensor_parallel_size the model's heads do not divide
        raise
    except (ValueError, OSError) as e:  # a missing, truncated or unreadable model
        raise UsageError(f"model: {e}") from None
    loaded = llm.loaded
    note = f"; {loaded.cache_note}" if loaded.cache_note else ""
    print(f"model {loaded.source}: loaded in {loaded.load_seconds:.2f} s ({loaded.origin}{note}); "
          f"engine ready in {time.perf_counter() - t0:.2f} s")
    attention = llm.attention_impl + (f" ({llm.attention_note})" if llm.attention_note else "")
    print(f"KV pool: {llm.num_blocks} blocks x {config.block_size} tokens, {llm.kv_dtype.name} "
          f"({llm.kv_pool_bytes / 2**20:.0f} MiB), attention {attention}, scheduler {config.scheduler}")
    print(format_memory(llm.memory_per_device()))
    if args.precompile:
        t0 = time.perf_counter()
        n = llm.precompile()
        print(f"precompiled {n} of the {len(llm.token_buckets)} step buckets in {time.perf_counter() - t0:.1f} s")

    try:
        return run_batch(llm, config, good, writer, summary_file, stopper, len(todo), t_start, args.output)
    finally:
        llm.close()  # a multi-process run: the other processes stop following


def run_batch(llm: Any, config: Any, good: list[ParsedRequest], writer: ResultWriter,
              summary_file: TextIO | None, stopper: StopOnSignal, num_todo: int, t_start: float,
              output: str | None = None) -> int:
    """Runs the good requests, writing and echoing each result as it finishes;
    OutputFailed when --output cannot be written (the rest are aborted)."""
    from jpaged.core.progress import EngineStalled
    from jpaged.entrypoints.metrics import format_summary, summarize
    outputs = []
    t0 = time.perf_counter()
    stream = llm.generate_iter([r.prompt for r in good], [r.params for r in good],
                               use_tqdm=True, stop=stopper.event)
    try:
        for out in stream:
            request = good[out.index]
            outputs.append(out)
            writer.write({**out.to_json(), "index": request.index, "warnings": request.warnings})
            report_result(request.index, request, out)
    except EngineStalled as e:  # every result that finished is already on disk
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        stream.close()
        writer.close()
    wall = time.perf_counter() - t0
    if stopper.signum is not None:
        name = signal.Signals(stopper.signum).name
        where = f" in {output} (rerun with --resume to finish the rest)" if output else ""
        print(f"interrupted by {name}: {len(outputs)} of {len(good)} requests finished and were "
              f"written{where}", file=sys.stderr)
        return 128 + stopper.signum
    summary = summarize(outputs, llm, wall)
    summary["process_wall_s"] = time.perf_counter() - t_start
    summary["requests"] += num_todo - len(good)  # the lines rejected before the model loaded
    summary["errors"] += num_todo - len(good)
    print("\n" + format_summary(summary))
    if summary_file is not None:
        with summary_file:
            json.dump(summary, summary_file, indent=1)
    return 0


def process_id(args: Args) -> int:
    return args.process_id if args.process_id is not None else int(os.environ.get("JAX_PROCESS_ID", "0"))


def start_distributed(args: Args) -> None:
    """Joins a multi-process run when flags or environment ask for one."""
    from jpaged.runtime import distributed
    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)


def follow(config: Any, args: Args) -> int:
    """A process other than 0: the same engine, running the steps process 0 schedules."""
    from jpaged.engine.router import create_engine
    start_distributed(args)
    create_engine(config).follow()
    return 0


def main(argv: list[str] | None = None) -> None:
    """`jpaged batch`: parses `argv` (default sys.argv; argv[0] is the program) and exits."""
    config, holders = cli.start(argv, define_flags)

    def command(unused_argv: list[str]) -> None:
        try:
            status = run(config.value, Args(**{name: h.value for name, h in holders.items()}))
        except (ConfigError, UsageError) as e:
            cli.exit_usage(str(e))
        sys.exit(status)

    app.run(command, flags_parser=lambda a: cli.parse_flags(a, config))


if __name__ == "__main__":
    main()
