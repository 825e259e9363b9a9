"""``expertcache serve`` as a user runs it (docs/serve.md): the server is started on a free loopback
port, spoken to with the real ``openai`` client (models, completion, chat, streamed and not) and with
raw HTTP for the bad requests; ``/metrics`` is scraped and its counters checked against the run's own
figures and the process's ``/proc/<pid>/io``; a client that leaves mid-stream frees the slot; SIGTERM
stops it. ``llama generate`` and every page-cache mode give the server's greedy text.

Needs the llama and serve extras and the openai client; skips with the reason otherwise.
"""

from __future__ import annotations

import base64
import collections
import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import small_moe_gguf

pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "small-moe"
PROMPT = "The Python interpreter"


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    return small_moe_gguf(tmp_path_factory, "serve")


class Server:
    """``expertcache serve ... --port 0 --json`` in a child process: its URL from the first line."""

    def __init__(self, gguf: Path, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "expertcache.cli.main", "serve", str(gguf), "--port", "0",
                                      "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=REPO)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"serve did not start: {self.proc.stderr.read()}")
        self.info = json.loads(line)
        self.url = self.info["url"]
        self.host, self.port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(self.port)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=120, max_retries=0)

    def raw(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict:
        status, text = self.raw("GET", "/metrics")
        assert status == 200
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("serve did not stop within 30 s of SIGTERM") from None
        return self.proc.returncode, self.proc.stderr.read()


@pytest.fixture(scope="module")
def managed(small_gguf):
    """The server in managed mode, its page cache bounded at 60% of the experts, chatml chats,
    routed experts returned on request."""
    s = Server(small_gguf, "--cache-memory", "60%", "--chat-format", "chatml", "--ctx", "512",
               "--enable-return-routed-experts")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def greedy_text(small_gguf):
    """``llama generate``'s greedy text for PROMPT (mmap mode: llama.cpp as it is)."""
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(small_gguf),
                           "--prompt", PROMPT, "--max-new-tokens", "16", "--json"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    rec = json.loads(done.stdout)
    assert rec["mode"] == "mmap" and rec["decode_steps"] == 15
    return rec["text"]


def test_openai_client_completion_chat_and_streams(managed, greedy_text):
    client = managed.client()
    assert [m.id for m in client.models.list().data] == ["small-moe"]
    done = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=16, temperature=0)
    assert done.choices[0].text == greedy_text and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 16 and done.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="small-moe", prompt=PROMPT,
                                                                            max_tokens=16, temperature=0, stream=True))
    assert streamed == greedy_text
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a list?"}]
    chat = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 12
    pieces, usage = [], None
    for c in client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
        else:
            usage = c.usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens


def _routing_of(gguf, prompt: str, new_tokens: int):
    """The routing of ``prompt`` and its greedy continuation by another path than the server's:
    llama-cpp-python's own ``eval`` with every row's logits (``logits_all``), the capture's
    :class:`RoutingRecorder`, every forward's rows concatenated: ``[positions, layers, k]`` over the
    decoder layers (dense ones 0), positions = the prompt and every new token but the last."""
    import llama_cpp

    from expertcache.llama.capture import RoutingRecorder
    from expertcache.llama.engine import EvalHook
    from expertcache.formats.gguf import read_geometry
    from expertcache.llama.textgen import ObservedLlama

    g = read_geometry(gguf)
    rec, hook = RoutingRecorder(weights=False), EvalHook(llama_cpp)
    hook.attach(rec)
    llm = ObservedLlama(str(gguf), hook=hook, n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1,
                        logits_all=True, verbose=False)
    try:
        out = llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0)
    finally:
        llm.close()
    rows = np.zeros((sum(f.n_tokens for f in rec.forwards), g.num_layers, g.top_k), dtype=np.int32)
    for layer in g.moe_layers:
        rows[:, layer] = np.concatenate([f.experts[layer] for f in rec.forwards])
    return rows, out["usage"]


def _decode_routed(b64: str, g) -> np.ndarray:
    raw = base64.b64decode(b64, validate=True)
    return np.frombuffer(raw, dtype="<i4").reshape(-1, g.num_layers, g.top_k)


def test_routed_experts_equal_an_independent_capture_in_sglang_format(managed, small_gguf, tmp_path):
    from expertcache.formats.gguf import read_geometry

    g = read_geometry(small_gguf)
    want, usage = _routing_of(small_gguf, PROMPT, 16)
    body = {"model": "small-moe", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "return_routed_experts": True}
    status, raw = managed.raw("POST", "/v1/completions", json.dumps(body))
    assert status == 200, raw[:300]
    done = json.loads(raw)
    got = _decode_routed(done["sglext"]["routed_experts"], g)
    P, C = done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"]
    assert (P, C) == (usage["prompt_tokens"], usage["completion_tokens"]) == (P, 16)
    assert got.shape == (P + C - 1, g.num_layers, g.top_k) == want.shape  # the last token is never evaluated
    assert np.array_equal(got, want)
    dense = [i for i in range(g.num_layers) if i not in g.moe_layers]
    assert not got[:, dense].any() and (got[:, g.moe_layers] < g.num_experts).all()
    # the same request again: its prompt is a cached prefix, its rows those recorded then
    status, raw = managed.raw("POST", "/v1/completions", json.dumps({**body, "routed_experts_start_len": P - 1}))
    assert status == 200 and np.array_equal(_decode_routed(json.loads(raw)["sglext"]["routed_experts"], g), want[P - 1:])
    # streamed: one chunk without choices carries them, after the finish and before the usage
    status, raw = managed.raw("POST", "/v1/completions", json.dumps({**body, "stream": True,
                                                                     "stream_options": {"include_usage": True}}))
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    tail = [i for i, e in enumerate(events) if "sglext" in e]
    assert status == 200 and len(tail) == 1 and events[tail[0]]["choices"] == []
    assert events[tail[0] - 1]["choices"][0]["finish_reason"] == "length" and "usage" in events[tail[0] + 1]
    assert np.array_equal(_decode_routed(events[tail[0]]["sglext"]["routed_experts"], g), want)
    # the serve -> import loop: a log of this server's responses (one non-streamed, one streamed as
    # its SSE lines) is one `expertcache import` away, each response a sequence, the dense layers out
    log = tmp_path / "responses.jsonl"
    log.write_text(json.dumps(done) + "\n" + raw.decode())
    out = tmp_path / "served.npz"
    imp = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "import", str(log), "--num-experts",
                          str(g.num_experts), "--top-k", str(g.top_k), "--out", str(out), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert imp.returncode == 0, imp.stderr
    from expertcache import load_trace

    trace = load_trace(out)
    assert json.loads(imp.stdout)["format"] == "sglang-r3" and trace.num_sequences == 2
    for s in range(2):
        assert np.array_equal(trace.experts[trace.seq == s], want[:, g.moe_layers])
    # a chat through the openai client (extra_body), decoded from the response's extra field
    chat = managed.client().chat.completions.create(
        model="small-moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        extra_body={"return_routed_experts": True})
    rows = _decode_routed(chat.model_extra["sglext"]["routed_experts"], g)
    assert len(rows) == chat.usage.prompt_tokens + chat.usage.completion_tokens - 1


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(managed):
    def err(status, body, path="/v1/completions", method="POST", headers=None):
        got, raw = managed.raw(method, path, body, headers)
        assert got == status, (body if isinstance(body, str) else "", raw[:300])
        e = json.loads(raw)["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["message"]
        return e

    assert err(400, "{not json")["type"] == "invalid_request_error"
    assert err(400, "[1, 2]")["message"].startswith("the request body is not a JSON object")
    assert err(400, json.dumps({"prompt": "x", "max_tokens": -1}))["param"] == "max_tokens"
    assert err(400, json.dumps({"prompt": "x", "temperature": 9}))["param"] == "temperature"
    assert err(400, json.dumps({"max_tokens": 3}))["param"] == "prompt"
    assert err(404, json.dumps({"prompt": "x", "model": "gpt-4o"}))["code"] == "model_not_found"
    assert err(400, json.dumps({"prompt": "x", "max_tokens": 10**9}))["code"] == "context_length_exceeded"
    assert err(400, json.dumps({"prompt": "word " * 2000, "max_tokens": 4}))["code"] == "context_length_exceeded"
    assert err(400, json.dumps({"prompt": "x", "n": 2}))["param"] == "n"
    assert err(400, json.dumps({"prompt": "x", "return_routed_experts": True, "routed_experts_start_len": 999})
               )["param"] == "routed_experts_start_len"  # beyond the prompt
    assert err(400, json.dumps({"prompt": "x", "routed_experts_start_len": 0}))["param"] == "routed_experts_start_len"
    assert err(400, json.dumps({"prompt": "x", "return_routed_experts": True, "routed_experts_start_len": -1})
               )["param"] == "routed_experts_start_len"
    assert err(400, json.dumps({"messages": []}), "/v1/chat/completions")["param"] == "messages"
    assert err(400, json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "/v1/chat/completions")
    assert err(413, "x" * (2 << 20))["message"].startswith("the request body is larger")
    assert err(404, None, "/v2/nothing", "GET")["code"] == "not_found"
    assert err(405, None, "/v1/completions", "GET")
    assert managed.raw("GET", "/health")[0] == 200
    ok = managed.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4


def test_metrics_move_and_agree_with_the_run(managed):
    before = managed.metrics()
    done = managed.client().completions.create(model="small-moe", prompt="def main():", max_tokens=10, temperature=0)
    after = managed.metrics()
    with open(f"/proc/{managed.proc.pid}/io") as fh:
        proc_read = next(int(line.split()[1]) for line in fh if line.startswith("read_bytes:"))
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["expertcache_completion_tokens_total"] == done.usage.completion_tokens == 10
    assert d["expertcache_prompt_tokens_total"] == done.usage.prompt_tokens
    assert d["expertcache_decode_steps_total"] == 9  # the last token is not fed back
    # every decode step routes k distinct experts in each of the 4 MoE layers; the prefill adds its own
    k, layers = 2, 4
    seen = d["expertcache_expert_hits_total"] + d["expertcache_expert_misses_total"]
    assert seen >= 9 * layers * k and d["expertcache_expert_hits_total"] > 0
    assert after["expertcache_device_read_bytes_total"] == proc_read  # the process's own /proc/<pid>/io
    assert 0 < after["expertcache_resident_expert_bytes"] <= after["expertcache_cache_memory_bytes"]
    assert after["expertcache_decode_tokens_per_second"] > 0
    # the roofline: D from the decode steps' own reads, c from the steps that read nothing
    assert 0 <= d["expertcache_decode_read_bytes_total"] <= d["expertcache_device_read_bytes_total"]
    c, limit = after["expertcache_compute_tokens_per_second"], after["expertcache_limit_tokens_per_second"]
    assert 0 < limit <= c and after["expertcache_serial_limit_tokens_per_second"] <= limit
    rate = after["expertcache_decode_steps_total"] / after["expertcache_decode_seconds_total"]
    assert after["expertcache_efficiency"] == pytest.approx(rate / limit, rel=1e-3)
    assert d['expertcache_requests_total{endpoint="/v1/completions",code="200"}'] == 1


def open_stream(server: Server, max_tokens: int, each=None) -> socket.socket:
    """A greedy streamed completion of PROMPT sent by hand, read until its third event; its socket,
    open. ``each()`` is called after every read."""
    sock = socket.create_connection((server.host, server.port), timeout=60)
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:
        part = sock.recv(4096)
        assert part, "the stream ended early"
        got += part
        if each is not None:
            each()
    return sock


def test_a_client_that_leaves_mid_stream_frees_the_slot(managed):
    steps0 = managed.metrics()["expertcache_decode_steps_total"]
    sock = open_stream(managed, 480)
    sock.close()  # gone mid-stream
    done = managed.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=5, temperature=0)
    assert done.usage.completion_tokens == 5  # the slot was freed
    after = managed.metrics()
    assert after["expertcache_decode_steps_total"] - steps0 < 200  # the abandoned decode stopped, far from its 480
    assert after['expertcache_requests_total{endpoint="/v1/completions",code="499"}'] >= 1
    assert after["expertcache_queue_waiting"] == 0


def test_requests_queue_for_the_one_slot(managed):
    client = managed.client()
    out: list = []

    def ask(i):
        out.append(client.completions.create(model="small-moe", prompt=f"x = {i}", max_tokens=8, temperature=0))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(out) == 3 and all(r.usage.completion_tokens == 8 for r in out)


@pytest.mark.parametrize("mode", ["mmap", "random", "advise", "pin", "lookahead", "nocache", "nommap"])
def test_every_mode_serves_the_greedy_text(small_gguf, greedy_text, mode):
    s = Server(small_gguf, "--mode", mode)
    try:
        done = s.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=16, temperature=0)
        assert done.choices[0].text == greedy_text
        if mode == "mmap":  # not started with --enable-return-routed-experts: asked for, refused
            status, raw = s.raw("POST", "/v1/completions", json.dumps({"prompt": "x", "return_routed_experts": True}))
            assert status == 400 and json.loads(raw)["error"]["code"] == "routed_experts_disabled"
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err  # SIGTERM stops it cleanly


def test_refusals_are_one_line(small_gguf, tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all" * 4)
    for args, match in [
        ([str(small_gguf), "--cache-memory", "50%", "--mode", "advise"], "--cache-memory bounds the managed"),
        ([str(small_gguf), "--cache-memory", "1MB"], "fewer than one layer routes"),
        ([str(small_gguf), "--port", "70000"], "--port"),
        ([str(small_gguf), "--host", ""], "argument --host: expected an address"),  # had listened on every interface
        ([str(small_gguf), "--chat-format", "nonsense"], "--chat-format"),
        ([str(small_gguf), "--chat-template-kwargs", "nope"], "argument --chat-template-kwargs: not JSON"),
        ([str(small_gguf), "--chat-template-kwargs", '{"stop": 1}'], "'stop' is set by the server"),
        ([str(small_gguf), "--chat-format", "chatml", "--chat-template-kwargs", '{"enable_thinking": false}'],
         "named format 'chatml', which takes no template variables"),
        ([str(tmp_path / "x.gguf")], "not a GGUF file"),
    ]:
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "serve", *args], capture_output=True,
                              text=True, cwd=REPO, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and match in lines[0], (args, done.stderr)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "serve", str(small_gguf), "--port",
                               str(busy.getsockname()[1])], capture_output=True, text=True, cwd=REPO, timeout=120)
    finally:
        busy.close()
    assert done.returncode == 2 and "cannot listen there" in done.stderr, done.stderr


def _with_metadata(src: Path, dst: Path, **values) -> Path:
    """A copy of the GGUF ``src`` whose metadata keys (``__`` for ``.``) hold new values of their type."""
    import gguf

    over = {k.replace("__", "."): v for k, v in values.items()}
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = {"sub_type": f.types[-1]} if f.types[0] == gguf.GGUFValueType.ARRAY else {}
        w.add_key_value(name, over.pop(name, f.contents()), f.types[0], **sub)
    assert not over, over
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


def test_a_file_llama_cpp_stops_on_is_one_line(small_gguf, tmp_path):
    """A header the reader's checks pass but llama.cpp's own do not (OLMoE asserts that the rotary
    dimension equals the head size, when the context builds its graph): ggml's abort callback makes
    the assert one line and exit 2, in-process (``generate``, ``serve``) and in ``run``'s child, where
    it printed a gdb backtrace and dumped core. The unchanged copy still decodes."""
    same = _with_metadata(small_gguf, tmp_path / "same.gguf")
    bad = _with_metadata(small_gguf, tmp_path / "rot.gguf", olmoe__rope__dimension_count=16)
    text = ["--prompt", PROMPT, "--max-new-tokens", "2"]
    for cmd, options in [(["llama", "generate"], text), (["serve"], ["--port", "0"]), (["llama", "run"], text)]:
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *cmd, str(bad), *options],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (cmd, done.returncode, done.stderr[-2000:])
        assert f"MODEL {bad}: llama.cpp stopped on it (olmoe.cpp:" in lines[0], (cmd, lines)
        assert "GGML_ASSERT(n_embd_head == n_rot) failed)" in lines[0] and "backtrace" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(same), "--prompt",
                           PROMPT, "--max-new-tokens", "2"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr


def test_the_context_settings_reach_llama_cpp(small_gguf):
    """``--flash-attn``, ``--cache-type-k/-v``, ``--batch-size``, ``--ubatch-size``: the context llama.cpp
    made has them (read back from its parameters), a q8_0 cache holds the same tokens in about half
    the bytes of f16's (llama.cpp's own state size), ``generate --json`` and ``serve --json`` say
    them; what llama.cpp would refuse or clamp is one line, exit 2."""
    import llama_cpp

    from expertcache.llama.textgen import Session

    sizes = {}
    for kv, kw in (("f16", {}), ("q8_0", dict(flash_attn=True, type_k="q8_0", type_v="q8_0", n_batch=64, n_ubatch=32))):
        with Session.open(str(small_gguf), n_ctx=256, **kw) as s:
            p = s.llama.context_params
            assert (p.type_k, p.type_v) == ((8, 8) if kv == "q8_0" else (1, 1))
            assert p.flash_attn_type == (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if kw else
                                         llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            assert (p.n_batch, p.n_ubatch) == ((64, 32) if kw else (256, 256))
            s.llama.eval(s.llama.tokenize(PROMPT.encode() * 8))
            sizes[kv] = llama_cpp.llama_state_get_size(s.llama.ctx)
    assert sizes["q8_0"] < 0.6 * sizes["f16"], sizes

    def gen(*args):
        return subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(small_gguf),
                               "--prompt", PROMPT, "--max-new-tokens", "4", *args],
                              capture_output=True, text=True, cwd=REPO, timeout=300)

    done = gen("--json", "-fa", "on", "-ctk", "q8_0", "--cache-type-v", "q4_0", "-b", "128", "-ub", "64")
    rec = json.loads(done.stdout)
    assert done.returncode == 0 and (rec["flash_attn"], rec["cache_type_k"], rec["cache_type_v"], rec["n_batch"],
                                     rec["n_ubatch"]) == ("on", "q8_0", "q4_0", 128, 64), done.stderr
    for args, match in ((("-ctv", "q8_0"), "needs --flash-attn on"), (("-b", "4096"), "above the context"),
                        (("-b", "64", "-ub", "128"), "above --batch-size 64"), (("-ctk", "q9"), "invalid choice")):
        done = gen(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and match in lines[0], (args, done.stderr)
    served = Server(small_gguf, "--ctx", "256", "-fa", "on", "-ctv", "q8_0", "-ub", "128")
    try:
        assert (served.info["flash_attn"], served.info["cache_type_v"], served.info["n_batch"],
                served.info["n_ubatch"]) == ("on", "q8_0", 256, 128)
        assert served.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    finally:
        served.stop()


def test_generate_takes_llama_cpps_sampling_options(small_gguf, greedy_text):
    """``llama generate --top-k``, ``--min-p`` and ``--repeat-penalty`` (llama-cli's): hot sampling
    with ``--top-k 1`` or ``--min-p`` near 1 is greedy; a repetition penalty at temperature 0 writes
    what llama-cpp-python's own ``create_completion`` writes with it, not the greedy text; a value
    out of range is one line."""
    import llama_cpp

    def gen(*args):
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(small_gguf),
                               "--prompt", PROMPT, "--max-new-tokens", "16", "--json", *args],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
        return done.returncode, done.stdout and json.loads(done.stdout)["text"], done.stderr

    assert gen("--temperature", "1.5", "--seed", "5", "--min-p", "0.999")[1] == greedy_text
    assert gen("--temperature", "1.5", "--seed", "5", "--top-k", "1", "--min-p", "0")[1] == greedy_text
    llm = llama_cpp.Llama(str(small_gguf), n_ctx=512, verbose=False)
    want = llm.create_completion(PROMPT, max_tokens=16, temperature=0, top_k=1, repeat_penalty=1.5)["choices"][0]["text"]
    assert gen("--repeat-penalty", "1.5")[1] == want != greedy_text
    code, _, err = gen("--min-p", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--min-p" in err, err


def test_generate_streams_text_and_refuses_in_one_line(small_gguf, greedy_text, tmp_path):
    def gen(*args):
        return subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(small_gguf), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=300)

    done = gen("--prompt", PROMPT, "--max-new-tokens", "16", "--cache-memory", "60%")
    assert done.returncode == 0 and done.stdout == greedy_text + "\n" and "managed" in done.stderr, done.stderr
    (tmp_path / "p.txt").write_text(PROMPT, encoding="utf-8")
    done = gen("--prompt-file", tmp_path / "p.txt", "--max-new-tokens", "16", "--mode", "pin", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["text"] == greedy_text
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    for args, match in [(("--chat", "hi"), "has no chat template"),
                        (("--prompt-file", tmp_path / "bin.txt"), "not UTF-8"),
                        (("--prompt", "x", "--max-new-tokens", "5000"), "exceed the context"),
                        (("--prompt", "x", "--top-p", "0"), "--top-p"),
                        (("--prompt", "   "), "the prompt is empty"),
                        (("--system", "s", "--prompt", "x"), "--system goes with --chat")]:
        done = gen(*map(str, args))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and match in lines[0], (args, done.stderr)


def test_run_takes_a_text_prompt(small_gguf):
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "run", str(small_gguf), "--prompt",
                           PROMPT, "--max-new-tokens", "6", "--mode", "advise", "--json"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    from expertcache.llama.textgen import tokenize

    rec = json.loads(done.stdout.strip().splitlines()[-1])
    assert rec["prefill_tokens"] == len(tokenize(str(small_gguf), PROMPT)) and len(rec["output_ids"]) == 6
    assert isinstance(rec["output_text"], str) and rec["output_text"]


def test_expert_hits_are_counted_or_none_never_a_zero_not_counted(small_gguf):
    """prefetch routes experts every step; generate counted neither its hits nor its misses and said
    0 and 0 (serve's /metrics too). A llama run, which does not pay for the mincore probes, says
    null for the modes it does not count."""
    def run(*args):
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", *args, str(small_gguf),
                               "--prompt", PROMPT, "--max-new-tokens", "6", "--json"], capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    for mode in ("prefetch", "advise"):
        rec = run("generate", "--mode", mode)
        assert rec["expert_hits"] + rec["expert_misses"] >= 5 * 4 * 2, (mode, rec)  # 5 decode steps x 4 layers x k
    for mode in ("prefetch", "advise"):
        advice = run("run", "--mode", mode, "--no-roofline")["advice"]
        assert advice["expert_hits"] is None and advice["expert_misses"] is None, advice
        # advise hints the routed experts; prefetch's readers read them, or skip them resident
        assert advice["hints"] > 0 if mode == "advise" else \
            advice["hints"] == 0 and advice["populated_bytes"] + advice["resident_pieces_skipped"] > 0, advice
    advice = run("run", "--mode", "managed", "--no-roofline")["advice"]
    assert advice["expert_hits"] + advice["expert_misses"] > 0


