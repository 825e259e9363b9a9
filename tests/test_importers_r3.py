"""sglang-r3 and vllm-r3: routed experts returned by SGLang and vLLM servers (R3), through the CLI.

Every fixture is built here the way the server code builds its response (the releases and source
files are in docs/importers.md, "Routed experts from servers"): SGLang's payload is
``base64(int32 array .tobytes())`` (``detokenizer_manager.py``), vLLM's ``base64(np.save(...))``
(``serial_utils.numpy2base64``) or, in 0.21, ``.tolist()``. A payload holds the rows of positions
``start .. P + C - 2`` (prompt included, the last sampled token excluded), every decoder layer,
dense layers 0.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import subprocess
import sys

import numpy as np
import pytest

import expertcache as ec
from expertcache.cli.main import main
from expertcache.trace.importers import detect_format, import_r3

L, K, E, DENSE = 5, 2, 16, (0, 1)  # DeepSeek-like: the first layers dense (0 in every row)
MOE = [x for x in range(L) if x not in DENSE]


@pytest.fixture(autouse=True)
def _bugs_raise(monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_DEBUG", "1")  # an internal error is a traceback, not exit 3


def routing(seed: int, rows: int, layers: int = L, dense=DENSE, k: int = K, e: int = E) -> np.ndarray:
    """int32 [rows, layers, k]: k distinct ids per MoE layer, 0 at dense layers (what the capturer
    leaves in layers it never writes)."""
    rng = np.random.default_rng(seed)
    out = rng.random((rows, layers, e)).argsort(axis=2)[:, :, :k].astype(np.int32)
    out[:, list(dense)] = 0
    return out


def sgl_b64(r: np.ndarray) -> str:
    """SGLang (all releases 0.5.7-0.5.23): pybase64.b64encode(item.numpy().tobytes()) of int32."""
    return base64.b64encode(np.ascontiguousarray(r, "<i4").tobytes()).decode()


def vllm_b64(r: np.ndarray, dtype=np.uint8) -> str:
    """vLLM >= 0.22: np.save(buffer, array, allow_pickle=False), base64 (uint8 for <= 256 experts)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(r, dtype), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def sgl_completion(rid: str, P: int, C: int, payload, n: int = 1, per_choice=None) -> dict:
    """SGLang 0.5.12+ non-streamed /v1/completions (serving_completions.py): the routing of ret[0]
    in the response-level sglext; ``per_choice``: our own server's sglext on each choice."""
    choices = [{"index": i, "text": "…", "logprobs": None, "finish_reason": "stop", "matched_stop": None}
               for i in range(n)]
    for ch, p in zip(choices, per_choice or []):
        ch["sglext"] = {"routed_experts": p}
    out = {"id": rid, "object": "text_completion", "created": 1760000000, "model": "m", "choices": choices,
           "usage": {"prompt_tokens": P, "completion_tokens": C * n, "total_tokens": P + C * n}}
    if payload is not None:
        out["sglext"] = {"routed_experts": payload}
    return out


def sgl_generate(rid: str, P: int, C: int, payload, **meta) -> dict:
    """SGLang >= 0.5.7 native /generate, non-streamed: meta_info.routed_experts."""
    mi = {"id": rid, "finish_reason": {"type": "length", "length": C}, "prompt_tokens": P, "completion_tokens": C,
          "cached_tokens": 0, **meta}
    if payload is not None:
        mi["routed_experts"] = payload
    return {"text": "…", "output_ids": list(range(100, 100 + C)), "meta_info": mi}


def sse(chunks: list) -> list[str]:
    """Server-sent events as the servers write them: 'data: <json>', a blank line, 'data: [DONE]'."""
    out = []
    for c in chunks:
        out += [f"data: {json.dumps(c)}", ""]
    return out + ["data: [DONE]", ""]


