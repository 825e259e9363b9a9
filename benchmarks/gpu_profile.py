"""Where an offloaded layer's time goes at C = E: the stock model, the stock model with one host
synchronisation per MoE layer, and the offloaded model with every expert resident.

gpu_check measured C = E at 0.695x the stock model on an H200 (docs/offload.md). Nothing is copied
at C = E, so the difference is the offloaded layer's own work per forward: reading the router's
choices on the host (a device-to-host copy that drains the queue) and the cache step in Python.
This script splits the two in one run, on gpu_check's checkpoint geometry:

* ``stock``: the model as transformers runs it (decode, one position per forward, KV cache);
* ``stock + sync``: the same model with a forward pre-hook on each experts module that copies the
  router's ``top_k_index`` to the host (what the offloaded layer does first), nothing else;
* ``C = E``: :func:`expertcache.load_offloaded` at ``capacity = E``, warm (no copies).

Each is timed over ``--tokens`` decode steps in ``--repeat`` interleaved rounds (the order rotated
each round, so a machine that drifts slows every run alike): median and min-max of the rounds, and
each round's stock/this speed ratio (a lead inside the spread is a tie), then profiled once with ``torch.profiler`` over a few steps
(the top operators by self CPU time, where the CUDA runtime's calls, ``cudaMemcpyAsync`` and
``cudaLaunchKernel``, show what the host waited on) and once with ``cProfile`` (the Python
functions' own time, which the operator table does not show).

``PYTHONPATH=src python3 benchmarks/gpu_profile.py [--out DIR]``; ``--small --device cpu`` runs
every step on a tiny model (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import transformers

from expertcache.hf import load_offloaded
from expertcache.hf.model import cache_argument
from expertcache.hf.toy import toy_config


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(model, ids, device, logits: list | None = None) -> float:
    """Seconds to decode ``ids`` one position per forward (KV cache), the device drained at both ends
    (``logits``: a list that receives each step's logits, outside the timing's purpose)."""
    key, cache = cache_argument(model), None
    x = torch.as_tensor(ids[None], device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(x.shape[1]):
            out = model(input_ids=x[:, i : i + 1], use_cache=True, **{key: cache})
            cache = out["cache"] if "cache" in out else out.get("past_key_values")
            if logits is not None:
                logits.append(out.logits[:, -1].float())
    sync(device)
    return time.perf_counter() - t0


def profiled(name, model, ids, device, out_dir, top):
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        decode(model, ids, device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    print(f"--- profile: {name} ({len(ids)} tokens), top {top} by self CPU time", flush=True)
    print(table, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, f"profile-{name.replace(' ', '').replace('+', '-').replace('=', '')}.txt"), "w") as fh:
            fh.write(table)


def python_profile(name, model, ids, device, out_dir, top):
    """The Python functions' own time over one decode (cProfile): what the CUDA profiler cannot see."""
    prof = cProfile.Profile()
    prof.enable()
    decode(model, ids, device)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    print(f"--- python profile: {name} ({len(ids)} tokens), top {top} by own time", flush=True)
    print(text, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, f"python-{name.replace(' ', '').replace('+', '-').replace('=', '')}.txt"), "w") as fh:
            fh.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="default: cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model (smoke test, e.g. on the CPU)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per timed pass")
    ap.add_argument("--repeat", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--profile-tokens", type=int, default=8, help="0: no profiles")
    ap.add_argument("--top", type=int, default=25, help="profiler rows printed")
    ap.add_argument("--out", default=None, help="a folder for the profiles and a JSON of the timings")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    hidden, inter, E, k, layers = (64, 32, 8, 2, 3) if args.small else (2048, 1024, 64, 8, 8)
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: error: no CUDA device (use --small --device cpu)", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    rows: list[dict] = []
    same, diff = None, None
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        cfg = toy_config("olmoe", hidden=hidden, intermediate=inter, experts=E, top_k=k, layers=layers,
                         heads=max(hidden // 128, 4), vocab=4096, positions=4096)
        torch.manual_seed(0)
        with torch.device(device if device.type == "cuda" else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        del model
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens)

        stock = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(device).eval()
        model, run = load_offloaded(tmp, capacity=E, device=device, dtype="bfloat16", reset="none")
        experts = [m for n, m in stock.named_modules() if n.endswith("mlp.experts")]

        def read_choices(module, args):  # the offloaded layer's first act; returns None: args unchanged
            args[1].detach().to("cpu", torch.int64)

        hooks: list = []

        def use_sync(on: bool) -> None:
            while hooks:
                hooks.pop().remove()
            if on:
                hooks.extend(m.register_forward_pre_hook(read_choices) for m in experts)

        runs = {"stock": (stock, False), "stock + sync": (stock, True), "C = E": (model, False)}
        for m, sync_on in runs.values():  # warm: the C = E pass fills its slots here
            use_sync(sync_on)
            decode(m, ids, device)
        copies_warm = run.stats().copies_total
        ref, got = [], []
        use_sync(False)
        decode(stock, ids, device, ref)
        decode(model, ids, device, got)
        diff = float((torch.stack(got) - torch.stack(ref)).abs().max())
        same = all(torch.equal(a, b) for a, b in zip(got, ref))
        print(f"C = E against stock over {len(ids)} decode steps: bitwise {'equal' if same else 'different'}, "
              f"max |dlogit| {diff:.3g}", flush=True)
        # interleaved rounds, the order rotated each round, so a machine that drifts slows every run alike
        ms = {name: [] for name in runs}
        names = list(runs)
        for r in range(args.repeat):
            for name in names[r % 3:] + names[: r % 3]:
                m, sync_on = runs[name]
                use_sync(sync_on)
                ms[name].append(1000.0 * decode(m, ids, device) / len(ids))
        use_sync(False)
        for name, xs in ms.items():
            paired = sorted(ms["stock"][i] / x for i, x in enumerate(xs))
            row = {"run": name, "ms_per_token": statistics.median(xs), "min": min(xs), "max": max(xs),
                   "repeats": len(xs), "x_stock_speed_paired": statistics.median(paired),
                   "x_stock_speed_min": paired[0], "x_stock_speed_max": paired[-1]}
            rows.append(row)
            print(f"{name:<14} {row['ms_per_token']:8.3f} ms/token [{row['min']:.3f}-{row['max']:.3f}]; "
                  f"stock/this per round {row['x_stock_speed_paired']:.3f}x [{paired[0]:.3f}-{paired[-1]:.3f}] "
                  f"({len(xs)} rounds)", flush=True)
        print(f"copies in the timed C = E passes: {run.stats().copies_total - copies_warm} "
              f"({copies_warm} cold fills in the warm pass)", flush=True)
        if args.profile_tokens:
            for name, (m, sync_on) in runs.items():
                use_sync(sync_on)
                profiled(name, m, ids[: args.profile_tokens], device, args.out, args.top)
            use_sync(False)
            python_profile("stock", stock, ids, device, args.out, args.top)
            python_profile("C = E", model, ids, device, args.out, args.top)
    print("summary: " + ", ".join(f"{r['run']} {r['ms_per_token']:.2f} ms ({r['x_stock_speed_paired']:.3f}x)" for r in rows))
    if args.out:
        with open(os.path.join(args.out, "gpu_profile.json"), "w", encoding="utf-8") as fh:
            json.dump({"layers": layers, "experts": E, "top_k": k, "tokens": args.tokens, "rows": rows,
                       "c_equals_e_bitwise_equal": same, "c_equals_e_max_abs_logit_diff": diff}, fh, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
