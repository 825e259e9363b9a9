"""What hostile or departing clients cost ``expertcache serve`` (docs/serve.md, "Clients that hold
resources" and the SIGTERM paragraph): measured on a server started here on a free loopback port.

1. **Unfinished uploads**: ``--uploads`` connections each declare a 1 MiB body, send 1,040,000 bytes
   of it and hold; then ``--idle`` more connections send nothing. The server's RSS (its
   ``/proc/<pid>/status`` VmRSS) before, while held, and once ``--request-timeout`` has passed; the
   status a normal completion gets during the flood and after it.
2. **Clients that leave**: a streamed completion holds the slot while five non-streamed ones wait;
   the five close their connections (``waiting`` in ``/health`` 0.25-1 s later); the stream's
   client closes; a non-streamed completion of most of the context starts and its client leaves
   after 1 s (``busy`` 1 s later); the decode steps run in all and the requests counted 499.
3. **SIGTERM mid-decode**: a streamed completion of most of the context is decoding and three
   requests wait; the seconds from SIGTERM to exit, the exit status, whether the stream ended in
   the ``shutting_down`` error event, what the waiting ones got, and stderr's line and traceback
   counts. On a small model the stream may finish before the signal: ``in flight`` says so.

    .venv/bin/python benchmarks/serve_limits.py MODEL.gguf [--uploads 1000] [--idle 3000] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(model: str, *args: str) -> tuple[subprocess.Popen, str, int]:
    p = subprocess.Popen([sys.executable, "-m", "expertcache.cli.main", "serve", model, "--port", "0", "--json", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = p.stdout.readline()
    if not line:
        sys.exit(f"serve_limits: the server did not start: {p.stderr.read().strip()[-300:]}")
    host, port = json.loads(line)["url"].removeprefix("http://").rsplit(":", 1)
    return p, host, int(port)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return round(int(next(line for line in fh if line.startswith("VmRSS")).split()[1]) / 1024, 1)


def ask(host: str, port: int, stream: bool = False, max_tokens: int = 4) -> str:
    try:
        c = http.client.HTTPConnection(host, port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": stream}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return str(r.status)
    except OSError as exc:
        return f"refused ({type(exc).__name__})"


def post(host: str, port: int, body: dict) -> socket.socket:
    s = socket.create_connection((host, port), timeout=60)
    raw = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return s


def uploads(model: str, n_uploads: int, n_idle: int, timeout: float) -> dict:
    p, host, port = start(model, "--request-timeout", str(timeout))
    out = {"rss_before_mb": rss_mb(p.pid)}
    held, chunk = [], b"x" * 1_040_000
    for _ in range(n_uploads):
        try:
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1048576\r\n\r\n" + chunk)
            held.append(s)
        except OSError:
            pass  # answered 503 and closed while sending
    time.sleep(2)
    out["rss_uploads_held_mb"] = rss_mb(p.pid)
    idle = []
    for _ in range(n_idle):
        try:
            idle.append(socket.create_connection((host, port), timeout=10))
        except OSError:
            pass
    time.sleep(1)
    out["rss_idle_held_mb"] = rss_mb(p.pid)
    out["normal_during"] = ask(host, port)
    time.sleep(timeout + 2)
    out["rss_after_timeout_mb"] = rss_mb(p.pid)
    out["normal_after"] = ask(host, port)
    for s in held + idle:
        s.close()
    return stop(p, out)


def stop(p: subprocess.Popen, out: dict) -> dict:
    """SIGTERM the server; ``out`` with its exit status and stderr's line and traceback counts."""
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    err = p.stderr.read()
    out.update(exit_status=p.returncode, stderr_lines=len(err.splitlines()), tracebacks=err.count("Traceback"))
    return out


def health(host: str, port: int) -> dict:
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/health")
    return json.loads(c.getresponse().read())


def metric(host: str, port: int, name: str) -> float:
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/metrics")
    lines = c.getresponse().read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def leaving(model: str, ctx: int) -> dict:
    p, host, port = start(model, "--ctx", str(ctx))
    stream = post(host, port, {"prompt": "The Python interpreter", "max_tokens": ctx - 64, "temperature": 0,
                               "stream": True})
    stream.recv(200)
    waiting = [post(host, port, {"prompt": f"q{i}", "max_tokens": ctx - 64, "temperature": 0}) for i in range(5)]
    time.sleep(0.5)
    out = {"waiting_before": health(host, port)["waiting"]}
    for s in waiting:
        s.close()
    time.sleep(1)
    out["waiting_1s_after_they_left"] = health(host, port)["waiting"]
    stream.close()
    time.sleep(0.5)
    solo = post(host, port, {"prompt": "The Python interpreter", "max_tokens": ctx - 64, "temperature": 0})
    time.sleep(1)
    solo.close()
    time.sleep(1)
    out["busy_1s_after_a_decoding_client_left"] = health(host, port)["busy"]
    out["decode_steps"] = metric(host, port, "expertcache_decode_steps_total")
    out["requests_499"] = metric(host, port, 'expertcache_requests_total{endpoint="/v1/completions",code="499"}')
    return stop(p, out)


def sigterm(model: str, ctx: int) -> dict:
    p, host, port = start(model, "--ctx", str(ctx))
    stream = post(host, port, {"prompt": "The Python interpreter", "max_tokens": ctx - 64, "temperature": 0,
                               "stream": True})
    stream.recv(200)
    waiting = [post(host, port, {"prompt": f"q{i}", "max_tokens": 8, "temperature": 0}) for i in range(3)]
    time.sleep(1)
    health = http.client.HTTPConnection(host, port, timeout=10)
    health.request("GET", "/health")
    busy = json.loads(health.getresponse().read())["busy"]
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)
        took = time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        took = None
    got = b""
    stream.settimeout(5)
    try:
        while part := stream.recv(65536):
            got += part
    except OSError:
        pass
    answers = []
    for s in waiting:
        s.settimeout(5)
        try:
            answers.append(s.recv(64).split(b"\r\n", 1)[0].decode(errors="replace"))
        except OSError as exc:
            answers.append(type(exc).__name__)
    err = p.stderr.read()
    return {"in_flight": busy, "seconds_to_exit": None if took is None else round(took, 2), "exit_status": p.returncode,
            "stream_ended_shutting_down": b"shutting_down" in got, "waiting_got": answers,
            "stderr_lines": len(err.splitlines()), "tracebacks": err.count("Traceback")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--uploads", type=int, default=1000)
    ap.add_argument("--idle", type=int, default=3000)
    ap.add_argument("--request-timeout", type=float, default=30.0)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.uploads + args.idle + 256)), hard))
    rec = {"model": args.model, "uploads": uploads(args.model, args.uploads, args.idle, args.request_timeout),
           "leaving": leaving(args.model, args.ctx), "sigterm": sigterm(args.model, args.ctx)}
    if args.json:
        print(json.dumps(rec))
    else:
        for part, figures in rec.items():
            if isinstance(figures, dict):
                print(part + ": " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
