"""`strata-jax` command line: generate, convert, serve."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _lora_args(p):
  # Each flag occurrence is one numbered adapter (0, 1, ... in command-line order); the files
  # of one occurrence, comma-separated, stack into one set (docs/adapters.md).
  p.add_argument("--lora", dest="lora_groups", action="append", type=lambda v: ("plain", v),
                 metavar="F[,F...]", help="adapter GGUF file(s); repeat the flag for numbered "
                 "adapters, comma-separate files to stack them into one")
  p.add_argument("--lora-scaled", dest="lora_groups", action="append",
                 type=lambda v: ("scaled", v), metavar="F:S[,F:S...]",
                 help="adapter file(s) with scales (one file: its default scale)")
  p.add_argument("--lora-off", action="store_true",
                 help="load the adapters, run with the switch off")


def _control_vector_args(p):
  # llama.cpp's flags; both file flags append to one list, so the files keep their order.
  p.add_argument("--control-vector", dest="control_vectors", action="append",
                 type=lambda v: ("plain", v), metavar="F[,F...]",
                 help="control vector GGUF file(s) (llama.cpp's format), scale 1")
  p.add_argument("--control-vector-scaled", dest="control_vectors", action="append",
                 type=lambda v: ("scaled", v), metavar="F:S[,F:S...]",
                 help="control vector file(s) with scales")
  p.add_argument("--control-vector-layer-range", nargs=2, type=int, default=None,
                 metavar=("START", "END"),
                 help="layers the control vectors apply to, inclusive (default: all)")


def _model_args(p):
  p.add_argument("--model", default=None, help="model GGUF (default: the embedded demo model)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--layer-split", default=None, help="auto | N1,N2,... layers per stage")
  p.add_argument("--split-devices", default=None, help="device indices for the stages: 0,1,...")
  p.add_argument("--weights", default="keep", choices=["keep", "dequantize"],
                 help="keep: Q8_0/Q4_K/Q5_K/Q6_K weights stay quantised on the device (other "
                      "types are dequantised at load); dequantize: all in the compute dtype")
  p.add_argument("--forms", default="", metavar="NAME=VALUE[,...]",
                 help="implementation choices (strata_jax.forms.Forms), e.g. "
                      "lora_branch=select,gdn_chunked=products; default: each 'auto'")
  _lora_args(p)
  _control_vector_args(p)
  p.add_argument("--spec", type=int, default=0, metavar="N",
                 help="speculative decoding: N draft tokens per step, 0..16 (0: off)")
  p.add_argument("--draft", default=None, metavar="mtp|ngram",
                 help="drafter: mtp (the model's MTP layer; the default when it has one) or "
                      "ngram (prompt lookup)")


class _Parser(argparse.ArgumentParser):
  """argparse with the contract's error line: a usage mistake prints `error: <message>` on
  stderr (argparse's own form is the usage block and `prog: error: ...`) and exits 2."""

  def error(self, message):
    sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
  ap = _Parser(prog="strata-jax", description=__doc__)
  sub = ap.add_subparsers(dest="cmd", required=True)
  g = sub.add_parser("generate", help="generate text or tokens from a prompt")
  _model_args(g)
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", default=None)
  src.add_argument("--prompt-tokens", default=None, help="comma-separated token ids")
  g.add_argument("-n", type=int, default=32, help="tokens to generate")
  g.add_argument("--temperature", type=float, default=0.0)
  g.add_argument("--top-k", type=int, default=0, help="0 = off")
  g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  g.add_argument("--min-p", type=float, default=0.0, help="0 = off")
  g.add_argument("--presence-penalty", type=float, default=0.0,
                 help="llama.cpp's, over the last 64 tokens; 0 = off")
  g.add_argument("--frequency-penalty", type=float, default=0.0, help="as --presence-penalty")
  g.add_argument("--repeat-penalty", type=float, default=1.0, help="as llama.cpp; 1 = off")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--logprobs", type=int, default=None, metavar="K",
                 help="--json adds each token's logprob and the K most likely (K <= 20)")
  g.add_argument("--json", action="store_true", help="print one JSON object")
  g.add_argument("--dump-logits", default=None, metavar="OUT.npz")

  c = sub.add_parser("convert", help="convert transformers / PEFT checkpoints to GGUF")
  csub = c.add_subparsers(dest="what", required=True)
  ch = csub.add_parser("hf", help="transformers Qwen3-Next checkpoint -> model GGUF")
  ch.add_argument("hf_dir")
  ch.add_argument("out")
  ch.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16"])
  cp = csub.add_parser("peft", help="PEFT LoRA -> llama.cpp adapter GGUF")
  cp.add_argument("peft_dir")
  cp.add_argument("out")
  cp.add_argument("--base", required=True, help="the base transformers checkpoint dir")
  cp.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16"])

  s = sub.add_parser("serve", help="OpenAI / Anthropic compatible HTTP server")
  _model_args(s)
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--port", type=int, default=8080)
  s.add_argument("--slots", type=int, default=4)
  s.add_argument("--slot-save-path", default=None)
  s.add_argument("--config", default=None, help="JSON server config file")
  s.add_argument("--ctx-size", type=int, default=4096)
  s.add_argument("--lora-rank", type=int, default=None, metavar="R",
                 help="rank columns to reserve for adapters (hot loads within it compile "
                      "nothing new; default: the loaded adapters' total, rounded up to 64)")
  return ap


