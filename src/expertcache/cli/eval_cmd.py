"""``expertcache eval``: a Hugging Face MoE checkpoint with offloaded experts, one pass per policy.

torch and transformers are imported only when the command runs, so the rest of the CLI works
without them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from ..costmodel.runs import HOSTS
from ..formats.safetensors import checkpoint_files
from ..policies import available_policies
from .common import (add_json, add_layers, byte_size, check_out, emit_json, nonnegative_float, positive_int,
                     resamples_int, samples_int, seed_int, slow_copies_int, table)
from .inputs import check_checkpoint, import_hf, read_text, read_tokens

HELP = """Teacher-force token sequences through a Hugging Face MoE checkpoint whose experts live in host
memory behind CAPACITY device slots per offloaded layer, once per policy, and compare each run
with the all-resident reference.

Per policy: next-token NLL and the reference NLL (all experts resident), 'exact' when they agree
within --tolerance (a lossless policy that misses fails the command with exit status 1; the
set-holding policies dwell:k[:w], prefix:P and the learned controller controller:HEADS:THR[:W]
(docs/controller.md) restrict routing to the experts they hold and report their dNLL), copies (fill = those that first fill each sequence's empty pool, steady = the
rest; copies/token = steady copies over all offloaded layers / tokens), the switch rate (token
steps whose chosen expert set changed), tokens/s (CUDA events on a GPU, perf_counter on the CPU),
copy time, and whether the copies equal a replay of the run's own captured trace. --json records
carry c_ms, rho and dnll for 'expertcache choose'; --slow-copies N repeats every copy N times.

