"""Several processes (hosts) under `jax.distributed`: start-up and reading results back.

Multi-controller JAX: every process runs the same program and makes the same calls in the same
order. A stage's jitted step runs on the process that owns the stage's device; the others make
a handle of the result's shape that they cannot read (`call_on_stage`). `jax.device_put`
moves the activation to the next stage's device even when another process owns it (JAX's
cross-host transfer, enabled by `jax_cross_host_transfer_socket_address`), and what the host
must see (logits, cached K/V) is broadcast from the owning process to all with
`multihost_utils.broadcast_one_to_all` (`to_host`), so every process takes the same decisions
(the same sampled token, the same cache entries). No transport of our own: JAX's collectives
(NCCL on GPUs, gloo on CPUs) and its transfer server carry everything.

  strata_jax.parallel.distributed.initialize("10.0.0.1:1234", 2, process_id,
                                             transfer_address="10.0.0.2:1240")
"""
from __future__ import annotations

import jax
import numpy as np


def initialize(coordinator: str, num_processes: int, process_id: int,
               transfer_address: str | None = None):
  """`jax.distributed.initialize` with what a layer split across hosts needs. Call it before
  any other JAX use. `transfer_address` (host:port this process listens on for device-to-device
  transfers from other processes) defaults to this host's address (the coordinator's when that
  is the loopback: all processes on one machine) with port = coordinator port + 1 + id."""
  if transfer_address is None:
    host, port = coordinator.rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost", "::1"):
      import socket  # noqa: PLC0415
      host = socket.gethostbyname(socket.gethostname())
    transfer_address = f"{host}:{int(port) + 1 + int(process_id)}"
  jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU hosts only
  jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
  # Make the collectives' context now, while the processes are in step. Made lazily at the
  # first broadcast, it waits at most 30 s (gloo's key-value wait, no knob) for a peer that
  # may still be compiling: a loaded 2-core CI machine once failed there.
  from jax.experimental import multihost_utils  # noqa: PLC0415 (multi-process only)
  multihost_utils.broadcast_one_to_all(np.zeros((), np.int32))


def multi_process() -> bool:
  return jax.process_count() > 1


def call_on_stage(step, device, *args, **kwargs):
  """`step(*args, **kwargs)` for a stage placed on `device`. The process that owns the device
  runs it; another process only needs the result's handle (to pass it to the next stage's
  transfer and to `to_host`), so it makes one with the right shape, dtype and placement and
  no data. (It must not run the step itself: with JAX 0.10 on CPU a jitted call that takes
  another process's output crashes the calling process.)"""
  if device is None or device.process_index == jax.process_index():
    return step(*args, **kwargs)
  from jax.sharding import SingleDeviceSharding  # noqa: PLC0415
  sharding = SingleDeviceSharding(device)
  return jax.tree.map(
      lambda sd: jax.make_array_from_single_device_arrays(sd.shape, sharding, [], dtype=sd.dtype),
      step.eval_shape(*args, **kwargs))


def start_host_copy(x: jax.Array) -> jax.Array:
  """Start copying a one-device array to the host without waiting; read it later with
  `to_host`. Where the device offers page-locked host memory ("pinned_host") the copy is a
  DMA into it; otherwise JAX's own host copy (`copy_to_host_async`). H200, bench-a3b: a 75 MB
  GDN state went through the pageable path at ~1-2 GB/s, and the decode chunk queued after it
  waited that long (bench_engine_run6.json: a ~45 ms gap at every chunk boundary at batch 32)."""
  (device,) = x.sharding.device_set
  if x.sharding.memory_kind != "pinned_host" and any(
      m.kind == "pinned_host" for m in device.addressable_memories()):
    try:
      return jax.device_put(x, jax.sharding.SingleDeviceSharding(device,
                                                                 memory_kind="pinned_host"))
    except jax.errors.JaxRuntimeError:   # no pinned memory to be had: the pageable copy
      pass
  x.copy_to_host_async()
  return x


def to_host(x, shared: bool = False) -> np.ndarray:
  """The value of `x` on this host. With `shared` (an engine whose stages sit on devices of
  several processes), `x` lives on one stage's device and is broadcast from the process that
  owns it, on every process, the owner included: each process must call this for the same
  arrays in the same order (the multi-controller rule). Otherwise a plain read."""
  if not shared or not isinstance(x, jax.Array):
    return np.asarray(x)
  devices = x.sharding.device_set
  if len(devices) != 1:
    raise ValueError(f"to_host: expected an array on one device, got {len(devices)}")
  from jax.experimental import multihost_utils  # noqa: PLC0415 (multi-process only)
  owner = next(iter(devices)).process_index
  src = jax.process_index() == owner
  value = np.asarray(x.addressable_data(0)) if src else np.zeros(x.shape, x.dtype)
  return np.asarray(multihost_utils.broadcast_one_to_all(value, is_source=src))
