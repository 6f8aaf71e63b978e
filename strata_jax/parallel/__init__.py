"""Layer split: contiguous layer ranges (stages) placed on devices.

Each stage's params, LoRA A/B and state are committed to its device; a step runs one jitted
program per stage and hands the activation [T, D] (or [B, D] in decode) to the next stage's
device with `jax.device_put`, one transfer per boundary per step. `auto` sizes the ranges from
each device's free memory (`plan.py`).

Scope: one process driving every device it can address (one host with many GPUs, or fake CPU
devices in tests). Several hosts under `jax.distributed.initialize()` are not supported yet:
in multi-controller JAX a process cannot `device_put` onto another host's device, so that
needs the single-program form (a `stage` mesh axis, `shard_map` and `ppermute` between
stages), which this package does not implement.
"""