def test_run_sweep_and_serve_refuse_what_the_model_cannot_run(small_gguf):
    """As generate, serve and capture do: small-moe's context_length is 512 (they had decoded 600
    tokens, reporting tokens/s for positions the model never learned)."""
    for cmd in (["run"], ["sweep", "--walls", "100%", "--runs", "1"]):
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", *cmd, str(small_gguf), "--prompt",
                               "hi", "--max-new-tokens", "600", "--no-roofline"], capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "--max-new-tokens 600 need 602 positions, more than 512 (the model's olmoe.context_length)" in lines[0]
    # a wall below the file with --mode nommap (which reads the whole file): refused at once, as by llama run
    for cmd in (["serve", str(small_gguf), "--port", "0"], ["llama", "run", str(small_gguf), "--prompt", "hi"]):
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *cmd, "--memory-wall", "50%", "--mode",
                               "nommap"], capture_output=True, text=True, cwd=REPO, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "--mode nommap reads the whole model into memory: the wall" in lines[0]


HOLDER = """
import mmap, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
sum(m[i] for i in range(0, len(m), 4096))
print("held", flush=True)
time.sleep(120)
"""


def test_a_wall_on_a_file_another_process_holds_is_refused_in_one_line(small_gguf, tmp_path):
    """Pages another process maps stay in the page cache after eviction, and the wall counts them in
    its tier: the run's limit was pulled down until the worker died at start (ENOMEM, tracebacks
    from serve). Said in one line before any worker starts."""
    gguf = tmp_path / "held.gguf"
    shutil.copy(small_gguf, gguf)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(gguf)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for cmd in (["llama", "run", str(gguf), "--prompt", "hi", "--max-new-tokens", "2", "--no-roofline"],
                    ["serve", str(gguf), "--port", "0"]):
            done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *cmd, "--memory-wall", "50%"],
                                  capture_output=True, text=True, cwd=REPO, timeout=120)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert "bytes stay in the page cache after eviction: another process maps or locks them" in lines[0]
    finally:
        holder.kill()
        holder.wait()


def test_every_answer_is_counted_and_a_trailing_slash_is_a_json_404(managed):
    """requests_total counts what the HTTP parser refuses (400, as other) and a path with a trailing
    slash is a JSON 404 (it had been a bare 307 to a location built from the client's Host header,
    neither counted)."""
    def count(code):
        return managed.metrics().get(f'expertcache_requests_total{{endpoint="other",code="{code}"}}', 0)

    before = {c: count(c) for c in (400, 404)}
    with socket.create_connection((managed.host, managed.port), timeout=30) as sock:
        sock.sendall(b"\x00\x01garbage\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")
    for method, path in (("GET", "/v1/models/"), ("POST", "/v1/completions/")):
        got, raw = managed.raw(method, path, '{"prompt": "hi"}' if method == "POST" else None)
        assert got == 404 and json.loads(raw)["error"]["code"] == "not_found", raw
    assert count(400) == before[400] + 1 and count(404) == before[404] + 2


def test_a_headroom_below_the_workers_own_memory_ends_with_its_diagnosis(small_gguf, tmp_path):
    """--headroom 1MB: the worker's own memory cannot fit beside the model under the start-up ceiling.
    It had waited for memory for ever (the OOM killer is off under a following v1 wall); it is killed
    after the patience, and the one line says to raise the headroom."""
    from expertcache.wall.capacity import detect_walls

    walls = detect_walls()["cgroup"]
    if not walls["ok"] or walls.get("version") != "v1":
        pytest.skip("no cgroup v1 wall on this machine")
    gguf = tmp_path / "own.gguf"  # a copy: the module's server holds small_gguf's pages
    shutil.copy(small_gguf, gguf)
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "run", str(gguf), "--prompt",
                           "hi", "--max-new-tokens", "2", "--no-roofline", "--memory-wall", "100%", "--headroom",
                           "1MB"], capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "raise the headroom" in lines[0], done.stderr


def test_hostile_requests_are_4xx_with_the_field_named(managed):
    """Requests a client should not send, each a 4xx naming the field, the server serving after
    every one (docs/serve.md, Errors)."""
    def err(status, body, path="/v1/completions", method="POST"):
        got, raw = managed.raw(method, path, body)
        assert got == status, (body[:200], raw[:300])
        return json.loads(raw)["error"]

    chat = "/v1/chat/completions"
    for body, param in [('{"prompt": "", "max_tokens": 4}', "prompt"), ('{"prompt": [""]}', "prompt"),
                        ('{"prompt": "\\ud800abc"}', "prompt"),  # a lone surrogate escape: not text
                        ('{"prompt": "x", "stop": ["\\udc00"]}', "stop"),
                        ('{"prompt": "x", "model": "\\ud800"}', "model"),
                        ('{"prompt": "x", "stop": ""}', "stop"), ('{"prompt": "x", "stop": ["a", ""]}', "stop"),
                        (json.dumps({"prompt": "x", "stop": "s" * 1001}), "stop"),
                        ('{"prompt": "x", "temperature": "0.5"}', "temperature"),  # no coercion
                        ('{"prompt": "x", "temperature": true}', "temperature"),
                        ('{"prompt": "x", "max_tokens": "5"}', "max_tokens"), ('{"prompt": "x", "max_tokens": 5.0}',
                                                                               "max_tokens"),
                        ('{"prompt": "x", "stream": "yes"}', "stream"), ('{"prompt": "x", "n": "1"}', "n"),
                        ('{"prompt": "x", "logprobs": 21}', "logprobs"), ('{"prompt": "x", "logprobs": true}', "logprobs"),
                        ('{"prompt": "x", "top_logprobs": 2}', "top_logprobs"),  # a chat field
                        ('{"prompt": "x", "logprobs": -1}', "logprobs"), ('{"prompt": "x", "logprobs": 1.0}', "logprobs"),
                        ('{"prompt": [%d], "logprobs": 1}' % 10 ** 30, "prompt"), ('{"prompt": [[1, -5]]}', "prompt"),
                        ('{"prompt": "x", "logit_bias": {"01": 5}}', "logit_bias"),
                        ('{"prompt": "x", "logit_bias": {"1": 100.5}}', "logit_bias"),
                        ('{"prompt": "x", "logit_bias": {"1": NaN}}', "logit_bias"),
                        ('{"prompt": "x", "logit_bias": {"1": "5"}}', "logit_bias"),
                        ('{"prompt": "x", "logit_bias": {"99999999": 1}}', "logit_bias"),
                        ('{"prompt": "x", "response_format": {"type": "xml"}}', "response_format"),
                        ('{"prompt": "x", "response_format": {"type": "json_schema"}}', "response_format"),
                        ('{"prompt": "x", "response_format": {"type": "json_object", "schema": []}}', "response_format"),
                        # a remote reference (nothing is fetched), an unknown type, a grammar of 1 GB, one that
                        # llama.cpp refuses (llama-cpp-python would add its null sampler: the process died)
                        ('{"prompt": "x", "response_format": {"type": "json_object", "schema": {"$ref": '
                         '"https://example.com/s.json"}}}', "response_format"),
                        ('{"prompt": "x", "response_format": {"type": "json_object", "schema": {"type": "foo"}}}',
                         "response_format"),
                        ('{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n", '
                         '"schema": {"type": "string", "pattern": "^a{1000000000}$"}}}}', "response_format"),
                        ('{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n", '
                         '"schema": {"type": "string", "pattern": "^(|a)*$"}}}}', "response_format"),
                        # keywords the grammar would not hold the text to: refused, not ignored
                        ('{"prompt": "x", "response_format": {"type": "json_object", "schema": {"type": "integer", '
                         '"maximum": 99}}}', "response_format"),
                        ('{"prompt": "x", "response_format": {"type": "json_object", "schema": {"type": "string", '
                         '"format": "email"}}}', "response_format"),
                        ('{"prompt": "x", "best_of": 3}', "best_of"),  # options that would change the result
                        ('{"prompt": "x", "suffix": "y"}', "suffix")]:
        e = err(400, body)
        assert e["param"] == param and e["type"] == "invalid_request_error" and e["code"] is None, (body, e)
    user = '"messages": [{"role": "user", "content": "x"}]'
    for body, param in [('{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}', "messages"),
                        ('{%s, "response_format": {"type": "json_schema", "json_schema": {"schema": '
                         '{"type": "string", "pattern": "^(|a)*$"}}}}' % user, "response_format"),
                        ('{%s, "tools": [{"type": "function"}]}' % user, "tools"),
                        ('{%s, "top_logprobs": 2}' % user, "top_logprobs"), ('{%s, "logprobs": 3}' % user, "logprobs"),
                        ('{%s, "logprobs": true, "top_logprobs": 21}' % user, "top_logprobs"),
                        ('{%s, "logprobs": true, "top_logprobs": "2"}' % user, "top_logprobs")]:
        e = err(400, body, chat)
        assert e["param"] == param and e["code"] is None, (body, e)
    # a number of more digits than Python converts, anywhere in the body: 400, not the 500 of a ValueError
    big = "1" + "0" * 5000
    for path, body in [("/v1/completions", '{"prompt": "x", "max_tokens": %s}' % big),
                       ("/v1/completions", '{"prompt": "x", "foo": %s}' % big),
                       (chat, '{%s, "seed": %s}' % (user, big))]:
        e = err(400, body, path)
        assert e["type"] == "invalid_request_error" and "number Python will not read" in e["message"], e
    # null max_tokens on a completion is OpenAI's default, 16
    done = json.loads(managed.raw("POST", "/v1/completions", '{"prompt": "x = 1", "max_tokens": null, '
                                                             '"temperature": 0}')[1])
    assert done["usage"]["completion_tokens"] == 16
    assert managed.raw("HEAD", "/health", None)[0] == 200 and managed.raw("GET", "/openapi.json", None)[0] == 404
    ok = managed.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4


def test_slow_or_departing_clients_hold_nothing(small_gguf):
    """A connection that trickles its request is closed after --request-timeout; one beyond
    --max-connections is answered 503 and closed; a client that leaves while sending its body is
    counted 499; after all of it the server answers, and stops with no traceback."""
    s = Server(small_gguf, "--request-timeout", "1.5", "--max-connections", "6")
    try:
        slow = socket.create_connection((s.host, s.port), timeout=30)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        t0 = time.monotonic()
        assert slow.recv(1024) == b"" and time.monotonic() - t0 < 20  # closed by the server
        slow.close()
        idle = [socket.create_connection((s.host, s.port), timeout=30) for _ in range(6)]
        extra = socket.create_connection((s.host, s.port), timeout=30)
        got = b""
        while part := extra.recv(4096):
            got += part
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
        for c in idle + [extra]:
            c.close()
        gone = socket.create_connection((s.host, s.port), timeout=30)
        gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.3)
        gone.close()
        status, raw = s.raw("POST", "/v1/completions", "Content-Length: abc", {"Content-Length": "abc"})
        assert status == 400 and json.loads(raw)["error"]["message"].startswith("Invalid HTTP request")
        deadline = time.monotonic() + 20
        while (m := s.metrics()).get('expertcache_requests_total{endpoint="/v1/completions",code="499"}', 0) < 1:
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert not any('code="500"' in k for k in m)
        done = s.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err and all(line.startswith(("expertcache serve", "WARNING"))
                                                        for line in err.splitlines()), err


def test_the_completion_loop_agrees_with_llama_cpp_python(small_gguf):
    """expertcache's streamed completion (llama/completion.py) against llama-cpp-python's own,
    non-streamed: the same text for greedy completions with and without stop sequences, and for a
    chat through the same chat handler; one chunk per sampled token."""
    from expertcache.llama.completion import stream_chat, stream_completion
    from expertcache.llama.textgen import Session, completion_kwargs

    with Session.open(str(small_gguf), chat_format="chatml", n_ctx=512) as session:
        llm = session.llama
        for prompt, stop in [(PROMPT, None), ("def main():", ["\n"]), ("x = 1", ["XXX", " # "]), ("import", ["s"])]:
            kw = dict(completion_kwargs(48, 0.0, 1.0, None), stop=stop)
            want = llm.create_completion(prompt, **kw)
            chunks = list(stream_completion(llm, prompt, **kw))
            assert "".join(c["choices"][0]["text"] for c in chunks) == want["choices"][0]["text"], (prompt, stop)
            assert chunks[-1]["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
            tokens = want["usage"]["completion_tokens"]
            assert tokens <= len(chunks) <= tokens + 2  # a chunk a token, the held text, the finish
        msgs = [{"role": "user", "content": "What is a list?"}]
        kw = completion_kwargs(24, 0.0, 1.0, None)
        want = llm.create_chat_completion(messages=msgs, **kw)["choices"][0]["message"]["content"]
        got = "".join(c["choices"][0]["delta"].get("content") or "" for c in stream_chat(llm, msgs, **kw))
        assert got == want


ROLE_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}<|system|>{{ m.content }}\n"
                 "{% elif m.role == 'user' %}<|user|>{{ m.content }}\n{% elif m.role == 'assistant' %}<|assistant|>"
                 "{{ m.content }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A chat template with branches for system, user and assistant only, as many models' have."""


def test_roles_a_chat_format_drops_are_found_and_not_dropped_silently(small_gguf, tmp_path):
    """rendered_roles formats a probe message of each role (nothing decoded) and finds which reach the
    prompt; kept_roles sends a developer message as system where only the second is kept, and
    refuses any other dropped message (chatml, and a template without those branches, had left
    them out without a word: OpenAI's newer clients send instructions as developer messages)."""
    from expertcache.llama.completion import rendered_roles
    from expertcache.llama.convert import convert
    from expertcache.llama.server import ApiError, kept_roles
    from expertcache.llama.textgen import Session

    ckpt = tmp_path / "ckpt"
    shutil.copytree(SMALL, ckpt)
    (ckpt / "chat_template.jinja").write_text(ROLE_TEMPLATE)
    templated = tmp_path / "templated.gguf"
    convert(ckpt, templated, "f16")
    (ckpt / "chat_template.jinja").write_text(ROLE_TEMPLATE.replace("m.role == 'system'",
                                                                    "m.role in ('system', 'developer', 'tool')"))
    every = tmp_path / "every.gguf"
    convert(ckpt, every, "f16")
    found = {}
    for name, path, fmt in [("chatml", small_gguf, "chatml"), ("template", templated, None), ("every", every, None),
                            ("gemma", small_gguf, "gemma")]:
        with Session.open(str(path), chat_format=fmt, n_ctx=512) as session:
            assert session.chat_ready
            found[name] = rendered_roles(session.llama)
    assert found == {"chatml": {"system": True, "developer": False, "tool": False},
                     "template": {"system": True, "developer": False, "tool": False},
                     "every": {"system": True, "developer": True, "tool": True},
                     "gemma": {"system": False, "developer": False, "tool": False}}
    dev = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    assert kept_roles(dev, found["template"]) == [{"role": "system", "content": "Answer in French."}, dev[1]]
    assert kept_roles(dev, found["every"]) == dev  # a template that takes developer messages gets them
    for roles, messages, where in [(found["chatml"], [dev[1], {"role": "tool", "content": "42"}], "messages[1]"),
                                   (found["gemma"], dev, "messages[0]"),
                                   (found["gemma"], [{"role": "system", "content": "s"}, dev[1]], "messages[0]")]:
        with pytest.raises(ApiError) as info:
            kept_roles(messages, roles)
        assert info.value.status == 400 and where in str(info.value), info.value
    # generate's --system, where the format drops it: one line, not a system message gone without a word
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(small_gguf), "--chat",
                           "hi", "--system", "be brief", "--chat-format", "gemma", "--max-new-tokens", "2"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "leaves system messages out of the prompt" in lines[0]


def test_a_chat_the_template_refuses_or_the_context_cannot_hold_is_a_400_and_one_line(managed, small_gguf, tmp_path):
    """A template's own refusal (raise_exception: "System role not supported", as Gemma- and
    Mistral-style templates have) and a templated prompt longer than the context had been a 500 in
    serve and exit 70 in generate (llama.cpp pads its context to 256, above the Llama's own --ctx)."""
    from expertcache.llama.convert import convert

    got, raw = managed.raw("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "word " * 700}], "max_tokens": 1}))
    err = json.loads(raw)["error"]
    assert got == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages", raw
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SMALL, ckpt)
    (ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<<{{ m.role }}>>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}")
    convert(ckpt, tmp_path / "strict.gguf", "f16")

    def gen(path, *args):
        return subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(path), *args,
                               "--max-new-tokens", "2"], capture_output=True, text=True, cwd=REPO, timeout=300)

    for path, args, said in [(tmp_path / "strict.gguf", ("--chat", "hi", "--system", "s"), "System role not supported"),
                             (small_gguf, ("--chat", "hi", "--chat-format", "chatml", "--ctx", "40"),
                              "exceed context window of 40")]:
        done = gen(path, *args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr
    assert gen(tmp_path / "strict.gguf", "--chat", "hi").returncode == 0  # the same template takes a user message
    s = Server(tmp_path / "strict.gguf")
    try:
        for stream in (False, True):
            got, raw = s.raw("POST", "/v1/chat/completions", json.dumps(
                {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "max_tokens": 2,
                 "stream": stream}))
            err = json.loads(raw)["error"]
            assert got == 400 and "System role not supported" in err["message"] and err["param"] == "messages", raw
        got, raw = s.raw("POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        assert got == 200, raw
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


def test_a_developer_message_reaches_the_prompt_and_a_dropped_tool_message_is_refused(managed):
    """Through the server (chatml): a developer message counts the prompt tokens a system message of
    the same text counts; a tool message, which chatml leaves out, is a 400 naming the message."""
    long = "You must always answer in French. " * 5
    usage = {}
    for first in ("developer", "system", None):
        msgs = ([{"role": first, "content": long}] if first else []) + [{"role": "user", "content": "hi"}]
        got, raw = managed.raw("POST", "/v1/chat/completions", json.dumps({"messages": msgs, "max_tokens": 1,
                                                                            "temperature": 0}))
        assert got == 200, raw
        usage[first] = json.loads(raw)["usage"]["prompt_tokens"]
    assert usage["developer"] == usage["system"] > usage[None] + 20
    got, raw = managed.raw("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": long}], "max_tokens": 1}))
    err = json.loads(raw)["error"]
    assert got == 400 and err["param"] == "messages" and "messages[1].role" in err["message"], raw


def test_a_seeded_completion_does_not_depend_on_the_request_before(small_gguf):
    """The same seeded request gave another text right after itself (its prompt's prefix kept in the
    KV cache, evaluated in another batch shape, moving the logits slightly) than after another
    request: a seed now evaluates the whole prompt, as a fresh process does. This prompt flipped a
    sample at temperature 2 (1 of 40 prompts did)."""
    from expertcache.llama.completion import stream_completion
    from expertcache.llama.textgen import Session, completion_kwargs

    def text(llm, prompt, temperature, seed, n):
        kw = completion_kwargs(n, temperature, 1.0, seed)
        return "".join(c["choices"][0]["text"] for c in stream_completion(llm, prompt, **kw))

    with Session.open(str(small_gguf), n_ctx=512) as session:
        llm = session.llama
        text(llm, "something else entirely", 0.0, None, 3)
        after_other = text(llm, "x\u4e17\u00e9", 2.0, 23, 60)
        after_itself = text(llm, "x\u4e17\u00e9", 2.0, 23, 60)
    assert after_itself == after_other


def test_llama_cpps_sampling_fields_are_served_or_refused(managed, small_gguf):
    """llama.cpp's sampling extensions: ``repeat_penalty``, ``min_p``, ``typical_p`` and ``mirostat``
    sample as llama-cpp-python's own ``create_completion`` does with them (a fresh ``Llama``, the same
    seed); ``min_p`` near 1 leaves only the likeliest token, so hot sampling is greedy; the fields
    llama.cpp has and this server does not are a 400 naming the field when set to change the
    answer, and accepted at their defaults (a client that sends them all)."""
    import llama_cpp

    client = managed.client()
    llm = llama_cpp.Llama(str(small_gguf), n_ctx=512, verbose=False, seed=0)
    ask = dict(model="small-moe", prompt=PROMPT, max_tokens=24)

    def served(**extra) -> str:
        return client.completions.create(**ask, extra_body=extra).choices[0].text

    def direct(**kw) -> str:
        llm.reset()
        return llm.create_completion(PROMPT, max_tokens=24, **kw)["choices"][0]["text"]

    greedy = served(temperature=0)
    penalised = served(temperature=0, repeat_penalty=1.5)
    assert penalised != greedy and penalised == direct(temperature=0, repeat_penalty=1.5, top_k=1)
    assert served(temperature=1.5, seed=5, min_p=0.999) == greedy
    for kw in (dict(min_p=0.2), dict(typical_p=0.5, min_p=0.0), dict(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2)):
        mode = {"mirostat_mode": kw.pop("mirostat")} if "mirostat" in kw else {}
        got = served(temperature=1.0, seed=11, top_k=0, **kw, **({"mirostat": mode["mirostat_mode"]} if mode else {}))
        assert got == direct(temperature=1.0, seed=11, top_k=0, top_p=1.0, **kw, **mode), kw
    defaults = dict(repeat_last_n=64, dynatemp_range=0, xtc_probability=0, dry_multiplier=0.0, top_n_sigma=-1,
                    grammar="", n_probs=0, ignore_eos=False, min_p=0.05, typical_p=1, repeat_penalty=1, mirostat=0)
    assert served(temperature=0, **defaults) == greedy
    for field, value in (("repeat_last_n", 128), ("dynatemp_range", 0.5), ("xtc_probability", 0.1),
                         ("dry_multiplier", 0.8), ("top_n_sigma", 1.0), ("grammar", "root ::= \"a\""),
                         ("n_probs", 3), ("ignore_eos", True), ("samplers", ["top_k"]), ("mirostat", 3),
                         ("min_p", 1.5), ("repeat_penalty", 0)):
        status, raw = managed.raw("POST", "/v1/completions", json.dumps({"prompt": PROMPT, field: value}))
        assert status == 400 and json.loads(raw)["error"]["param"] == field, (field, raw)


