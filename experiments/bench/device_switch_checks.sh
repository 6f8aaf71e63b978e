python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
STRATA_SPLIT_REAL=1 python3 tests/split_check.py 2 2>/dev/null | tee $OUT/split_check2.json
python3 -m pytest tests/test_lora_switch.py tests/test_decode_greedy.py -p no:cacheprovider -W ignore 2>&1 | tail -15 | tee $OUT/gpu_switch.log
