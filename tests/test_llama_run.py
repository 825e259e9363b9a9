"""``expertcache llama run`` / ``sweep`` on a tiny GGUF (docs/llama.md): every page-cache mode gives
the same tokens, the JSON carries the issue's fields, a walled run reports its proof (or says in one
line why no wall could be built), the demand model and the sweep summary are checked by hand.

Needs the llama extra; skips with the reason otherwise. No timed asserts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import small_moe_gguf

pytest.importorskip("gguf", reason="the llama extra (gguf) is not installed")
pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")

from expertcache.llama.advice import MODES  # noqa: E402
from expertcache.formats.gguf import read_geometry  # noqa: E402
from expertcache.llama.runner import demand, run_one  # noqa: E402
from expertcache.llama.sweep import in_rounds, parse_walls, summarize  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "small-moe"
FIELDS = ("mode", "memory_wall", "prefill_tokens_per_s", "decode_tokens_per_s", "read_bytes_per_token",
          "major_faults", "output_sha256", "proof_ok", "demand_bytes_per_token", "amplification")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """models/small-moe as an f16 GGUF (real routing; 8 MB)."""
    return small_moe_gguf(tmp_path_factory, "run")


@pytest.fixture(scope="module")
def prompt():
    return np.load(SMALL / "heldout_ids.npy")[0][:24]


def test_every_mode_gives_the_same_tokens(gguf_path, prompt):
    g = read_geometry(str(gguf_path))
    recs = {m: run_one(g, prompt, 10, m) for m in MODES}
    assert len({r["output_sha256"] for r in recs.values()}) == 1
    for r in recs.values():
        assert set(FIELDS) <= set(r) and len(r["output_ids"]) == 10 and r["decode_tokens"] == 9
        assert r["proof_ok"] is False and r["memory_wall"] is None  # no wall: nothing proven
    assert recs["advise"]["advice"]["hints"] > 0 and recs["mmap"]["advice"]["hints"] == 0
    assert recs["nocache"]["advice"]["layer_drops"] == 9 * 4 + 4  # prefill and every decode step, 4 layers
    recall = recs["lookahead"]["advice"]["lookahead_recall"]
    assert recall is not None and 0.0 <= recall <= 1.0
    # nocache drops every layer after use: its decode steps must read from the device again
    assert recs["nocache"]["read_bytes_per_token"] > 0
    # pin locks exactly the dense part: every tensor but the expert tensors
    expert = {(t.offset, t.nbytes) for parts in g.experts.values() for t in parts.values()}
    dense = sum(t.nbytes for t in g.tensors.values() if (t.offset, t.nbytes) not in expert)
    assert recs["pin"]["advice"]["locked_bytes"] == dense > 0 and recs["advise"]["advice"]["locked_bytes"] == 0
    assert recs["pin"]["advice"]["hints"] == recs["advise"]["advice"]["hints"]


def test_cli_run_in_a_wall_reports_its_proof(gguf_path, tmp_path, prompt):
    from expertcache.wall.capacity import detect_walls

    np.save(tmp_path / "ids.npy", prompt)
    wall = str(read_geometry(str(gguf_path)).file_bytes + 4 * 10**6)
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "llama", "run", str(gguf_path), "--tokens",
                           str(tmp_path / "ids.npy"), "--max-new-tokens", "6", "--mode", "advise", "--memory-wall",
                           wall, "--headroom", "300MB", "--wall", "cgroup", "--json"], capture_output=True, text=True, timeout=600, cwd=REPO)
    if not detect_walls()["cgroup"]["ok"]:
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "cgroup" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    rec = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(FIELDS) <= set(rec) and rec["memory_wall"] == int(wall)
    assert rec["capacity_enforced_by"].startswith("cgroup")
    assert rec["proof_ok"] is True, rec["wall_note"]  # the model fits and the headroom is generous: nothing to fail


def test_nommap_refuses_a_wall_below_the_model(gguf_path, prompt):
    from expertcache.errors import ConfigError

    g = read_geometry(str(gguf_path))
    with pytest.raises(ConfigError, match="nommap reads the whole model"):
        run_one(g, prompt, 4, "nommap", wall_bytes=g.file_bytes // 2)


def test_demand_model_by_hand(gguf_path):
    """Two layers' worth of routing replayed by hand: a pool of 3 experts beside the dense part."""
    g = read_geometry(str(gguf_path))
    dense = g.dense_bytes
    wall = dense + 3 * g.uniform_expert_bytes
    only = [[[0, 1], [], [], []], [[0, 2], [], [], []], [[3, 1], [], [], []]]  # layer 0 only
    d = demand(only, g, wall)
    # warm {0,1}; step 1 needs 2 (miss, pool {0,1,2}); step 2 needs 3 and 1: 3 misses (evicts 0), 1 hits
    assert d["capacity_experts"] == 3 and d["demand_misses"] == 2
    assert d["demand_bytes_per_token"] == 2 * g.uniform_expert_bytes / 2
    assert demand(only, g, dense + g.uniform_expert_bytes)["demand_bytes_per_token"] is None  # cannot hold one layer's 2


