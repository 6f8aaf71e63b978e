"""Speculative decoding on the embedded demo model, on CPU: `--spec 3` against `--spec 0`.

  python experiments/demo_model/spec_demo.py            # -> experiments/results/demo_spec.json

Through `Engine` (what `strata-jax generate` runs), greedy, one request at a time, the same
prompts for each setting: decode tokens/s (the median over prompts; the settings' passes
interleaved `--reps` times, the median of those; after an untimed pass over the same prompts
that compiles every program the timed ones run), the drafts' acceptance (accepted /
proposed, summed over prompts), and whether the tokens equal plain decoding's (they must:
greedy speculation is lossless). Rows: the MTP head at each `--rounds` value
(`Engine(spec_rounds=)`: greedy MTP rounds run back to back in one program) and prompt lookup
(`ngram`), adapter off and on (the head is never adapted, so with the adapter on it drafts the
base model's text). Prints a Markdown table and the summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)

PROMPTS = ("The function returns", "This module provides", "Return a new",
           "<|im_start|>user\nTell me something.<|im_end|>\n<|im_start|>assistant\n",
           "In the beginning", "If the argument is")


def run(engine, model, prompts, n, spec, lora, temperature=0.0):
  from strata_jax.engine.engine import Request
  rates, toks, prop, acc = [], [], 0, 0
  for i, p in enumerate(prompts):
    r = engine.run([Request(tokens=model.encode(p), max_tokens=n, lora=lora, spec=spec,
                            temperature=temperature, top_p=0.95, seed=i)])[0]
    rates.append(r.decode_tokens_per_s)
    toks.append(r.tokens)
    if r.draft:
      prop, acc = prop + r.draft["proposed"], acc + r.draft["accepted"]
  return statistics.median(rates), toks, prop, acc


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default=None, help="default: the embedded demo model")
  ap.add_argument("-n", type=int, default=96, help="tokens generated per prompt")
  ap.add_argument("--spec", type=int, default=3)
  ap.add_argument("--rounds", default="1,4",
                  help="Engine(spec_rounds=) values timed for the MTP drafter (greedy MTP "
                       "rounds a dispatch at most); prompt lookup runs one round a dispatch")
  ap.add_argument("--reps", type=int, default=3, help="interleaved timed passes per setting")
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="> 0: sampled rows (top-p 0.95, seed = the prompt's index), whose "
                       "tokens are not compared with plain decoding's (same_tokens: null)")
  ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "demo_spec.json"))
  args = ap.parse_args(argv)

  import jax

  import strata_jax as sj
  model = sj.load_model(args.model)
  lora = sj.load_lora(model, [sj.api.asset_path("demo-lora.gguf")])
  rows = []
  drafts = ["mtp", "ngram"] if model.params.mtp is not None else ["ngram"]
  settings = [(d, r, on) for d in drafts
              for r in ([int(x) for x in args.rounds.split(",")] if d == "mtp" else [1])
              for on in (False, True)]
  engines = {(d, r): sj.Engine(model, lora=lora, slots=1, max_seq=512, prefix_cache_bytes=0,
                               draft=d, spec_rounds=r) for d, r, _ in settings}
  for d, r, on in settings:   # compile every program (each rounds bucket) the timed passes run
    for spec in (0, args.spec):
      run(engines[d, r], model, PROMPTS, args.n, spec, on, args.temperature)
  # the settings interleaved, --reps times (this machine's speed drifts over minutes)
  samples = {s: [] for s in settings}
  for _ in range(args.reps):
    for d, r, on in settings:
      eng = engines[d, r]
      base_rate, base_toks, _, _ = run(eng, model, PROMPTS, args.n, 0, on, args.temperature)
      t0 = time.perf_counter()
      rate, toks, prop, acc = run(eng, model, PROMPTS, args.n, args.spec, on, args.temperature)
      samples[d, r, on].append((base_rate, rate, toks == base_toks, prop, acc,
                                time.perf_counter() - t0))
  for (d, r, on), got in samples.items():
    base_rate = statistics.median(g[0] for g in got)
    rate = statistics.median(g[1] for g in got)
    prop, acc = got[0][3], got[0][4]
    rows.append({"draft": d, "spec_rounds": r, "adapter": on, "spec": args.spec,
                 "tok_s_spec0": round(base_rate, 1), "tok_s_spec": round(rate, 1),
                 "speedup": round(rate / base_rate, 3),
                 "speedups": [round(g[1] / g[0], 3) for g in got],
                 "proposed": prop, "accepted": acc,
                 "acceptance": round(acc / prop, 3) if prop else None,
                 "temperature": args.temperature,
                 "same_tokens": all(g[2] for g in got) if not args.temperature else None,
                 "wall_s": round(statistics.median(g[5] for g in got), 2)})
    print(rows[-1], flush=True)
  head = (f"| drafter | rounds a dispatch | adapter | tok/s `--spec 0` | "
          f"tok/s `--spec {args.spec}` | speed-up | acceptance | same tokens |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
  lines = [f"| {r['draft']} | {r['spec_rounds']} | {'on' if r['adapter'] else 'off'} | "
           f"{r['tok_s_spec0']} | "
           f"{r['tok_s_spec']} | {r['speedup']}x | {r['acceptance']} | {r['same_tokens']} |"
           for r in rows]
  print("\n".join([head, *lines]))
  details = {"model": model.path, "jax": jax.__version__, "backend": jax.default_backend(),
             "n": args.n, "prompts": list(PROMPTS), "rows": rows,
             "command": "python experiments/demo_model/spec_demo.py "
                        + " ".join(argv or sys.argv[1:])}
  with open(args.out, "w") as f:
    json.dump(details, f, indent=1)
  best = max(rows, key=lambda r: r["speedup"])
  print(f"summary: spec {args.spec} on the demo model, best {best['draft']} "
        f"(rounds a dispatch {best['spec_rounds']}) adapter "
        f"{'on' if best['adapter'] else 'off'}: {best['speedup']}x, acceptance "
        f"{best['acceptance']}, all tokens equal plain greedy: "
        f"{all(r['same_tokens'] for r in rows) if not args.temperature else 'n/a (sampled)'}")


if __name__ == "__main__":
  main()