def test_llama_cpps_completion_endpoint_answers_in_its_shape(managed, small_gguf, greedy_text):
    """``POST /completion`` (llama.cpp's own API): greedy text the same as ``llama generate``'s; its
    defaults llama.cpp's (a seeded sample the same as llama-cpp-python's ``create_completion`` with
    temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); ``stop_type`` ``limit``, ``word`` (with its
    ``stopping_word``) or ``eos``; token counts as ``/v1/completions`` counts them; streamed, the same
    text a piece an event, then the answer, no ``[DONE]``; ``n_predict`` -1 stops within the context;
    ``json_schema`` and ``logit_bias`` pairs held; what is refused is a 400 naming the field as the
    request names it; ``/metrics`` counts the path."""
    import llama_cpp

    def post(body) -> tuple[int, dict]:
        status, raw = managed.raw("POST", "/completion", json.dumps(body))
        return status, json.loads(raw)

    status, out = post({"prompt": PROMPT, "n_predict": 16, "temperature": 0})
    openai_usage = managed.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=16,
                                                       temperature=0).usage
    assert status == 200 and out["content"] == greedy_text and out["stop"] is True and out["stop_type"] == "limit"
    assert (out["tokens_evaluated"], out["tokens_predicted"]) == (openai_usage.prompt_tokens, 16)
    assert out["prompt"] == PROMPT and out["timings"]["predicted_n"] == 16 and out["truncated"] is False
    llm = llama_cpp.Llama(str(small_gguf), n_ctx=512, verbose=False, seed=0)
    want = llm.create_completion(PROMPT, max_tokens=16, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                 seed=7)["choices"][0]["text"]
    assert post({"prompt": PROMPT, "n_predict": 16, "seed": 7})[1]["content"] == want  # llama.cpp's defaults
    word = greedy_text[6:10]
    status, cut = post({"prompt": PROMPT, "n_predict": 16, "temperature": 0, "stop": [word]})
    assert (cut["content"], cut["stop_type"], cut["stopping_word"]) == (greedy_text[:greedy_text.index(word)], "word",
                                                                        word)
    status, raw = managed.raw("POST", "/completion", json.dumps({"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                                  "stream": True}))
    events = [json.loads(e[len("data: "):]) for e in raw.decode().strip().split("\n\n")]
    assert status == 200 and b"[DONE]" not in raw and all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == greedy_text and events[-1]["stop"] is True
    assert events[-1]["tokens_predicted"] == 16 and events[-1]["has_new_line"] == ("\n" in greedy_text)
    status, rest = post({"prompt": PROMPT, "temperature": 0})  # n_predict -1: to the end of generation or context
    assert status == 200 and rest["stop_type"] in ("eos", "limit") and rest["content"].startswith(greedy_text)
    assert rest["tokens_evaluated"] + rest["tokens_predicted"] <= 512
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    status, shaped = post({"prompt": PROMPT, "n_predict": 32, "json_schema": schema, "temperature": 0})
    assert shaped["stop_type"] == "eos" and set(json.loads(shaped["content"])) == {"n"}
    (bias_id,) = llm.tokenize(b" the", add_bos=False)
    assert post({"prompt": PROMPT, "n_predict": 3, "temperature": 0, "logit_bias": [[bias_id, 100]]})[1][
        "content"] == " the" * 3
    for body, param in (({"n_predict": 0}, "n_predict"), ({"n_predict": -2}, "n_predict"),
                        ({"return_tokens": True}, "return_tokens"), ({"logit_bias": [["hi", 1.0]]}, "logit_bias"),
                        ({"logit_bias": [[1, False]]}, "logit_bias"), ({"prompt": ["a", "b"]}, "prompt"),
                        ({"dry_multiplier": 0.5}, "dry_multiplier"), ({"json_schema": {"minimum": 1, "type": "integer"}},
                                                                      "json_schema"),
                        ({"temperature": "0.8"}, "temperature"), ({"prompt": [0, 10 ** 9]}, "prompt")):
        status, err = post({"prompt": PROMPT, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)
    assert managed.metrics()['expertcache_requests_total{endpoint="/completion",code="200"}'] >= 7


class _ByteVocab:
    """A stand-in for a ``Llama`` whose tokens are single bytes (a byte-level vocabulary's fallback
    tokens): token t is byte t, 0 the end of generation; ``generate`` yields a script."""

    def __init__(self, script):
        self.script, self._seed, self.model_path, self.detokenized = script, 0, "bytes", 0
        self._model = type("M", (), {"vocab": None})()
        self.input_ids = np.zeros(4096, dtype=np.intc)  # a Llama's own context, as n_ctx() says here

    def n_ctx(self):
        return 4096

    def set_seed(self, seed):
        pass

    def tokenize(self, text, special=True):
        return list(text)

    def detokenize(self, tokens, prev_tokens=None, special=False):
        self.detokenized += len(tokens)
        return bytes(tokens)

    def generate(self, tokens, **kw):
        yield from self.script


def test_the_completion_loop_is_linear_on_bytes_that_are_not_utf8(monkeypatch):
    """Invalid UTF-8 (a lone 0xff, a truncated sequence) becomes U+FFFD and never holds the text back:
    one chunk per token, each token detokenized once (llama-cpp-python's loop re-decoded every held
    token on each new one); a stop sequence is held back while it could still begin, and cut."""
    from expertcache.llama import completion

    monkeypatch.setattr(completion.llama_cpp, "llama_vocab_is_eog", lambda vocab, token: token == 0)
    script = [0xFF, ord("a")] * 2000 + [0xE2, 0x82] + [ord("b")]  # 0xE2 0x82 begins "€" and is never finished
    llm = _ByteVocab(script)
    chunks = list(completion.stream_completion(llm, "p", max_tokens=len(script)))
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "\ufffda" * 2000 + "\ufffdb" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == len(script) + 1 and llm.detokenized == len(script)
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["\ufffd", "a"]  # nothing held behind the bad byte
    llm = _ByteVocab(list(b"one STOP two") + [0])
    chunks = list(completion.stream_completion(llm, "p", max_tokens=100, stop=["STOP", "xyz"]))
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == "one " and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert pieces[:4] == ["o", "n", "e", " "] and not any("S" in p for p in pieces)  # "S", "ST", ... held back
    llm = _ByteVocab(list(b"ab") + [0])  # the end of generation: "stop", the text whole
    chunks = list(completion.stream_completion(llm, "p", max_tokens=100, stop=["b!"]))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(completion.PromptError, match="empty"):
        next(completion.stream_completion(_ByteVocab([]), ""))
    with pytest.raises(completion.PromptError, match="exceed context window") as exc:
        next(completion.stream_completion(_ByteVocab([]), "x" * 5000))
    assert exc.value.code == "context_length_exceeded"


def test_the_slot_is_first_come_first_served_and_waiters_may_leave():
    """``Slot``: a waiter that gives up leaves the queue; the slot handed to a waiter that is leaving
    is passed on; release with nobody waiting frees it."""
    import asyncio

    from expertcache.llama.server import Slot

    async def main():
        slot, order = Slot(), []
        assert await slot.acquire(None) is None and slot.locked()

        async def never():
            return None

        leave = asyncio.Event()

        async def wants_to_leave():
            return "gone" if leave.is_set() else None

        async def waiter(name, give_up):
            got = await slot.acquire(give_up)
            order.append((name, got))
            if got is None:
                slot.release()

        a = asyncio.ensure_future(waiter("a", wants_to_leave))
        b = asyncio.ensure_future(waiter("b", never))
        await asyncio.sleep(0.05)
        leave.set()
        await asyncio.sleep(0.5)  # a looks, and leaves the queue
        slot.release()
        await asyncio.wait_for(asyncio.gather(a, b), 5)
        assert order == [("a", "gone"), ("b", None)] and not slot.locked() and not slot.waiters

    asyncio.run(main())


def test_the_live_wall_gauge_shows_the_proofs_published_peak(small_gguf, tmp_path):
    """``serve --memory-wall``'s ``/metrics`` reads the peak the wall's sampler publishes (the proof's
    own measure), not a sampler of its own: the higher of that and the page cache now; the proof's
    verdict follows the peak."""
    from expertcache.llama.server import WallGauge
    from expertcache.wall.cgroupfs import publish_peak
    from expertcache.wall.pagecache import FileCache, evict_file_pages

    path = tmp_path / "own.gguf"  # a copy no other process maps: its page cache is this test's
    path.write_bytes(small_gguf.read_bytes())
    evict_file_pages([str(path)])
    now = FileCache([str(path)]).bytes()
    peak_file = str(tmp_path / "w.follow.peak")
    gauge = WallGauge(str(path), 10 << 20, peak_file)

    def read():
        return {name: value for name, _, value in gauge()}

    assert read()["wall_tier_peak_bytes"] == now  # nothing published yet: the reading now
    publish_peak(peak_file, now + (3 << 20))
    got = read()
    assert got["wall_tier_peak_bytes"] == now + (3 << 20) and got["wall_proof_ok"] == 1
    publish_peak(peak_file, gauge.capacity + gauge.slack)  # at the proof's bound: still ok
    assert read()["wall_proof_ok"] == 1
    publish_peak(peak_file, gauge.capacity + gauge.slack + 1)  # over it: the live proof says so
    assert read()["wall_proof_ok"] == 0


@pytest.mark.parametrize("value", ["{", "[]", '{"capacity": 0, "follow_flag": null, "bandwidth": {}}',
                                   '{"capacity": 5, "follow_flag": 3, "bandwidth": {}}',
                                   '{"capacity": 5, "follow_flag": null, "bandwidth": {"2": 1.0}}',
                                   '{"capacity": 5, "follow_flag": null, "bandwidth": {"1": "fast"}}',
                                   '{"capacity": 5, "follow_flag": null}', "x" * 5000])
def test_a_wall_variable_not_written_by_the_wall_is_one_line(monkeypatch, value):
    """``EXPERTCACHE_SERVE_WALL`` is how the walled parent talks to its server; anything else found
    there is refused in one line, not taken (a text bandwidth had been a rate)."""
    from expertcache.cli.serve_cmd import WALL_ENV, wall_inside
    from expertcache.errors import ConfigError

    monkeypatch.setenv(WALL_ENV, value)
    with pytest.raises(ConfigError, match="EXPERTCACHE_SERVE_WALL: not what serve --memory-wall gives"):
        wall_inside()
    monkeypatch.setenv(WALL_ENV, '{"capacity": 5, "follow_flag": "/tmp/f", "bandwidth": {"1": 2.5e9, "4": null}}')
    assert wall_inside() == {"capacity": 5, "follow_flag": "/tmp/f", "bandwidth": {1: 2.5e9, 4: None}}
    monkeypatch.delenv(WALL_ENV, raising=False)
    assert wall_inside() is None


def test_a_request_starts_no_thread(managed):
    """Every thread a request runs on exists before it (docs/serve.md, "Threads"): the decode and the
    rendering of ``/metrics`` run on two threads made at the server's start, before its model loads.
    Inside ``serve --memory-wall`` a new thread's stack and kernel memory are charged to a cgroup
    whose limit hugs the server after its warm-up (docs/robustness.md, "Under load"); before, every
    request started a decode thread of its own and ``/metrics`` one of anyio's pool."""
    tasks = Path(f"/proc/{managed.proc.pid}/task")

    def threads() -> set[str]:
        return {p.name for p in tasks.iterdir()}

    managed.metrics()
    before = threads()
    seen: set[str] = set()
    sock = open_stream(managed, 200, each=lambda: seen.update(threads()))  # while it decodes
    managed.metrics()
    seen |= threads()
    sock.close()
    client = managed.client()
    client.completions.create(model="small-moe", prompt="x = 1", max_tokens=4, temperature=0)
    seen |= threads()
    client.chat.completions.create(model="small-moe", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   temperature=0)
    managed.metrics()
    seen |= threads()
    assert seen - before == set(), f"threads started by requests: {sorted(seen - before)}"


def test_logprobs_agree_with_llama_cpp_pythons_own(managed, small_gguf):
    """``logprobs`` (docs/serve.md, "Log-probabilities") against llama-cpp-python computing them its
    own way: a ``Llama`` keeping every position's logits (``logits_all``) and its own non-streamed
    ``create_completion(logprobs=N)``: the same tokens, log-probabilities, alternatives and text
    offsets. Then the server's own invariants: one entry per completion token, a stream's entries
    those of the same request unstreamed, a chat's shape."""
    llama_cpp = pytest.importorskip("llama_cpp")
    client = managed.client()
    got = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                    seed=1)
    lp = got.choices[0].logprobs
    llm = llama_cpp.Llama(str(small_gguf), n_ctx=512, logits_all=True, verbose=False)
    try:
        want = llm.create_completion(PROMPT, max_tokens=12, temperature=0.0, top_k=1, logprobs=3)["choices"][0]
    finally:
        llm.close()
    assert got.choices[0].text == want["text"]
    assert lp.tokens == want["logprobs"]["tokens"] and lp.text_offset == want["logprobs"]["text_offset"]
    # its logits_all forward computes every row's output, ours the last row's: other matrix shapes,
    # which move an f16 model's logits in the fourth digit (1.7e-3 of -3.81 seen)
    close = {"rel": 2e-3, "abs": 2e-3}
    assert lp.token_logprobs == pytest.approx(want["logprobs"]["token_logprobs"], **close)
    for mine, theirs in zip(lp.top_logprobs, want["logprobs"]["top_logprobs"]):
        assert mine.keys() == theirs.keys() and list(mine.values()) == pytest.approx(list(theirs.values()), **close)
    n = got.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n == 12
    assert "".join(lp.tokens) == got.choices[0].text and lp.text_offset[0] == len(PROMPT)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen is the likeliest
        assert chosen == max(top.values()) and chosen <= 0 and len(top) == 3
    # streamed: the same entries, each with the chunk its token made (its text may come later)
    stream = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                       seed=1, stream=True)
    tokens, values = [], []
    for c in stream:
        if c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            values += c.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-5)
    # a chat: OpenAI's shape, exactly top_logprobs alternatives, the token's bytes
    msgs = [{"role": "user", "content": "What is a list?"}]
    chat = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, seed=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    for e in content:
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token and len(e.top_logprobs) == 2
        assert e.logprob == e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    chunks = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=8, temperature=0,
                                            logprobs=True, seed=1, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs: none
    cut = client.completions.create(model="small-moe", prompt="def main():", max_tokens=24, temperature=0, logprobs=1,
                                    stop=["\n"], seed=1)  # a stop sequence cuts the text, not the tokens' entries
    assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].logprobs.tokens) == cut.usage.completion_tokens
    assert "".join(cut.choices[0].logprobs.tokens).startswith(cut.choices[0].text + "\n")
    plain = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def prompt_ids(gguf: Path) -> tuple[list[int], int, int]:
    """PROMPT's token ids as the server tokenizes a text prompt, the vocabulary's size, its BOS."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        return vocab.tokenize(PROMPT.encode(), special=True), vocab.n_vocab(), vocab.token_bos()
    finally:
        vocab.close()


def test_a_prompt_of_token_ids_is_the_same_prompt(managed, small_gguf):
    """A completion's ``prompt`` may be token ids (a list, or a list of one list), as OpenAI's and
    vLLM's: the same text, usage and logprobs as the prompt's text; an id outside the vocabulary, a
    number that is not an integer, or more than one prompt is a 400 naming the prompt."""
    ids, n, _ = prompt_ids(small_gguf)
    client = managed.client()
    want = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=8, temperature=0, seed=1, logprobs=1)
    for prompt in (ids, [ids]):
        got = client.completions.create(model="small-moe", prompt=prompt, max_tokens=8, temperature=0, seed=1,
                                        logprobs=1)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(ids)
        assert got.choices[0].logprobs.text_offset == want.choices[0].logprobs.text_offset
    for prompt in ([n], [-1], [ids[0], 1.5], [True], [ids, ids], [], [[]], [ids[0], "x"]):
        status, raw = managed.raw("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}))
        assert status == 400 and json.loads(raw)["error"]["param"] == "prompt", (prompt, raw[:200])


def test_echo_with_logprobs_scores_the_prompt_as_an_independent_forward_does(managed, small_gguf):
    """``echo`` with ``logprobs`` (how an evaluation harness scores a text: lm-eval's
    ``local-completions`` sends token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``): the prompt's
    tokens and their log-probabilities before the completion's, against expertcache's own engine
    (``llama.engine.Engine``: llama.cpp through ctypes, not llama-cpp-python) giving every position's
    logits in one forward. llama-cpp-python's ``echo`` is no reference: on a model without a BOS it
    scores each token with the logits of its own position (which predict the next token), and
    leaves out the last new token. Streamed, the same; without ``logprobs``, the prompt's text before the completion's."""
    from expertcache.llama.engine import Engine

    ids, _, bos = prompt_ids(small_gguf)
    client = managed.client()
    got = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                    echo=True, seed=1).choices[0]
    lp = got.logprobs
    skip = 1 if ids[0] == bos else 0  # a leading BOS is not listed
    new = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                    seed=1).choices[0]
    assert got.text == PROMPT + new.text and len(lp.tokens) == len(ids) - skip + 4
    assert lp.tokens[len(ids) - skip:] == new.logprobs.tokens
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids) - skip:] == new.logprobs.text_offset
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first listed: OpenAI's null
    with Engine(str(small_gguf), n_ctx=512) as eng:
        completion: list[int] = []  # the greedy new tokens
        logits = eng.forward(ids, logits="all").astype(np.float64)
        for _ in range(3):  # the new tokens, greedy, one forward each (as the server decodes them)
            completion.append(int(np.argmax(logits[-1])))
            logits = np.vstack([logits, eng.forward([completion[-1]], logits="all")])
    full = ids + completion
    lse = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
    want = [logits[i - 1, full[i]] - lse[i - 1] for i in range(1 + skip, len(full))]  # row i-1 predicts token i
    close = {"rel": 2e-3, "abs": 2e-3}  # another batch shape: an f16 model's logits move in the fourth digit
    assert lp.token_logprobs[1:len(full) - skip] == pytest.approx(want, **close)
    for j, top in enumerate(lp.top_logprobs[1:len(full) - skip], start=1 + skip):
        assert len(top) in (3, 4) and top[lp.tokens[j - skip]] == pytest.approx(want[j - 1 - skip], **close)
    streamed = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                         echo=True, seed=1, stream=True)
    tokens, values, text = [], [], ""
    for c in streamed:
        text += c.choices[0].text
        if c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            values += c.choices[0].logprobs.token_logprobs
    assert text == got.text and tokens == lp.tokens and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    # as lm-eval asks: token ids, one new token
    harness = client.completions.create(model="small-moe", prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                        echo=True).choices[0].logprobs
    n = len(ids) - skip
    assert harness.tokens == lp.tokens[:n + 1]
    assert harness.token_logprobs[1:n + 1] == pytest.approx(lp.token_logprobs[1:n + 1], abs=1e-5)
    plain = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, seed=1)
    assert plain.choices[0].text == got.text and plain.choices[0].logprobs is None


def test_response_format_and_logit_bias_sample_as_llama_cpp_python_does(managed, small_gguf):
    """``response_format`` and ``logit_bias`` (docs/serve.md, "Structured output and logit_bias")
    against llama-cpp-python sampling with the same grammar or biases in its own loop
    (``create_completion``): the same text, greedy. Then what they promise: a JSON mode's text is a
    JSON object, a schema's text validates (an enum is one of its values), a stream sends the same
    text, a biased token is the only one sampled (+100) or never (-100)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

    client = managed.client()
    point = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                              "tag": {"type": "string", "maxLength": 8}}, "required": ["n", "ok"]}
    answer = {"type": "string", "enum": ["yes", "no"]}
    cases = [({"type": "json_object"}, LlamaGrammar.from_string(JSON_GBNF), dict),
             ({"type": "json_schema", "json_schema": {"name": "point", "schema": point, "strict": True}},
              LlamaGrammar.from_json_schema(json.dumps(point)), dict),
             ({"type": "json_object", "schema": answer},  # llama-cpp-python's server's spelling
              LlamaGrammar.from_json_schema(json.dumps(answer)), str)]
    llm = llama_cpp.Llama(str(small_gguf), n_ctx=512, verbose=False)
    try:
        for fmt, grammar, kind in cases:
            got = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=64, temperature=0, seed=1,
                                            extra_body={"response_format": fmt})
            want = llm.create_completion(PROMPT, max_tokens=64, temperature=0.0, top_k=1, repeat_penalty=1.0,
                                         grammar=grammar)["choices"][0]
            text = got.choices[0].text
            assert text == want["text"] and got.choices[0].finish_reason == "stop" == want["finish_reason"], (fmt, text)
            value = json.loads(text)
            assert isinstance(value, kind), (fmt, text)
            if fmt.get("json_schema"):
                assert isinstance(value["n"], int) and isinstance(value["ok"], bool) and len(value.get("tag", "")) <= 8
            if kind is str:
                assert value in answer["enum"]
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model="small-moe", prompt=PROMPT, max_tokens=64, temperature=0, seed=1, stream=True,
                extra_body={"response_format": fmt}))
            assert streamed == text
        plain = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=6, temperature=0, seed=1,
                                          logprobs=0)
        first = plain.choices[0].logprobs.tokens[0]
        first_id = llm.tokenize(first.encode(), add_bos=False, special=True)
        assert len(first_id) == 1
        target = 7 if first_id[0] != 7 else 8
        for bias in ({str(target): 100.0}, {str(first_id[0]): -100.0}):
            got = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=6, temperature=0, seed=1,
                                            logit_bias=bias, logprobs=0)
            want = llm.create_completion(PROMPT, max_tokens=6, temperature=0.0, top_k=1, repeat_penalty=1.0,
                                         logit_bias=bias)["choices"][0]["text"]
            assert got.choices[0].text == want, bias
            tokens = got.choices[0].logprobs.tokens
            if bias.get(str(target)) == 100.0:
                assert tokens == [llm.detokenize([target]).decode("utf-8", "replace")] * 6
            else:
                assert tokens[0] != first and first not in tokens
    finally:
        llm.close()
    chat = client.chat.completions.create(model="small-moe", messages=[{"role": "user", "content": "Is it?"}],
                                          max_tokens=32, temperature=0,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "answer", "schema": {"type": "object", "properties": {
                                                  "answer": answer}, "required": ["answer"]}}})
    assert chat.choices[0].finish_reason == "stop"
    assert json.loads(chat.choices[0].message.content)["answer"] in answer["enum"]


