#!/usr/bin/env python
"""``expertcache serve`` through its HTTP API under memory walls, against llama.cpp's plain mmap
through the same API (docs/serve.md, "Measured").

1. Builds (once, under --scratch, never in the repository) a random-weight GGUF at OLMoE's routing
   geometry (64 experts, top-8; hidden 1024, expert width 512, 8 layers; 1.69 GB in f16) with
   models/small-moe's tokenizer (so the API speaks text), and the same quantized by llama.cpp to
   Q4_K_M.
2. Per model, every (wall, mode, run) cell once in one seeded shuffled order: a server is started
   (``serve MODEL --mode M --memory-wall W``; ``managed`` with ``--cache-memory W``, its default),
   one streamed completion of ``--tokens`` new tokens (greedy, the same prompt) is timed by the
   client (time to first token; decode rate = (completion tokens - 1) / first-to-last chunk
   seconds), ``/metrics`` is read (hits, misses, the process's own device bytes, the live proof),
   the server is stopped with SIGTERM and its final proof line read. Walls: 25%, 50%, 100% of the
   expert bytes beside the dense part. Modes: ``mmap`` (llama.cpp as it is) and ``managed``.
3. The server's overhead: with no wall, ``llama generate --mode mmap`` and ``serve --mode mmap``
   alternate --runs times; the same decode rate (first to last piece of text) on both sides. Then
   the chat APIs on one server (``--chat-format chatml``): the same chat streamed through
   ``/v1/chat/completions``, OpenAI's ``/v1/responses`` and Anthropic's ``/v1/messages``, in a
   seeded order, --runs times each.
4. Tables (median [min-max] over runs; a lead inside the spread is a tie) between the markers of
   docs/serve.md; the records to --json-out.

Run (about 25 minutes on the shared 2-core machine)::

    nice -n 10 .venv/bin/python benchmarks/serve_bench.py --scratch /work/scratch --json-out /tmp/serve_bench.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from expertcache.llama.convert import convert_random  # noqa: E402
from expertcache.formats.gguf import read_geometry  # noqa: E402
from expertcache.llama.quantize import quantize  # noqa: E402
from expertcache.llama.sweep import parse_walls  # noqa: E402

BIG = dict(hidden_size=1024, intermediate_size=512, num_experts=64, num_experts_per_tok=8, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=16, vocab_size=2048, max_position_embeddings=4096,
           rms_norm_eps=1e-5, norm_topk_prob=False)
PROMPT = "def read_config(path):\n    "
START, END = "<!-- serve-bench:start -->", "<!-- serve-bench:end -->"


def start(gguf: Path, *args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "expertcache.cli.main", "serve", str(gguf), "--port", "0", "--json",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"serve did not start: {proc.stderr.read()[-2000:]}")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.stderr.read()


def timed_stream(url: str, path: str, body: dict, read) -> dict:
    """POST ``body`` to ``path`` as a stream, timed at the client: each server-sent event's JSON goes
    to ``read``, which gives ``(text, completion tokens or None)``; ``ttft_seconds`` (request to
    first text), ``decode_tokens_per_s`` ((tokens - 1) / first-to-last text seconds), the text."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    pieces, n, first, last, buf = [], None, None, None, b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().rsplit("data: ", 1)[-1]  # after Anthropic's "event: NAME" line
            if data == "[DONE]":
                continue
            text, tokens = read(json.loads(data))
            n = tokens if tokens is not None else n
            if text:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                pieces.append(text)
    conn.close()
    return {"ttft_seconds": first - t0 if first else None, "completion_tokens": n, "text": "".join(pieces),
            "decode_tokens_per_s": (n - 1) / (last - first) if n and last and last > first else None}


def stream_completion(url: str, max_tokens: int) -> dict:
    """One streamed greedy completion of PROMPT (:func:`timed_stream`)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return timed_stream(url, "/v1/completions", body, lambda obj: (
        "".join(c.get("text") or "" for c in obj.get("choices", [])),
        obj["usage"]["completion_tokens"] if obj.get("usage") else None))


def stream_chat(url: str, api: str, max_tokens: int) -> dict:
    """One streamed greedy chat of PROMPT through ``api`` (``chat``: /v1/chat/completions;
    ``responses``: /v1/responses; ``messages``: Anthropic's /v1/messages) (:func:`timed_stream`)."""
    ask = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
           "temperature": 0, "stream": True}
    if api == "chat":
        rec = timed_stream(url, "/v1/chat/completions", {**ask, "stream_options": {"include_usage": True}},
                           lambda obj: ("".join(c["delta"].get("content") or "" for c in obj.get("choices", [])),
                                        obj["usage"]["completion_tokens"] if obj.get("usage") else None))
    elif api == "responses":
        done = ("response.completed", "response.incomplete")
        rec = timed_stream(url, "/v1/responses", {"model": "bench", "input": PROMPT, "max_output_tokens": max_tokens,
                                                  "temperature": 0, "stream": True}, lambda obj: (
            obj["delta"] if obj["type"] == "response.output_text.delta" else "",
            obj["response"]["usage"]["output_tokens"] if obj["type"] in done else None))
    else:
        rec = timed_stream(url, "/v1/messages", ask, lambda obj: (
            obj["delta"].get("text", "") if obj.get("type") == "content_block_delta" else "",
            obj["usage"]["output_tokens"] if obj.get("type") == "message_delta" else None))
    return {"api": api, **rec}