def sgl_chat_stream(rid: str, P: int, C: int, payload, usage: bool = True) -> list[dict]:
    """SGLang 0.5.23 streamed /v1/chat/completions (serving_chat.py): content chunks, the finish
    chunk, one chunk with choices [] and sglext, then the usage chunk (stream_options.include_usage)."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "t"}, "logprobs": None,
                                    "finish_reason": "stop" if t == C - 1 else None, "matched_stop": None}], "usage": None}
              for t in range(C)]
    if payload is not None:
        chunks.append({**base, "choices": [], "usage": None, "sglext": {"routed_experts": payload}})
    if usage:
        chunks.append({**base, "choices": [], "usage": {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C}})
    return chunks


def write(path, lines, compression=None):
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    path.write_bytes(gzip.compress(data) if compression == "gzip" else data)
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["import", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def imported(capsys, tmp_path, log, *opts, num_experts=E):
    out = tmp_path / "t.npz"
    rc, stdout, err = run_cli(capsys, log, "--num-experts", num_experts, "--out", out, *opts)
    assert rc == 0, err
    return ec.load_trace(out), stdout, err


def phases(P: int, first: int, last: int) -> list[int]:
    return [1 if p < P else 0 for p in range(first, last)]


# ---------------------------------------------------------------------- SGLang
@pytest.mark.parametrize("compression", [None, "gzip"])
def test_sglang_sglext_round_trip_dense_layers_and_phases(tmp_path, capsys, compression):
    """SGLang 0.5.12+ /v1/completions, sglext: ids equal, dense layers out, prompt/decode rows."""
    seqs = [(7, 4), (3, 6), (5, 1)]
    truth = [routing(i, P + C - 1) for i, (P, C) in enumerate(seqs)]
    log = write(tmp_path / "sgl.jsonl", [sgl_completion(f"r{i}", P, C, sgl_b64(r))
                                         for i, ((P, C), r) in enumerate(zip(seqs, truth))], compression)
    t, stdout, err = imported(capsys, tmp_path, log)  # auto-detected, L and k learned
    assert "(read as sglang-r3)" in stdout and "k = 2 inferred" in err and "layers 0-1 hold only 0" in err
    assert t.layer_ids == MOE and t.top_k == K and t.num_experts == E and t.num_sequences == 3
    assert np.array_equal(t.experts, np.concatenate(truth)[:, MOE])
    assert t.extras["position"].tolist() == [p for P, C in seqs for p in range(P + C - 1)]
    assert t.extras["row_phase"].tolist() == [x for P, C in seqs for x in phases(P, 0, P + C - 1)]
    assert t.meta["phase"] == "mixed" and t.meta["source"]["dense_layers"] == list(DENSE)
    assert t.meta["rows"] == {"prefill": 15, "decode": 8, "unknown": 0}
    t2, _, err = imported(capsys, tmp_path, log, "--num-layers", L, "--top-k", K, "--format", "sglang-r3")
    assert np.array_equal(t2.experts, t.experts) and not t2.meta["source"]["top_k_inferred"] and "inferred" not in err


def test_sglang_chat_meta_info_per_choice(tmp_path, capsys):
    """SGLang 0.5.13+ chat with return_meta_info: each choice's meta_info.routed_experts (n=2)."""
    P, Cs = 4, (3, 5)
    truth = [routing(10 + i, P + C - 1) for i, C in enumerate(Cs)]
    choices = [{"index": i, "message": {"role": "assistant", "content": "…"}, "logprobs": None, "finish_reason": "stop",
                "matched_stop": None, "meta_info": {"id": f"c{i}", "prompt_tokens": P, "completion_tokens": C,
                                                    "routed_experts": sgl_b64(r)}}
               for i, (C, r) in enumerate(zip(Cs, truth))]
    resp = {"id": "chat", "object": "chat.completion", "created": 1, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": P, "completion_tokens": sum(Cs), "total_tokens": P + sum(Cs)}}
    t, _, _ = imported(capsys, tmp_path, write(tmp_path / "chat.jsonl", [resp]), "--top-k", K)
    assert np.array_equal(t.experts, np.concatenate(truth)[:, MOE]) and t.num_sequences == 2
    assert t.meta["sequence_ids"] == {"0": "chat#0", "1": "chat#1"}
    assert t.extras["row_phase"].tolist() == phases(P, 0, P + Cs[0] - 1) + phases(P, 0, P + Cs[1] - 1)


def test_our_server_sglext_per_choice_and_stock_first_choice_only(tmp_path, capsys):
    """SGLang 0.5.12+ format as our server emits it: sglext.routed_experts per choice (n=3); stock
    SGLang (sglext on the response) carries only the first choice's, the others are counted."""
    P, C, n = 3, 4, 3
    truth = [routing(20 + i, P + C - 1) for i in range(n)]
    ours = sgl_completion("ours", P, C, None, n=n, per_choice=[sgl_b64(r) for r in truth])
    stock = sgl_completion("stock", P, C, sgl_b64(truth[0]), n=n)
    t, _, err = imported(capsys, tmp_path, write(tmp_path / "n.jsonl", [ours, stock]), "--num-layers", L, "--top-k", K)
    assert np.array_equal(t.experts, np.concatenate(truth + truth[:1])[:, MOE]) and t.num_sequences == 4
    assert t.meta["validation"]["choices_without_routing"] == 2 and "2 choice(s) without routed experts" in err
    # per choice: usage's completion tokens sum over choices, so each choice's phase split needs its
    # own count; with the prompt length known the prompt rows are still told apart
    assert t.extras["row_phase"].tolist() == phases(P, 0, P + C - 1) * 4


def test_sglang_generate_batch_and_streams(tmp_path, capsys):
    """SGLang 0.5.7 /generate (a batch is a JSON array), streamed /generate (0.5.7-0.5.8: [] in early
    chunks; 0.5.10+: no key), and 0.5.23 chat SSE with the sglext chunk and the usage chunk."""
    a, b, c, d, e = (routing(30 + i, 5 + i) for i in range(5))
    early7 = [{"text": "t", "meta_info": {"id": "g7", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1,
                                          "routed_experts": []}}]
    early10 = [{"text": "t", "meta_info": {"id": "g10", "finish_reason": None, "prompt_tokens": 4, "completion_tokens": 1}}]
    lines = [[sgl_generate("b0", 2, 4, sgl_b64(a)), sgl_generate("b1", 3, 4, sgl_b64(b))]]
    lines += sse(early7 + [sgl_generate("g7", 3, 5, sgl_b64(c))])                # P + C - 1 = 7 rows
    lines += sse(early10 + [sgl_generate("g10", 4, 5, sgl_b64(d))])              # 8 rows
    lines += sse(sgl_chat_stream("chat", 6, 4, sgl_b64(e)))                       # 9 rows
    log = write(tmp_path / "s.jsonl", lines)
    assert detect_format(log) == "sglang-r3"
    t, _, _ = imported(capsys, tmp_path, log, "--top-k", K)
    assert np.array_equal(t.experts, np.concatenate([a, b, c, d, e])[:, MOE])
    assert [t.meta["sequence_ids"][str(i)] for i in range(5)] == ["b0#0", "b1#1", "g7#0", "g10#0", "chat#0"]
    assert t.extras["row_phase"].tolist()[-9:] == phases(6, 0, 9)  # the usage chunk came after the payload
    bare = write(tmp_path / "bare.jsonl", sgl_chat_stream("chat", 6, 4, sgl_b64(e)))  # chunk objects, no SSE
    t, _, _ = imported(capsys, tmp_path, bare, "--top-k", K)
    assert np.array_equal(t.experts, e[:, MOE])
    no_usage = write(tmp_path / "nu.jsonl", sse(sgl_chat_stream("chat", 6, 4, sgl_b64(e), usage=False)))
    t, _, _ = imported(capsys, tmp_path, no_usage, "--top-k", K, "--num-layers", L)
    assert set(t.extras["row_phase"].tolist()) == {-1} and t.meta["phase"] == "mixed"


# ---------------------------------------------------------------------- vLLM
def test_vllm_npy_multi_choice_and_wide_ids(tmp_path, capsys):
    """vLLM 0.28+ non-streamed completions: choices[i].routed_experts = base64 .npy (uint8 for <= 256
    experts, uint16 above), token_ids with return_token_ids; and vLLM 0.21 nested lists."""
    P, Cs = 5, (2, 6)
    truth = [routing(40 + i, P + C - 1) for i, C in enumerate(Cs)]
    choices = [{"index": i, "text": "…", "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                "prompt_logprobs": None, "token_ids": list(range(C)), "routed_experts": vllm_b64(r)}
               for i, (C, r) in enumerate(zip(Cs, truth))]
    resp = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": P, "total_tokens": P + sum(Cs), "completion_tokens": sum(Cs)}}
    log = write(tmp_path / "v.jsonl", [resp])
    t, stdout, _ = imported(capsys, tmp_path, log)
    assert "(read as vllm-r3)" in stdout and not t.meta["source"]["top_k_inferred"]
    assert np.array_equal(t.experts, np.concatenate(truth)[:, MOE]) and t.layer_ids == MOE
    assert t.extras["row_phase"].tolist() == phases(P, 0, P + Cs[0] - 1) + phases(P, 0, P + Cs[1] - 1)
    wide = routing(45, 6, e=300)
    choice = {**choices[0], "token_ids": [1, 2], "routed_experts": vllm_b64(wide, np.uint16)}
    t, _, _ = imported(capsys, tmp_path, write(tmp_path / "w.jsonl", [{**resp, "choices": [choice]}]), num_experts=300)
    assert np.array_equal(t.experts, wide[:, MOE])
    # vLLM 0.21: generated rows on the choice, prompt rows on the response, MoE layers only
    r = routing(46, P + 3 - 1, layers=3, dense=())
    old = {"id": "chatcmpl-0", "object": "chat.completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "…"}, "finish_reason": "stop",
                        "stop_reason": None, "routed_experts": r[P:].tolist()}],
           "prompt_routed_experts": r[:P].tolist(), "usage": {"prompt_tokens": P, "completion_tokens": 3, "total_tokens": 8}}
    t, _, _ = imported(capsys, tmp_path, write(tmp_path / "o.jsonl", [old]))
    assert np.array_equal(t.experts, r) and t.layer_ids == [0, 1, 2] and t.meta["phase"] == "mixed"


