"""Session files (orbax checkpoint directories): save, inspect, load with limits, erase.

The format knows nothing of slots or engines: the engine converts a slot's state to and from
the per-stage dicts of numpy arrays these functions take and return.

Modules: `schema` (constants, public types, the header a save writes), `validate` (the checks
of a read), `atomic` (atomic replacement and crash recovery), `orbax_io` (orbax calls),
`format` (save / read / load / erase, built from those).
"""
from strata_jax.session.format import (
    erase_session,
    load_session,
    read_session_meta,
    save_session,
)
from strata_jax.session.schema import (
    FLAG_LORA_ON,
    KNOWN_FLAGS,
    MAGIC,
    SUPPORTED_VERSIONS,
    SessionMeta,
    SessionReadLimits,
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