--mode decode feeds one token per forward with a KV cache (token-by-token decoding, as in the
seeds' harness); --mode forward runs one forward per sequence, in which every offloaded layer
still serves its tokens one cache step at a time: both make the same copies. Clairvoyant policies
(belady, foresight:h) read the future from the reference pass's trace, which --capture saves.

Loading: the checkpoint is read into host memory and the offloaded layers' experts stay there
(page-locked on a GPU); only the rest of the model goes to the device, so a model larger than the
GPU can be evaluated. Peak device memory per policy is reported (CUDA). --reference resident
moves the experts to the device for the reference pass only; --reference offloaded runs the
reference offloaded under lru (lossless; for experts that do not fit the device); auto picks.

--prefetch next-layer (decode mode) loads the next offloaded layer's predicted experts while this
layer computes (lossless; counted apart: prefetch copies = used + wasted + pending); --prefetch
oracle reads them from the reference trace (an upper bound). --batch B decodes B sequences of
equal length together: one cache step per layer per position over the union of the rows' experts.
--pool global shares CAPACITY slots among all offloaded layers (decode mode), as replay --pool global.
Timing per step (ms/token) is compared with the blocking sum c + rho*tau and the overlapped bound
max(c, rho*tau), c being the reference's time per step and tau the measured time of one copy.

--host says where the offloaded experts live between copies: memory (default: loaded into host
memory), mmap (left in the checkpoint's safetensors files, copied on a miss from a read-only
mapping: the page cache is the host tier) or direct (read on a miss with O_DIRECT: every miss
pays the device). Each record reports where each request was served (tier_hits: slot, host
memory, page cache, device) and this process's own read_bytes from /proc/self/io.
--repeats N runs the reference and every policy N times, interleaved, and reports the median
round's timings with each round's ms/token and the spread (max - min) / median.
A capacity at or above the experts per layer holds every expert: it is clamped (a note says so).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate policies live on a Hugging Face MoE checkpoint", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (save_pretrained layout)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", metavar="IDS.npy",
                     help="token ids: a 1-d stream cut into --max-len sequences, or a 2-d [sequences, tokens] array")
    src.add_argument("--text", metavar="FILE", help="UTF-8 text, tokenized with the checkpoint's tokenizer")
    p.add_argument("--capacity", "-c", type=positive_int, required=True, help="device slots per offloaded layer")
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=f"repeatable; lossless: {', '.join(available_policies())}; set-holding (lossy): dwell:k[:w], "
                        "prefix:P, controller:HEADS.pt:THR[:W] (default: lru and belady)")
    add_layers(p, "MoE layer ids to offload")
    p.add_argument("--max-len", type=positive_int, default=384, metavar="N", help="tokens per sequence (default 384)")
    p.add_argument("--max-sequences", type=positive_int, default=None, metavar="N", help="evaluate at most N sequences")
    p.add_argument("--mode", choices=("decode", "forward"), default="decode",
                   help="one token per forward with a KV cache (default), or one forward per sequence")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--prefetch", choices=("none", "next-layer", "oracle"), default="none",
                   help="copy the next offloaded layer's experts ahead of demand (decode mode; default none)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B",
                   help="decode B equal-length sequences together, one cache step over their union (default 1)")
    p.add_argument("--slow-copies", type=slow_copies_int, default=1, metavar="N",
                   help="make every copy N times, counted once: emulates an N times slower link (default 1)")
    p.add_argument("--pool", choices=("layer", "global"), default="layer",
                   help="CAPACITY slots per offloaded layer (default), or shared by all of them (decode mode)")
    p.add_argument("--reference", choices=("auto", "resident", "offloaded"), default="auto",
                   help="reference pass with every expert on the device, or offloaded under lru (default auto)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights dtype (default: the checkpoint's)")
    p.add_argument("--capture", metavar="OUT.npz", help="save the reference pass's router trace (canonical .npz)")
    p.add_argument("--router-probs", action="store_true", help="include the full router softmax in --capture")
    p.add_argument("--host", choices=HOSTS, default="memory",
                   help="where offloaded experts live between copies: memory (default), mmap (the checkpoint's "
                        "files through the page cache) or direct (O_DIRECT reads: every miss pays the device)")
    p.add_argument("--repeats", type=samples_int, default=1, metavar="N",
                   help="run the reference and each policy N times, interleaved; timings: the median round, "
                        "with each round's ms/token and the spread (default 1; at most 10,000)")
    p.add_argument("--memory-wall", type=byte_size("--memory-wall"), default=None, metavar="SIZE",
                   help="run behind the tier's memory wall (a memory cgroup): the page cache holding experts "
                        "(--host mmap) gets at most SIZE, e.g. 400MB; the record carries the wall's proof")
    p.add_argument("--headroom", type=byte_size("--headroom"), default=None, metavar="SIZE",
                   help="with --memory-wall: the most the wall's limit follows the process's own memory to, above "
                        "SIZE (default 4 GiB, within what the machine can give)")
    p.add_argument("--bootstrap", type=resamples_int, default=0, metavar="N",
                   help="N bootstrap resamples of the sequences give each policy a 95%% interval of its dnll "
                        "(dnll_ci; paired: every policy on the same resamples; default 0: none)")
    p.add_argument("--bootstrap-seed", type=seed_int, default=0, help="seed of the resamples (default 0)")
    p.add_argument("--tolerance", type=nonnegative_float, default=5e-3, metavar="NATS",
                   help="largest |nll - nll_reference| a lossless policy may show (default 5e-3)")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    check_out(args.capture, "--capture")
    if args.headroom is not None and args.memory_wall is None:
        raise ConfigError("--headroom needs --memory-wall")
    check_checkpoint(args.model, "--model")  # before torch and transformers are imported: a bad folder is quick
    hf = import_hf()
    if args.memory_wall is not None:
        return _run_walled(args)
    ids = read_tokens(args.tokens) if args.tokens else read_text(args.model, args.text)  # inputs first: cheap
    model = hf.load_model(args.model, device=args.device, dtype=args.dtype, host_layers=args.layers, host=args.host)
    sequences = hf.split_tokens(ids, args.max_len, args.max_sequences, hf.positions(model))
    fits = hf.fitting_capacity(model, args.capacity, args.layers, args.pool)
    if fits < args.capacity:  # before the long passes, on stderr so --json stays a clean stream
        what = "experts of each offloaded layer" if args.pool == "layer" else "experts of the offloaded layers together"
        print(f"expertcache eval: note: capacity {args.capacity} is at or above the {fits} {what}: every expert fits; "
              f"clamped to {fits} (no steady copies, only each sequence's fill)", file=sys.stderr)
    evaluation = hf.evaluate(
        model, sequences, args.capacity, args.policies or ["lru", "belady"], args.layers,
        mode=args.mode, tolerance=args.tolerance, router_probs=args.router_probs,
        progress=sys.stderr.isatty() and not args.json, batch=args.batch, prefetch=args.prefetch,
        reference=args.reference, pool=args.pool, slow_copies=args.slow_copies, repeats=args.repeats,
        bootstrap=args.bootstrap, bootstrap_seed=args.bootstrap_seed,
    )
    if evaluation.dropped:
        print(f"expertcache eval: warning: --batch {args.batch} leaves out the last {evaluation.dropped} sequence(s): "
              "they do not fill a batch of equal-length rows", file=sys.stderr)
    records = [r.to_dict() | {"model": args.model, "num_experts": evaluation.trace.num_experts,
                              "needs_future": r.stats.needs_future, "capacity_requested": args.capacity}
               for r in evaluation.results]
    if args.json:
        emit_json(records)
    else:
        _print_table(args, evaluation, records)
    if args.capture:  # after the results, so that a capture that cannot be written does not lose them
        evaluation.trace.save(args.capture)
        if not args.json:
            print(f"trace of the reference pass saved to {args.capture}")
    failures = evaluation.failures()
    for line in failures:
        print(f"expertcache eval: error: {line}", file=sys.stderr)
    return 1 if failures else 0