def test_sampled_text_keeps_to_the_schema_at_any_temperature(managed):
    """Sampling under a grammar draws from the chain first and lets the grammar check only that
    token (``constraints.GrammarFirst``, as llama.cpp's own sampler); whatever is drawn, the text
    keeps to the schema and is JSON: seeded requests at temperatures 0.7-2 with patterns (escapes,
    ``.``), an enum, a length bound and a date format. Before, the converter's string let a newline
    through unescaped (``json.loads`` refused the text) and its patterns' ``\\d`` made a grammar
    llama.cpp refuses."""
    import re

    client = managed.client()
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[ab]{2,4}\\.\\d$"},
                                               "note": {"type": "string", "pattern": "^.{1,6}$"},
                                               "pick": {"type": "string", "enum": ["red", "green"]},
                                               "n": {"type": "integer"}, "tag": {"type": "string", "maxLength": 3},
                                               "when": {"type": "string", "format": "date"}},
              "required": ["code", "note", "pick", "n", "tag", "when"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    for seed in range(12):
        got = client.completions.create(model="small-moe", prompt=PROMPT, max_tokens=240, temperature=0.7 + seed / 9,
                                        seed=seed, extra_body={"response_format": fmt})
        assert got.choices[0].finish_reason == "stop", (seed, got.choices[0].text)
        value = json.loads(got.choices[0].text)
        assert re.fullmatch(r"[ab]{2,4}\.\d", value["code"]) and re.fullmatch(".{1,6}", value["note"]), value
        assert value["pick"] in ("red", "green"), value
        assert isinstance(value["n"], int) and len(value["tag"]) <= 3, value
        assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", value["when"]), value


def test_generate_keeps_to_a_json_schema_as_the_server_does(managed, small_gguf, tmp_path):
    """``llama generate --json-schema`` (llama.cpp's ``-j``) gives the server's ``response_format``
    text for the same schema; a schema it cannot hold, or not JSON, is one line (exit 2)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}
    (tmp_path / "s.json").write_text(json.dumps(schema), encoding="utf-8")
    served = managed.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=64, temperature=0,
                                                 seed=1, extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "s", "schema": schema}}})

    def gen(*args):
        return subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(small_gguf),
                               "--prompt", PROMPT, "--max-new-tokens", "64", *args], capture_output=True, text=True,
                              cwd=REPO, timeout=300)

    for args in (["--json-schema", json.dumps(schema)], ["--json-schema-file", str(tmp_path / "s.json")]):
        done = gen(*args, "--json")
        assert done.returncode == 0, done.stderr
        rec = json.loads(done.stdout)
        assert rec["text"] == served.choices[0].text and rec["finish_reason"] == "stop", (rec, served)
    (tmp_path / "bad.json").write_bytes(b"\xff{}")
    for args, match in [(["--json-schema", '{"type": "integer", "maximum": 3}'], "--json-schema: schema: maximum"),
                        (["--json-schema", "[1]"], "a JSON schema is a JSON object"),
                        (["--json-schema", "{"], "--json-schema: not JSON"),
                        (["--json-schema-file", str(tmp_path / "bad.json")], "not UTF-8"),
                        (["--json-schema-file", str(tmp_path / "none.json")], "No such file")]:
        done = gen(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and match in lines[0], (args, done.stderr)


def test_a_forced_tool_call_is_its_arguments_under_the_parameters_grammar(managed):
    """``tools`` with ``tool_choice`` naming a function (or ``required`` with one tool): the answer is
    that call, its arguments sampled under the grammar of its ``parameters`` (the text
    ``response_format`` gives for that schema: chatml shows no tools, so the prompt is the same),
    in OpenAI's shapes: ``message.tool_calls``, a stream's ``delta.tool_calls`` pieces,
    ``finish_reason`` ``stop`` for a named call and ``tool_calls`` for ``required``, as OpenAI's API
    gives them. ``auto`` is a 400 here: chatml teaches no call format the server reads (a Hermes
    template: ``test_auto_tool_calls_of_a_hermes_template``)."""
    client = managed.client()
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "a city's weather",
                                               "parameters": params}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    shaped = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=64, temperature=0, seed=1,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "w", "schema": params}})
    named = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=64, temperature=0, seed=1,
                                           tools=tools, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].message.content is None and named.choices[0].finish_reason == "stop"
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments == shaped.choices[0].message.content
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and isinstance(args["days"], int) and len(args["city"]) <= 12
    required = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=64, temperature=0, seed=1,
                                              tools=tools, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    pieces, firsts, finish = [], [], None
    for c in client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=64, temperature=0, seed=1,
                                            tools=tools, tool_choice="required", stream=True):
        for tc in c.choices[0].delta.tool_calls or []:
            pieces.append(tc.function.arguments or "")
            if tc.id is not None:
                firsts.append((tc.id, tc.function.name))
        finish = c.choices[0].finish_reason or finish
    assert "".join(pieces) == call.function.arguments and finish == "tool_calls"
    assert len(firsts) == 1 and firsts[0][1] == "get_weather" and firsts[0][0].startswith("call_")
    none = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=8, temperature=0, seed=1,
                                          tools=tools, tool_choice="none")
    plain = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=8, temperature=0, seed=1)
    assert none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls

    def refused(param, **kw):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=8, **kw)
        assert info.value.body["param"] == param, info.value.body
        return info.value.body["message"]

    # chatml teaches no call format: auto, by default, and required among several are refused
    assert "teaches no tool-call format" in refused("tool_choice", tools=tools)
    assert "teaches no tool-call format" in refused("tool_choice", tools=tools, tool_choice="auto")
    two = tools + [{"type": "function", "function": {"name": "f2"}}]
    assert "2 tools given" in refused("tool_choice", tools=two, tool_choice="required")
    assert "no tool is named" in refused("tool_choice", tools=tools, tool_choice={"type": "function",
                                                                                 "function": {"name": "nope"}})
    assert "no tools" in refused("tool_choice", tool_choice="required")
    assert "leave response_format out" in refused("response_format", tools=tools, tool_choice="required",
                                                  response_format={"type": "json_object"})
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "maximum": 3}}}}}]
    assert "maximum is not held" in refused("tools", tools=bad, tool_choice="required")
    refused("tools", tools=[{"type": "function", "function": {"name": "has space"}}], tool_choice="required")


def _fuzzed_schema(rng, depth=0):
    """A generated JSON-schema-like value: keywords held and not, hostile values, nesting."""
    hostile = [None, True, -1, 0, 2.5, 1e308, 10**20, "", "x", "^[a-z]{2,3}$", "^\\d+$", "^.{1,4}$", "^(|a)*$",
               "^a{99999999}$", '^a"$', "^\\D$", [], [1], {}]
    types = ["object", "array", "string", "integer", "number", "boolean", "null", "foo", ["string", "null"]]
    if depth > 3 or rng.random() < 0.2:
        return rng.choice(hostile) if rng.random() < 0.3 else {"type": rng.choice(types[:7])}
    node = {}
    for _ in range(rng.randint(0, 4)):
        k = rng.choice(["type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
                        "maxItems", "minLength", "maxLength", "pattern", "enum", "const", "anyOf", "allOf", "$ref",
                        "$defs", "format", "maximum", "title"])
        node[k] = (rng.choice(types) if k == "type" else
                   {rng.choice(["a", "b", 'q"', "x" * 40]): _fuzzed_schema(rng, depth + 1) for _ in range(rng.randint(0, 3))}
                   if k == "properties" else _fuzzed_schema(rng, depth + 1) if k in ("items", "additionalProperties")
                   else [_fuzzed_schema(rng, depth + 1) for _ in range(rng.randint(0, 2))] if k in ("prefixItems", "anyOf", "allOf")
                   else {"D": _fuzzed_schema(rng, depth + 1)} if k == "$defs"
                   else rng.choice(["#/$defs/D", "#", "#/nope", "https://x/y"]) if k == "$ref"
                   else rng.choice([["a", "b"], [1, None], [], ["a\nb"]]) if k == "enum"
                   else rng.choice([["a"], ["a", "zz"], []]) if k == "required"
                   else rng.choice(["date", "uuid", "email"]) if k == "format"
                   else rng.choice([h for h in hostile if isinstance(h, str)]) if k == "pattern"
                   else rng.choice(hostile))
    return node


@pytest.mark.parametrize("server", ["managed", "hermes"])
def test_generated_schemas_tools_and_biases_are_a_200_or_a_400_and_json(server, request):
    """Seeded generated requests (schemas with keywords held and not, hostile values; tools and
    tool choices; logit biases; streamed or not): each a 200 or a 400, never a 5xx; a non-streamed
    text under a grammar that finished with ``stop`` is JSON, and so is a completed call's
    arguments; the server answers after all of it. Some chat bodies also to ``/apply-template`` and
    ``/v1/chat/completions/input_tokens``: a 200 (a prompt, a count) or a 400; some completions to
    llama.cpp's ``/completion``: a 200 or a 400. Against chatml (no
    call format read) and a Hermes template (calls read back)."""
    import random

    managed = request.getfixturevalue(server)
    rng, prompts = random.Random(59), random.Random(61)
    seen = collections.Counter()
    for i in range(120):
        chat = rng.random() < 0.5
        body = {"max_tokens": rng.choice([8, 64]), "temperature": rng.choice([0, 1.2]), "seed": i,
                "stream": rng.random() < 0.25}
        body.update({"messages": [{"role": "user", "content": "JSON?"}]} if chat else {"prompt": PROMPT})
        r = rng.random()
        if r < 0.5:
            body["response_format"] = {"type": rng.choice(["json_object", "json_schema", "text", "xml"]),
                                       "json_schema": {"name": "s", "schema": _fuzzed_schema(rng)}}
        elif r < 0.75 and chat:
            body["tools"] = [{"type": "function", "function": {"name": rng.choice(["f", "g", "bad name"]),
                                                               "parameters": _fuzzed_schema(rng)}}]
            body["tool_choice"] = rng.choice([None, "auto", "none", "required", {"type": "function",
                                                                                 "function": {"name": "f"}}])
        else:
            body["logit_bias"] = {rng.choice(["1", "7", "2048", "01", "x"]): rng.choice([5, -100, 100.5, "5"])
                                  for _ in range(rng.randint(0, 3))}
        status, raw = managed.raw("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body))
        seen[status] += 1
        assert status in (200, 400), (status, body, raw[:300])
        if not chat and prompts.random() < 0.3:  # the same completion, asked of llama.cpp's /completion
            native = {k: v for k, v in body.items() if k != "max_tokens"}
            got, answered = managed.raw("POST", "/completion", json.dumps({**native, "n_predict": body["max_tokens"]}))
            assert got in (200, 400), (got, body, answered[:300])
            if got == 200:  # the answer, or the stream's last event
                last = json.loads(answered.decode().rstrip().rsplit("data: ", 1)[-1] if body["stream"] else answered)
                assert last["stop"] is True and isinstance(last["content"], str), last
            else:
                assert json.loads(answered)["error"]["message"]
        if chat and prompts.random() < 0.3:  # the same body's prompt: rendered, or counted (llama.cpp's paths)
            path = prompts.choice(["/apply-template", "/v1/chat/completions/input_tokens"])
            got, rendered = managed.raw("POST", path, json.dumps(body))
            assert got in (200, 400), (got, path, body, rendered[:300])
            if got == 200:
                answer = json.loads(rendered)
                assert answer["prompt"] if path == "/apply-template" else answer["input_tokens"] > 0, answer
            else:
                assert json.loads(rendered)["error"]["message"]
        if status != 200 or body["stream"]:
            continue
        out = json.loads(raw)["choices"][0]
        if out["finish_reason"] in ("stop", "tool_calls") and (body.get("response_format") or {}).get("type") in (
                "json_object", "json_schema"):
            json.loads(out["text"] if "text" in out else out["message"]["content"])
        if chat and out["message"].get("tool_calls") and out["finish_reason"] != "length":
            json.loads(out["message"]["tool_calls"][0]["function"]["arguments"])
    assert seen[200] >= 20 and seen[400] >= 20, seen
    assert managed.client().completions.create(model="small-moe", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{% if message.content %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}{% for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif think_open %}<think>
{% endif %}{% endif %}"""
"""A Qwen3-style chat template (its tools block, the Hermes <tool_call> format, an assistant turn's
thinking and Qwen3's ``enable_thinking`` switch, simplified). ``think_open``, a variable of this
test's, opens the <think> block in the prompt, as DeepSeek-R1-0528's and Qwen3's 2507 thinking
models' templates always do."""