def test_walls_and_summary(gguf_path):
    g = read_geometry(str(gguf_path))
    dense = g.dense_bytes
    assert parse_walls("100%,50%,12MB", g) == sorted({dense + g.expert_tensor_bytes, dense + g.expert_tensor_bytes // 2,
                                                      12 * 10**6})
    recs = [{"mode": "mmap", "memory_wall": 10, "decode_tokens_per_s": v, "read_bytes_per_token": 1.0,
             "proof_ok": True, "output_sha256": "a"} for v in (1.0, 3.0, 2.0)]
    recs += [{"mode": "mmap", "memory_wall": 20, "decode_tokens_per_s": 9.0, "read_bytes_per_token": 0.0,
              "proof_ok": False, "output_sha256": "a"}]
    recs += [{"mode": "mmap", "memory_wall": 10, "error": "killed by signal 9", "decode_tokens_per_s": None,
              "read_bytes_per_token": None, "proof_ok": False, "output_sha256": None}]  # a run the wall killed
    s = summarize(recs, ["mmap"], [10, 20], target=2.5)
    cell = s["cells"][0]
    assert cell["decode_tokens_per_s"] == {"median": 2.0, "min": 1.0, "max": 3.0} and cell["runs"] == 3
    assert cell["failed_runs"] == 1 and cell["errors"] == ["killed by signal 9"] and not cell["proof_ok"]
    assert s["smallest_wall"] == {"mmap": 20} and not s["cells"][1]["proof_ok"]


def test_runs_come_in_rounds_of_every_cell():
    """A sweep's (and the benchmark's) runs: round r holds every cell's run r once, in an order the
    seed fixes, and differs from round to round; all runs of a cell never sit side by side in one
    stretch of the host's time."""
    cells = [(w, m) for w in (10, 20, 30) for m in ("mmap", "advise", "managed")]
    order = in_rounds(cells, 3, seed=4)
    assert len(order) == 27 and order == in_rounds(cells, 3, seed=4)
    rounds = [order[i * 9:(i + 1) * 9] for i in range(3)]
    for r, block in enumerate(rounds):
        assert sorted(c[:2] for c in block) == sorted(cells) and {c[2] for c in block} == {r}
    assert len({tuple(c[:2] for c in block) for block in rounds}) > 1  # each round shuffled on its own
    assert in_rounds(cells, 3, seed=5) != order and in_rounds(cells, 0, seed=4) == []