def _print_table(args, evaluation, records) -> None:
    first = records[0]
    layers = ",".join(map(str, first["layers"]))
    print(
        f"model {args.model}: {first['sequences']} sequence(s), {first['tokens']} tokens, mode {first['mode']}, "
        f"device {first['device']}; " + (
            f"capacity {first['capacity']} of {evaluation.trace.num_experts} experts per layer in layers {layers}"
            if args.pool == "layer" else
            f"capacity {first['capacity']} slots shared by layers {layers} ({evaluation.trace.num_experts} experts each)"
        ) + f"; host {first['host']}" + (f"; {first['repeats']} interleaved rounds" if first["repeats"] > 1 else "")
    )
    ref = evaluation.reference
    kind = "all experts resident" if evaluation.reference_kind == "resident" else evaluation.reference_kind
    print(f"reference ({kind}): nll {ref.nll:.5f}, {ref.tokens_per_s:.1f} tokens/s, {ref.ms_per_step:.3f} ms/token")
    agree = {True: "yes", False: "NO", None: "n/a"}
    rows = [
        (r["policy"], "yes" if r["needs_future"] else "", r["nll"], r["nll_delta"],
         ("yes" if r["exact"] else "NO") if r["lossless"] else "lossy",
         r["copies_per_token"], r["copies_steady"], r["copies_total"], r["switch_rate"], r["tokens_per_s"],
         r["speed_vs_reference"], r["ms_per_token"], r["ms_blocking"], r["ms_overlapped"], agree[r["replay_agrees"]])
        for r in records
    ]
    table(rows, ["policy", "future", "nll", "dnll", "exact", "copies/token", "steady", "total", "switch", "tok/s",
                 "x ref", "ms/token", "c+rho*tau", "max(c,rho*tau)", "= replay"])
    _print_tiers(args, records)
    _print_intervals(records)
    if args.prefetch != "none":
        table([(r["policy"], r["prefetch_copies"], r["prefetch_hits"], r["prefetch_wasted"], r["prefetch_pending"])
               for r in records], [f"prefetch {args.prefetch}", "copies", "used", "wasted", "pending"])
    mem = first["memory"]
    line = (f"memory: {mem['host_expert_bytes'] / 1e6:.1f} MB of experts in {'pinned ' if mem['pinned'] else ''}host memory, "
            + (f"{mem['file_expert_bytes'] / 1e6:.1f} MB left in the checkpoint's files, " if mem["file_expert_bytes"] else "")
            + f"{mem['slot_bytes'] / 1e6:.1f} MB of slots")
    if mem["device_peak_bytes"] is not None:
        line += (f", {mem['device_weight_bytes'] / 1e6:.1f} MB of other weights on the device, peak device memory "
                 f"{max(r['memory']['device_peak_bytes'] for r in records) / 1e6:.1f} MB")
    print(line)


def _print_intervals(records) -> None:
    """With --bootstrap: each policy's dnll interval over the sequences (one line)."""
    r0 = records[0]
    if not r0.get("bootstrap"):
        return
    parts = [f"{r['policy']} {r['dnll']:+.4f} [{r['dnll_ci'][0]:+.4f}, {r['dnll_ci'][1]:+.4f}]" for r in records]
    print(f"dnll, 95% intervals over {r0['sequences']} sequence(s) ({r0['bootstrap']} resamples, seed "
          f"{r0['bootstrap_seed']}, paired): " + "; ".join(parts))