def cmd_generate(args) -> int:
  import numpy as np  # noqa: PLC0415

  import strata_jax as sj  # noqa: PLC0415
  from strata_jax.engine.engine import Request  # noqa: PLC0415
  from strata_jax.engine.sampling import check  # noqa: PLC0415
  from strata_jax.errors import RequestError  # noqa: PLC0415
  from strata_jax.loading import control_vector_from_args, load_from_args  # noqa: PLC0415
  from strata_jax.speculative import check_spec  # noqa: PLC0415
  check_spec(args.spec, None, True)          # the range, before the model loads
  if args.dump_logits:   # where it goes, before any work
    where = os.path.dirname(os.path.abspath(args.dump_logits))
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
      raise RequestError(f"--dump-logits {args.dump_logits}: cannot write in {where}")
  check(Request(tokens=[0], temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, repeat_penalty=args.repeat_penalty,
                seed=args.seed, logprobs=args.logprobs),   # before the model is read
        names={f: "--" + f.replace("_", "-") for f in (
            "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repeat_penalty", "seed", "logprobs")})
  model, lora = load_from_args(args)
  cvec = control_vector_from_args(args, model)
  if args.prompt_tokens is not None:
    try:
      ids = [int(t) for t in args.prompt_tokens.split(",") if t.strip()]
    except ValueError:
      raise RequestError(
          f"--prompt-tokens {args.prompt_tokens!r}: expected ids like 1,2,3") from None
  else:
    ids = model.encode(args.prompt)
  if args.n < 1:
    raise RequestError(f"-n must be >= 1, got {args.n}")
  use_lora = bool(lora) and not args.lora_off
  # A power-of-two capacity: repeat runs with other prompt lengths reuse the compiled program.
  need = len(ids) + args.n + 1
  engine = sj.Engine(model, lora=lora, slots=1, max_seq=max(256, 1 << (need - 1).bit_length()),
                     control_vector=cvec, spec=args.spec, draft=args.draft)
  stop = model.stop_ids()   # end-of-generation tokens end the run, as in llama.cpp and transformers
  res = engine.generate(tokens=ids, max_tokens=args.n, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        repeat_penalty=args.repeat_penalty, seed=args.seed, stop=stop,
                        lora=use_lora, logprobs=args.logprobs,
                        return_logits=bool(args.dump_logits))
  if not _is_output_process():
    return 0
  if args.dump_logits:
    # the path as given (savez would add ".npz"), written whole or not at all: a file already
    # there is replaced only once the new one is complete
    part = args.dump_logits + ".part"
    try:
      with open(part, "wb") as f:
        np.savez(f, prompt=res.prompt_logits.astype(np.float32),
                 prompt_last=res.prompt_logits[-1].astype(np.float32),
                 steps=res.step_logits.astype(np.float32))
      os.replace(part, args.dump_logits)
    finally:
      if os.path.exists(part):
        os.remove(part)
  text = res.text or ""
  if args.json:
    out = {"prompt_tokens": ids, "tokens": res.tokens, "text": text, "lora": bool(use_lora)}
    if res.logprobs is not None:   # "top" keys are the ids as strings (JSON object keys)
      out["logprobs"] = [{"token": e["token"], "logprob": e["logprob"],
                          "top": {str(k): v for k, v in e["top"].items()}}
                         for e in res.logprobs]
    if res.draft is not None:
      out["draft"] = res.draft
    print(json.dumps(out))
  else:
    print(text if model.tokenizer is not None else " ".join(map(str, res.tokens)))
  return 0