# ---------------------------------------------------------------------- positions
def turn(rid, prompt, out, rows, start, with_request=True):
    """One multi-turn step: a /generate request (input_ids, routed_experts_start_len, SGLang 0.5.12+)
    and its response holding the rows of positions start .. len(prompt) + len(out) - 2."""
    resp = sgl_generate(rid, len(prompt), len(out), sgl_b64(rows))
    resp["output_ids"] = out
    if not with_request:
        return resp
    req = {"input_ids": prompt, "sampling_params": {"max_new_tokens": len(out)}, "return_routed_experts": True,
           "routed_experts_start_len": start}
    return {"request": req, "response": resp}


def conversation(seed, P1=4, C1=3, U=2, C2=4):
    p1 = list(range(seed * 100, seed * 100 + P1))
    o1 = list(range(seed * 100 + 50, seed * 100 + 50 + C1))
    p2 = p1 + o1 + list(range(seed * 100 + 80, seed * 100 + 80 + U))
    o2 = list(range(seed * 100 + 90, seed * 100 + 90 + C2))
    return p1, o1, p2, o2, routing(seed, len(p2) + C2 - 1)


@pytest.mark.parametrize("gap", [0, 1, -2])
def test_suffix_stitching_interleaved_conversations(tmp_path, capsys, gap):
    """routed_experts_start_len suffixes (SGLang 0.5.12+): turn 2 continues turn 1's sequence, matched by
    token ids across interleaved conversations; start = rows held (gap 0), = tokens held (gap 1: the
    last output token has no row), or before the end (gap -2: the later rows replace the earlier)."""
    convs = [conversation(s) for s in (1, 2)]
    lines = [turn(f"a{i}", p1, o1, R[:len(p1) + len(o1) - 1], 0) for i, (p1, o1, _, _, R) in enumerate(convs)]
    for i, (p1, o1, p2, o2, R) in enumerate(convs):
        s = len(p1) + len(o1) - 1 + gap
        lines.append(turn(f"b{i}", p2, o2, R[s:], s))
    t, _, err = imported(capsys, tmp_path, write(tmp_path / "mt.jsonl", lines), "--top-k", K)
    assert t.num_sequences == 2 and t.meta["sequence_ids"] == {"0": "a0#0", "1": "a1#0"}
    end1 = len(convs[0][0]) + len(convs[0][1]) - 1
    for i, (p1, o1, p2, o2, R) in enumerate(convs):
        rows = t.select_sequences([i])
        want = [p for p in range(len(R)) if not (gap == 1 and p == end1)]
        assert rows.extras["position"].tolist() == want
        assert np.array_equal(rows.experts, R[want][:, MOE])
        s = end1 + gap  # rows before s come from turn 1 (prompt p1), the others from turn 2 (prompt p2)
        assert rows.extras["row_phase"].tolist() == [int(p < (len(p1) if p < s else len(p2))) for p in want]
    assert t.meta["validation"]["rows_replaced"] == (4 if gap == -2 else 0)
    assert t.meta["validation"]["unstitched_suffixes"] == [] and "continue no sequence" not in err