def _child_argv(args, **override) -> list[str]:
    """The same ``eval`` for the walled child (JSON out; ``override``: options to change)."""
    v = vars(args) | override
    argv = ["eval", "--model", v["model"], "--capacity", str(v["capacity"])]
    argv += ["--tokens", v["tokens"]] if v["tokens"] else ["--text", v["text"]]
    for spec in v["policies"] or ["lru", "belady"]:
        argv += ["--policy", spec]
    if v["layers"] is not None:
        argv += ["--layers", ",".join(map(str, v["layers"]))]
    for opt in ("max_len", "max_sequences", "mode", "device", "prefetch", "batch", "slow_copies", "pool",
                "reference", "dtype", "capture", "host", "repeats", "tolerance", "bootstrap", "bootstrap_seed"):
        if v[opt] is not None:
            argv += ["--" + opt.replace("_", "-"), str(v[opt])]
    return argv + (["--router-probs"] if v["router_probs"] else []) + ["--json"]


def _run_walled(args) -> int:
    """``eval`` as a child behind the memory wall (see expertcache.hf.wall); its records + the proof."""
    from ..hf.wall import walled_eval

    reference = "offloaded" if args.reference == "auto" else args.reference  # all resident would fill the wall
    child = _child_argv(args, reference=reference)
    shards = checkpoint_files(Path(args.model))
    records, wall, stderr = walled_eval(child, args.memory_wall, tier_files=shards, headroom_bytes=args.headroom)
    for line in stderr.splitlines():
        if line.startswith("expertcache eval:"):
            print(line, file=sys.stderr)  # the child's notes and failed checks
    if args.json:
        emit_json(records)
    else:
        r0 = records[0]
        print(f"model {args.model}: {r0['sequences']} sequence(s), {r0['tokens']} tokens, capacity {r0['capacity']}, "
              f"host {r0['host']}, behind a memory wall of {args.memory_wall / 1e6:.0f} MB ({wall['enforced_by']})")
        table([(r["policy"], r["nll"], r["dnll"], "yes" if r["exact"] else ("NO" if r["lossless"] else "lossy"),
                r["copies_per_token"], r["ms_per_token"]) for r in records],
              ["policy", "nll", "dnll", "exact", "copies/token", "ms/token"])
        _print_tiers(args, records)
        _print_intervals(records)
        pr = wall["proof"]
        low, high = pr.get("min_limit_bytes"), pr.get("max_limit_bytes")
        limit = f"{pr.get('limit_bytes')} bytes" if low is None or high is None else f"{low}-{high} bytes"
        print(f"wall: limit {limit} ({wall['headroom_note']}); "
              f"tier peak {pr.get('tier_peak_bytes')} bytes, own peak {pr.get('own_peak_bytes')}; "
              f"proof {'ok' if wall['proof_ok'] else 'FAILED: ' + (wall['note'] or 'incomplete')}")
    if not wall["proof_ok"]:
        print(f"expertcache eval: warning: the memory wall's proof does not hold ({wall['note'] or 'incomplete'}): "
              "the page cache was not bounded by --memory-wall", file=sys.stderr)
    bad = [r for r in records if (r["lossless"] and not r["exact"]) or r["replay_agrees"] is False]
    return 1 if bad else 0


def _print_tiers(args, records) -> None:
    """Where the requests were served (slot, host memory, page cache, device), this process's own
    read bytes, and with --repeats each policy's spread of ms/token."""
    rows = []
    for r in records:
        t = r["tier_hits"]
        read = r["read_bytes_self"]
        rows.append((r["policy"], t["slot"], t["host_memory"], t["page_cache"], t["device"],
                     t["device_bytes"] / 1e6, "n/a" if read is None else f"{read / 1e6:.1f}",
                     f"{100 * r['ms_per_token_spread']:.1f}%"))
    table(rows, ["policy", "slot hits", "host memory", "page cache", "device", "device MB", "read MB (self)",
                 f"ms/token spread ({records[0]['repeats']} runs)"])
