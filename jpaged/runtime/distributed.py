"""Multi-host runs: JAX's own distributed runtime, one controller per process.

Every process calls `initialize` (before anything touches a device), builds the
same engine over the global mesh and loads the same weights.  Process 0 alone
schedules: before each step it broadcasts the step's host arrays (tokens,
metadata, sampling controls, copy-on-write pairs) with
`multihost_utils.broadcast_one_to_all`, and every process then runs the same
jitted step (`ModelRunner.follow` on the others).  Only process 0 reads
requests and writes outputs.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """jax.distributed.initialize from the arguments, else the environment
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); does nothing
    for a single process.  True when this run spans several processes."""
    env = os.environ.get
    coordinator_address = coordinator_address or env("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes or int(env("JAX_NUM_PROCESSES", "1"))
    process_id = process_id if process_id is not None else int(env("JAX_PROCESS_ID", "0"))
    if num_processes <= 1:
        return False
    if not coordinator_address:
        raise ValueError(f"num_processes={num_processes} needs a coordinator address (host:port of process 0)")
    # CPU collectives across processes go over gloo (TCP); accelerators use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def broadcast_step(payload: Any) -> Any:
    """Process 0's `payload` (picklable: numpy arrays, lists) on every process; the
    others pass None.  Two collectives: the size, then the bytes, padded to a
    power of two so that few broadcast programs compile."""
    from jax.experimental import multihost_utils
    source = jax.process_index() == 0
    data = np.frombuffer(pickle.dumps(payload), np.uint8) if source else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size), is_source=source))
    padded = np.zeros(max(64, 1 << (size - 1).bit_length()), np.uint8)
    padded[:data.size] = data
    received = np.asarray(multihost_utils.broadcast_one_to_all(padded, is_source=source))
    return pickle.loads(received[:size].tobytes())
