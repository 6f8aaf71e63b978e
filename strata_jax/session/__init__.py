"""Session files (orbax checkpoint directories): save, inspect, load with limits, erase.

The format knows nothing of slots or engines: the engine converts a slot's state to and from
the per-stage dicts of numpy arrays these functions take and return.
"""
from strata_jax.session.format import (
    FLAG_LORA_ON,
    KNOWN_FLAGS,
    MAGIC,
    SUPPORTED_VERSIONS,
    SessionMeta,
    SessionReadLimits,
    erase_session,
    load_session,
    read_session_meta,
    save_session,
    stage_shapes_for,
)

__all__ = [
    "FLAG_LORA_ON",
    "KNOWN_FLAGS",
    "MAGIC",
    "SUPPORTED_VERSIONS",
    "SessionMeta",
    "SessionReadLimits",
    "erase_session",
    "load_session",
    "read_session_meta",
    "save_session",
    "stage_shapes_for",
]
