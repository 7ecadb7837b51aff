"""Devices and processes: `jax.distributed` start-up, the (data, seq) mesh and global batches.

Mesh axes: "data" shards the batch, "seq" shards the time axis. Consecutive devices form the sequence axis, so a
sequence-parallel group never spans processes (each process then feeds whole rows of its batch).
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, SEQ = "data", "seq"


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, *, cpu_collectives: str = "gloo") -> bool:
    """Starts `jax.distributed` when asked for (arguments, or DELTAJAX_COORDINATOR_ADDRESS / DELTAJAX_NUM_PROCESSES
    / DELTAJAX_PROCESS_ID in the environment); returns whether it did. Must run before any other jax call.

    On CPU, cross-process collectives need an implementation (`gloo`), which must be set before initialising.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("DELTAJAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("DELTAJAX_NUM_PROCESSES"):
        num_processes = int(env["DELTAJAX_NUM_PROCESSES"])
    if process_id is None and env.get("DELTAJAX_PROCESS_ID"):
        process_id = int(env["DELTAJAX_PROCESS_ID"])
    if not coordinator_address:
        if num_processes not in (None, 1):
            raise ValueError("several processes need a coordinator address (host:port)")
        return False
    if num_processes is None or process_id is None:
        raise ValueError("with a coordinator address, give the number of processes and this process's id")
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return True


def make_mesh(sequence_parallel: int = 1) -> Mesh:
    """All devices as a (data, seq) mesh with `sequence_parallel` devices on the sequence axis."""
    devices = jax.devices()
    local = jax.local_device_count()
    if sequence_parallel < 1 or len(devices) % sequence_parallel:
        raise ValueError(f"sequence_parallel ({sequence_parallel}) must divide the number of devices "
                         f"({len(devices)})")
    if jax.process_count() > 1 and local % sequence_parallel:
        raise ValueError(f"sequence_parallel ({sequence_parallel}) must divide the devices of one process "
                         f"({local}): a sequence is never split across processes")
    grid = np.array(devices).reshape(len(devices) // sequence_parallel, sequence_parallel)
    return Mesh(grid, (DATA, SEQ))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, T] arrays: rows over "data", time over "seq"."""
    return NamedSharding(mesh, P(DATA, SEQ))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_batch(mesh: Mesh, batch_size: int, seq_len: int, grad_accum_steps: int = 1):
    data, seq = mesh.shape[DATA], mesh.shape[SEQ]
    if (batch_size // grad_accum_steps) % data:
        raise ValueError(f"the batch of {batch_size} rows ({batch_size // grad_accum_steps} per micro-batch) must "
                         f"divide over the {data} devices of the data axis")
    if seq_len % seq:
        raise ValueError(f"seq_len ({seq_len}) must divide over the {seq} devices of the sequence axis")


def global_batch(local_batch: dict, sharding: NamedSharding, global_rows: int) -> dict:
    """This process's rows (numpy) -> global jax arrays sharded by `sharding`."""
    return {name: jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])
            for name, x in local_batch.items()}
