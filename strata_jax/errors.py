"""User-facing errors. Each is a ValueError whose message names the file and the problem; the
CLI prints `error: <message>` and exits with status 2."""


class StrataError(ValueError):
  """Base class for bad input."""


class GGUFError(StrataError):
  """A model GGUF that cannot be read or does not describe a qwen3next model."""


class AdapterError(StrataError):
  """A LoRA adapter GGUF that cannot be applied to the loaded model."""


class SessionError(StrataError):
  """A session file that cannot be restored into this engine."""


class RequestError(StrataError):
  """A generation request that is malformed or exceeds the engine's limits."""


class DeviceMemoryError(GGUFError):
  """A model (or one stage of it) that does not fit the free memory of its device."""


class FormsError(StrataError):
  """An unknown implementation choice (`strata_jax.forms.Forms`, the CLI's `--forms`)."""


class ControlVectorError(StrataError):
  """A control-vector GGUF (llama.cpp's format) that cannot be applied to the loaded model."""


class SpecError(StrataError):
  """A speculative-decoding request the model cannot serve (`--spec`, `--draft`)."""
