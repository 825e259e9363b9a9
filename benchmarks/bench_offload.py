"""Offloaded experts against the stock model, measured in the same run.

A random-weight OLMoE-family model in which the expert matmuls dominate (hidden 1024, 64 experts,
top-8, expert intermediate 1024, i.e. 12.6 MB per expert in fp32, the size of an OLMoE-1B-7B expert
in bf16; 2 MoE layers), built from ``OlmoeConfig``. Teacher-forced decoding, one token per forward
with a KV cache (``--mode forward``: one forward per sequence), batch 1.

1. tokens/s of the stock model (every expert resident, the model's own experts implementation)
   and of the offloaded path at C = E with warm pools (``reset="none"``, filled by a warm-up pass
   over the same sequences, so no copy is left: this isolates what the slot path itself costs per
   token), measured alternately ``--repeat`` times; the best of each is compared (target >= 0.95x);
2. C = E as the evaluation runs it, every pool emptied at each sequence: the fill copies
   (each expert a sequence touches is copied once) are now part of the time;
3. C = E/2 under LRU, pools emptied at each sequence: tokens/s, copies per token (fill and steady),
   copy time per token and the bandwidth of this machine's copy path (host -> device on a GPU,
   host -> host on a CPU-only machine).

The output says where it ran (device, CPU, threads, torch / transformers versions).
Run: ``python benchmarks/bench_offload.py [--tokens N] [--repeat R] [--threads T] [--mode decode|forward]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import numpy as np
import torch
import transformers

import expertcache
from expertcache.hf.passes import run_pass
from expertcache.hf.toy import toy_model


def where(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu ({cpu}, {torch.get_num_threads()} torch threads)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens per sequence (default 48)")
    ap.add_argument("--sequences", type=int, default=2, help="sequences per measurement (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="alternating measurements of stock and C=E (default 3)")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers, all offloaded (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--mode", choices=("decode", "forward"), default="decode")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    E, k = 64, 8
    model = toy_model("olmoe", hidden=1024, intermediate=1024, experts=E, top_k=k, layers=args.layers,
                      heads=16, vocab=1024).to(device)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1024, args.tokens) for _ in range(args.sequences)]
    expert_mb = 3 * 1024 * 1024 * model.dtype.itemsize / 1e6

    def stock():
        return run_pass(model, seqs, args.mode)

    def offloaded(capacity, warm_pools=False):
        with expertcache.offload(model, capacity=capacity, policy="lru", reset="none" if warm_pools else "sequence") as run:
            if warm_pools:
                run_pass(model, seqs, args.mode)  # fills the pools with every expert these sequences use
                run.clear_counters()
            else:
                run_pass(model, seqs[:1], args.mode)  # warm-up: code paths, first copies
                run.rewind()
            result = run_pass(model, seqs, args.mode)
        return result, run.stats()

    run_pass(model, seqs[:1], args.mode)  # global warm-up
    stock_runs, warm_runs = [], []
    for _ in range(args.repeat):
        stock_runs.append(stock().tokens_per_s)
        warm, warm_stats = offloaded(E, warm_pools=True)
        warm_runs.append(warm.tokens_per_s)
    full, full_stats = offloaded(E)
    half, half_stats = offloaded(E // 2)
    best_stock = max(stock_runs)
    report = {
        "where": where(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "mode": args.mode,
        "model": f"olmoe random weights, hidden 1024, E={E}, k={k}, expert intermediate 1024, "
                 f"{args.layers} MoE layers offloaded, {model.dtype}",
        "expert_mb": expert_mb,
        "tokens": sum(len(s) for s in seqs),
        "stock_tokens_per_s": best_stock,
        "warm_full_tokens_per_s": max(warm_runs),
        "warm_full_vs_stock": max(warm_runs) / best_stock,
        "warm_full_copies": warm_stats.copies_total,
        "full_tokens_per_s": full.tokens_per_s,
        "full_vs_stock": full.tokens_per_s / best_stock,
        "full_fill_copies_per_token": full_stats.copies_fill / full_stats.tokens,
        "half_capacity": E // 2,
        "half_tokens_per_s": half.tokens_per_s,
        "half_vs_stock": half.tokens_per_s / best_stock,
        "half_copies_per_token": half_stats.copies_per_token,
        "half_fill_copies_per_token": half_stats.copies_fill / half_stats.tokens,
        "half_copy_ms_per_token": 1e3 * half_stats.copy_seconds / half_stats.tokens,
        "copy_gb_per_s": half_stats.copy_bandwidth / 1e9,
        "stock_runs": stock_runs,
        "warm_full_runs": warm_runs,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"ran on {report['where']}; torch {report['torch']}, transformers {report['transformers']}")
    print(f"model: {report['model']} ({expert_mb:.1f} MB per expert); {args.mode}, {report['tokens']} tokens per measurement")
    runs = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    print(f"stock (all experts resident)        {best_stock:8.2f} tokens/s  (best of {args.repeat}: {runs(stock_runs)})")
    print(f"offloaded C=E={E}, warm pools        {report['warm_full_tokens_per_s']:8.2f} tokens/s  (best of {args.repeat}: "
          f"{runs(warm_runs)}) = {report['warm_full_vs_stock']:.3f}x stock (target >= 0.95x), "
          f"{report['warm_full_copies']} copies")
    print(f"offloaded C=E={E}, empty per seq.    {report['full_tokens_per_s']:8.2f} tokens/s  = {report['full_vs_stock']:.3f}x stock; "
          f"{report['full_fill_copies_per_token']:.2f} fill copies/token")
    print(f"offloaded C=E/2={E // 2} (lru)           {report['half_tokens_per_s']:8.2f} tokens/s  = {report['half_vs_stock']:.3f}x stock; "
          f"{report['half_copies_per_token']:.2f} steady + {report['half_fill_copies_per_token']:.2f} fill copies/token, "
          f"{report['half_copy_ms_per_token']:.2f} ms of copies/token, {report['copy_gb_per_s']:.2f} GB/s copy path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
