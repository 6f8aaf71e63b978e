"""Pick the model forms the benchmark runs with, from `decode_probe.py`'s measurements in the
same session: prints the `--forms` value (`strata_jax.forms.Forms` fields) of the forms that
measured faster (the code defaults are then set to match; experiments/bench/README.md).

  python experiments/bench/pick_forms.py PREFILL_PROBE.json DECODE_PROBE.json
"""
import json
import sys


def rows(path):
  try:
    return {r["variant"]: r for r in json.load(open(path))["results"] if "error" not in r}
  except (OSError, ValueError, KeyError):
    return {}


def main():
  pre, dec = rows(sys.argv[1]), rows(sys.argv[2])
  forms = []
  ms = {k: v["ms"] for k, v in pre.items()}
  if "base" in ms:
    best = min(ms, key=ms.get)
    if "grouped" in best:
      forms.append("moe_many=grouped")
    if "fastgdn" in best:
      forms.append("gdn_chunked=products")
  st = {k: v["ms_per_step"] for k, v in dec.items()}
  need = ("base", "base@on", "base@off", "cond@on", "cond@off")
  if all(k in st for k in need):
    sel = (st["base@on"] - st["base"]) + (st["base@off"] - st["base"])
    cond = (st["cond@on"] - st["base"]) + (st["cond@off"] - st["base"])
    forms.append("lora_branch=" + ("cond" if cond < sel else "select"))
  print(",".join(forms))
  print(f"# prefill ms {ms}; decode ms/step {st}", file=sys.stderr)


if __name__ == "__main__":
  main()
