"""The step's compiled programs: built once per bucket, kept in memory, and kept
on disk across runs.

`StepPrograms` owns every compiled program of one runner's jitted step, keyed
like the runner keys them: (T tokens, S sequences, StepInputs structure).  A
program is made ready in one of two ways:

  built   traced and lowered from shapes alone (`jax.ShapeDtypeStruct`s with
          their shardings: the weights and the donated pool never meet another
          thread), then compiled by XLA (or read from JAX's persistent
          compilation cache, which is keyed by the lowered program, so a hit
          still pays the tracing and lowering);
  loaded  read back from `<cache_dir>/programs/` with
          `jax.experimental.serialize_executable`: no tracing at all.

With a directory, every built program is written there.  An entry's file name
is the sha256 of its key, a canonical text of everything that changes the
program (`ProgramKey`: the source of the jpaged and pallas_kernels packages,
the model, the weights' and the pool's shapes, dtypes and shardings, the
step's static arguments, the bucket, the backend and its devices, the jax
versions, flags and XLA_FLAGS, and the XLA compiler options the programs are
built with: config.xla_step_options); the file holds that text and a sha256 of its
payload, both checked on load.  A damaged, truncated or foreign entry is
logged, rebuilt and atomically rewritten, never trusted.  Loading unpickles:
the directory must be as trusted as the code.

One worker thread builds programs in the background (`submit`): the runner
queues a bucket there when a step can run, for now, padded to a larger ready
bucket; `precompile(background=True)` queues a set of buckets.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import pickle
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterable

import jax
import pallas_kernels
from jax.experimental import serialize_executable

from jpaged.core.xla_options import OptionValue, options_text
from jpaged.runtime.step_inputs import StepInputs

log = logging.getLogger(__name__)

MAGIC = b"jpaged-step-program 1\n"
XLA_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_PACKAGES = (pathlib.Path(__file__).resolve().parents[1], pathlib.Path(pallas_kernels.__file__).resolve().parent)


@functools.cache
def code_fingerprint() -> str:
    """sha256 of every .py file of the jpaged and pallas_kernels packages (paths
    and contents), once per process: any source change invalidates every entry,
    since the step's program is whatever that code traces."""
    h = hashlib.sha256()
    for root in _PACKAGES:
        for path in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


_thread = threading.local()


@functools.cache
def _watch_xla_cache() -> None:
    """Notes, per thread, when a compile is served by JAX's persistent cache: such
    an executable serializes into an entry that loads but fails when it runs
    (measured on jax 0.10.2 CPU: "Function ... not found"), so it is not written."""
    def listener(event: str, **kwargs: Any) -> None:
        if event == XLA_CACHE_HIT:
            _thread.xla_cache_hit = True
    jax.monitoring.register_event_listener(listener)


def shape_specs(tree: Any) -> Any:
    """The tree's leaves as ShapeDtypeStructs, with their shardings where they have one."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def describe_tree(tree: Any) -> list[str]:
    """One line per leaf: path, shape, dtype, sharding (what a program depends on)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [f"{jax.tree_util.keystr(p)} {tuple(x.shape)} {x.dtype} {getattr(x, 'sharding', None)}"
            for p, x in leaves]


def environment() -> dict[str, Any]:
    """What the backend and jax contribute to a program besides its own inputs."""
    devices = jax.devices()
    return {
        "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
        "platform": devices[0].platform, "platform_version": devices[0].client.platform_version,
        "device_kinds": sorted({d.device_kind for d in devices}), "device_count": len(devices),
        "process_count": jax.process_count(),
        "x64": bool(jax.config.jax_enable_x64),
        "default_matmul_precision": str(jax.config.jax_default_matmul_precision),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }


def program_key(inputs: StepInputs) -> tuple:
    """A program's key in memory: (T, S, StepInputs structure)."""
    return inputs.num_tokens, inputs.num_seqs, jax.tree.structure(inputs)