def test_start_ignored_inferred_and_unstitched(tmp_path, capsys):
    """SGLang 0.5.8-0.5.11 ignore routed_experts_start_len (every row comes back): the response replaces
    its conversation's sequence. Without requests the start comes from the counts and the newest
    sequence is continued; a suffix that continues nothing starts a sequence at its start."""
    p1, o1, p2, o2, R = conversation(3)
    s = len(p1) + len(o1) - 1
    log = write(tmp_path / "old.jsonl", [turn("a", p1, o1, R[:s], 0), turn("b", p2, o2, R, s)])
    t, _, err = imported(capsys, tmp_path, log, "--top-k", K)
    assert t.num_sequences == 1 and np.array_equal(t.experts, R[:, MOE])
    assert t.meta["validation"]["start_len_ignored"] == 1 and "request set a start" in err
    log = write(tmp_path / "bare.jsonl", [turn("a", p1, o1, R[:s], 0, False), turn("b", p2, o2, R[s:], s, False)])
    t, _, _ = imported(capsys, tmp_path, log, "--top-k", K)
    assert t.num_sequences == 1 and np.array_equal(t.experts, R[:, MOE])
    log = write(tmp_path / "lone.jsonl", [turn("b", p2, o2, R[s:], s)])
    t, _, err = imported(capsys, tmp_path, log, "--top-k", K, "--num-layers", L)
    assert t.extras["position"].tolist() == list(range(s, len(R))) and "continue no sequence" in err
    assert t.meta["validation"]["unstitched_suffixes"][0]["start"] == s