def covered_bytes(g) -> int:
    """The most bytes of whole pages one expert's slices cover (the managed pool's item), by hand."""
    from expertcache.llama.advice import PAGE

    return max(sum(((off + n + PAGE - 1) // PAGE - off // PAGE) * PAGE for off, n in g.expert_ranges(layer, e))
               for layer in g.moe_layers for e in range(g.num_experts))


def test_managed_mode_hints_exactly_the_policys_loads(gguf_path, prompt):
    """managed: an ExpertCache decides residency; its loads are the only experts hinted, its pool is
    sized by hand below the wall, and an offline rule or a pool below one layer is refused."""
    from expertcache.errors import ConfigError
    from expertcache.llama.advice import managed_capacity
    from expertcache.llama.runner import check_managed

    g = read_geometry(str(gguf_path))
    dense = g.dense_bytes
    L, E = len(g.moe_layers), g.num_experts
    wall = dense + 12 * covered_bytes(g)  # 12 experts beside the dense part
    assert managed_capacity(g, wall) == 12 and managed_capacity(g, None) == L * E
    rec = run_one(g, prompt, 10, "managed", keep_routing=True)  # no wall: the pool holds every expert
    adv = rec["advice"]
    assert adv["managed_capacity"] == L * E and adv["managed_policy"] == "lru" and adv["managed_drops"] == 0
    routed = {j * E + e for f in rec["routing"] for j, layer in enumerate(f) for e in layer}
    assert adv["managed_loads"] == len(routed)  # the pool starts empty: each routed expert loaded once, never again
    assert adv["hint_bytes"] == adv["managed_loads"] * g.uniform_expert_bytes
    assert rec["output_sha256"] == run_one(g, prompt, 10, "mmap")["output_sha256"]
    # --predict lookahead: the pool loads the predicted experts; the tokens stay the model's, and
    # with a tight pool every load (routed or predicted) is a hinted expert
    pred = run_one(g, prompt, 10, "managed", wall_bytes=wall, predict="lookahead")
    pa = pred["advice"]
    assert pred["output_sha256"] == rec["output_sha256"] and pred["proof_ok"]
    assert 0 < pa["predicted_loads"] <= pa["managed_loads"] and 0 <= pa["lookahead_recall"] <= 1
    assert pa["hint_bytes"] == pa["managed_loads"] * g.uniform_expert_bytes
    with pytest.raises(ConfigError, match="the managed mode's option"):
        run_one(g, prompt, 10, "advise", predict="lookahead")
    with pytest.raises(ConfigError, match="fewer than one layer routes"):
        check_managed(g, dense + g.uniform_expert_bytes, "lru")
    with pytest.raises(ConfigError, match="needs the future"):
        check_managed(g, wall, "belady")


def test_managed_mode_replays_its_own_cache(gguf_path, prompt):
    """With a pool of a few experts the mode's loads and drops are those of an ExpertCache replay of
    the run's own routing from an empty pool (prefill groups split at the pool size, as the mode
    splits them)."""
    from expertcache.cache import ExpertCache

    g = read_geometry(str(gguf_path))
    dense = g.dense_bytes
    L, E = len(g.moe_layers), g.num_experts
    cap = 2 * g.top_k
    wall = dense + cap * covered_bytes(g)
    rec = run_one(g, prompt, 10, "managed", wall_bytes=wall, wall="none", keep_routing=True)
    assert rec["advice"]["managed_capacity"] == cap
    cache = ExpertCache(cap, "lru", L * E, steps_per_token=L)
    loads = drops = 0
    for f in rec["routing"]:
        for j, layer in enumerate(f):
            items = np.asarray(layer, dtype=np.int64) + j * E
            for i in range(0, items.size, cap):
                step = cache.prepare(items[i:i + cap])
                loads, drops = loads + step.misses, drops + len(step.evicted)
    assert (rec["advice"]["managed_loads"], rec["advice"]["managed_drops"]) == (loads, drops) and drops > 0


def test_roofline_by_hand_and_in_a_run(gguf_path, prompt, tmp_path, monkeypatch):
    """The limits' arithmetic by hand; a walled run carries them, its bandwidth and compute rate
    measured once and then taken from the cache (per device / per file)."""
    from expertcache.llama.roofline import device_bandwidth, limits

    c, d, b1, b4 = 40.0, 10e6, 1e9, 2e9
    got = limits(c, d, b1, b4, measured_tokens_per_s=30.0)
    assert got["serial_limit_tokens_per_s"] == pytest.approx(1 / (1 / 40 + 10e6 / 1e9))
    assert got["limit_tokens_per_s"] == pytest.approx(min(40.0, 2e9 / 10e6)) == 40.0
    assert got["efficiency"] == pytest.approx(30 / 40)
    assert limits(c, 0.0, b1, b4)["limit_tokens_per_s"] == c  # nothing missed: the compute rate
    assert limits(c, 1e9, b1, 0.5e9)["limit_tokens_per_s"] == pytest.approx(1.0)  # the faster reader count counts
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = device_bandwidth(str(gguf_path), 196608, 1, seconds=0.2)
    again = device_bandwidth(str(gguf_path), 196608, 1, seconds=0.2)
    if first["bytes_per_s"] is None:  # no O_DIRECT on this filesystem: said, not faked
        assert first["note"].startswith("O_DIRECT")
        return
    assert first["bytes_per_s"] > 0 and not first["cached"] and again["cached"]
    assert again["bytes_per_s"] == first["bytes_per_s"] and first["request_bytes"] % 4096 == 0
    g = read_geometry(str(gguf_path))
    rec = run_one(g, prompt, 8, "managed", wall_bytes=g.dense_bytes + g.expert_tensor_bytes // 2, wall="none")
    assert rec["compute_tokens_per_s"] > 0 and rec["device_read_bytes_per_s_1"] > 0
    assert rec["compute_pages"] == "hinted"  # the page state managed's hints leave
    assert rec["limit_tokens_per_s"] >= rec["serial_limit_tokens_per_s"] > 0
    assert rec["efficiency"] == pytest.approx(rec["decode_tokens_per_s"] / rec["limit_tokens_per_s"])


def test_compute_rate_is_timed_and_kept_per_page_state(gguf_path, prompt, tmp_path, monkeypatch):
    """The compute rate depends on how the file's pages came in (docs/llama.md, "The pages' structure
    and the compute rate"): it is timed in the state asked for and kept per state; ``hinted``
    reads the whole file back by hints after dropping it (resident again when it returns); each
    mode's state is the one its reads leave; an unknown state is a one-line error."""
    from expertcache.errors import ConfigError
    from expertcache.llama.roofline import bring_in, compute_rate, pages_of
    from expertcache.wall.pagecache import evict_file_pages, residency

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    faulted = compute_rate(str(gguf_path), prompt, 4, pages="faulted")
    hinted = compute_rate(str(gguf_path), prompt, 4, pages="hinted")
    assert (faulted["pages"], hinted["pages"]) == ("faulted", "hinted")
    assert not faulted["cached"] and not hinted["cached"] and faulted["tokens_per_s"] > 0 and hinted["tokens_per_s"] > 0
    again = compute_rate(str(gguf_path), prompt, 4, pages="hinted")
    assert again["cached"] and again["tokens_per_s"] == hinted["tokens_per_s"]
    assert compute_rate(str(gguf_path), prompt, 4)["cached"]  # faulted, the default
    with pytest.raises(ConfigError, match="page state 'warm' is not one of faulted, hinted"):
        compute_rate(str(gguf_path), prompt, 4, pages="warm")
    import expertcache.llama.roofline as rl

    # the hints cover the whole file, in the advisor's pieces, after dropping it; the wait ends once
    # the residency is complete, or has stood still for HINT_STALL_S (readahead is best-effort)
    calls = []
    real_fadvise = rl.os.posix_fadvise
    monkeypatch.setattr(rl.os, "posix_fadvise", lambda fd, off, n, advice: (calls.append((off, n, advice)),
                                                                            real_fadvise(fd, off, n, advice))[1])
    evict_file_pages([str(gguf_path)])
    calls.clear()
    assert bring_in(str(gguf_path), "hinted") is None  # nothing mapped here: the hints alone
    size = gguf_path.stat().st_size
    assert calls[0] == (0, 0, rl.os.POSIX_FADV_DONTNEED)
    hints = calls[1:]
    assert {a for _, _, a in hints} == {rl.os.POSIX_FADV_WILLNEED}
    assert hints[0][0] == 0 and sum(n for _, n, _ in hints) == size
    assert all(a[0] + a[1] == b[0] for a, b in zip(hints, hints[1:]))
    have, total = residency([str(gguf_path)])
    assert total == size and have >= 0.99 * total  # a page the readahead declined is faulted in later
    seen = iter([(10, 100), (50, 100), (100, 100)])
    monkeypatch.setattr(rl, "residency", lambda paths: next(seen))
    assert bring_in(str(gguf_path), "hinted") is None and next(seen, None) is None  # stops once complete
    monkeypatch.setattr(rl, "residency", lambda paths: (60, 100))
    monkeypatch.setattr(rl, "HINT_STALL_S", 0.2)
    t0 = time.monotonic()
    assert bring_in(str(gguf_path), "hinted") is None  # stands still: stops after the stall window
    assert 0.2 <= time.monotonic() - t0 < 5
    # a file whose residency cannot be read (neither owned nor writable): a bounded wait, said

    def refuse(paths):
        raise PermissionError(f"{paths[0]}: mincore cannot report residency")

    monkeypatch.setattr(rl, "residency", refuse)
    monkeypatch.setattr(rl, "HINT_WAIT_S", 0.01)
    note = bring_in(str(gguf_path), "hinted")
    assert note.startswith("hinted pages not watched (") and "mincore cannot report residency" in note
    assert {m: pages_of(m) for m in MODES} == {
        "mmap": "faulted", "random": "hinted", "advise": "hinted", "pin": "hinted", "managed": "hinted",
        "lookahead": "hinted", "nocache": "hinted", "prefetch": "faulted", "nommap": "faulted"}


def test_compute_rate_as_the_managed_step_runs(gguf_path, prompt, tmp_path, monkeypatch):
    """``step="managed"``: the compute rate timed with the managed mode's own advisor observing every
    forward (its pool every expert: the first pass loads, nothing is ever dropped), kept apart from
    the plain hinted rate; ``step="advise"`` likewise with advise's; a step of another mode, or in
    another page state, is a one-line error."""
    import expertcache.llama.roofline as rl
    from expertcache.errors import ConfigError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made = []

    class Recorded(rl.PageAdvisor):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(rl, "PageAdvisor", Recorded)
    plain = rl.compute_rate(str(gguf_path), prompt, 4, pages="hinted")
    assert not made and plain["step"] is None
    stepped = rl.compute_rate(str(gguf_path), prompt, 4, pages="hinted", step="managed")
    assert not stepped["cached"] and stepped["step"] == "managed" and stepped["tokens_per_s"] > 0
    (adv,) = made
    assert adv.mode == "managed" and adv.managed_loads > 0 and adv.managed_drops == 0 and adv.n_tokens > 0
    again = rl.compute_rate(str(gguf_path), prompt, 4, pages="hinted", step="managed")
    assert again["cached"] and again["tokens_per_s"] == stepped["tokens_per_s"] and len(made) == 1
    # advise's callback observes too, hinting every routed expert, in the hinted pages it runs in
    advised = rl.compute_rate(str(gguf_path), prompt, 4, pages="hinted", step="advise")
    assert not advised["cached"] and advised["step"] == "advise" and advised["tokens_per_s"] > 0
    assert made[-1].mode == "advise" and made[-1].hints > 0 and made[-1].n_tokens > 0 and len(made) == 2
    for step, pages in (("pin", "hinted"), ("managed", "faulted"), ("advise", "faulted")):
        with pytest.raises(ConfigError, match=f"step '{step}': one of managed, advise, in its own page state"):
            rl.compute_rate(str(gguf_path), prompt, 4, pages=pages, step=step)


def test_hinted_bandwidth_reads_as_the_managed_step_does(gguf_path, tmp_path, monkeypatch):
    """The managed mode's miss path timed on the file: per round one MoE layer's top_k experts, each
    slice hinted in the advisor's pieces, then dropped over the whole pages it covers; bytes per
    second over the slices' bytes; kept in the cache."""
    import expertcache.llama.roofline as rl
    from expertcache.formats.gguf import read_geometry

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    g = read_geometry(str(gguf_path))
    slices = {r for layer in g.moe_layers for e in range(g.num_experts) for r in g.expert_ranges(layer, e)}
    calls = []
    real = rl.os.posix_fadvise
    monkeypatch.setattr(rl.os, "posix_fadvise", lambda fd, off, n, advice: (calls.append((off, n, advice)),
                                                                            real(fd, off, n, advice))[1])
    r = rl.hinted_bandwidth(g, seconds=0.3)
    assert not r["cached"] and r["passes"] == rl.BANDWIDTH_PASSES and r["bytes"] > 0 and r["bytes_per_s"] > 0
    assert r["bytes_per_s_min"] <= r["bytes_per_s"] <= r["bytes_per_s_max"]
    piece = rl.hint_piece(g.path)
    hinted, dropped = [], []
    for off, n, advice in calls:
        (hinted if advice == rl.os.POSIX_FADV_WILLNEED else dropped).append((off, n))
    assert all(n <= piece for _, n in hinted)
    # the hints, joined where a piece continues its slice, are whole slices; each slice dropped over its pages
    joined = []
    for off, n in hinted:
        if joined and joined[-1][0] + joined[-1][1] == off and joined[-1] not in slices:
            joined[-1] = (joined[-1][0], joined[-1][1] + n)
        else:
            joined.append((off, n))
    assert set(joined) <= slices and sum(n for _, n in joined) == r["bytes"]
    drops = [(off // 4096 * 4096, -(-(off + n) // 4096) * 4096 - off // 4096 * 4096) for off, n in joined]
    assert [d for d in dropped if d[1]] == drops
    assert rl.hinted_bandwidth(g)["cached"]


def test_faulted_bandwidth_reads_as_llama_cpp_maps(gguf_path, tmp_path, monkeypatch):
    """mmap's miss path timed on the file: opened POSIX_FADV_SEQUENTIAL as llama.cpp opens it, no
    hint, the bytes those of the process's own read counter over each pass (what the faults' windows
    read); kept in the cache; a kernel without the counter is a one-line error for the forecast."""
    import expertcache.llama.forecast as dk
    import expertcache.llama.roofline as rl
    from expertcache.errors import ConfigError
    from expertcache.formats.gguf import read_geometry

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    g = read_geometry(str(gguf_path))
    calls = []
    real = rl.os.posix_fadvise
    monkeypatch.setattr(rl.os, "posix_fadvise", lambda fd, off, n, advice: (calls.append((off, n, advice)),
                                                                            real(fd, off, n, advice))[1])
    reads = iter(range(0, 10 ** 12, 1000))  # the counter: 1000 bytes more at every reading
    monkeypatch.setattr(rl, "read_self_io", lambda: ({"read_bytes": next(reads)}, None))
    evictions = []
    real_evict = rl.evict_file_pages
    monkeypatch.setattr(rl, "evict_file_pages", lambda paths: (evictions.append(paths), real_evict(paths))[1])
    r = rl.faulted_bandwidth(g, seconds=0.3)
    assert not r["cached"] and r["passes"] == rl.BANDWIDTH_PASSES and r["bytes"] == 1000 * rl.BANDWIDTH_PASSES
    assert r["bytes_per_s_min"] <= r["bytes_per_s"] <= r["bytes_per_s_max"]
    assert calls[0] == (0, 0, rl.os.POSIX_FADV_SEQUENTIAL)
    assert not any(advice == rl.os.POSIX_FADV_WILLNEED for _, _, advice in calls)
    # the file evicted once, before the passes (a whole-file eviction a round had been timed as reads);
    # each round drops its slices with the windows' spill beside them
    import os

    from expertcache.tier.readers import readahead_bytes

    spill = 4 * readahead_bytes(g.path)
    drops = [(off, n) for off, n, advice in calls if advice == rl.os.POSIX_FADV_DONTNEED and n]  # n 0: the eviction
    slice_bytes = min(n for layer in g.moe_layers for _, n in g.expert_ranges(layer, 0))
    assert len(evictions) == 1 and drops and all(n >= min(slice_bytes + spill, os.path.getsize(g.path) - off)
                                                 for off, n in drops)
    assert rl.faulted_bandwidth(g)["cached"]
    monkeypatch.setattr(rl, "read_self_io", lambda: (None, "/proc/self/io: no read_bytes field"))
    assert rl.faulted_bandwidth(g, fresh=True) == {"bytes_per_s": None, "cached": False,
                                                   "note": "/proc/self/io: no read_bytes field"}
    with pytest.raises(ConfigError, match="cannot measure faulted reads .* give --disk-bandwidth"):
        dk.measure_faulted(g, fresh=True)


def test_full_bandwidth_reads_where_the_kernel_reclaims(gguf_path, tmp_path, monkeypatch):
    """advise's and mmap's miss paths timed at a full cgroup: a child in a memory cgroup of its own
    whose limit leaves it a quarter of the expert tensors, nothing dropped, so its charges meet the
    limit and the kernel reclaims; the cgroup gone after; kept in the cache per kind."""
    import expertcache.llama.forecast as dk
    import expertcache.llama.roofline as rl
    from expertcache.errors import ConfigError
    from expertcache.formats.gguf import read_geometry

    target, why = rl.cgroup_target()
    if target is None or target["placement"] == "systemd-scope":
        pytest.skip(f"no memory cgroup of its own here: {why or 'a systemd scope only'}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    g = read_geometry(str(gguf_path))
    before = set(os.listdir(target["dir"]))
    for kind in rl.FULL_KINDS:
        r = rl.full_bandwidth(g, kind, seconds=0.3)
        assert r["note"] is None and not r["cached"] and r["passes"] == rl.BANDWIDTH_PASSES
        assert r["bytes_per_s_min"] <= r["bytes_per_s"] <= r["bytes_per_s_max"] and r["bytes"] > 0
        assert r["room_bytes"] == rl.full_room(g) < g.expert_tensor_bytes and r["limit_hits"] > 0
        assert rl.full_bandwidth(g, kind)["cached"]
        rate, source = dk.measure_full(g, kind)
        assert rate == r["bytes_per_s"] and source.startswith("cached: ") and "every page read reclaims one" in source
    assert {n for n in os.listdir(target["dir"]) if n.startswith("expertcache-full-")} <= before
    with pytest.raises(ConfigError, match="kind 'managed' is not one of hinted, faulted"):
        rl.full_bandwidth(g, "managed")


def test_without_a_cgroup_the_forecast_reads_at_the_dropped_rate(gguf_path, tmp_path, monkeypatch):
    """Where no memory cgroup can be made, full_bandwidth says why in one line, and advise and mmap
    take their dropped paths' rates with that reason in their source; managed's is its own either way."""
    import expertcache.llama.forecast as dk
    import expertcache.llama.roofline as rl
    from expertcache.formats.gguf import read_geometry

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(rl, "cgroup_target", lambda: (None, "no memory controller"))
    g = read_geometry(str(gguf_path))
    r = rl.full_bandwidth(g, "hinted", seconds=0.3)
    assert r == {"bytes_per_s": None, "cached": False, "note": "no memory cgroup of its own to read in (no memory "
                                                              "controller)"}
    full = {kind: dk.measure_full(g, kind) for kind in rl.FULL_KINDS}
    assert full["faulted"] == (None, "not timed at a full cgroup: no memory cgroup of its own to read in (no memory "
                                     "controller)")
    disk = dk.Disk(1e9, 1e9, 4096, "x", {}, {}, 1, 2e9, "hinted path", 3e9, "faulted path", *full["hinted"],
                   *full["faulted"])
    assert disk.read_rate("managed") == (2e9, "hinted path")
    assert disk.read_rate("advise") == (2e9, "hinted path; not timed at a full cgroup: no memory cgroup of its own "
                                             "to read in (no memory controller)")
    assert disk.read_rate("mmap")[0] == 3e9
    full = dk.Disk(1e9, 1e9, 4096, "x", {}, {}, 1, 2e9, "hinted path", 3e9, "faulted path", 1e9, "hinted full",
                   0.5e9, "faulted full")
    assert [full.read_rate(m) for m in ("managed", "advise", "mmap")] == [
        (2e9, "hinted path"), (1e9, "hinted full"), (0.5e9, "faulted full")]


def test_a_failed_reading_process_is_one_line(gguf_path, tmp_path, monkeypatch, capsys):
    """The reading process prints what failed as one JSON line (no traceback), and full_bandwidth
    turns it, or a process that printed nothing, into a note; the cgroup is removed either way."""
    import expertcache.llama.roofline as rl
    from expertcache.formats.gguf import read_geometry

    monkeypatch.setattr(sys, "argv", ["-c", str(tmp_path / "gone.gguf"), "hinted", str(tmp_path), "v1", "0.1"])
    rl.full_child()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and set(json.loads(out[0])) == {"error"} and "gone.gguf" in json.loads(out[0])["error"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(rl, "cgroup_target", lambda: ({"version": "v1", "dir": str(tmp_path), "placement": "child"}, ""))
    made, removed = [], []
    monkeypatch.setattr(rl, "make_wall_cgroup", lambda d, version, limit: made.append(d))
    monkeypatch.setattr(rl.cg, "kill_members", lambda d: None)
    monkeypatch.setattr(rl.cg, "rmdir_retry", lambda d: removed.append(d))
    g = read_geometry(str(gguf_path))
    for said, note in (('{"error": "OSError: [Errno 16] Device or resource busy"}',
                        "the reading process failed: OSError: [Errno 16] Device or resource busy"),
                       ("", "the reading process failed: exit status 1")):
        monkeypatch.setattr(rl, "spawn", lambda argv, procs, timeout: (1 if not said else 0, said, "", False))
        assert rl.full_bandwidth(g, "faulted") == {"bytes_per_s": None, "cached": False, "note": note}
    assert len(made) == 2 and removed == made


def test_prefill_compute_rate_is_timed_once_per_prompt(gguf_path, prompt, tmp_path, monkeypatch):
    """The prefill's compute rate (the benchmark's prefill limit): the median of timed prefills in one
    process, kept per (file, threads, prompt) in the cache file; another prompt is timed afresh."""
    from expertcache.llama.roofline import prefill_compute_rate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = prefill_compute_rate(str(gguf_path), prompt)
    again = prefill_compute_rate(str(gguf_path), prompt)
    other = prefill_compute_rate(str(gguf_path), list(prompt)[:-1])
    assert first["tokens_per_s"] > 0 and not first["cached"] and first["note"] is None and first["repeats"] == 3
    assert first["tokens_per_s_min"] <= first["tokens_per_s"] <= first["tokens_per_s_max"]
    assert again["cached"] and again["tokens_per_s"] == first["tokens_per_s"]
    assert not other["cached"] and other["tokens_per_s"] > 0


def test_the_roofline_cache_keeps_current_measurements_only(tmp_path, monkeypatch):
    """The device cache (``~/.cache/expertcache/devices.json``): an entry is reused only while it is
    current and its rates are numbers; storing drops the expired and damaged ones (test runs add one
    per temporary file: this machine's had grown to 1,083 entries, 383 kB); a file that is not JSON
    or too large is measured again, not an error. A text rate had been exit 70 where it was used."""
    import expertcache.llama.roofline as rl

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    now = time.time()
    good = {"bytes_per_s": 1e9, "bytes_per_s_min": 9e8, "bytes_per_s_max": 1.1e9, "passes": 3, "at": now}
    rl.cache_path().parent.mkdir(parents=True)
    rl.cache_path().write_text(json.dumps({
        "good": good, "old": {**good, "at": now - rl.CACHE_SECONDS - 1}, "future": {**good, "at": now + 3600},
        "text": {**good, "bytes_per_s": "x"}, "count": {**good, "passes": 2.5}, "no rate": {"at": now},
        "not a table": 5}))
    assert rl._cached("good", False) == good
    for key in ("old", "future", "text", "count", "no rate", "not a table", "absent"):
        assert rl._cached(key, False) is None, key
    assert rl._cached("good", True) is None  # fresh: measured again
    rl._store("new", {**good, "at": time.time()})
    assert sorted(json.loads(rl.cache_path().read_text())) == ["good", "new"]
    for damaged in ("[" * 100_000 + "]" * 100_000, "not json", " " * (rl.MAX_CACHE_BYTES + 1)):
        rl.cache_path().write_text(damaged)
        assert rl._cached("good", False) is None
    rl._store("good", good)
    assert json.loads(rl.cache_path().read_text()) == {"good": good}


def test_the_roofline_cache_forgets_the_measurements_of_deleted_files(tmp_path, monkeypatch):
    """A measurement of one file's (``file``: hinted bandwidth, compute and prefill rates) goes with
    the file at the next store, not a day later (this machine's cache held 1,402 compute entries of
    a test suite's deleted temporary GGUFs); the device's bandwidths (no ``file``) stay; a ``file``
    that is not a path is a damaged entry."""
    import expertcache.llama.roofline as rl

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kept, gone = tmp_path / "kept.gguf", tmp_path / "gone.gguf"
    kept.write_bytes(b"x")
    gone.write_bytes(b"x")
    rate = {"tokens_per_s": 50.0, "repeats": 3, "at": time.time()}
    rl._store("kept", {**rate, "file": str(kept)})
    rl._store("gone", {**rate, "file": str(gone)})
    rl._store("device", {"bytes_per_s": 1e9, "passes": 3, "at": time.time()})
    assert rl._cached("gone", False) is not None
    gone.unlink()
    assert rl._cached("gone", False) is None  # measured again were the file back
    data = json.loads(rl.cache_path().read_text())
    rl.cache_path().write_text(json.dumps({**data, "number": {**rate, "file": 5}}))
    assert rl._cached("number", False) is None
    rl._store("again", {**rate, "file": str(kept)})
    assert sorted(json.loads(rl.cache_path().read_text())) == ["again", "device", "kept"]


def test_prefetch_marks_cold_only_what_a_prefills_lookahead_read(gguf_path):
    """As ik_llama.cpp's --prefetch-experts: a decode step's routed experts are read and left as they
    are (no ffn_moe_out callback, nothing to mark cold); a prefill streams the next MoE layers' whole
    expert tensors, and what that read is handed back at the layer's ffn_moe_out."""
    import mmap

    from expertcache.llama.advice import PREFETCH_AHEAD, PageAdvisor
    from expertcache.wall.pagecache import evict_file_pages

    g = read_geometry(str(gguf_path))
    layers = g.moe_layers
    assert len(layers) > PREFETCH_AHEAD
    out = f"ffn_moe_out-{layers[0]}".encode()
    fallback = PageAdvisor(g, "prefetch", readers=0)  # no readers: the hints, as ik_llama.cpp falls back
    try:
        assert not fallback.wants(out)
    finally:
        fallback.close()
    evict_file_pages([str(gguf_path)])
    adv = PageAdvisor(g, "prefetch", readers=1)
    with open(gguf_path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        adv.base = int(np.frombuffer(m, dtype=np.uint8).ctypes.data)
        adv.begin(1, True, False)
        assert not adv.wants(out)
        adv.warm(layers[0], np.array([0, 1]))  # a decode step: the routed experts only, untracked
        adv.begin(24, True, False)
        assert adv.wants(out) and adv.ahead == set(layers[:PREFETCH_AHEAD])
        adv.warm(layers[0], np.array([0, 1]))  # a prefill's layer 0: one more layer streams ahead
        assert adv.ahead == set(layers[:PREFETCH_AHEAD + 1])
        adv.readers.close()  # every queued piece read
        read = {layer: adv.readers.take_read(layer) for layer in layers}
        for layer in layers:
            got = sum(n for _, n in read[layer])
            whole = sum(n for _, n in g.layer_span(layer))
            # a piece already wholly resident is skipped: at most the whole layer is handed back
            assert (0 < got <= whole) if layer in adv.ahead else got == 0, layer
    finally:
        adv.close()
        m.close()