@dataclasses.dataclass
class BuildStats:
    """Where the seconds of getting programs ready went (summed over threads)."""
    compiled: int = 0                 # programs traced, lowered and compiled here
    loaded: int = 0                   # programs read back from disk
    trace_lower_seconds: float = 0.0
    compile_seconds: float = 0.0      # XLA (or its persistent cache), and writing the entry
    load_seconds: float = 0.0         # reading and deserializing entries (a failed read too)

    @property
    def total_seconds(self) -> float:
        return self.trace_lower_seconds + self.compile_seconds + self.load_seconds


class ProgramCacheError(Exception):
    """An entry on disk that cannot be used (the message says why)."""


BACKGROUND_NICE = 10  # the background builder's niceness: below every step and request thread


def lower_thread_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux, where priority is per thread):
    a program built in the background then takes only the CPU time that the steps
    and the server's threads leave; on a 2-core machine a build at full priority
    took a core from the serving path while it ran.  Elsewhere (where
    setpriority would lower the whole process) it does nothing."""
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as e:  # e.g. a sandbox that forbids it: build at the normal priority
        log.debug("could not lower the program builder's priority: %s", e)


class StepPrograms:
    """The compiled programs of one jitted step(params, kv_pool, inputs).

    `params` and `kv_pool` are read for their shapes, dtypes and shardings only,
    once, here; the runner may replace both later with arrays of the same specs
    (update_params, restore_pool).  `static` names the step's static arguments
    and whatever else the program depends on that the arrays do not show; it is
    part of every key, with the model config and the mesh.  `compiler_options`
    (jpaged.core.xla_options) go to XLA with every program built here, and into
    every key: an entry built with other options is never loaded."""

    def __init__(self, step: Any, params: Any, kv_pool: jax.Array, *, static: dict[str, Any],
                 model_config: Any, mesh: Any, cache_dir: pathlib.Path | None,
                 mesh_context: Callable[[], contextlib.AbstractContextManager],
                 compiler_options: dict[str, OptionValue] | None = None):
        self._step = step
        self.compiler_options = dict(compiler_options or {})
        self._params_spec, self._pool_spec = shape_specs(params), shape_specs(kv_pool)
        self._devices = (list(mesh.devices.flat) if mesh is not None
                         else sorted(kv_pool.sharding.device_set, key=lambda d: d.id))
        self._mesh_context = mesh_context
        self.cache_dir = cache_dir
        self._base_key = json.dumps({
            "code": code_fingerprint(), "model_config": repr(model_config), "mesh": repr(mesh),
            "static": {k: repr(v) for k, v in static.items()}, "environment": environment(),
            "compiler_options": options_text(self.compiler_options),
            "params": describe_tree(self._params_spec), "kv_pool": describe_tree(self._pool_spec),
        }, sort_keys=True, indent=0)
        self._ready: dict[tuple, jax.stages.Compiled] = {}
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpaged-programs",
                                                             initializer=lower_thread_priority)
        self.stats = BuildStats()

    # ---------------------------------------------------------------- lookup
    @property
    def ready(self) -> dict[tuple, jax.stages.Compiled]:
        with self._lock:
            return dict(self._ready)

    def is_ready(self, key: tuple) -> bool:
        return key in self._ready

    def on_disk(self, inputs: StepInputs) -> bool:
        """Whether an entry for this bucket exists (loading it costs no tracing)."""
        return self.cache_dir is not None and self._path(self.key_text(inputs)).exists()

    def key_text(self, inputs: StepInputs) -> str:
        """The canonical text of everything the program of `inputs` depends on."""
        return self._base_key + "\n" + json.dumps({
            "inputs_structure": str(jax.tree.structure(inputs)), "inputs": describe_tree(shape_specs(inputs))},
            sort_keys=True, indent=0)

    # -------------------------------------------------------------- building
    def program(self, inputs: StepInputs) -> tuple[jax.stages.Compiled, float]:
        """The program of `inputs`, and the seconds this call waited for it: ready,
        or in flight (waited for), or built here now."""
        key = program_key(inputs)
        with self._lock:
            exe = self._ready.get(key)
            if exe is not None:
                return exe, 0.0
            future = self._pending.get(key)
            mine = future is None
            if mine:
                future = self._pending[key] = concurrent.futures.Future()
        t0 = time.perf_counter()
        if mine:
            self._build_into(key, shape_specs(inputs), future)
        return future.result(), time.perf_counter() - t0

    def submit(self, inputs: StepInputs) -> bool:
        """Queues the program of `inputs` on the worker unless it is ready or in
        flight; True when queued."""
        key = program_key(inputs)
        with self._lock:
            if key in self._ready or key in self._pending:
                return False
            future = self._pending[key] = concurrent.futures.Future()
        self._worker.submit(self._background_build, key, shape_specs(inputs), future)
        return True

    def precompile(self, inputs: Iterable[StepInputs], background: bool = False) -> int:
        """Makes these programs ready (or queues them, with `background`); returns
        how many were not ready (or in flight) before."""
        count = 0
        for x in inputs:
            key = program_key(x)
            if background:
                count += self.submit(x)
            elif not self.is_ready(key):
                count += key not in self._pending
                self.program(x)
        return count

    def wait(self) -> None:
        """Waits for every build in flight (a failed one is logged, not raised)."""
        with self._lock:
            futures = list(self._pending.values())
        concurrent.futures.wait(futures)

    def _background_build(self, key: tuple, inputs: StepInputs, future: concurrent.futures.Future) -> None:
        if not threading.main_thread().is_alive():  # the interpreter is exiting: build nothing more
            with self._lock:
                self._pending.pop(key, None)
            future.cancel()
            return
        self._build_into(key, inputs, future)
        if future.exception() is not None:
            log.warning("building the step program for %d tokens, %d sequences in the background failed: %s "
                        "(the step that needs it builds it again)", key[0], key[1], future.exception())

    def _build_into(self, key: tuple, inputs: StepInputs, future: concurrent.futures.Future) -> None:
        """Loads or builds the program, then publishes it (or the error) to `future`."""
        future.set_running_or_notify_cancel()
        try:
            exe = self._load_or_build(inputs)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            with self._lock:
                self._pending.pop(key, None)
            future.set_exception(e)
            return
        with self._lock:
            self._ready[key] = exe
            self._pending.pop(key, None)
        future.set_result(exe)

    def _load_or_build(self, inputs: StepInputs) -> jax.stages.Compiled:
        if self.cache_dir is None:
            return self._build(inputs)[0]
        key_text = self.key_text(inputs)
        path = self._path(key_text)
        exe = self._load(path, key_text)
        if exe is None:
            exe, from_xla_cache = self._build(inputs)
            t0 = time.perf_counter()
            if from_xla_cache:
                log.info("a step program came from JAX's persistent compilation cache, whose executables do "
                         "not survive a second serialization: not written to %s", path.parent)
            else:
                self._save(path, key_text, exe, (inputs.num_tokens, inputs.num_seqs))
            self._count(compile_seconds=time.perf_counter() - t0)
        return exe

    def _build(self, inputs: StepInputs) -> tuple[jax.stages.Compiled, bool]:
        """Traces, lowers and compiles; True with it when JAX's persistent cache served the compile."""
        t0 = time.perf_counter()
        with self._mesh_context():
            lowered = self._step.trace(self._params_spec, self._pool_spec, inputs).lower()
        t1 = time.perf_counter()
        _watch_xla_cache()
        _thread.xla_cache_hit = False
        exe = lowered.compile(self.compiler_options or None)
        self._count(compiled=1, trace_lower_seconds=t1 - t0, compile_seconds=time.perf_counter() - t1)
        return exe, _thread.xla_cache_hit

    def _count(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.stats, name, getattr(self.stats, name) + amount)

    # ------------------------------------------------------------------ disk
    @property
    def _engine_dir(self) -> pathlib.Path:
        """One folder per engine (base key), so that preload finds its entries."""
        return self.cache_dir / hashlib.sha256(self._base_key.encode()).hexdigest()[:32]

    def _path(self, key_text: str) -> pathlib.Path:
        return self._engine_dir / (hashlib.sha256(key_text.encode()).hexdigest() + ".program")

    def _load(self, path: pathlib.Path, key_text: str) -> jax.stages.Compiled | None:
        """The entry's program, or None (missing; or unusable: logged, to be rebuilt)."""
        t0 = time.perf_counter()
        try:
            exe = self._decode(path.read_bytes(), key_text)[0]
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - any damage means: rebuild it
            log.warning("step program cache entry %s is unusable (%s: %s): rebuilding it", path,
                        type(e).__name__, e)
            self._count(load_seconds=time.perf_counter() - t0)
            return None
        self._count(loaded=1, load_seconds=time.perf_counter() - t0)
        return exe

    def _decode(self, data: bytes, key_text: str | None) -> tuple[jax.stages.Compiled, dict[str, Any]]:
        """The entry's program and header; `key_text` None (a preload) accepts any
        key of this engine (the base key's, hashed to the file's own name)."""
        if not data.startswith(MAGIC):
            raise ProgramCacheError("not a step program entry")
        head, sep, payload = data[len(MAGIC):].partition(b"\n")
        if not sep:
            raise ProgramCacheError("truncated header")
        header = json.loads(head)
        if key_text is not None and header["key"] != key_text:
            raise ProgramCacheError("written for another key")
        if key_text is None and not header["key"].startswith(self._base_key + "\n"):
            raise ProgramCacheError("written for another engine")
        if len(payload) != header["payload_bytes"]:
            raise ProgramCacheError(f"payload of {len(payload)} bytes, expected {header['payload_bytes']}")
        if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
            raise ProgramCacheError("payload checksum mismatch")
        serialized, in_tree, out_tree = pickle.loads(payload)
        exe = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                        backend=self._devices[0].client,
                                                        execution_devices=self._devices)
        header["inputs_tree"] = in_tree.children()[0].children()[2]  # of ((params, pool, inputs), {})
        return exe, header

    def preload(self) -> int:
        """Loads every entry this engine (its base key) has on disk, so that a warm
        run's steps find their programs ready: the cost moves to start-up, before
        the first request.  Returns how many were loaded; an unusable entry is
        skipped here (the step that needs it rebuilds it)."""
        if self.cache_dir is None or not self._engine_dir.is_dir():
            return 0
        loaded = 0
        for path in sorted(self._engine_dir.glob("*.program")):
            t0 = time.perf_counter()
            try:
                exe, header = self._decode(path.read_bytes(), None)
                key = (header["num_tokens"], header["num_seqs"], header["inputs_tree"])
                if hashlib.sha256(header["key"].encode()).hexdigest() != path.stem:
                    raise ProgramCacheError("file name is not its key's hash")
            except Exception as e:  # noqa: BLE001 - any damage: left for the step that needs it
                log.info("step program cache entry %s not preloaded (%s: %s)", path, type(e).__name__, e)
                continue
            finally:
                self._count(load_seconds=time.perf_counter() - t0)
            with self._lock:
                self._ready.setdefault(key, exe)
            self._count(loaded=1)
            loaded += 1
        return loaded

    def _save(self, path: pathlib.Path, key_text: str, exe: jax.stages.Compiled, bucket: tuple[int, int]) -> None:
        """Writes the entry atomically (tmp file + os.replace); a program that
        cannot be serialized or written is logged and kept in memory only."""
        try:
            payload = pickle.dumps(serialize_executable.serialize(exe))
        except Exception as e:  # noqa: BLE001 - an unsupported program still runs
            log.warning("cannot serialize the step program (%s: %s): compiled it, kept in memory only",
                        type(e).__name__, e)
            return
        header = json.dumps({"key": key_text, "num_tokens": bucket[0], "num_seqs": bucket[1],
                             "payload_bytes": len(payload),
                             "payload_sha256": hashlib.sha256(payload).hexdigest()}).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
                f.write(MAGIC + header + b"\n" + payload)
            os.replace(f.name, path)
        except OSError as e:
            log.warning("cannot write the step program cache entry %s (%s)", path, e)
            with contextlib.suppress(OSError, NameError):
                os.unlink(f.name)