def test_lacking_rows_and_duplicates(tmp_path, capsys):
    """A row whose ids at a MoE layer are all 0 recorded nothing there: an error, or dropped with
    --drop-incomplete; an id twice in a row is always an error."""
    r = routing(50, 6)
    r[2, MOE[0]] = 0
    log = write(tmp_path / "z.jsonl", [sgl_completion("z", 4, 3, sgl_b64(r))])
    rc, _, err = run_cli(capsys, log, "--top-k", K, "--out", tmp_path / "t.npz")
    assert rc == 2 and "z.jsonl:1: sglext.routed_experts: row 2 (position 2), layer 2: no routing recorded: [0, 0]" in err
    t, _, err = imported(capsys, tmp_path, log, "--top-k", K, "--drop-incomplete")
    assert t.extras["position"].tolist() == [0, 1, 3, 4, 5] and "dropped 1 token(s)" in err
    r[2, MOE[0]] = [5, 5]
    rc, _, err = run_cli(capsys, write(tmp_path / "d.jsonl", [sgl_completion("d", 4, 3, sgl_b64(r))]),
                         "--top-k", K, "--num-layers", L, "--out", tmp_path / "t.npz")
    assert rc == 2 and "row 2 (position 2), layer 2: an expert id appears twice in [5, 5]" in err


