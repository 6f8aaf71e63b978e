# Sourced by the one-call device scripts: the carried wheels (all but fla's: with fla importable,
# transformers' Qwen3-Next runs fla's kernels, not its torch reference) into /tmp/site, the
# import path, no preallocation, a compilation cache, and no global precision flag (float32
# programs ask for full fp32 through their Forms). WHL: the wheel folder (default .whl).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $(ls ${WHL:-.whl}/*.whl | grep -v -e fla -e flash_linear -e einops) >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false STRATA_JAX_CACHE=/tmp/xla
unset JAX_DEFAULT_MATMUL_PRECISION