def small_moe_with(tmp_path_factory, name: str, template: str | None, specials=(), words=()) -> Path:
    """small-moe converted with ``template`` as its own chat template and ``specials`` as special
    tokens of its vocabulary (its last ids, one each), as a release's tokenizer holds its tags;
    ``words`` as tokens written as text (user-defined), the ids before them: a test biases one to
    make the model write a whole call."""
    from expertcache.llama.convert import convert

    if not (SMALL / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    folder = tmp_path_factory.mktemp(name) / "small-moe"
    folder.mkdir()
    for f in SMALL.iterdir():
        if f.is_file() and f.name != "tokenizer.json":
            (folder / f.name).symlink_to(f)
    tok = json.loads((SMALL / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = len(tok["model"]["vocab"])
    tok["added_tokens"] += [{"id": vocab - 1 - i, "content": m, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, m in enumerate(specials)]
    tok["added_tokens"] += [{"id": vocab - 1 - len(specials) - i, "content": w, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": False} for i, w in enumerate(words)]
    (folder / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    if template is not None:  # None: a GGUF with no chat template
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    out = folder.parent / f"{name}.gguf"
    convert(folder, out, "f16")
    return out


def serving(tmp_path_factory, name: str, template: str, specials=(), words=()) -> Server:
    """:func:`small_moe_with`'s file served (``.gguf``: the file)."""
    out = small_moe_with(tmp_path_factory, name, template, specials, words)
    s = Server(out, "--ctx", "512", "--model-alias", "small-moe")
    s.gguf = out
    return s


def closing(gguf, template: str | None = None) -> dict:
    """A ``logit_bias`` that makes the model of a reasoning template (``template``, else the GGUF's)
    close its thinking block at once (the vocabulary's token that is the whole close tag), as a model
    that answers without thinking does: a forced call may follow a thinking block
    (:func:`expertcache.llama.callgrammar.call_grammar`), and a random model under that grammar
    thinks until ``max_tokens``. Empty for a template that thinks in no such block."""
    import llama_cpp

    from expertcache.llama.reasoning import DEEPSEEK, GEMMA4, KIMI_K3, MINIMAX_M3, TAGS, think_format
    from expertcache.llama.toolcalls import GEMMA4_OPEN

    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    fmt = think_format(template or llm.metadata.get("tokenizer.chat_template"))
    if fmt not in (DEEPSEEK, GEMMA4, KIMI_K3, MINIMAX_M3):
        return {}
    close = (GEMMA4_OPEN if fmt == GEMMA4 else TAGS[fmt][1]).encode()  # Gemma's prompt opens none: the call at once
    (token,) = [t for t in range(llm.n_vocab()) if llm.detokenize([t], special=True) == close]  # one token: the tag
    return {str(token): 100}


def unending(gguf) -> dict:
    """A ``logit_bias`` that keeps the model from ending its turn (each end-of-generation token of its
    vocabulary at -100): under a grammar of one call or more, it writes calls until ``max_tokens``."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    return {str(t): -100 for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)}


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """small-moe with HERMES_TEMPLATE as its own chat template and <think> / </think> as control
    tokens of its vocabulary (whose text llama.cpp leaves out unless asked), served."""
    s = serving(tmp_path_factory, "hermes", HERMES_TEMPLATE, ("<think>", "</think>"))
    yield s
    s.stop()


def test_auto_tool_calls_of_a_hermes_template(hermes):
    """A GGUF whose template teaches the Hermes format: ``auto`` shows the tools to the model and
    reads its ``<tool_call>`` blocks back (a model that answers in text gets its text); ``required``
    among several tools and a named one force a call in that format by grammar, read back by the
    same parser: the call's name one of the tools, its arguments JSON of its schema; streamed, the
    same call; one call with ``parallel_tool_calls: false``, else one or more; a second turn with the
    call and its result goes to the template."""
    client = hermes.client()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=24, temperature=0, seed=1)
    auto = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=24, temperature=0, seed=1,
                                          tools=tools)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are in the prompt
    assert auto.choices[0].message.content and not auto.choices[0].message.tool_calls
    assert auto.choices[0].finish_reason in ("stop", "length")
    bias = closing(hermes.gguf)  # the model closes its thinking at once
    assert bias
    one = dict(logit_bias=bias, parallel_tool_calls=False)  # one call (by default one or more: below)
    required = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=96, temperature=0, seed=1,
                                              tools=tools, tool_choice="required", **one)
    (call,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city"} and len(args["city"]) <= 10
    else:
        assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")
    named = client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=96, temperature=0, seed=1,
                                           tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           **one)
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.tool_calls[0].function.name == "get_time"
    streamed, finish, content = [], None, ""
    for c in client.chat.completions.create(model="small-moe", messages=msgs, max_tokens=96, temperature=0, seed=1,
                                            tools=tools, tool_choice="required", stream=True, **one):
        d = c.choices[0].delta
        streamed += [(tc.index, tc.function.name, tc.function.arguments) for tc in d.tool_calls or []]
        content += d.content or ""
        finish = c.choices[0].finish_reason or finish
    assert streamed == [(0, call.function.name, call.function.arguments)] and finish == "tool_calls", streamed
    assert content == ""
    # by default one call or more (the model kept from ending: it calls on until max_tokens), streamed the same
    on = dict(model="small-moe", messages=msgs, max_tokens=150, temperature=0, seed=1, tools=tools,
              tool_choice="required", logit_bias={**bias, **unending(hermes.gguf)})
    several = client.chat.completions.create(**on).choices[0]
    assert len(several.message.tool_calls) >= 2 and several.finish_reason == "length"
    for c in several.message.tool_calls:
        assert (c.function.name, set(json.loads(c.function.arguments))) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**on, stream=True) if c.choices]
    assert [(tc.index, tc.function.name, tc.function.arguments) for d in deltas for tc in d.tool_calls or []] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(several.message.tool_calls)]
    turn2 = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    after = client.chat.completions.create(model="small-moe", messages=turn2, max_tokens=8, temperature=0, tools=tools)
    assert after.usage.prompt_tokens > auto.usage.prompt_tokens and after.choices[0].finish_reason in ("stop", "length")


def test_llama_cpps_own_endpoints_tokenize_and_render_as_the_chat_endpoint_does(hermes):
    """llama.cpp's ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/v1/chat/completions/input_tokens``,
    ``GET /props`` and ``/v1/models``' ``meta``, through HTTP: the ids are the model's tokenizer's (llama-cpp-python's, asked
    directly), special tokens read as one unless ``parse_special`` is false, BOS with ``add_special``;
    each piece its text, or its bytes where they are not UTF-8, the pieces the content's bytes;
    ``/detokenize`` gives the text back, an id outside the vocabulary or a mistyped field a 400; the
    template's prompt is what a chat evaluates (its tokens ``input_tokens`` and the chat's
    ``prompt_tokens``, its tools rendered); ``/props`` tells the context, the template and the file;
    ``/metrics`` counts each by its path."""
    import llama_cpp

    llm = llama_cpp.Llama(str(hermes.gguf), vocab_only=True, verbose=False)

    def post(path: str, body) -> tuple[int, dict]:
        status, raw = hermes.raw("POST", path, json.dumps(body))
        return status, json.loads(raw)

    text = "Hi <think> 😀 déjà"
    status, out = post("/tokenize", {"content": text})
    assert status == 200 and out == {"tokens": llm.tokenize(text.encode(), add_bos=False, special=True)}
    assert post("/tokenize", {"content": text, "parse_special": False})[1]["tokens"] == \
        llm.tokenize(text.encode(), add_bos=False, special=False) != out["tokens"]
    assert post("/tokenize", {"content": text, "add_special": True})[1]["tokens"] == \
        llm.tokenize(text.encode(), add_bos=True, special=True)
    pieces = post("/tokenize", {"content": text, "with_pieces": True})[1]["tokens"]
    assert [p["id"] for p in pieces] == out["tokens"]
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) == \
        text.encode()
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes split across tokens
    for p in pieces:
        if isinstance(p["piece"], list):
            with pytest.raises(UnicodeDecodeError):
                bytes(p["piece"]).decode()
    assert post("/detokenize", {"tokens": out["tokens"]}) == (200, {"content": text})
    for bad, param in (({"tokens": [0, llm.n_vocab()]}, "tokens"), ({"tokens": [-1]}, "tokens"),
                       ({"tokens": [10 ** 30]}, "tokens"), ({"tokens": [1.0]}, "tokens"), ({"tokens": "1 2"}, "tokens"),
                       ({"content": 5}, "content"), ({"content": "\ud800"}, "content"), ({}, "content"),
                       ({"content": "x", "with_pieces": "yes"}, "with_pieces")):
        status, err = post("/detokenize" if "tokens" in bad else "/tokenize", bad)
        assert status == 400 and err["error"]["param"] == param, (bad, err)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    chat = {"model": "small-moe", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools}
    status, rendered = post("/apply-template", chat)
    assert status == 200 and "Weather in Paris?" in rendered["prompt"] and "get_weather" in rendered["prompt"]
    status, counted = post("/v1/chat/completions/input_tokens", chat)
    ids = post("/tokenize", {"content": rendered["prompt"], "add_special": True})[1]["tokens"]
    asked = hermes.client().chat.completions.create(**chat, max_tokens=1, temperature=0)
    assert status == 200 and counted == {"object": "response.input_tokens", "input_tokens": len(ids)}
    assert asked.usage.prompt_tokens == len(ids)
    assert post("/apply-template", {"messages": []})[0] == 400
    from expertcache.formats.gguf import read_geometry

    meta = read_geometry(str(hermes.gguf)).metadata  # the header as expertcache reads it, against llama.cpp's
    arch = meta["general.architecture"]
    (listed,) = hermes.client().models.list().data
    assert listed.id == "small-moe" and listed.meta == {
        "vocab_type": llama_cpp.llama_vocab_type(llm._model.vocab), "n_vocab": llm.n_vocab(),
        "n_ctx_train": meta[f"{arch}.context_length"], "n_embd": meta[f"{arch}.embedding_length"],
        "n_params": llama_cpp.llama_model_n_params(llm.model),
        "size": llama_cpp.llama_model_size(llm.model)}  # llama-server's meta, as llama.cpp reports the model
    assert listed.meta["size"] > 0.9 * hermes.gguf.stat().st_size
    status, raw = hermes.raw("GET", "/props")
    props = json.loads(raw)
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 1
    assert props["chat_template"] == HERMES_TEMPLATE and props["model_path"] == str(hermes.gguf)
    counts = hermes.metrics()
    for path in ("/tokenize", "/detokenize", "/apply-template", "/v1/chat/completions/input_tokens", "/props"):
        assert counts[f'expertcache_requests_total{{endpoint="{path}",code="200"}}'] >= 1, path
    assert counts['expertcache_requests_total{endpoint="/detokenize",code="400"}'] >= 3


def test_api_keys_are_asked_of_every_request_but_health_and_models(small_gguf, tmp_path):
    """``--api-key`` and ``--api-key-file`` (llama.cpp's): OpenAI's client with a key (``Authorization:
    Bearer``) and Anthropic's (``x-api-key``) are answered; no key, a wrong one, or a right one with
    another scheme is a 401 in the path's error shape, counted, and the server keeps serving;
    ``/health`` and ``/v1/models`` answer without one; a bad key or an empty file is one line
    before anything loads."""
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    (tmp_path / "keys").write_text("\n  key-from-file  \n\n", encoding="utf-8")
    served = Server(small_gguf, "--ctx", "256", "--chat-format", "chatml", "--model-alias", "small-moe",
                    "--api-key", "k1,k2", "--api-key-file", str(tmp_path / "keys"))
    try:
        assert served.info["api_keys"] == 3
        ask = dict(model="small-moe", prompt=PROMPT, max_tokens=2)
        for key in ("k1", "k2", "key-from-file"):
            client = openai.OpenAI(base_url=served.url + "/v1", api_key=key, timeout=120, max_retries=0)
            assert client.completions.create(**ask).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            served.client().completions.create(**ask)  # its key is "unused"
        claude = anthropic.Anthropic(base_url=served.url, api_key="k2", max_retries=0)
        assert claude.messages.create(model="small-moe", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
                                      ).usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=served.url, api_key="k3", max_retries=0).messages.create(
                model="small-moe", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        body = json.dumps({"prompt": PROMPT, "max_tokens": 2})
        for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "Basic k1"}, {"Authorization": "Bearer"},
                        {"x-api-key": "Bearer  k1"}):
            status, raw = served.raw("POST", "/v1/completions", body, {"Content-Type": "application/json", **headers})
            err = json.loads(raw)["error"]
            assert status == 401 and (err["type"], err["code"]) == ("authentication_error", "invalid_api_key"), headers
        status, raw = served.raw("POST", "/v1/messages", "{}", {})
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"  # Anthropic's shape
        assert json.loads(raw)["type"] == "error"
        for path in ("/health", "/v1/models"):
            assert served.raw("GET", path)[0] == 200, path
        assert served.raw("GET", "/metrics")[0] == 401
        status, text = served.raw("GET", "/metrics", None, {"Authorization": "Bearer k1"})
        assert status == 200 and b'expertcache_requests_total{endpoint="/v1/completions",code="401"} 6' in text, text
        assert b'expertcache_requests_total{endpoint="/v1/completions",code="200"} 3' in text
    finally:
        served.stop()
    (tmp_path / "blank").write_text("\n \n", encoding="utf-8")
    for args, match in ((("--api-key", "a,,b"), "--api-key: a key is empty"), (("--api-key", "é"), "printable ASCII"),
                        (("--api-key-file", str(tmp_path / "blank")), "holds no key"),
                        (("--api-key-file", str(tmp_path / "none")), "--api-key-file")):
        done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "serve", str(small_gguf), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and match in lines[0], (args, done.stderr)


def test_a_server_stopped_as_soon_as_it_announces_itself_exits(small_gguf):
    """SIGTERM right after the URL is announced (a supervisor that starts and stops it, a test that
    fails at once): the server exits 0 within seconds, each of three times. It had run on for ever:
    the signal came after the server's own handler (which only notes it, for uvicorn to act on) and
    before uvicorn listened for signals."""
    for _ in range(3):
        code, err = Server(small_gguf, "--ctx", "256").stop()  # stop: SIGTERM, then at most 30 s
        assert code == 0, err


def test_allowed_origins_let_a_page_of_that_origin_read_the_answers(small_gguf):
    """``--allowed-origins`` (CORS, vLLM's option): a browser's preflight from an allowed origin is
    answered without a key, a disallowed one is not allowed; answers (a 401 too, with a key asked)
    carry ``Access-Control-Allow-Origin`` for the allowed origin only; without the option no answer
    carries it; a malformed origin is one line."""
    served = Server(small_gguf, "--ctx", "256", "--api-key", "k1", "--allowed-origins",
                    "http://app.example.test, https://b.example.test:8443")
    plain = Server(small_gguf, "--ctx", "256")
    try:
        page = "http://app.example.test"
        preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        conn = http.client.HTTPConnection(served.host, served.port, timeout=60)
        conn.request("OPTIONS", "/v1/completions", headers=preflight)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("access-control-allow-origin") == page
        assert "POST" in resp.getheader("access-control-allow-methods")
        conn.request("OPTIONS", "/v1/completions", headers={**preflight, "Origin": "http://evil.example.test"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 400 and resp.getheader("access-control-allow-origin") is None
        body = json.dumps({"prompt": PROMPT, "max_tokens": 2})
        for key, status in (("k1", 200), ("k2", 401)):
            for origin, allowed in ((page, page), ("https://b.example.test:8443", "https://b.example.test:8443"),
                                    ("http://evil.example.test", None)):
                conn.request("POST", "/v1/completions", body=body, headers={
                    "Origin": origin, "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                assert (resp.status, resp.getheader("access-control-allow-origin")) == (status, allowed), (key, origin)
        conn.close()
        conn = http.client.HTTPConnection(plain.host, plain.port, timeout=60)
        conn.request("POST", "/v1/completions", body=body, headers={"Origin": page, "Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("access-control-allow-origin") is None
        conn.close()
    finally:
        served.stop()
        plain.stop()
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "serve", str(small_gguf), "--allowed-origins",
                           "app.example.test/path"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--allowed-origins" in done.stderr


def test_a_chat_template_file_stands_for_the_ggufs_own(hermes, tmp_path, tmp_path_factory):
    """``--chat-template-file`` (llama.cpp's): its template formats the chats of a GGUF that has none,
    and tells the server the call and thinking formats (``required`` among two tools is a Hermes
    call under its grammar, where with ``--chat-format chatml`` it is a 400:
    ``test_a_forced_tool_call_is_its_arguments_under_the_parameters_grammar``; a prompt the file
    opens a <think> block in gives reasoning); it serves a GGUF whose own template does not compile,
    which is otherwise refused; a file that cannot be read, is not UTF-8, is empty or does not
    compile, and the option beside ``--chat-format``, are one line before anything loads (``serve``
    checks each, ``llama generate`` some: one parser)."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "maxLength": 6}}, "required": ["x"]}}}
        for name in ("get_weather", "get_time")]
    ask = dict(model="small-moe", messages=[{"role": "user", "content": "hi"}], temperature=0, seed=1)
    (tmp_path / "hermes.jinja").write_text(HERMES_TEMPLATE, encoding="utf-8")
    bare = small_moe_with(tmp_path_factory, "no-template", None, ("<think>", "</think>"))  # its tags, no template
    served = Server(bare, "--ctx", "512", "--model-alias", "small-moe", "--chat-template-file",
                    str(tmp_path / "hermes.jinja"))
    try:
        client = served.client()
        answer = client.chat.completions.create(**ask, max_tokens=96, tools=tools, tool_choice="required",
                                                parallel_tool_calls=False, logit_bias=closing(bare, HERMES_TEMPLATE))
        (call,) = answer.choices[0].message.tool_calls
        assert call.function.name in ("get_weather", "get_time") and answer.choices[0].finish_reason == "tool_calls"
        assert set(json.loads(call.function.arguments)) == {"x"}
        opened = client.chat.completions.create(**ask, max_tokens=4,
                                                extra_body={"chat_template_kwargs": {"think_open": True}})
        assert getattr(opened.choices[0].message, "reasoning_content", None)
    finally:
        served.stop()
    broken = _with_metadata(hermes.gguf, tmp_path / "broken.gguf", tokenizer__chat_template="{% if %}")
    (tmp_path / "bin.jinja").write_bytes(b"\xff\xfe{{ x }}")
    (tmp_path / "empty.jinja").write_text(" \n", encoding="utf-8")
    (tmp_path / "bad.jinja").write_text("{% for %}", encoding="utf-8")
    refusals = [([], "or none (serve and llama generate take --chat-template-file PATH in its place)"),
                (["--chat-template-file", str(tmp_path / "none.jinja")], "No such file"),
                (["--chat-template-file", str(tmp_path / "bin.jinja")], "not UTF-8 text (byte 0)"),
                (["--chat-template-file", str(tmp_path / "empty.jinja")], "the file is empty"),
                (["--chat-template-file", str(tmp_path / "bad.jinja")], "not a template Jinja compiles"),
                (["--chat-template-file", str(tmp_path / "hermes.jinja"), "--chat-format", "chatml"],
                 "not allowed with argument")]
    text = ["--prompt", PROMPT, "--max-new-tokens", "2"]
    for cmd, options, picked in [(["serve"], ["--port", "0"], [0, 1, 2, 4, 5]), (["llama", "generate"], text, [0, 3])]:
        for args, match in (refusals[i] for i in picked):
            done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *cmd, str(broken), *options, *args],
                                  capture_output=True, text=True, cwd=REPO, timeout=120)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and match in lines[-1] and (len(lines) == 1 or "usage:" in lines[0]), \
                (cmd, args, done.stderr)
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "generate", str(broken), "--chat",
                           "hi", "--max-new-tokens", "2", "--chat-template-file", str(tmp_path / "hermes.jinja")],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr


def test_thinking_is_read_out_into_reasoning_content_and_template_variables_reach_the_template(hermes):
    """A template that teaches <think> blocks: a prompt the template opens one in (``think_open``, a
    ``chat_template_kwargs`` variable) makes the model's text its reasoning, as
    ``reasoning_format: none`` shows it raw, streamed the same; ``enable_thinking: false`` reaches
    the template (Qwen3's empty block in the prompt); a text with no block is content word for word;
    an assistant turn's ``reasoning_content`` goes back to the template; a grammar's text is not
    read for thinking; names the server sets are refused as template variables."""
    from expertcache.llama.reasoning import split_reasoning

    client = hermes.client()
    msgs = [{"role": "user", "content": "Capital of France?"}]
    ask = dict(model="small-moe", messages=msgs, max_tokens=24, temperature=0, seed=1)
    first = client.chat.completions.create(**ask)
    plain = first.choices[0]
    assert plain.message.content and getattr(plain.message, "reasoning_content", None) is None
    raw = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"think_open": True},
                                                            "reasoning_format": "none"})
    opened = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"think_open": True}})
    assert opened.usage.prompt_tokens > first.usage.prompt_tokens and raw.usage == opened.usage
    reasoning, content = split_reasoning(raw.choices[0].message.content, opened=True)
    msg = opened.choices[0].message
    assert reasoning and (msg.reasoning_content, msg.content) == (reasoning, content), (msg, raw)
    streamed = {"reasoning_content": "", "content": ""}
    for c in client.chat.completions.create(**ask, stream=True, extra_body={"chat_template_kwargs": {"think_open": True}}):
        for key in streamed:
            streamed[key] += (getattr(c.choices[0].delta, key, None) or "") if c.choices else ""
    assert streamed == {"reasoning_content": msg.reasoning_content, "content": msg.content}
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > opened.usage.prompt_tokens  # the empty block: more than "<think>"
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    turn2 = msgs + [{"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks a capital."},
                    {"role": "user", "content": "And Spain?"}]
    bare = msgs + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    with_thought = client.chat.completions.create(**{**ask, "messages": turn2, "max_tokens": 1})
    assert with_thought.usage.prompt_tokens > client.chat.completions.create(
        **{**ask, "messages": bare, "max_tokens": 1}).usage.prompt_tokens
    as_json = client.chat.completions.create(**ask, response_format={"type": "json_object"},
                                             extra_body={"chat_template_kwargs": {"think_open": True}})
    assert getattr(as_json.choices[0].message, "reasoning_content", None) is None and as_json.choices[0].message.content
    for kwargs, says in (({"temperature": 2}, "'temperature' is set by the server"),
                         ({"1x": 1}, "'1x' is not a template variable's name"),
                         ([1], "chat_template_kwargs: Input should be a valid dictionary")):
        status, body = hermes.raw("POST", "/v1/chat/completions", json.dumps({**ask, "chat_template_kwargs": kwargs}))
        err = json.loads(body)["error"]
        assert status == 400 and says in err["message"] and err["param"] == "chat_template_kwargs", body
    status, body = hermes.raw("POST", "/v1/chat/completions", json.dumps({**ask, "reasoning_format": "think"}))
    assert status == 400 and json.loads(body)["error"]["param"] == "reasoning_format", body
    # </think> is a control token here: written into the text all the same (as llama.cpp's server
    # preserves it), so the block closes; three of them forced by logit_bias
    import llama_cpp

    llm = llama_cpp.Llama(str(hermes.gguf), vocab_only=True, verbose=False)
    (close,) = llm.tokenize(b"</think>", add_bos=False, special=True)
    assert llama_cpp.llama_vocab_is_control(llm._model.vocab, close)
    forced = dict(ask, max_tokens=3, logit_bias={str(close): 100}, extra_body={"chat_template_kwargs": {"think_open": True}})
    assert client.chat.completions.create(**forced).choices[0].message.content == "</think></think>"
    forced["extra_body"]["reasoning_format"] = "none"
    assert client.chat.completions.create(**forced).choices[0].message.content == "</think>" * 3


def _anthropic(server):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic client is not installed")
    return anthropic, anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


def _prompt(message) -> int:
    """An Anthropic answer's prompt tokens: those read again from the KV cache and the others."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def _blocks(message) -> list[tuple]:
    """An Anthropic message's blocks as ``(type, text or (name, input))``."""
    return [(b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input))
            for b in message.content]


def _streamed(client, **ask):
    """What ``client.messages.stream`` accumulates (the SDK's own reading of the events), and the
    events' types in order."""
    with client.messages.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        return stream.get_final_message(), kinds


def test_anthropic_messages_answer_as_the_chat_endpoint_does(hermes):
    """``/v1/messages`` through Anthropic's own client: the same decode as the equivalent chat
    request (text, thinking, stop reasons, token counts), streamed as the same message in
    Anthropic's event order; ``count_tokens`` counts the prompt the request evaluates; the thinking
    switch reaches the template's variable; a stop sequence is reported; a schema in
    ``output_config`` holds the text; ``top_k`` 1 samples the greedy text."""
    _, client = _anthropic(hermes)
    chat = hermes.client()
    system, msgs = "You answer briefly.", [{"role": "user", "content": "Capital of France?"}]
    ask = dict(model="small-moe", max_tokens=24, extra_body={"temperature": 0})  # the client's own field no longer
    chatting = dict(model="small-moe", max_tokens=24, temperature=0)
    want = chat.chat.completions.create(messages=[{"role": "system", "content": system}] + msgs, **chatting)
    got = client.messages.create(system=system, messages=msgs, **ask)
    assert got.id.startswith("msg_") and got.role == "assistant" and got.model == "small-moe"
    assert _blocks(got) == [("text", want.choices[0].message.content)]
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert (_prompt(got), got.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert 0 < got.usage.cache_read_input_tokens < _prompt(got)  # the chat's prompt, kept: its prefix read again
    assert client.messages.count_tokens(model="small-moe", system=system, messages=msgs).input_tokens == _prompt(got)
    streamed, kinds = _streamed(client, system=system, messages=msgs, **ask)
    assert _blocks(streamed) == _blocks(got) and streamed.stop_reason == got.stop_reason
    assert streamed.usage.output_tokens == got.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    # the system prompt as text blocks: one paragraph each
    blocks = client.messages.create(system=[{"type": "text", "text": "You answer"}, {"type": "text", "text": "briefly."}],
                                    messages=msgs, **ask)
    joined = chat.chat.completions.create(messages=[{"role": "system", "content": "You answer\n\nbriefly."}] + msgs,
                                          **chatting)
    assert _prompt(blocks) == joined.usage.prompt_tokens

    # thinking: a prompt that opens <think> (the template's own variable, through chat_template_kwargs)
    opened = dict(ask, messages=msgs, extra_body={"temperature": 0, "chat_template_kwargs": {"think_open": True}})
    want = chat.chat.completions.create(**chatting, messages=msgs, extra_body={
        "chat_template_kwargs": {"think_open": True}}).choices[0].message
    got = client.messages.create(**opened)
    assert want.reasoning_content and _blocks(got) == [("thinking", want.reasoning_content)] + (
        [("text", want.content)] if want.content else [])
    assert got.content[0].signature == ""
    streamed, kinds = _streamed(client, **opened)
    assert _blocks(streamed) == _blocks(got), kinds
    starts = [k for k in kinds if k in ("content_block_start", "content_block_stop")]
    assert starts == ["content_block_start", "content_block_stop"] * len(got.content)  # one block at a time
    omitted = dict(opened, thinking={"type": "adaptive", "display": "omitted"})
    assert _blocks(client.messages.create(**omitted)) == [("thinking", "")] + _blocks(got)[1:]
    assert _blocks(_streamed(client, **omitted)[0]) == [("thinking", "")] + _blocks(got)[1:]
    # the thinking switch sets the variable the template reads (enable_thinking: Qwen3's empty block)
    off = client.messages.create(messages=msgs, thinking={"type": "disabled"}, **ask)
    off_chat = chat.chat.completions.create(messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                            **chatting)
    on = client.messages.create(messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}, **ask)
    assert _prompt(off) == off_chat.usage.prompt_tokens > _prompt(on) == \
        client.messages.count_tokens(model="small-moe", messages=msgs).input_tokens

    # a stop sequence: the text cut before it, and reported (a seeded sample: greedy text repeats itself here)
    seeded = dict(ask, extra_body={"temperature": 1.0, "seed": 3})
    sample = client.messages.create(messages=msgs, **seeded).content[0].text
    at = next(i for i in range(2, len(sample) - 3) if sample.find(sample[i:i + 3]) == i and sample[i:i + 3].strip())
    stop = sample[at:at + 3]
    for got in (client.messages.create(messages=msgs, stop_sequences=[stop], **seeded),
                _streamed(client, messages=msgs, stop_sequences=[stop], **seeded)[0]):
        assert (got.stop_reason, got.stop_sequence, _blocks(got)) == ("stop_sequence", stop, [("text", sample[:at])])
    text = client.messages.create(messages=msgs, **ask).content[0].text
    # output_config's schema holds the text; top_k 1 at temperature 1 samples the greedy text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    shaped = client.messages.create(messages=msgs, output_config={"format": {"type": "json_schema", "schema": schema}},
                                    **dict(ask, max_tokens=64))
    assert set(json.loads(shaped.content[0].text)) == {"city"}
    # max_tokens beyond the context's room: the room, ending where the context is full (the chat endpoint: a 400)
    full = client.messages.create(messages=msgs, **dict(ask, max_tokens=100_000))
    assert full.stop_reason == "model_context_window_exceeded", full.stop_reason
    assert _prompt(full) + full.usage.output_tokens == 512  # --ctx 512, every place taken
    status, _ = hermes.raw("POST", "/v1/chat/completions", json.dumps(dict(chatting, messages=msgs, max_tokens=100_000)))
    assert status == 400
    assert _streamed(client, messages=msgs, **dict(ask, max_tokens=100_000))[0].stop_reason == \
        "model_context_window_exceeded"
    sampled = client.messages.create(messages=msgs, **dict(ask, extra_body={"temperature": 1.0, "top_k": 1}))
    assert sampled.content[0].text == text
    top1 = chat.chat.completions.create(messages=msgs, **dict(chatting, temperature=1.0), extra_body={"top_k": 1})
    assert top1.choices[0].message.content == text