# ---------------------------------------------------------------------- errors
def _bad_npy() -> str:
    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 2, 2), np.uint8))
    return base64.b64encode(buf.getvalue()[:-3]).decode()


R = routing(60, 6)
ERRORS = [
    ("missing sglext", [sgl_completion("m", 4, 3, None)], [],
     ":1: no routed experts in this response, id 'm'; looked for sglext.routed_experts"),
    ("missing in a stream", sse(sgl_chat_stream("s", 4, 3, None)), [],
     ":1: no routed experts in this stream (or it ends before its last chunk), id 's'"),
    ("request did not ask", [{"request": {"prompt": "hi"}, "response": sgl_completion("q", 4, 3, None)}], [],
     "(the request does not set return_routed_experts): start the server with --enable-return-routed-experts"),
    ("vLLM stream", ["data: " + json.dumps({"id": "v", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": "x"}, "finish_reason": "stop", "stop_reason": None}]}), "data: [DONE]"],
     ["--format", "vllm-r3"], "looked for choices[i].routed_experts: start the server with --enable-return-routed-experts and request stream=false"),
    ("byte length", [sgl_completion("b", 4, 3, sgl_b64(R)[:-8] + "AAAAAAA=")], ["--num-layers", L, "--top-k", K],
     ":1: sglext.routed_experts: 239 bytes, not a whole number of int32 ids (4 bytes each)"),
    ("not a multiple of L*k", [sgl_completion("b", 4, 3, sgl_b64(R[:, :4]))], ["--num-layers", L, "--top-k", K],
     ":1: sglext.routed_experts: 192 bytes are not a multiple of 4 x L x k = 5 x 2"),
    ("L*k inconsistent", [sgl_completion("a", 4, 3, sgl_b64(R)), sgl_completion("b", 4, 3, sgl_b64(R[:, :3]))], [],
     ":2: sglext.routed_experts: 144 bytes are not a multiple of 4 x L x k = 10 (learned from "),
    ("shapes inconsistent", [{"id": "v", "object": "text_completion", "usage": {}, "choices": [
        {"index": i, "stop_reason": None, "routed_experts": vllm_b64(R[:, :L - i])}]} for i in range(2)], [],
     ":2: choices[0].routed_experts: shape (6, 4, 2): 4 layers and k = 2, but"),
    ("bad base64", [sgl_completion("b", 4, 3, "AAA*")], ["--top-k", K],
     ":1: sglext.routed_experts: not valid base64"),
    ("bad npy", [{"id": "v", "object": "text_completion", "usage": {}, "choices": [{"routed_experts": _bad_npy()}]}], [],
     ":1: choices[0].routed_experts: .npy header says (2, 2, 2) uint8, but 5 data bytes follow"),
    ("id >= E", [sgl_completion("b", 4, 3, sgl_b64(R + 10))], ["--top-k", K],
     ":1: sglext.routed_experts: expert id "),
    ("negative id", [sgl_completion("b", 4, 3, sgl_b64(np.where(R == 3, -1, R)))], ["--top-k", K],
     "is outside [0, 16) (--num-experts 16)"),
    ("no counts", [sgl_generate("g", 4, 3, sgl_b64(R), prompt_tokens=None)], [],
     "no response states its prompt and completion token counts (usage, meta_info), so the payload's layers x k is unknown"),
    ("bad request", [{"request": {"routed_experts_start_len": -1}, "response": sgl_completion("b", 4, 3, sgl_b64(R))}], [],
     ":1: field 'request.routed_experts_start_len': -1 is outside [0, 2^31)"),
    ("not a response", [sgl_completion("b", 4, 3, sgl_b64(R)), {"hello": 1}], [],
     ":2: not a server response (no 'choices' list, no 'meta_info' object)"),
    ("empty", ["", ""], ["--format", "sglang-r3"], "e.jsonl: empty file (no records)"),
    ("top-k on vllm", [{"choices": [{"routed_experts": vllm_b64(R)}], "usage": {}}], ["--top-k", 2],
     "--top-k does not apply to vllm-r3"),
    ("pad", [sgl_completion("b", 4, 3, sgl_b64(R))], ["--pad"], "--pad does not apply to sglang-r3"),
    ("a boolean id in nested lists", [{"id": "c", "usage": {"prompt_tokens": 1, "completion_tokens": 2},  # true was 1
                                      "choices": [{"index": 0, "routed_experts": [[[True, 2], [3, 4]]]}]}], [],
     ":1: choices[0].routed_experts: expected [rows][layers][k] integer lists"),
]


@pytest.mark.parametrize("lines, opts, message", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_every_error_is_one_line_exit_2(tmp_path, capsys, lines, opts, message):
    log = write(tmp_path / "e.jsonl", lines)
    rc, _, err = run_cli(capsys, log, "--num-experts", E, "--out", tmp_path / "t.npz", *opts)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert err.startswith("expertcache import: error: ") and not (tmp_path / "t.npz").exists()


def test_a_real_process_prints_no_traceback(tmp_path):
    log = write(tmp_path / "e.jsonl", [sgl_completion("b", 4, 3, "AAA*")])
    proc = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "import", "sglang-r3", str(log), "--top-k", "2",
                           "--out", str(tmp_path / "t.npz")], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------- detection, replay, API
def test_detection_python_api_and_sse_blank_lines(tmp_path, monkeypatch):
    from expertcache.trace.importers import records

    pairs = write(tmp_path / "p.jsonl", [turn("a", [1, 2, 3], [4, 5], routing(70, 4), 0)])
    assert detect_format(pairs) == "sglang-r3"
    sse_text = {"request": {"stream": True}, "response": "\n\n".join(sse(sgl_chat_stream("c", 3, 2, sgl_b64(routing(71, 4)))))}
    assert detect_format(write(tmp_path / "q.jsonl", [sse_text])) == "sglang-r3"
    early = write(tmp_path / "x.jsonl", sse(sgl_chat_stream("c", 3, 2, sgl_b64(routing(71, 4)))))
    assert detect_format(early) == "sglang-r3"  # decided by the sglext chunk, after the content chunks
    monkeypatch.setattr(records, "MAX_BLANK_LINES", 2)  # SSE: a blank line after every record, never 3 in a row
    t = import_r3(early, num_experts=E, top_k=K)
    assert np.array_equal(t.experts, routing(71, 4)[:, MOE]) and t.meta["source"]["format"] == "sglang-r3"


def test_import_then_replay_and_stats(tmp_path, capsys):
    truth = [routing(80 + i, 12) for i in range(3)]
    log = write(tmp_path / "r.jsonl", [sgl_completion(f"r{i}", 6, 7, sgl_b64(r)) for i, r in enumerate(truth)])
    out = tmp_path / "t.npz"
    assert main(["import", str(log), "--num-experts", str(E), "--top-k", str(K), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["replay", str(out), "-c", "4", "-p", "lru", "-p", "belady", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {r["policy"] for r in rows} >= {"lru", "belady"}
    assert main(["stats", str(out), "--json"]) == 0 and capsys.readouterr().out


def test_help_lists_the_r3_formats(capsys):
    with pytest.raises(SystemExit):
        main(["import", "--help"])
    text = capsys.readouterr().out
    for word in ("sglang-r3", "vllm-r3", "--num-layers", "sglext", "routed_experts_start_len", "row_phase"):
        assert word in text


def test_mixed_shapes_and_block_wise_id_checks(tmp_path, monkeypatch):
    """A file of server responses and routing records is refused; the id checks of every trace run
    over row blocks (so importing a 1 GB R3 log stays under 1 GB) and still name the first bad index."""
    from expertcache.errors import TraceError
    from expertcache.trace import validate

    record = {"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1]}
    mixed = write(tmp_path / "m.jsonl", sgl_chat_stream("c", 3, 2, None)[:1] + [record])  # an early chunk decides nothing
    with pytest.raises(TraceError, match=r"m.jsonl:2: a vllm-jsonl record, but .*m.jsonl:1 is a server response"):
        detect_format(mixed)
    decided = write(tmp_path / "d.jsonl", [sgl_completion("a", 4, 3, sgl_b64(R)), record])
    with pytest.raises(TraceError, match=r"d.jsonl:2: not a server response"):
        import_r3(decided, num_experts=E)
    monkeypatch.setattr(validate, "_CHECK_BLOCK", 8)  # one token per block here
    ids = routing(90, 7, dense=())
    for bad, message in [((5, 3, 1), "id 16 at token 5, layer 3, slot 1 is outside"),
                         ((6, 2, 0), "id {} appears twice at token 6, layer 2")]:
        arr = ids.copy()
        arr[bad] = E if "outside" in message else arr[bad[0], bad[1], 1]
        with pytest.raises(TraceError, match=message.format(arr[bad]).replace("(", r"\(")):
            ec.Trace.from_arrays(arr, num_experts=E)


# ---------------------------------------------------------------------- chunked (bounded memory)
def by_name(trace_or_chunks):
    """{sequence name: (experts, position, row_phase)} of a trace or of every chunk of a chunked one."""
    pieces = trace_or_chunks.iter_chunks() if hasattr(trace_or_chunks, "iter_chunks") else [trace_or_chunks]
    out = {}
    for t in pieces:
        ids = t.meta["sequence_ids"]
        for j in range(t.num_sequences):
            one = t.select_sequences([j])
            out[ids[str(j)]] = (one.experts.tolist(), one.extras["position"].tolist(), one.extras["row_phase"].tolist())
    return out


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_chunked_import_holds_the_same_sequences(tmp_path, capsys, monkeypatch, chunk):
    """import --chunk-sequences: the same sequences (rows, ids, positions, phases) as the whole import,
    with suffixes stitched across other conversations, written while the log is read (a sequence
    once no later response can continue it: RECENT made small here so that most are written early)."""
    from expertcache.trace.importers import r3

    monkeypatch.setattr(r3, "RECENT", 3)
    lines = []
    for s in range(8):
        p1, o1, p2, o2, R = conversation(s + 10)
        cut = len(p1) + len(o1) - 1
        lines.append(turn(f"a{s}", p1, o1, R[:cut], 0))
        if s % 2:  # every other conversation continues right away, the others never
            lines.append(turn(f"b{s}", p2, o2, R[cut:], cut))
    lines.append(sgl_completion("c", 3, 2, sgl_b64(routing(99, 4)), n=1))
    log = write(tmp_path / "log.jsonl", lines)
    whole = r3.import_r3(log, num_experts=E, top_k=K)
    ct = r3.import_r3_chunked(log, tmp_path / "chunks", chunk_sequences=chunk, num_experts=E, top_k=K)
    assert ct.num_sequences == whole.num_sequences == 9 and ct.num_tokens == whole.num_tokens
    assert ct.num_chunks == -(-9 // chunk) and ct.layer_ids == whole.layer_ids
    assert by_name(ct) == by_name(whole)
    assert ct.meta["validation"]["responses"] == whole.meta["validation"]["responses"]
    rc, out, err = run_cli(capsys, log, "--num-experts", E, "--top-k", K, "--chunk-sequences", chunk,
                           "--out", tmp_path / "cli-chunks")
    assert rc == 0, err
    assert by_name(ec.trace.chunked.open_chunked(tmp_path / "cli-chunks")) == by_name(whole)