def cmd_convert(args) -> int:
  if args.what == "hf":
    from strata_jax.gguf.convert_hf import convert_hf  # noqa: PLC0415
    convert_hf(args.hf_dir, args.out, outtype=args.outtype)
  else:
    from strata_jax.gguf.convert_peft import convert_peft  # noqa: PLC0415
    convert_peft(args.peft_dir, args.base, args.out, outtype=args.outtype)
  print(f"wrote {args.out}", file=sys.stderr)
  return 0


# What `pip install 'strata-jax[serve]'` adds (fastapi brings starlette and pydantic).
_SERVE_EXTRA = ("fastapi", "uvicorn", "starlette", "pydantic")


def cmd_serve(args) -> int:
  import jax  # noqa: PLC0415

  from strata_jax.errors import StrataError  # noqa: PLC0415
  if jax.process_count() > 1:
    # One HTTP front would have to replay every request on every process; not built.
    raise StrataError("serve across processes (STRATA_COORDINATOR) is not supported; "
                      "use generate, or serve from one host")
  try:
    import uvicorn  # noqa: F401, PLC0415 (here, so a missing server stack is named at once)

    from strata_jax.serve.app import serve_main  # noqa: PLC0415
  except ModuleNotFoundError as e:
    missing = (e.name or "").split(".")[0]
    if missing not in _SERVE_EXTRA:
      raise
    raise StrataError(f"strata-jax serve needs the 'serve' extra ({missing} is not installed): "
                      "pip install 'strata-jax[serve]'") from None
  return serve_main(args)


def _compilation_cache():
  """JAX's persistent compilation cache (STRATA_JAX_CACHE, default ~/.cache/strata-jax/xla;
  "0" disables): repeat runs start fast, and every process on a machine runs the same
  executable for a program (GPU autotuning is not re-run, so numbers repeat exactly)."""
  d = os.environ.get("STRATA_JAX_CACHE", os.path.expanduser("~/.cache/strata-jax/xla"))
  if d and d != "0":
    import jax  # noqa: PLC0415
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _distributed():
  """Several hosts: with STRATA_COORDINATOR=host:port, STRATA_NUM_PROCESSES and
  STRATA_PROCESS_ID (and optionally STRATA_TRANSFER_ADDRESS) set, join the jax.distributed
  cluster before anything else; every process then runs the same command, `--split-devices`
  indexes the global device list, and only process 0 writes output."""
  coord = os.environ.get("STRATA_COORDINATOR")
  if not coord:
    return
  from strata_jax.errors import StrataError  # noqa: PLC0415
  from strata_jax.parallel import distributed  # noqa: PLC0415
  try:
    n, pid = int(os.environ["STRATA_NUM_PROCESSES"]), int(os.environ["STRATA_PROCESS_ID"])
  except (KeyError, ValueError):
    raise StrataError("STRATA_COORDINATOR is set: STRATA_NUM_PROCESSES and STRATA_PROCESS_ID "
                      "must be integers too") from None
  distributed.initialize(coord, n, pid, os.environ.get("STRATA_TRANSFER_ADDRESS"))


def _is_output_process() -> bool:
  import jax  # noqa: PLC0415
  return jax.process_index() == 0


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  from strata_jax.errors import StrataError  # noqa: PLC0415
  try:
    _distributed()
  except StrataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _compilation_cache()
  import logging  # noqa: PLC0415
  logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
  logging.getLogger("strata_jax").setLevel(logging.INFO)
  try:
    return {"generate": cmd_generate, "convert": cmd_convert, "serve": cmd_serve}[args.cmd](args)
  except (StrataError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