def test_anthropic_tools_round_trip_as_chat_tools(hermes):
    """Anthropic's tools are the chat endpoint's: ``any`` forces a call (the same call as
    ``required``), a named tool that one, ``none`` none; a ``tool_use`` and its ``tool_result`` go
    back to the template as the chat's call and tool message (the same prompt, token for token);
    streamed, the same blocks."""
    _, client = _anthropic(hermes)
    chat = hermes.client()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": schema},
             {"name": "get_time", "input_schema": {"type": "object", "properties": {
                 "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}]
    chat_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                    **({"description": t["description"]} if "description" in t else {})}}
                  for t in tools]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    bias = closing(hermes.gguf)  # the model closes its thinking at once, before a forced call
    ask = dict(model="small-moe", max_tokens=96, messages=msgs, extra_body={"temperature": 0, "logit_bias": bias})
    chatting = dict(model="small-moe", max_tokens=96, messages=msgs, temperature=0, logit_bias=bias)
    one = {"disable_parallel_tool_use": True}  # one call (by default one or more: below)
    want = chat.chat.completions.create(tools=chat_tools, tool_choice="required", parallel_tool_calls=False,
                                        **chatting).choices[0].message
    got = client.messages.create(tools=tools, tool_choice={"type": "any", **one}, **ask)
    (call,) = want.tool_calls
    assert _blocks(got) == [("tool_use", (call.function.name, json.loads(call.function.arguments)))]
    assert got.stop_reason == "tool_use" and got.stop_sequence is None
    assert got.content[0].id == call.id or got.content[0].id.startswith("call_")
    streamed, _ = _streamed(client, tools=tools, tool_choice={"type": "any", **one}, **ask)
    assert _blocks(streamed) == _blocks(got) and streamed.stop_reason == "tool_use"
    named = client.messages.create(tools=tools, tool_choice={"type": "tool", "name": "get_time", **one}, **ask)
    assert [b.name for b in named.content] == ["get_time"] and named.stop_reason == "tool_use"
    on = {**bias, **unending(hermes.gguf)}  # the model calls on until max_tokens, where it may
    several = chat.chat.completions.create(tools=chat_tools, tool_choice="required",
                                           **dict(chatting, logit_bias=on, max_tokens=136)).choices[0].message
    uses = [b for b in _blocks(client.messages.create(tools=tools, tool_choice={"type": "any"}, **dict(
        ask, max_tokens=136, extra_body={"temperature": 0, "logit_bias": on}))) if b[0] == "tool_use"]
    assert uses == [("tool_use", (c.function.name, json.loads(c.function.arguments))) for c in several.tool_calls]
    assert len(uses) >= 2
    assert named.content[0].input["zone"] in ("UTC", "CET")
    none = client.messages.create(tools=tools, tool_choice={"type": "none"}, **dict(ask, max_tokens=8))
    assert _prompt(none) == client.messages.count_tokens(model="small-moe", messages=msgs).input_tokens
    auto = client.messages.create(tools=tools, **dict(ask, max_tokens=8))
    assert _prompt(auto) == chat.chat.completions.create(
        tools=chat_tools, **dict(chatting, max_tokens=8)).usage.prompt_tokens == \
        client.messages.count_tokens(model="small-moe", messages=msgs, tools=tools).input_tokens
    # the call and its result back to the template: the chat's prompt, token for token
    use = got.content[0]
    turn2 = msgs + [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                      {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": [{"type": "text", "text": "sunny"}]},
                                                 {"type": "text", "text": "And tomorrow?"}]}]
    chat2 = msgs + [{"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}, {"role": "user", "content": "And tomorrow?"}]
    after = client.messages.create(**dict(ask, messages=turn2, max_tokens=8), tools=tools)
    assert _prompt(after) == chat.chat.completions.create(
        **dict(chatting, messages=chat2, max_tokens=8), tools=chat_tools).usage.prompt_tokens
    assert _prompt(after) > _prompt(auto)


def test_anthropic_mistakes_are_anthropic_errors_and_the_server_keeps_serving(hermes, managed):
    """A request the server cannot serve as asked is a 4xx in Anthropic's error shape naming the
    field, raised by Anthropic's client as its own error; what would change the answer (an image, a
    server tool, a thinking block in a user's message) is refused, never dropped."""
    anthropic, client = _anthropic(hermes)
    ok = {"model": "small-moe", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, 400, "max_tokens"),
        (dict(ok, model="claude-sonnet"), 404, "small-moe"),
        (dict(ok, temperature=1.5), 400, "temperature"),
        (dict(ok, messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), 400, "image"),
        (dict(ok, messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]),
         400, "messages.0.content.0"),
        (dict(ok, messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]), 400, "thinking"),
        (dict(ok, messages=[{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]), 400,
         "redacted_thinking"),
        (dict(ok, tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "tools.0"),
        (dict(ok, tool_choice={"type": "tool"}), 400, "tool_choice.name"),
        (dict(ok, tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool", "name": "g"}),
         400, "tool_choice"),
        (dict(ok, container="c1"), 400, "container"),
        (dict(ok, output_config={"effort": "low", "task_budget": 1}), 400, "output_config"),
        (dict(ok, stop_sequences=[""]), 400, "stop"),
        ("{", 400, "not JSON"),
    ]
    for body, status, says in cases:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            if path.endswith("count_tokens") and says == "max_tokens":
                continue  # counting takes no max_tokens
            got, raw = hermes.raw("POST", path, body if isinstance(body, str) else json.dumps(body))
            err = json.loads(raw)
            assert got == status and err["type"] == "error" and says in err["error"]["message"], (path, body, raw)
            assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**ok, extra_body={"temperature": 2.0})
    assert caught.value.status_code == 400 and "temperature" in caught.value.message
    got, raw = hermes.raw("POST", "/v1/messages", json.dumps({**ok, "model": "small-moe", "metadata": {"user_id": "u"},
                                                              "service_tier": "auto"}))
    assert got == 200 and json.loads(raw)["type"] == "message"  # fields that change nothing here: taken
    assert hermes.metrics()['expertcache_requests_total{endpoint="/v1/messages",code="400"}'] >= 10
    got, raw = hermes.raw("GET", "/v1/messages")
    assert got == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error", raw
    # a chat format that drops tool messages (chatml): the tool_result block named, not the chat's message
    result = dict(ok, messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "text", "text": "Here:"}, {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}])
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        got, raw = managed.raw("POST", path, json.dumps(result))
        assert got == 400 and json.loads(raw)["error"]["message"].startswith(
            "messages.2.content.1.role: this model's chat format leaves tool messages out"), raw


HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_CALL = "<|channel|>commentary"
HARMONY_THOUGHT = "<|channel|>analysis<|message|>Weather: ask it.<|end|><|start|>assistant<|channel|>commentary"
"""Tokens of the harmony fixture's vocabulary (a test biases one): a forced call's channel begun at
once, or after an analysis message (a random model under the grammar, free to analyse first, would
analyse until ``max_tokens``)."""
HARMONY_TEMPLATE = """{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{% for tool in tools %}type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}}<|end|>{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}{% for tc in message.tool_calls %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>{{ tc.function.arguments }}<|call|>{% endfor %}
{%- elif message.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}
{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
"""gpt-oss's harmony turns and tool calls, simplified (its template also states the channels in a system
message)."""


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """small-moe with gpt-oss's harmony markers as special tokens of its vocabulary (llama.cpp knows
    them by their text) and HARMONY_TEMPLATE, served."""
    s = serving(tmp_path_factory, "harmony", HARMONY_TEMPLATE, HARMONY_MARKERS, [HARMONY_CALL, HARMONY_THOUGHT])
    yield s
    s.stop()


def test_harmony_markers_reach_the_text_and_a_harmony_chat_is_read(harmony):
    """The premise of reading gpt-oss's channels from the text: with the pinned llama.cpp, the
    markers that structure a message (``<|end|>`` too) are written into the text by the same
    per-token detokenization the server's loop uses, and ``<|return|>`` / ``<|call|>`` end the
    decode where ``<|end|>`` does not. Served: a harmony template's chat is read with the
    harmony reader (a text that does not begin with a channel is content as written, equal to
    ``reasoning_format: none``'s), and a forced ``<|channel|>`` reaches the client's text; ``tools``
    with ``auto`` are shown to the template and the text read for calls (``reasoning_format: none``
    with them, a 400), a named call is a message to it under the grammar, at once or after an
    ``analysis`` message (its reasoning), streamed the same, and a second turn with the call and its
    result goes to the template."""
    import llama_cpp

    from expertcache.llama.reasoning import split_harmony

    llm = llama_cpp.Llama(str(harmony.gguf), vocab_only=True, verbose=False)
    text = "<|channel|>analysis<|message|>Hi.<|end|><|start|>assistant<|channel|>final<|message|>Bye."
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    shown = "".join(llm.detokenize([t], prev_tokens=ids[:i]).decode() for i, t in enumerate(ids))
    assert shown == text, shown
    assert split_harmony(shown) == ("Hi.", "Bye.")
    vocab = llm._model.vocab
    eog = {m: bool(llama_cpp.llama_vocab_is_eog(vocab, llm.tokenize(m.encode(), add_bos=False, special=True)[0]))
           for m in ("<|return|>", "<|call|>", "<|end|>")}
    assert eog == {"<|return|>": True, "<|call|>": True, "<|end|>": False}, eog
    client = harmony.client()
    ask = dict(model="small-moe", messages=[{"role": "user", "content": "Hi"}], max_tokens=16, temperature=0, seed=1)
    raw = client.chat.completions.create(**ask, extra_body={"reasoning_format": "none"}).choices[0].message
    read = client.chat.completions.create(**ask).choices[0].message
    assert (getattr(read, "reasoning_content", None), read.content) == split_harmony(raw.content)
    channel = llm.tokenize(b"<|channel|>", add_bos=False, special=True)[0]
    forced = client.chat.completions.create(**{**ask, "max_tokens": 1}, logit_bias={str(channel): 100})
    assert forced.choices[0].message.content == "<|channel|>"  # a header never closed: as written
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    auto = client.chat.completions.create(**ask, tools=tools)  # read from its channels (this model calls nothing)
    assert auto.usage.prompt_tokens > client.chat.completions.create(**ask).usage.prompt_tokens + 20
    assert auto.choices[0].message.content is not None and not auto.choices[0].message.tool_calls
    forced = dict(ask, max_tokens=128, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for word, thought in ((HARMONY_CALL, None), (HARMONY_THOUGHT, "Weather: ask it.")):  # analysis first, or not
        (token,) = llm.tokenize(word.encode(), add_bos=False, special=True)
        named = client.chat.completions.create(**forced, logprobs=True, logit_bias={str(token): 100})
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and len(json.loads(call.function.arguments)["city"]) <= 8
        wrote = written_text(named.choices[0])  # a message on its channel
        assert re.match(re.escape(word) + r" to=functions\.get_weather( (<\|constrain\|>)?json)?<\|message\|>\{",
                        wrote), wrote  # its content type as the model writes it, or none
        assert named.choices[0].message.content is None and named.choices[0].finish_reason == "stop"
        assert getattr(named.choices[0].message, "reasoning_content", None) == thought
        deltas = [c.choices[0].delta for c in client.chat.completions.create(
            **forced, stream=True, logit_bias={str(token): 100}) if c.choices]
        assert [(tc.function.name, tc.function.arguments) for d in deltas for tc in d.tool_calls or []] == \
            [("get_weather", call.function.arguments)]
        assert not "".join(d.content or "" for d in deltas)
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (thought or "")
    turn2 = ask["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    after = client.chat.completions.create(**{**ask, "messages": turn2}, tools=tools)
    assert after.usage.prompt_tokens > auto.usage.prompt_tokens
    status, body = harmony.raw("POST", "/v1/chat/completions", json.dumps({**ask, "tools": tools,
                                                                           "reasoning_format": "none"}))
    assert status == 400 and json.loads(body)["error"]["param"] == "reasoning_format", body


WRITTEN_CALLS = {
    "glm": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", None, None),
    "deepseek": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, None),
    "qwen_xml": ("Paris, then.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</tool_call>", "Paris, then.", None),
    "minimax": ('Paris, then.</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
                'Paris</parameter>\n</invoke>\n</minimax:tool_call>', "Paris, then.", None),
    "kimi": ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', None, r"functions\.get_weather:0"),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, "[A-Za-z0-9]{9}"),
    "lfm2": ("<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>", None, None),
    "gemma4": ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', None, None),
    "dsv4": ('Paris, then.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜tool_calls>', "Paris, then.", None),
    "minimax_m3": ('<mm:think>Paris, then.</mm:think>]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="get_weather">'
                   ']<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>',
                   "Paris, then.", None),
    "kimi_k3": ('Paris, then.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
                '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
                '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>',
                "Paris, then.", None),
    "dsml": ('Paris, then.</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜function_calls>', "Paris, then.", None),
}
"""Per served format: a call to get_weather(city="Paris") as the model writes it (Qwen3.5's and
MiniMax's after the thinking their prompt opens), one token of the fixture's vocabulary; the
reasoning it holds; the pattern of the call's id where it is not OpenAI's (Kimi writes its own,
Mistral's templates take 9 letters and digits only)."""


GLM_TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>", "</think>")
GLM_TEMPLATE = """[gMASK]<sop>{%- if tools %}<|system|>
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
</tool_call>{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}
{{ m.content or '' }}
{%- if m.tool_calls %}{% for tc in m.tool_calls %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor %}{% endif %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>{{ m.content }}</tool_response>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}
<think></think>{% endif %}{% endif %}"""
"""GLM-4.5's chat template, simplified: its tools block, its <arg_key> calls (arguments iterated as an
object), its thinking."""


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """small-moe with GLM_TEMPLATE and GLM's tags as control tokens of its vocabulary, served."""
    s = serving(tmp_path_factory, "glm", GLM_TEMPLATE, GLM_TAGS, [WRITTEN_CALLS["glm"][0]])
    yield s
    s.stop()


DEEPSEEK_TAGS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>")
DEEPSEEK_TEMPLATE = """{{ bos_token }}{%- if tools %}## Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call a tool as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
```json
ARGUMENTS
```<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% endif %}
{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}<｜Assistant｜>{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name }}
```json
{{ tc.function.arguments }}
```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}{{ m.content or '' }}
{%- elif m.role == 'tool' %}<｜tool▁outputs▁begin｜>{{ m.content }}<｜tool▁outputs▁end｜>
{%- endif %}{%- endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"""
"""DeepSeek-V3's chat template, simplified: its tools and its call sections."""


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """small-moe with DEEPSEEK_TEMPLATE and DeepSeek's call tags as control tokens, served."""
    s = serving(tmp_path_factory, "deepseek", DEEPSEEK_TEMPLATE, DEEPSEEK_TAGS, [WRITTEN_CALLS["deepseek"][0]])
    yield s
    s.stop()


QWEN_XML_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You have access to the following functions:

<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for tc in m.tool_calls or [] %}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments|items %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% if enable_thinking is defined and enable_thinking is false %}
</think>

{% endif %}{% endif %}"""
"""Qwen3.5's chat template (Qwen3-Coder's calls), simplified: its tools, its XML calls (arguments
iterated as an object), a generation prompt that opens <think>."""
MINIMAX_TEMPLATE = """]~!b[]~b]system
You are a helpful assistant.{% if tools %}