def metrics(url: str) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


def cell_run(gguf: Path, mode: str, wall: int | None, tokens: int) -> dict:
    args = ["--mode", mode] + (["--memory-wall", str(wall)] if wall else [])
    proc, info = start(gguf, *args)
    try:
        before = metrics(info["url"])
        rec = stream_completion(info["url"], tokens)
        after = metrics(info["url"])
    finally:
        err = stop(proc)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    rec.update(mode=mode, wall=wall, read_bytes=d.get("expertcache_device_read_bytes_total"),
               hits=d.get("expertcache_expert_hits_total"), misses=d.get("expertcache_expert_misses_total"),
               server_decode_tokens_per_s=after.get("expertcache_decode_tokens_per_second"),
               wall_proof_live=after.get("expertcache_wall_proof_ok"),
               proof_ok=("proof ok" in last) if wall else None, proof_line=last[-300:] if wall else None)
    rec["read_bytes_per_token"] = rec["read_bytes"] / rec["completion_tokens"] if rec["completion_tokens"] else None
    return rec


def spread(values) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    return f"{statistics.median(vals):.3g} [{min(vals):.3g}-{max(vals):.3g}]"


def generate_rate(gguf: Path, tokens: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(gguf), "--prompt",
                           PROMPT, "--max-new-tokens", str(tokens), "--mode", "mmap", "--json"], capture_output=True,
                          text=True, cwd=REPO, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    rec = json.loads(done.stdout)
    n, s = rec["completion_tokens"], rec["stream_seconds"]
    return {"decode_tokens_per_s": (n - 1) / s if n and s else None, "ttft_seconds": rec["ttft_seconds"],
            "text": rec["text"], "engine_decode_tokens_per_s": rec["decode_tokens_per_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", required=True, help="folder for the GGUFs (never the repository)")
    ap.add_argument("--walls", default="25%,50%,100%")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per request (default 24)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="f16,q4_k_m")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--no-docs", action="store_true", help="do not write the tables into docs/serve.md")
    ap.add_argument("--overhead-only", action="store_true", help="only the no-wall generate / serve comparison")
    args = ap.parse_args()
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    f16 = scratch / "serve-bench-olmoe-f16.gguf"
    if not f16.exists():
        convert_random(BIG, f16, "f16", seed=0, tokenizer=REPO / "models" / "small-moe")
    files = {"f16": f16}
    if "q4_k_m" in args.models:
        q4 = scratch / "serve-bench-olmoe-q4_k_m.gguf"
        if not q4.exists():
            quantize(f16, q4, "q4_k_m")
        files["q4_k_m"] = q4
    t_start, load0 = time.time(), os.getloadavg()[0]
    out: dict = {"models": {}, "tokens": args.tokens, "runs": args.runs, "seed": args.seed}
    for name in args.models.split(","):
        gguf = files[name]
        g = read_geometry(str(gguf))
        walls = [] if args.overhead_only else parse_walls(args.walls, g)
        cells = [(w, m, r) for w in walls for m in ("mmap", "managed") for r in range(args.runs)]
        random.Random(args.seed).shuffle(cells)
        records = []
        for i, (w, m, r) in enumerate(cells):
            rec = cell_run(gguf, m, w, args.tokens)
            rec["run"] = r
            records.append(rec)
            print(f"[{name} {i + 1}/{len(cells)}] wall {w} {m}: {rec['decode_tokens_per_s']} tok/s, proof "
                  f"{rec['proof_ok']}", file=sys.stderr, flush=True)
        overhead = []
        for r in range(args.runs):  # alternating, no wall
            overhead.append({"side": "generate", **generate_rate(gguf, args.tokens)})
            srv = cell_run(gguf, "mmap", None, args.tokens)
            overhead.append({"side": "serve", **srv})
        apis = []  # the two chat APIs on one server, in a seeded order
        proc, info = start(gguf, "--mode", "mmap", "--chat-format", "chatml", "--model-alias", "bench")
        try:
            order = [api for _ in range(args.runs) for api in ("chat", "responses", "messages")]
            random.Random(args.seed + 1).shuffle(order)
            apis = [stream_chat(info["url"], api, args.tokens) for api in order]
        finally:
            stop(proc)
        out["models"][name] = {"geometry": g.summary(), "walls": walls, "records": records, "overhead": overhead,
                               "apis": apis}
    out.update(seconds=round(time.time() - t_start), load_start=load0, load_end=os.getloadavg()[0],
               when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    lines = report(out)
    print("\n".join(lines))
    if not args.no_docs:
        doc = REPO / "docs" / "serve.md"
        text = doc.read_text(encoding="utf-8")
        if START in text and END in text:
            head, rest = text.split(START, 1)
            _, tail = rest.split(END, 1)
            doc.write_text(head + START + "\n" + "\n".join(lines) + "\n" + END + tail, encoding="utf-8")
    return 0


def report(out: dict) -> list[str]:
    lines = [f"Measured {out['when']}, {out['seconds']} s, load average {out['load_start']:.1f} at the start and "
             f"{out['load_end']:.1f} at the end (2 cores, shared), 1 thread, {out['tokens']} new tokens per request "
             f"(greedy), {out['runs']} runs per cell, cells in one seeded shuffled order.", ""]
    for name, m in out["models"].items():
        g = m["geometry"]
        lines += [f"**Random OLMoE-geometry GGUF, {name}, {g['file_bytes'] / 1e9:.2f} GB** (dense "
                  f"{g['dense_bytes'] / 1e6:.0f} MB, experts {g['expert_tensor_bytes'] / 1e6:.0f} MB)", "",
                  "| wall | mode | decode tok/s (client) | time to first token s | read MB/token | hit rate | "
                  "proof | same text |", "|---|---|---|---|---|---|---|---|"]
        texts = {r["text"] for r in m["records"]} or {r["text"] for r in m["overhead"]}
        for w in m["walls"]:
            for mode in ("mmap", "managed"):
                rs = [r for r in m["records"] if r["wall"] == w and r["mode"] == mode]
                hit = [r["hits"] / (r["hits"] + r["misses"]) for r in rs if r.get("hits") is not None
                       and (r["hits"] + r["misses"])]
                lines.append(f"| {w / 1e6:.0f} MB | {mode} | {spread(r['decode_tokens_per_s'] for r in rs)} | "
                             f"{spread(r['ttft_seconds'] for r in rs)} | "
                             f"{spread((r['read_bytes_per_token'] or 0) / 1e6 for r in rs)} | "
                             f"{spread(hit) if hit else '-'} | "
                             f"{'ok' if all(r['proof_ok'] for r in rs) else 'FAILED'} | "
                             f"{'yes' if len(texts) == 1 else 'no'} |")
        gen = [r["decode_tokens_per_s"] for r in m["overhead"] if r["side"] == "generate"]
        srv = [r["decode_tokens_per_s"] for r in m["overhead"] if r["side"] == "serve"]
        ratio = statistics.median(srv) / statistics.median(gen) if gen and srv else None
        same = len({r["text"] for r in m["overhead"]} | texts) == 1
        lines += ["", f"No wall, `mmap`: `llama generate` {spread(gen)} tok/s, `serve` through the API {spread(srv)} "
                  f"tok/s: serve / generate {ratio:.3f} of the medians (overhead {100 * (1 - ratio):.1f}%); "
                  f"every run's text identical: {same}.", ""]
        by = {api: [r for r in m.get("apis", []) if r["api"] == api] for api in ("chat", "responses", "messages")}
        if all(by.values()):
            rate = {api: [r["decode_tokens_per_s"] for r in rs] for api, rs in by.items()}
            ratio_of = {api: statistics.median(rate[api]) / statistics.median(rate["chat"]) for api in by}
            lines += ["The same chat streamed (chatml, no wall): " + "; ".join(
                f"`{path}` {spread(rate[api])} tok/s, time to first token "
                f"{spread(r['ttft_seconds'] for r in by[api])} s" + (f" ({ratio_of[api]:.3f} of chat's median)"
                                                                     if api != "chat" else "")
                for api, path in (("chat", "/v1/chat/completions"), ("responses", "/v1/responses"),
                                  ("messages", "/v1/messages"))) +
                f"; every run's text identical: {len({r['text'] for r in m['apis']}) == 1}.", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
