"""Layer split: contiguous layer ranges (stages) placed on devices.

Each stage's params, LoRA A/B and state are committed to its device; a step runs one jitted
program per stage and hands the activation [T, D] (or [B, D] in decode) to the next stage's
device with `jax.device_put`, one transfer per boundary per step. `auto` sizes the ranges from
each device's free memory (`plan.py`).

The same code runs on one host with many devices and on several hosts under
`jax.distributed` (`distributed.py`): every process makes the same calls, the process that
owns a stage's device runs its step, the activation crosses hosts through JAX's cross-host
device transfer, and what the host reads (logits, cached K/V) is broadcast from the owning
process. Across processes `auto` splits equally (other hosts' free memory is not visible)
and sessions are refused (save and restore from a single-process engine).
"""