# Tools
<tools>{% for tool in tools %}
<tool>{{ tool.function | tojson }}</tool>{% endfor %}
</tools>
When making tool calls, use XML format to invoke tools and pass parameters:
<minimax:tool_call>
<invoke name="tool-name-1">
<parameter name="param-key-1">param-value-1</parameter>
</invoke>
</minimax:tool_call>{% endif %}[e~[
{%- for m in messages %}
{%- if m.role == 'user' %}]~b]user
{{ m.content }}[e~[
{% elif m.role == 'assistant' %}]~b]ai
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}{% if m.tool_calls %}
<minimax:tool_call>
{% for tc in m.tool_calls %}<invoke name="{{ tc.function.name }}">
{% if tc.function.arguments is mapping %}{% for k, v in tc.function.arguments|items %}<parameter name="{{ k }}">{{ v if v is string else v | tojson }}</parameter>
{% endfor %}{% endif %}</invoke>
{% endfor %}</minimax:tool_call>{% endif %}[e~[
{% elif m.role == 'tool' %}]~b]tool
<response>{{ m.content }}</response>[e~[
{% endif %}{%- endfor %}
{%- if add_generation_prompt %}]~b]ai
<think>
{% endif %}"""
"""MiniMax-M2's chat template, simplified: its tools, its invoke calls, an assistant turn's thinking, a
prompt that opens <think>."""
KIMI_TAGS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
             "<|tool_call_argument_begin|>", "<think>", "</think>")
KIMI_TEMPLATE = """{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|><think></think>{{ m.content or '' }}
{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>
{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""
"""Kimi K2 Thinking's chat template, simplified: its declared tools, its call sections (the call's
id written back), its empty thinking on past turns."""


@pytest.fixture(scope="module")
def qwen_xml(tmp_path_factory):
    """small-moe with QWEN_XML_TEMPLATE and <tool_call>, <think> as control tokens, served."""
    s = serving(tmp_path_factory, "qwen-xml", QWEN_XML_TEMPLATE, ("<tool_call>", "</tool_call>", "<think>", "</think>"),
                [WRITTEN_CALLS["qwen_xml"][0], INDENT, QWEN_XML_THOUGHT])
    yield s
    s.stop()


QWEN_XML_THOUGHT = "Weather: ask it.</think>\n\n"
"""A thought and the close of its block, one token of the qwen_xml fixture's vocabulary."""
INDENT = "\n" + " " * 40
"""A token of 41 bytes: a new line and the spaces that indent code (GPT-NeoX's and Qwen's vocabularies
hold such runs; OLMoE's tokenizer in models/ has this one)."""


def test_a_forced_call_may_follow_the_thinking_its_prompt_opened(qwen_xml):
    """Qwen3.5's prompt opens a <think> block: a forced call may follow the model's thinking (a token
    of this vocabulary that is a thought and the close, forced here by ``logit_bias``), given as
    ``reasoning_content``, or an empty block (``</think>`` forced), with none; either way the call is
    read back with no content, streamed the same."""
    import llama_cpp

    llm = llama_cpp.Llama(str(qwen_xml.gguf), vocab_only=True, verbose=False)
    (close,) = llm.tokenize(b"</think>", add_bos=False, special=True)
    (thought,) = llm.tokenize(QWEN_XML_THOUGHT.encode(), add_bos=False, special=True)
    client = qwen_xml.client()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    ask = dict(model="small-moe", messages=[{"role": "user", "content": "Weather?"}], max_tokens=160, temperature=0,
               seed=1, tools=tools, tool_choice="required", parallel_tool_calls=False, logprobs=True)
    for token, opening, reasoning in ((close, "</think>", None), (thought, QWEN_XML_THOUGHT, "Weather: ask it.")):
        answer = client.chat.completions.create(**ask, logit_bias={str(token): 100}).choices[0]
        written = written_text(answer)
        assert written.startswith(opening), written
        assert written[len(opening):].lstrip().startswith("<tool_call>\n<function=get_weather>"), written
        (call,) = answer.message.tool_calls
        assert call.function.name == "get_weather" and answer.finish_reason == "tool_calls"
        assert answer.message.content is None and getattr(answer.message, "reasoning_content", None) == reasoning
        streamed = [c.choices[0].delta for c in client.chat.completions.create(
            **{**ask, "logprobs": None}, logit_bias={str(token): 100}, stream=True) if c.choices]
        assert [tc.function.name for d in streamed for tc in d.tool_calls or []] == ["get_weather"]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in streamed) == (reasoning or "")
        assert not "".join(d.content or "" for d in streamed)


def test_a_token_longer_than_32_bytes_is_written_whole(qwen_xml):
    """llama-cpp-python's ``detokenize`` writes nothing for a token longer than 32 bytes (the premise,
    abetlen/llama-cpp-python#2362: should it pass, the workaround can go); the server writes it
    whole, in a completion, its stream and its log-probabilities, and so does ``llama run``'s text."""
    import llama_cpp

    from expertcache.llama.textgen import detokenize_file

    llm = llama_cpp.Llama(str(qwen_xml.gguf), vocab_only=True, verbose=False)
    (tid,) = llm.tokenize(INDENT.encode(), add_bos=False, special=False)
    assert llm.detokenize([tid]) == b""  # the premise
    client = qwen_xml.client()
    ask = dict(model="small-moe", prompt="def f():", max_tokens=3, temperature=0, logit_bias={str(tid): 100})
    whole = client.completions.create(**ask, logprobs=1).choices[0]
    assert whole.text == INDENT * 3 and whole.logprobs.tokens == [INDENT] * 3
    assert "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True)) == INDENT * 3
    assert detokenize_file(str(qwen_xml.gguf), [tid, tid]) == INDENT * 2


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    """small-moe with MINIMAX_TEMPLATE and MiniMax's call tags as control tokens, served."""
    s = serving(tmp_path_factory, "minimax", MINIMAX_TEMPLATE,
                ("<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"), [WRITTEN_CALLS["minimax"][0]])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """small-moe with KIMI_TEMPLATE and Kimi's call tags as control tokens, served."""
    s = serving(tmp_path_factory, "kimi", KIMI_TEMPLATE, KIMI_TAGS, [WRITTEN_CALLS["kimi"][0]])
    yield s
    s.stop()


MISTRAL_TAGS = ("[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                "[INST]", "[/INST]")
MISTRAL_TEMPLATE = """{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.first %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [{% for tc in m.tool_calls %}{% if tc.id is not defined or tc.id|length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}
{%- elif m.role == 'tool' %}{% if m.tool_call_id is not defined or m.tool_call_id|length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}{% endfor %}"""
"""Mixtral-8x22B-Instruct's chat template, simplified: its tools, its [TOOL_CALLS] JSON array, and its
refusal of any call id that is not 9 characters long."""


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """small-moe with MISTRAL_TEMPLATE and Mistral's control tokens, served."""
    s = serving(tmp_path_factory, "mistral", MISTRAL_TEMPLATE, MISTRAL_TAGS, [WRITTEN_CALLS["mistral"][0]])
    yield s
    s.stop()


DSML_TEMPLATE = """{%- set dsml_token = "｜DSML｜" -%}{{ bos_token }}{%- if tools -%}## Tools
You can invoke functions by writing a "<{{ dsml_token }}function_calls>" block:
<{{ dsml_token }}function_calls>
<{{ dsml_token }}invoke name="$FUNCTION_NAME">
<{{ dsml_token }}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{{ dsml_token }}parameter>
</{{ dsml_token }}invoke>
</{{ dsml_token }}function_calls>
<functions>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</functions>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<｜User｜>{{ m.content }}<｜Assistant｜></think>
{%- elif m.role == 'assistant' -%}{{ m.content or '' }}{% if m.tool_calls %}

<{{ dsml_token }}function_calls>{% for tc in m.tool_calls %}
<{{ dsml_token }}invoke name="{{ tc.function.name }}">{% if tc.function.arguments is mapping %}{% for k, v in tc.function.arguments.items() %}
<{{ dsml_token }}parameter name="{{ k }}" string="{{ 'true' if v is string else 'false' }}">{{ v if v is string else v | tojson }}</{{ dsml_token }}parameter>{% endfor %}{% endif %}
</{{ dsml_token }}invoke>{% endfor %}
</{{ dsml_token }}function_calls>{% endif %}<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' -%}<function_results><result>{{ m.content }}</result></function_results></think>
{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}<｜User｜>
<｜Assistant｜>{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}{%- endif -%}"""
"""DeepSeek-V3.2's chat template (llama.cpp's), simplified: its tools, its DSML calls spelled through a
variable (arguments iterated as an object, each marked a string or not), a prompt that opens <think>."""


@pytest.fixture(scope="module")
def dsml(tmp_path_factory):
    """small-moe with DSML_TEMPLATE, <think>, </think> and the DSML mark as control tokens (DeepSeek's
    vocabulary holds the mark, not the tags, as one special token), served."""
    s = serving(tmp_path_factory, "dsml", DSML_TEMPLATE, ("<think>", "</think>", "｜DSML｜"), [WRITTEN_CALLS["dsml"][0]])
    yield s
    s.stop()


DSV4_TEMPLATE = DSML_TEMPLATE.replace("function_calls", "tool_calls")
"""DeepSeek-V4's, as llama.cpp tells it from V3.2's: the same DSML, its block named ``tool_calls``."""


DSV4_UNCLOSED = WRITTEN_CALLS["dsv4"][0].replace("</think>", "")
"""DeepSeek-V4's call written straight after its thinking, the block never closed (llama.cpp reads it)."""


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    """small-moe with DSV4_TEMPLATE, <think>, </think> and the DSML mark as control tokens, served."""
    s = serving(tmp_path_factory, "dsv4", DSV4_TEMPLATE, ("<think>", "</think>", "｜DSML｜"),
                [WRITTEN_CALLS["dsv4"][0], DSV4_UNCLOSED])
    yield s
    s.stop()


def test_a_deepseek_v4_call_ends_thinking_never_closed(dsv4):
    """V4 may begin its calls without closing its thinking: with tools offered the call block ends
    the reasoning and is read as the call, streamed the same; without tools the text stays reasoning."""
    import llama_cpp

    client = dsv4.client()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    (word,) = llama_cpp.Llama(str(dsv4.gguf), vocab_only=True, verbose=False).tokenize(
        DSV4_UNCLOSED.encode(), add_bos=False, special=True)
    ask = dict(model="small-moe", messages=[{"role": "user", "content": "Weather?"}], max_tokens=1, temperature=0,
               logit_bias={str(word): 100})
    message = client.chat.completions.create(**ask, tools=tools).choices[0].message
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert (message.reasoning_content, message.content) == ("Paris, then.", None)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**ask, tools=tools, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Paris, then."
    assert [tc.function.name for d in deltas for tc in d.tool_calls or []] == ["get_weather"]
    plain = client.chat.completions.create(**ask).choices[0].message
    assert (plain.reasoning_content, plain.content) == (DSV4_UNCLOSED, "")


K3_TEMPLATE = """{%- macro open_tag(t, attrs=[]) -%}<|open|>{{ t }}{%- for k, v in attrs %} {{ k }}="{{ v }}"{%- endfor -%}<|sep|>{%- endmacro -%}
{%- macro close_tag(t) -%}<|close|>{{ t }}<|sep|>{%- endmacro -%}
{%- set thinking = thinking if thinking is defined else true -%}
{%- if tools -%}{{ open_tag('message', [('role', 'system'), ('type', 'tool-declare')]) }}# Tools
{{ tools | tojson }}{{ close_tag('message') }}<|end_of_msg|>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}{{ open_tag('message', [('role', 'assistant')]) }}
{%- if thinking -%}{{ open_tag('think') }}{{ m.reasoning_content or '' }}{{ close_tag('think') }}{%- endif -%}
{{ open_tag('response') }}{{ m.content or '' }}{{ close_tag('response') }}
{%- if m.tool_calls -%}{{ open_tag('tools') }}{%- for tc in m.tool_calls -%}
{{ open_tag('call', [('tool', tc.function.name), ('index', loop.index)]) }}
{%- if tc.function.arguments is mapping -%}{%- for k, v in tc.function.arguments.items() -%}
{{ open_tag('argument', [('key', k), ('type', 'string' if v is string else 'number')]) }}{{ v if v is string else v | tojson }}{{ close_tag('argument') }}
{%- endfor -%}{%- else -%}{{ open_tag('json', [('type', 'object')]) }}{{ tc.function.arguments }}{{ close_tag('json') }}{%- endif -%}
{{ close_tag('call') }}{%- endfor -%}{{ close_tag('tools') }}{%- endif -%}
{{ close_tag('message') }}<|end_of_msg|>
{%- elif m.role == 'tool' -%}{{ open_tag('message', [('role', 'tool'), ('index', loop.index)]) }}{{ m.content }}{{ close_tag('message') }}<|end_of_msg|>
{%- else -%}{{ open_tag('message', [('role', m.role)]) }}{{ m.content }}{{ close_tag('message') }}<|end_of_msg|>
{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}{{ open_tag('message', [('role', 'assistant')]) }}{{ open_tag('think' if thinking else 'response') }}{%- endif -%}"""
"""Kimi K3's chat template, simplified (its sections, as llama.cpp's copy writes them): tools declared
in a system message, a past assistant turn's thinking, answer and calls (each argument a section of
its own, arguments given as an object; given as a text, one ``json`` section), the prompt opening
the thinking."""
K3_TAGS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
K3_THINK_CLOSE = "<|close|>think<|sep|>"
"""Kimi K3's thinking section's close as one token of the test's vocabulary (:func:`closing` biases it)."""
M3_TEMPLATE = """{%- set ns_token = ']<]minimax[>[' -%}
{%- macro to_xml(val, ns) -%}
{%- if val is mapping -%}{%- for k, v in val.items() if v is not none -%}{{ ns }}<{{ k }}>{{ to_xml(v, ns) }}{{ ns }}</{{ k }}>{%- endfor -%}
{%- elif val is iterable and val is not string -%}{%- for item in val -%}{{ ns }}<item>{{ to_xml(item, ns) }}{{ ns }}</item>{%- endfor -%}
{%- elif val is none -%}
{%- elif val is boolean -%}{{ val | tojson }}
{%- else -%}{{ val }}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}]~b]developer
<tools>
{% for tool in tools %}<tool>{{ tool.function | tojson }}</tool>
{% endfor %}</tools>
Call a tool as {{ ns_token }}<tool_call> holding {{ ns_token }}<invoke name="NAME"> and an element per parameter.[e~[
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}]~b]ai
{% if m.reasoning_content %}<mm:think>{{ m.reasoning_content }}</mm:think>{% else %}</mm:think>{% endif %}{{ m.content or '' }}
{%- if m.tool_calls -%}{{ ns_token }}<tool_call>
{% for tc in m.tool_calls %}{{ ns_token }}<invoke name="{{ tc.function.name }}">
{%- for k, v in tc.function.arguments.items() if v is not none -%}{{ ns_token }}<{{ k }}>{{ to_xml(v, ns_token) }}{{ ns_token }}</{{ k }}>{%- endfor -%}
{{ ns_token }}</invoke>
{% endfor %}{{ ns_token }}</tool_call>{%- endif -%}[e~[
{% elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}]~b]tool{%- endif %}
<response>{{ m.content }}</response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}[e~[
{% endif -%}
{%- else -%}]~b]{{ m.role }}
{{ m.content }}[e~[
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}]~b]ai
{% endif -%}"""
"""MiniMax-M3's chat template, simplified (as the copy llama.cpp's tests read writes it): tools
declared to the developer, a past turn's thinking (or a bare close) and calls (each argument an
element, arrays of ``<item>``s: arguments iterated as an object), tool results by order."""
M3_TAGS = ("]<]minimax[>[", "<tool_call>", "</tool_call>", "<mm:think>", "</mm:think>")


@pytest.fixture(scope="module")
def minimax_m3(tmp_path_factory):
    """small-moe with M3_TEMPLATE and MiniMax-M3's namespace token and tags as control tokens, served."""
    s = serving(tmp_path_factory, "minimax_m3", M3_TEMPLATE, M3_TAGS, [WRITTEN_CALLS["minimax_m3"][0]])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def kimi_k3(tmp_path_factory):
    """small-moe with K3_TEMPLATE and Kimi K3's markers as control tokens, served."""
    s = serving(tmp_path_factory, "kimi_k3", K3_TEMPLATE, K3_TAGS, [WRITTEN_CALLS["kimi_k3"][0], K3_THINK_CLOSE])
    yield s
    s.stop()


def test_kimi_k3_calls_go_back_as_argument_sections(kimi_k3):
    """A past call's arguments reach Kimi K3's template as an object (its model learnt a section per
    argument; given OpenAI's JSON text, the template writes one ``json`` section): the prompt grows
    by the argument's section, token for token."""
    import llama_cpp

    client = kimi_k3.client()
    count = lambda text: len(llama_cpp.Llama(str(kimi_k3.gguf), vocab_only=True, verbose=False).tokenize(  # noqa: E731
        text.encode(), add_bos=False, special=True))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]

    def prompt_tokens(arguments: str) -> int:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        return client.chat.completions.create(model="small-moe", messages=messages, tools=tools, max_tokens=1,
                                              temperature=0).usage.prompt_tokens

    assert prompt_tokens('{"city": "Paris"}') - prompt_tokens("{}") == \
        count('<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>')


LFM2_TEMPLATE = """{{- bos_token -}}
{%- if tools -%}<|im_start|>system
List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|><|im_end|>
{% endif -%}
{%- for m in messages -%}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and m.tool_calls -%}
{%- set calls = namespace(items=[]) -%}
{%- for tc in m.tool_calls -%}{%- set args = namespace(items=[]) -%}
{%- for k, v in tc.function.arguments.items() -%}{%- set args.items = args.items + [k + "=" + ("'" + v + "'" if v is string else v | tojson)] -%}{%- endfor -%}
{%- set calls.items = calls.items + [tc.function.name + "(" + (args.items | join(", ")) + ")"] -%}{%- endfor -%}
<|tool_call_start|>[{{ calls.items | join(", ") }}]<|tool_call_end|>{{ m.content or '' }}
{%- else -%}{{ m.content or '' }}{%- endif -%}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""
"""LFM2's chat template, simplified: its tool list, its Python calls (arguments iterated as an object)."""


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """small-moe with LFM2_TEMPLATE and LFM2's call tags as control tokens, served."""
    s = serving(tmp_path_factory, "lfm2", LFM2_TEMPLATE, ("<|tool_call_start|>", "<|tool_call_end|>",
                                                          "<|tool_list_start|>", "<|tool_list_end|>"),
                [WRITTEN_CALLS["lfm2"][0]])
    yield s
    s.stop()


GEMMA4_THOUGHT = "<|channel>thought\nParis, then.<channel|>Sunny."
"""A thought and an answer as Gemma 4 writes them when asked to think: one token of the fixture's vocabulary."""
GEMMA4_FORCED_THOUGHT = "<|channel>thought\nWeather: ask it.<channel|>"
"""A thought before a forced call: one token of the fixture's vocabulary."""
GEMMA4_TAGS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>", "<|turn>", "<turn|>", "<|tool>",
               "<tool|>", "<|tool_response>", "<tool_response|>")
GEMMA4_TEMPLATE = """{%- macro arg(v) -%}
{%- if v is string -%}{{ '<|"|>' + v + '<|"|>' }}
{%- elif v is boolean -%}{{ 'true' if v else 'false' }}
{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}{{ ',' if not loop.first else '' }}{{ k }}:{{ arg(x) }}{%- endfor -%}{{ '}' }}
{%- elif v is sequence -%}{{ '[' }}{%- for x in v -%}{{ ',' if not loop.first else '' }}{{ arg(x) }}{%- endfor -%}{{ ']' }}
{%- else -%}{{ v }}{%- endif -%}
{%- endmacro -%}
{#- OpenAI Chat Completions: a call's tool messages go after it -#}
{%- set ns = namespace(prev=None) -%}
{{- bos_token -}}
{%- if tools -%}{{- '<|turn>system\\n' -}}
{%- for t in tools -%}{{- '<|tool>declaration:' + t.function.name + arg(t.function.parameters) + '<tool|>' -}}{%- endfor -%}
{{- '<turn|>\\n' -}}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<|turn>user\\n' + m.content + '<turn|>\\n' -}}{%- set ns.prev = 'user' -%}
{%- elif m.role == 'assistant' -%}{{- '<|turn>model\\n' -}}{%- set ns.prev = 'model' -%}
{%- for tc in m.tool_calls or [] -%}{{- '<|tool_call>call:' + tc.function.name + arg(tc.function.arguments) + '<tool_call|>' -}}
{%- set ns.prev = 'call' -%}{%- endfor -%}
{%- set scan = namespace(on=m.tool_calls is defined and m.tool_calls) -%}
{%- for r in messages[loop.index0 + 1:] -%}{%- if r.role != 'tool' -%}{%- set scan.on = false -%}{%- endif -%}
{%- if scan.on -%}{%- set who = namespace(name='unknown') -%}
{%- for tc in m.tool_calls -%}{%- if tc.id == r.tool_call_id -%}{%- set who.name = tc.function.name -%}{%- endif -%}{%- endfor -%}
{{- '<|tool_response>response:' + who.name + '{value:' + arg(r.content) + '}<tool_response|>' -}}{%- set ns.prev = 'response' -%}
{%- endif -%}{%- endfor -%}
{{- m.content or '' -}}
{%- if not (ns.prev == 'response' and not m.content) -%}{{- '<turn|>\\n' -}}{%- endif -%}
{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt and ns.prev not in ['call', 'response'] -%}
{{- '<|turn>model\\n' -}}{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}
{%- endif -%}"""
"""Gemma 4's chat template, simplified: its declarations, its calls (arguments iterated as an object),
a call's results after it and none elsewhere, content after them, no next turn opened after a
call's results; a generation prompt that opens and closes an empty thought."""


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """small-moe with GEMMA4_TEMPLATE and Gemma 4's tags as control tokens, served."""
    s = serving(tmp_path_factory, "gemma4", GEMMA4_TEMPLATE, GEMMA4_TAGS, [WRITTEN_CALLS["gemma4"][0], GEMMA4_THOUGHT,
                                                                         GEMMA4_FORCED_THOUGHT])
    yield s
    s.stop()


def test_a_forced_gemma4_call_may_follow_its_thought(gemma4):
    """Gemma 4's forced call after a thought (a token of this vocabulary that is the whole block,
    forced by ``logit_bias``): the thought is the ``reasoning_content``, the call read back, no
    content; streamed the same."""
    import llama_cpp

    (thought,) = llama_cpp.Llama(str(gemma4.gguf), vocab_only=True, verbose=False).tokenize(
        GEMMA4_FORCED_THOUGHT.encode(), add_bos=False, special=True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    ask = dict(model="small-moe", messages=[{"role": "user", "content": "Weather?"}], max_tokens=96, temperature=0,
               seed=1, tools=tools, tool_choice="required", parallel_tool_calls=False, logit_bias={str(thought): 100})
    client = gemma4.client()
    message = client.chat.completions.create(**ask).choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and message.content is None
    assert getattr(message, "reasoning_content", None) == "Weather: ask it."
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    assert [(tc.function.name, tc.function.arguments) for d in deltas for tc in d.tool_calls or []] == \
        [("get_weather", call.function.arguments)]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Weather: ask it."
    assert not "".join(d.content or "" for d in deltas)


def test_gemma4s_round_trip_reaches_its_template(gemma4):
    """Gemma 4's template renders a tool message only after its call: the server takes it there
    (the role probe asks again after a call); a call's arguments reach it as an object, written in
    Gemma's syntax; a turn with content beside its calls, whose template closes it and opens none,
    is given a model turn as llama.cpp does; its string mark reaches the text; asked to think, its
    thought is read out of its own tags."""
    import llama_cpp

    client = gemma4.client()
    llm = llama_cpp.Llama(str(gemma4.gguf), vocab_only=True, verbose=False)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ask = dict(model="small-moe", max_tokens=1, temperature=0, seed=1, tools=tools)

    def prompt_tokens(content, arguments='{"city": "Paris"}'):
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        return client.chat.completions.create(messages=msgs, **ask).usage.prompt_tokens

    def count(text):
        return len(llm.tokenize(text.encode(), add_bos=False, special=True))

    assert prompt_tokens(None) - prompt_tokens(None, "{}") == \
        count('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>') - count("<|tool_call>call:get_weather{}<tool_call|>")
    assert prompt_tokens("Let me look.") - prompt_tokens(None) == count("Let me look.") + count("<turn|>\n") + \
        count("<|turn>model\n")
    (quote,) = llm.tokenize('<|"|>'.encode(), add_bos=False, special=True)
    forced = client.chat.completions.create(messages=[{"role": "user", "content": "Weather?"}], logit_bias={str(quote): 100},
                                            **{**ask, "max_tokens": 2})
    assert forced.choices[0].message.content == '<|"|>' * 2
    (thought,) = llm.tokenize(GEMMA4_THOUGHT.encode(), add_bos=False, special=True)
    message = client.chat.completions.create(messages=[{"role": "user", "content": "Weather?"}],
                                             logit_bias={str(thought): 100}, extra_body={"chat_template_kwargs": {
                                                 "enable_thinking": True}}, **ask).choices[0].message
    assert (message.reasoning_content, message.content) == ("Paris, then.", "Sunny.")


def written_text(choice) -> str:
    """What the model wrote, special tokens and all: a chat choice's log-probabilities' bytes."""
    return bytes(b for t in choice.logprobs.content for b in t.bytes).decode()


NATIVE_OPENINGS = {"glm": "<tool_call>get_weather\n", "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",
                   "dsml": "<｜DSML｜function_calls>\n<｜DSML｜invoke", "dsv4": "<｜DSML｜", "qwen_xml": "<tool_call>\n<function=",
                   "minimax": '<minimax:tool_call>\n<invoke name="get_weather">',
                   "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:",
                   "mistral": "[TOOL_CALLS]", "gemma4": "<|tool_call>call:get_weather{city:<|\"|>",
                   "minimax_m3": ']<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>',
                   "lfm2": "<|tool_call_start|>[get_weather(city=",
                   "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                              '<|open|>argument key="city" type="string"<|sep|>'}
"""Per served format whose forced call is written in the format (:data:`expertcache.llama.callgrammar.FORMS`):
how a named call to get_weather begins."""
LEAD = re.compile(r"((</(mm:)?think>|<\|close\|>think<\|sep\|>)\s*)?(<\|open\|>response<\|sep\|>)?(<\|close\|>response<\|sep\|>)?")
"""What a forced call's text may begin with before its block: the close of a thinking block the prompt
opened (``</think>``, ``</mm:think>``, Kimi K3's section), and Kimi K3's answer section, empty."""


@pytest.mark.parametrize("fixture, tag", [("glm", "<tool_call>"), ("deepseek", "<｜tool▁calls▁begin｜>"),
                                          ("lfm2", "<|tool_call_start|>"),
                                          ("dsml", "｜DSML｜"), ("dsv4", "｜DSML｜"),
                                          ("qwen_xml", "<tool_call>"), ("minimax", "<minimax:tool_call>"),
                                          ("kimi", "<|tool_calls_section_begin|>"), ("kimi_k3", "<|open|>"),
                                          ("minimax_m3", "]<]minimax[>["),
                                          ("mistral", "[TOOL_CALLS]"),
                                          ("gemma4", "<|tool_call>")])
def test_a_template_is_answered_in_its_call_format(request, fixture, tag):
    """GLM-4.5's, DeepSeek's (V3, V3.2 and V4: the DSML mark a control token, which must reach the text),
    Qwen3.5's, MiniMax-M2's and M3's, Kimi K2's and K3's, Mistral's, LFM2's and Gemma 4's formats:
    ``auto`` shows the tools (a model that answers in text gets its text); their tags, control tokens
    here, reach the text (a forced opening tag never closed stays content); a call the model writes
    in the format (a token of this vocabulary, forced) is read back into ``tool_calls``, after the
    reasoning where the prompt opened a <think> block (Qwen3.5's, MiniMax's, DeepSeek-V3.2's),
    Kimi's with its own id, Mistral's with one of the 9 characters its template insists on,
    streamed the same; a named call, and ``required`` among two, is one call in the format under the
    grammar (after the close of the thinking the prompt opened, or not); a second turn's calls go to
    the template (with arguments as the object GLM's, Qwen3.5's, MiniMax's and DeepSeek-V3.2's
    iterate: OpenAI's clients send their JSON text; Mistral's refuses any other id)."""
    import llama_cpp

    glm = request.getfixturevalue(fixture)
    client = glm.client()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    ask = dict(model="small-moe", messages=[{"role": "user", "content": "Weather?"}], max_tokens=16, temperature=0,
               seed=1)
    auto = client.chat.completions.create(**ask, tools=tools)
    assert auto.usage.prompt_tokens > client.chat.completions.create(**ask).usage.prompt_tokens + 20
    assert auto.choices[0].message.content is not None and not auto.choices[0].message.tool_calls
    llm = llama_cpp.Llama(str(glm.gguf), vocab_only=True, verbose=False)
    (tag_id,) = llm.tokenize(tag.encode(), add_bos=False, special=True)
    forced = client.chat.completions.create(**{**ask, "max_tokens": 2}, tools=tools, logit_bias={str(tag_id): 100},
                                            extra_body={"reasoning_format": "none"})  # Qwen3.5's prompt opens <think>
    assert forced.choices[0].message.content == tag * 2
    # the model writes a whole call (one token of this vocabulary, forced): read back as the call, streamed the same
    word, reasoning, call_id = WRITTEN_CALLS[fixture]
    (word_id,) = llm.tokenize(word.encode(), add_bos=False, special=True)
    written = dict(ask, max_tokens=1, tools=tools, logit_bias={str(word_id): 100})
    message = client.chat.completions.create(**written).choices[0].message
    (wrote,) = message.tool_calls
    assert (wrote.function.name, json.loads(wrote.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert message.content is None and getattr(message, "reasoning_content", None) == reasoning
    assert re.fullmatch(call_id or "call_[0-9a-f]{24}", wrote.id), wrote.id
    chunks = list(client.chat.completions.create(**written, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert [(tc.index, tc.function.name, tc.function.arguments) for d in deltas for tc in d.tool_calls or []] == \
        [(0, "get_weather", wrote.function.arguments)]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning or "")
    assert "".join(d.content or "" for d in deltas) == ""
    bias = closing(glm.gguf)  # a reasoning template's model closes its thinking at once, before a forced call
    named = client.chat.completions.create(**{**ask, "max_tokens": 200}, tools=tools, logprobs=True, logit_bias=bias,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           parallel_tool_calls=False)  # one call
    (call,) = named.choices[0].message.tool_calls
    city = json.loads(call.function.arguments)["city"]
    written = written_text(named.choices[0])
    closed = LEAD.match(written)  # a block it may close
    assert written[closed.end():].startswith(NATIVE_OPENINGS[fixture]), written
    assert named.choices[0].message.content is None and not getattr(named.choices[0].message, "reasoning_content", None)
    two = [tools[0], {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    # required among several: a call to one, in the format (each format here forces one in its own)
    room = 250 if fixture == "kimi_k3" else 160  # Kimi K3's call is the longest text here
    required = client.chat.completions.create(**{**ask, "max_tokens": room}, tools=two, tool_choice="required",
                                              logit_bias=bias, parallel_tool_calls=False)
    (one,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and one.function.name in ("get_weather", "get_time")
    assert set(json.loads(one.function.arguments)) == ({"city"} if one.function.name == "get_weather" else {"zone"})
    turn2 = ask["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    after = client.chat.completions.create(**{**ask, "messages": turn2, "max_tokens": 1}, tools=tools)
    assert after.usage.prompt_tokens >= auto.usage.prompt_tokens + len(llm.tokenize(city.encode(), add_bos=False))
    turn2 = ask["messages"] + [{"role": "assistant", "content": None, "tool_calls": [wrote.model_dump()]},
                               {"role": "tool", "tool_call_id": wrote.id, "content": "sunny"}]
    again = client.chat.completions.create(**{**ask, "messages": turn2, "max_tokens": 1}, tools=tools)
    assert again.usage.prompt_tokens > auto.usage.prompt_tokens  # the written call goes back to the template


def test_parallel_tool_calls_false_answers_the_first_call_only(glm):
    """A model that writes two calls (a whole call, one token of this vocabulary, forced twice) is
    answered both with ``auto``; with ``parallel_tool_calls: false`` (Anthropic's
    ``disable_parallel_tool_use``) the first only, streamed the same."""
    import llama_cpp

    (word,) = llama_cpp.Llama(str(glm.gguf), vocab_only=True, verbose=False).tokenize(
        WRITTEN_CALLS["glm"][0].encode(), add_bos=False, special=True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ask = dict(model="small-moe", messages=[{"role": "user", "content": "Weather?"}], max_tokens=2, temperature=0,
               tools=tools, logit_bias={str(word): 100})
    client = glm.client()
    assert len(client.chat.completions.create(**ask).choices[0].message.tool_calls) == 2
    (one,) = client.chat.completions.create(**ask, parallel_tool_calls=False).choices[0].message.tool_calls
    assert (one.function.name, json.loads(one.function.arguments)) == ("get_weather", {"city": "Paris"})
    streamed = [tc for c in client.chat.completions.create(**ask, parallel_tool_calls=False, stream=True) if c.choices
                for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
        [(0, "get_weather", one.function.arguments)]
    _, anthropic_client = _anthropic(glm)
    anthropic_tools = [{"name": "get_weather", "input_schema": tools[0]["function"]["parameters"]}]
    for disable, calls in ((False, 2), (True, 1)):
        got = anthropic_client.messages.create(
            model="small-moe", max_tokens=2, messages=ask["messages"], tools=anthropic_tools,
            tool_choice={"type": "auto", "disable_parallel_tool_use": disable},
            extra_body={"temperature": 0, "logit_bias": {str(word): 100}})
        assert [(b.type, b.name, b.input) for b in got.content] == [("tool_use", "get_weather", {"city": "Paris"})] * calls
        assert got.stop_reason == "max_tokens"  # the limit ended it (as the chat's finish_reason says: length)


def _post_generated(served, rng, body: dict, create: str, count: str, seen) -> tuple[str, int, bytes]:
    """A generated request (its None fields left out) to a dialect's ``create`` path, or one in four
    to its ``count`` path: a 200, a 400 or a 404 (an unknown model), never a 5xx."""
    path = count if rng.random() < 0.25 else create
    status, raw = served.raw("POST", path, json.dumps({k: v for k, v in body.items() if v is not None}))
    seen[status] += 1
    assert status in (200, 400, 404), (status, body, raw[:300])
    return path, status, raw


def _fuzzed_block(rng, role: str):
    kind = rng.choice(["text", "text", "tool_use", "tool_result", "thinking", "image", "redacted_thinking", None])
    block = {"type": kind} if kind else {}
    hostile = [None, 1, -1.5, True, "", "x" * 50, "\ud800", [], {}, {"a": [1]}]
    if kind == "text":
        block["text"] = rng.choice(["Hi", "", "<tool_call>{}</tool_call>", "</think>", rng.choice(hostile)])
    elif kind == "tool_use":
        block.update(id=rng.choice(["t1", "", "call_0"]), name=rng.choice(["f", "bad name", ""]),
                     input=rng.choice([{}, {"city": "Paris"}, "x", None]))
    elif kind == "tool_result":
        block.update(tool_use_id=rng.choice(["t1", "t9", ""]),
                     content=rng.choice(["sunny", [{"type": "text", "text": "cold"}], [{"type": "image"}], 3, None]))
    elif kind == "thinking":
        block["thinking"] = rng.choice(["hm", "", 5])
    return block


@pytest.mark.parametrize("server", ["managed", "hermes"])
def test_generated_anthropic_requests_are_a_200_or_a_4xx_in_anthropics_shape(server, request):
    """Seeded generated message requests (blocks of every type in either role, hostile values, tools
    and tool choices, thinking, stop sequences; streamed or not; counted or answered): each a 200 or
    a 4xx in Anthropic's error shape, never a 5xx; a 200 is a message (or a count, or an event
    stream ending in ``message_stop``); the server answers after all of it."""
    import random

    served = request.getfixturevalue(server)
    rng = random.Random(61)
    seen = collections.Counter()
    for i in range(100):
        body = {"model": "small-moe", "max_tokens": rng.choice([2, 6]), "stream": rng.random() < 0.3, "extra": 1,
                "messages": [{"role": "user", "content": "Weather?"}]}
        if rng.random() < 0.5:  # a conversation of blocks, each role's or not
            messages = []
            for j in range(rng.randint(1, 3)):
                role = rng.choice(["user", "assistant"] * 4 + ["system"])
                messages.append({"role": role, "content": [_fuzzed_block(rng, role) for _ in range(rng.randint(1, 2))]})
            body["messages"] = messages + [{"role": "user", "content": "Weather?"}]
        for key, values in (("model", ["claude", None, 3]), ("max_tokens", [0, "3", None, 10 ** 6]),
                            ("messages", [[], None, "Hi", [{"role": "user"}]]),
                            ("system", ["Be brief.", [{"type": "text", "text": "Be"}], [{"type": "image"}], 3]),
                            ("tools", [[{"name": "f", "input_schema": {"type": "object", "properties": {
                                "city": {"type": "string"}}}}]] * 3 + [[{"name": "f"}],
                                [{"type": "bash_20250124", "name": "bash"}], [{"name": "bad name", "input_schema": {}}]]),
                            ("tool_choice", [{"type": "any"}, {"type": "tool", "name": "f"}, {"type": "none"},
                                             {"type": "auto", "disable_parallel_tool_use": True}, {"type": "x"}]),
                            ("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                          {"type": "adaptive", "display": "omitted"}, {"type": "on"}]),
                            ("stop_sequences", [["\n"], [], [""], ["a"] * 5, "x"]),
                            ("temperature", [0, 1, 1.5, "0"]), ("top_k", [1, -1, 0]),
                            ("output_config", [{"format": {"type": "json_schema", "schema": {"type": "object"}}},
                                               {"effort": "high"}, {"effort": "x"}, {"format": {"type": "x"}}])):
            if rng.random() < 0.12:
                body[key] = rng.choice(values)
        path, status, raw = _post_generated(served, rng, body, "/v1/messages", "/v1/messages/count_tokens", seen)
        if status != 200:
            err = json.loads(raw)
            assert err["type"] == "error" and err["error"]["message"], raw
        elif path.endswith("count_tokens"):
            assert json.loads(raw)["input_tokens"] > 0
        elif body["stream"]:
            assert raw.decode().startswith("event: message_start\n") and raw.decode().endswith(
                'event: message_stop\ndata: {"type": "message_stop"}\n\n'), raw[-300:]
        else:
            assert json.loads(raw)["type"] == "message"
    assert seen[200] >= 10 and seen[400] >= 20, seen
    _, client = _anthropic(served)
    assert client.messages.create(model="small-moe", max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}]).usage.output_tokens <= 2


def _output(response) -> list[tuple]:
    """A response's output items as ``(type, text or (name, arguments JSON))``."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content or [])))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", (item.name, json.loads(item.arguments))))
    return out


def _responded(client, **ask):
    """A streamed response (``stream=True``, read by the openai client): its final response (the
    ``response.completed`` or ``response.incomplete`` event's: the client's stream helper knows only
    the first), checked against what the deltas between each item's ``added`` and ``done`` built, and
    the events' types in order."""
    built, kinds, final, numbers = {}, [], None, []
    for e in client.responses.create(stream=True, **ask):
        kinds.append(e.type)
        numbers.append(e.sequence_number)
        if e.type == "response.output_item.added":
            built[e.output_index] = [e.item.id, ""]
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                        "response.function_call_arguments.delta"):
            assert built[e.output_index][0] == e.item_id and max(built) == e.output_index  # the open item's
            built[e.output_index][1] += e.delta
        elif e.type in ("response.completed", "response.incomplete"):
            final = e.response
    assert numbers == list(range(len(numbers))) and final is not None, kinds
    assert [(i.id, "".join(c.text for c in i.content or []) if i.type != "function_call" else i.arguments)
            for i in final.output] == [tuple(built[k]) for k in sorted(built)]
    return final, kinds


def test_responses_answer_as_the_chat_endpoint_does(hermes):
    """``/v1/responses`` through the openai client: the same decode as the equivalent chat request
    (text, reasoning, calls, token counts), streamed as the same response with its items' events in
    order; ``input_tokens`` counts the prompt; a call and its output sent back as items give the
    chat's prompt, token for token; what is not served is a 400 naming the field."""
    client = hermes.client()
    msgs = [{"role": "user", "content": "Capital of France?"}]
    ask = dict(model="small-moe", max_output_tokens=24, temperature=0)
    chatting = dict(model="small-moe", max_tokens=24, temperature=0)
    want = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."}] + msgs, **chatting)
    got = client.responses.create(instructions="Be brief.", input="Capital of France?", **ask)
    assert got.id.startswith("resp_") and got.output_text == want.choices[0].message.content
    assert _output(got) == [("message", want.choices[0].message.content)]
    assert got.status == {"length": "incomplete", "stop": "completed"}[want.choices[0].finish_reason]
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert 0 < got.usage.input_tokens_details.cached_tokens < got.usage.input_tokens  # the prompt's prefix was kept
    assert client.responses.input_tokens.count(model="small-moe", instructions="Be brief.",
                                               input="Capital of France?").input_tokens == got.usage.input_tokens
    streamed, kinds = _responded(client, instructions="Be brief.", input="Capital of France?", **ask)
    assert _output(streamed) == _output(got) and streamed.status == got.status
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{got.status}"
    # reasoning, as the chat endpoint reads it (the template's think_open variable through chat_template_kwargs)
    opened = dict(ask, input=msgs, extra_body={"chat_template_kwargs": {"think_open": True}})
    want = client.chat.completions.create(messages=msgs, extra_body={"chat_template_kwargs": {"think_open": True}},
                                          **chatting).choices[0].message
    got = client.responses.create(**opened)
    assert want.reasoning_content and _output(got) == [("reasoning", want.reasoning_content)] + (
        [("message", want.content)] if want.content else [])
    assert got.usage.output_tokens_details.reasoning_tokens > 0
    streamed, kinds = _responded(client, **opened)
    assert _output(streamed) == _output(got), kinds
    # tools: required, a named one; a call and its output back to the template as the chat's messages
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    tools = [{"type": "function", "name": "get_weather", "parameters": schema},
             {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {
                 "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    bias = closing(hermes.gguf)  # the model closes its thinking at once, before a forced call
    ask = dict(model="small-moe", max_output_tokens=96, temperature=0, input=[{"role": "user", "content": "Weather?"}],
               extra_body={"logit_bias": bias}, parallel_tool_calls=False)  # one call (by default one or more: below)
    chatting = dict(model="small-moe", max_tokens=96, temperature=0, tools=chat_tools, tool_choice="required",
                    messages=ask["input"], logit_bias=bias)
    (call,) = client.chat.completions.create(**chatting, parallel_tool_calls=False).choices[0].message.tool_calls
    got = client.responses.create(tools=tools, tool_choice="required", **ask)
    assert _output(got) == [("function_call", (call.function.name, json.loads(call.function.arguments)))]
    assert _output(_responded(client, tools=tools, tool_choice="required", **ask)[0]) == _output(got)
    on = {**bias, **unending(hermes.gguf)}  # the model calls on until max_tokens, where it may
    several = client.chat.completions.create(**dict(chatting, logit_bias=on, max_tokens=136)).choices[0].message
    calls = [i for i in _output(client.responses.create(tools=tools, tool_choice="required", **dict(
        ask, parallel_tool_calls=None, max_output_tokens=136, extra_body={"logit_bias": on}))) if i[0] == "function_call"]
    assert calls == [("function_call", (c.function.name, json.loads(c.function.arguments)))
                     for c in several.tool_calls]
    assert len(calls) >= 2
    named = client.responses.create(tools=tools, tool_choice={"type": "function", "name": "get_time"}, **ask)
    assert [i.name for i in named.output] == ["get_time"]
    item = got.output[0]
    turn2 = ask["input"] + [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
                            {"type": "function_call", "call_id": item.call_id, "name": item.name,
                             "arguments": item.arguments},
                            {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}]
    chat2 = ask["input"] + [{"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}]},
        {"role": "tool", "tool_call_id": item.call_id, "content": "sunny"}]
    after = client.responses.create(**dict(ask, input=turn2, max_output_tokens=4), tools=tools)
    assert after.usage.input_tokens == client.chat.completions.create(
        model="small-moe", max_tokens=4, temperature=0, messages=chat2, tools=chat_tools).usage.prompt_tokens
    # structured output; mistakes are OpenAI errors naming the response request's field
    shaped = client.responses.create(model="small-moe", input="Weather?", max_output_tokens=64, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "w", "schema": schema}})
    assert set(json.loads(shaped.output_text)) == {"city"}
    ok = {"model": "small-moe", "input": "Hi", "max_output_tokens": 2}
    both = ("/v1/responses", "/v1/responses/input_tokens")
    for body, says, param, code, paths in (
            (dict(ok, previous_response_id="resp_1"), "previous_response_id", "previous_response_id", None, both),
            (dict(ok, tools=[{"type": "web_search"}]), "tools.0.type", "tools", None, both),
            (dict(ok, input=[{"type": "input_image", "image_url": "x"}]), "input.0.type", "input", None, both),
            (dict(ok, input=[{"role": "user", "content": [{"type": "input_image"}]}]), "input.0.content", "input", None,
             both),
            (dict(ok, max_output_tokens=0), "max_output_tokens", "max_output_tokens", None, both),
            (dict(ok, tool_choice={"type": "function", "name": "nope"}, tools=tools), "tool_choice.name", "tool_choice",
             None, both),
            (dict(ok, include=["message.output_text.logprobs"]), "include.0", "include", None, both),
            (dict(ok, model="gpt-5"), "gpt-5", "model", "model_not_found", both),
            (dict(ok, input="Hi " * 600), "context window", "input", "context_length_exceeded", both[:1])):
        for path in paths:  # the chat endpoint's error fields, its param named as the response request has it
            status, raw = hermes.raw("POST", path, json.dumps(body))
            err = json.loads(raw)["error"]
            assert status in (400, 404) and says in err["message"], (path, body, raw)
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), (path, body, raw)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**dict(ok, temperature=3))


def _fuzzed_item(rng):
    kind = rng.choice(["message", "message", "function_call", "function_call_output", "reasoning", "input_image",
                       None, 3])
    hostile = [None, 1, -1.5, True, "", "x" * 50, [], {}, {"a": [1]}]
    if kind == "message" or kind is None:
        item = {"role": rng.choice(["user", "assistant", "developer", "system", "tool"]),
                "content": rng.choice(["Hi", [{"type": "input_text", "text": "Hi"}], [{"type": "output_text", "text": "x"}],
                                       [{"type": "input_image"}], rng.choice(hostile)])}
        return {**item, "type": "message"} if kind else item
    if kind == "function_call":
        return {"type": kind, "call_id": rng.choice(["c1", ""]), "name": rng.choice(["f", "bad name"]),
                "arguments": rng.choice(['{"city": "Paris"}', "{", 3])}
    if kind == "function_call_output":
        return {"type": kind, "call_id": "c1", "output": rng.choice(["sunny", [{"type": "input_text", "text": "x"}], 3])}
    if kind == "reasoning":
        return {"type": kind, "summary": rng.choice([[], [{"type": "summary_text", "text": "s"}], "x"]),
                "content": rng.choice([None, [{"type": "reasoning_text", "text": "r"}]]), "encrypted_content": None}
    return {"type": kind}


@pytest.mark.parametrize("server", ["managed", "hermes"])
def test_generated_response_requests_are_a_200_or_a_4xx_and_json(server, request):
    """Seeded generated ``/v1/responses`` requests (items of every type, hostile values, tools and
    tool choices, formats, include, reasoning; streamed or not; counted or answered): each a 200 or
    a 4xx in OpenAI's error shape, never a 5xx; a 200 is a response (or a count, or an event stream
    ending in its completion); the server answers after all of it."""
    import random

    served = request.getfixturevalue(server)
    rng = random.Random(67)
    seen = collections.Counter()
    for i in range(100):
        body = {"model": "small-moe", "max_output_tokens": rng.choice([2, 6]), "stream": rng.random() < 0.3,
                "input": "Weather?", "temperature": 0}
        if rng.random() < 0.5:
            body["input"] = [_fuzzed_item(rng) for _ in range(rng.randint(1, 3))] + [{"role": "user", "content": "Hi"}]
        for key, values in (("model", ["gpt-5", None, 3]), ("max_output_tokens", [0, "3", None, 10 ** 6]),
                            ("input", [[], None, 3, [{"type": "message"}]]), ("instructions", ["Be brief.", 3]),
                            ("tools", [[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
                                "city": {"type": "string"}}}}]] * 3 + [[{"type": "web_search"}], [{"name": "f"}]]),
                            ("tool_choice", ["required", {"type": "function", "name": "f"}, "none", "any",
                                             {"type": "allowed_tools"}]),
                            ("text", [{"format": {"type": "json_object"}}, {"format": {"type": "json_schema",
                                      "name": "s", "schema": {"type": "object"}}}, {"format": {"type": "json_schema"}},
                                      {"verbosity": "low"}, {"format": {"type": "xml"}}]),
                            ("reasoning", [{"effort": "high"}, {"effort": "none"}, {"effort": "max"}]),
                            ("include", [["reasoning.encrypted_content"], ["x"], "x"]),
                            ("previous_response_id", ["resp_1"]), ("store", [False, True, "no"]),
                            ("truncation", ["auto", "disabled"]), ("top_k", [1, -1])):
            if rng.random() < 0.1:
                body[key] = rng.choice(values)
        path, status, raw = _post_generated(served, rng, body, "/v1/responses", "/v1/responses/input_tokens", seen)
        if status != 200:
            assert json.loads(raw)["error"]["message"], raw
        elif path.endswith("input_tokens"):
            assert json.loads(raw)["input_tokens"] > 0
        elif body["stream"]:
            assert raw.decode().startswith("event: response.created\n"), raw[:300]
            assert json.loads(raw.decode().rstrip().rsplit("data: ", 1)[1])["type"] in (
                "response.completed", "response.incomplete"), raw[-300:]
        else:
            assert json.loads(raw)["object"] == "response"
    assert seen[200] >= 10 and seen[400] >= 20, seen
    assert served.client().responses.create(model="small-moe", input="Hi", max_output_tokens=2).usage.output_tokens <= 2


def test_a_lone_surrogate_in_an_answer_is_written_as_its_escape():
    """A call's arguments may hold a lone surrogate (a model's ``\\ud800`` escape, which JSON and
    Python read as such): the answer writes it as that escape, where UTF-8 could not hold it (a
    500 before); a pair is one character."""
    from expertcache.llama.server import JSONResponse
    from expertcache.llama.toolcalls import parse_tagged

    assert JSONResponse({"a": "x\ud800", "b": "é"}).body == '{"a":"x\\ud800","b":"é"}'.encode()
    call = '<|tool_call_start|>[f(a="\\ud83d\\ude00\\ud800")]<|tool_call_end|>'
    (read,) = parse_tagged(call, "lfm2", [("f", {"type": "object", "properties": {"a": {"type": "string"}}})])[1]
    assert json.loads(read["function"]["arguments"]) == {"a": "😀\ud800"}
    assert json.loads(JSONResponse(read).body)["function"]["arguments"] == read["function"]["arguments"]
