"""``expertcache calibrate``: this machine's tau (one expert copy) and c (compute per token) for a model."""

from __future__ import annotations

import argparse

from .._text import first_line
from ..errors import ConfigError
from .common import add_json, add_layers, emit_json, positive_int, samples_int, slow_copies_int

HELP = """Measure the cost model's two machine constants for a Hugging Face MoE checkpoint, on the
offload harness's own paths:

  tau  time of one expert copy into a device slot (pinned host -> device on a GPU, timed by events
       on the copy stream; host -> slot buffer on the CPU), one copy per sample;
  c    time of one decode step (one token, KV cache) with every expert resident.

Each is printed as the median and the 10th-90th percentile spread over --repeats samples, in
milliseconds; copy GB/s = expert bytes / median tau. Pass them to 'expertcache choose --tau' or
to the sizing options (--tau, --c) of replay / sweep. --slow-copies N times N repeated copies, as
'eval --slow-copies N' makes them.

--host (as 'eval --host') times the copy from where the experts live: memory (a copy out of
host memory), mmap (a copy out of the checkpoint's mapped file, every sampled expert read once
first: a page-cache hit) or direct (an O_DIRECT read of the file, then the copy: a device read).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure tau (one expert copy) and c (compute per token) on this machine",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (save_pretrained layout)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights dtype (default: the checkpoint's)")
    add_layers(p, "MoE layers whose experts are timed (default: all; the first one's experts are copied)")
    p.add_argument("--repeats", type=samples_int, default=30, metavar="N", help="samples of each (default 30)")
    p.add_argument("--tokens", type=positive_int, default=16, metavar="N",
                   help="tokens per decode sequence for c (default 16)")
    p.add_argument("--slow-copies", type=slow_copies_int, default=1, metavar="N",
                   help="time copies made N times each, as eval --slow-copies does (default 1)")
    p.add_argument("--host", choices=("memory", "mmap", "direct"), default="memory",
                   help="where the experts live between copies, as eval --host (default memory)")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        from ..hf import load_model
        from ..hf.calibrate import calibrate
    except ImportError as exc:
        raise ConfigError(first_line(exc)) from None
    model = load_model(args.model, device=args.device, dtype=args.dtype, host_layers=args.layers, host=args.host)
    result = calibrate(model, repeats=args.repeats, tokens=args.tokens, layers=args.layers,
                       slow_copies=args.slow_copies)
    record = {"model": args.model, **result.to_dict()}
    if args.json:
        emit_json([record])
        return 0
    r = result
    print(f"model {args.model} on {r.device} ({r.dtype}), expert {r.expert_bytes / 1e6:.2f} MB, host {r.host}"
          + (f" (samples served by the page cache {r.tau_tiers['page_cache']}, the device {r.tau_tiers['device']})"
             if r.tau_tiers else ""))
    print(f"tau  {r.tau_ms:.4f} ms per expert copy (p10 {r.tau_ms_p10:.4f}, p90 {r.tau_ms_p90:.4f}; "
          f"{r.tau_samples} copies{'' if r.slow_copies == 1 else f', each made {r.slow_copies} times'}): "
          f"{r.copy_gbps:.1f} GB/s")
    print(f"c    {r.c_ms:.3f} ms per token, all experts resident (p10 {r.c_ms_p10:.3f}, p90 {r.c_ms_p90:.3f}; "
          f"{r.c_samples} decode steps)")
    print(f"use: expertcache choose RUNS --tau {r.tau_ms:.4f}ms    (or --tau {r.tau_ms:.4f}ms --c {r.c_ms:.3f} on replay)")
    return 0
