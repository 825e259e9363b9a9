"""The physical limit of a decode that reads missed experts from a device: what the device can read,
what the compute can do with every expert resident, and the decode rate the two allow.

* :func:`device_bandwidth` reads the model file itself with ``O_DIRECT`` (the page cache neither
  helps nor is disturbed) in requests of one expert slice (rounded up to 4 KiB) at random aligned
  offsets, by 1 and by 4 concurrent readers, in :data:`BANDWIDTH_PASSES` timed passes (about
  ``seconds`` in all); bytes / second, the median pass, and its spread. Cached per
  (device, request size, readers) in ``$XDG_CACHE_HOME/expertcache/devices.json`` for a day (a sweep
  pays it once); ``fresh`` measures again.
* :func:`compute_rate` decodes after the prompt in one process with the file mapped, once to read
  the experts in, then :data:`COMPUTE_REPEATS` more times: those passes route the same tokens to the
  same experts, which the first left in the page cache, so their one-token forwards time the compute
  with every expert they need resident; the median of their tokens / second (and its spread). The
  file's pages are first brought in one of the ways of :data:`PAGE_STATES` (the compute rate
  depends on it). Cached per (file, size, mtime, threads, prompt, tokens, page state) in the same file.
  With ``step="managed"`` the ``managed`` mode's advisor observes every pass as in a run (its pool
  every expert, its own hinted pages): the compute rate as that mode decodes with nothing to read.
* :func:`hinted_bandwidth` times the ``managed`` mode's miss path on the file (hints of a layer's
  routed experts' slices, a fault per page, drops): bytes / second through the page cache;
  :func:`faulted_bandwidth` ``mmap``'s (faults through a mapping opened as llama.cpp opens it);
  :func:`full_bandwidth` either with nothing dropped, in a memory cgroup kept full, so that the
  kernel reclaims a page for each one read, as it does for ``advise`` and ``mmap`` at a wall.
* :func:`prefill_compute_rate` times prefills of a prompt the same way (the
  prefill's ``c``: a prefill's limit is ``min(c, max(B1, B4) / D)`` with ``D`` its routed experts'
  bytes per prompt token, each expert once).
* :func:`limits`: with ``c`` that compute rate, ``D`` the bytes a decode token misses and ``B1``,
  ``B4`` the device's bandwidth with 1 and 4 readers,

  - ``serial_limit_tokens_per_s`` = 1 / (1/c + D/B1): reads and compute one after the other, one reader;
  - ``limit_tokens_per_s`` = min(c, max(B1, B4) / D): reads entirely overlapped with compute, the
    device fed as well as it can be (several requests at once where that reads faster);
  - ``efficiency`` = a measured decode rate / ``limit_tokens_per_s``.

Refusals are one line; a device that cannot be read with ``O_DIRECT`` (tmpfs, some overlays) gives
``None`` with the reason rather than a buffered figure that would measure the page cache.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path

from .._io import atomic_open, read_json
from ..errors import ConfigError, ExpertcacheError, is_int, is_real
from ..wall import cgroupfs as cg
from ..wall.cgroupwall import WallUnavailable, cgroup_target, make_wall_cgroup, spawn
from ..wall.pagecache import evict_file_pages, residency
from ..wall.procfs import OpenProcFile, read_self_io
from ..formats.gguf import read_geometry
from .advice import (MADV_DONTNEED, MADV_RANDOM, SEQUENTIAL, PageAdvisor, drop_file, hint_piece, hint_range,
                     mapped_ranges, mapping_base)

BLOCK = 4096
CACHE_SECONDS = 24 * 3600
"""How long a measured bandwidth or compute rate is reused."""


MAX_CACHE_BYTES = 64 << 20
"""A larger device cache is taken as damaged (it holds a few hundred bytes an entry, and entries
older than :data:`CACHE_SECONDS` are dropped as each new one is stored)."""


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "expertcache" / "devices.json"


def _load() -> dict:
    try:
        data = read_json(cache_path(), "device cache", max_bytes=MAX_CACHE_BYTES)
    except ConfigError:  # none yet, or damaged: measure again (the next save replaces it)
        return {}
    return data if isinstance(data, dict) else {}


def _store(key: str, value: dict) -> None:
    """Add one entry to the cache file (written to a temporary file and renamed: atomic)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        data = {k: v for k, v in _load().items() if _current(v, now)}  # expired go (tests add one per temp file)
        data[key] = value
        with atomic_open(path, "w", encoding="utf-8", option="the roofline cache") as fh:
            json.dump(data, fh, indent=1)
    except (OSError, ConfigError):
        pass  # a read-only home: measured again next time


def _cached(key: str, fresh: bool) -> dict | None:
    entry = _load().get(key)
    if fresh or not _current(entry, time.time()):
        return None
    return entry


_COUNTS = ("passes", "requests", "bytes", "repeats", "request_bytes", "room_bytes")


def _current(entry, now: float) -> bool:
    """A cache entry measured within :data:`CACHE_SECONDS` whose rates (``*_per_s*``) are positive
    numbers and counts integers, as every stored measurement's are, and whose ``file`` (a
    measurement of one file's, not the device's) still exists; a damaged one (an edited or torn
    file) is measured again rather than computed with (a text rate had been exit 70). Storing keeps
    only the current ones: entries of deleted files (a test suite's temporary GGUFs, 1,402 of this
    machine's 1,479 entries) go at the next store instead of a day later."""
    if not (isinstance(entry, dict) and is_real(entry.get("at")) and 0 <= now - entry["at"] <= CACHE_SECONDS):
        return False
    if "file" in entry and not (isinstance(entry["file"], str) and os.path.isfile(entry["file"])):
        return False
    rates = [v for k, v in entry.items() if "_per_s" in k]
    return (bool(rates) and all(is_real(v) and v > 0 for v in rates)
            and all(is_int(entry[k], 0) for k in _COUNTS if k in entry))


def device_key(path: str) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


READERS = (1, 4)
"""The reader counts the device is measured with (:func:`device_bandwidths`): one, a miss read
while the compute waits (the serial limit), and four, several requests in flight (the overlapped
limit)."""
BANDWIDTH_PASSES = 3
"""Timed passes of :func:`device_bandwidth` per reader count; the median is kept. One second of
reads moved by 20-50% between the blocks of one benchmark run on this shared host (B1 1.29-1.92 GB/s)."""


def device_bandwidth(path: str, request_bytes: int, readers: int, *, seconds: float = 1.5,
                     fresh: bool = False) -> dict:
    """``{"bytes_per_s", "bytes_per_s_min", "bytes_per_s_max", "passes", "requests", "readers",
    "request_bytes", "device", "cached", "note"}`` of random ``O_DIRECT`` reads of
    ``request_bytes`` (rounded up to 4 KiB) from ``path`` by ``readers`` threads: the median of
    :data:`BANDWIDTH_PASSES` passes of ``seconds / passes`` each, and their spread;
    ``bytes_per_s`` None (and ``note`` why) where ``O_DIRECT`` fails."""
    size = os.path.getsize(path)
    req = max(BLOCK, -(-int(request_bytes) // BLOCK) * BLOCK)
    req = min(req, max(BLOCK, size // BLOCK * BLOCK))
    key = f"bw {device_key(path)} {req} {readers}"
    hit = _cached(key, fresh)
    if hit is not None:
        return {**hit, "cached": True}
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError as exc:
        return {"bytes_per_s": None, "readers": readers, "request_bytes": req, "device": device_key(path),
                "cached": False, "note": f"O_DIRECT open failed: {exc.strerror or exc}"}
    slots = max(1, (size - req) // BLOCK)
    rates, total, errors = [], 0, []
    try:
        for p in range(BANDWIDTH_PASSES):
            done = [0] * readers
            stop = time.monotonic() + seconds / BANDWIDTH_PASSES

            def worker(i: int) -> None:
                buf = mmap.mmap(-1, req)  # page-aligned, as O_DIRECT wants
                rng = random.Random(p * 1000 + i)
                try:
                    while time.monotonic() < stop:
                        off = rng.randrange(slots) * BLOCK
                        n = os.preadv(fd, [buf], off)
                        if n <= 0:
                            break
                        done[i] += n
                except OSError as exc:
                    errors.append(exc.strerror or str(exc))
                finally:
                    buf.close()

            t0 = time.monotonic()
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(readers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - t0
            if errors or not sum(done):
                break
            rates.append(sum(done) / elapsed)
            total += sum(done)
    finally:
        os.close(fd)
    if errors or not rates:
        return {"bytes_per_s": None, "readers": readers, "request_bytes": req, "device": device_key(path),
                "cached": False, "note": f"O_DIRECT read failed: {errors[0] if errors else 'nothing read'}"}
    out = {"bytes_per_s": statistics.median(rates), "bytes_per_s_min": min(rates), "bytes_per_s_max": max(rates),
           "passes": len(rates), "requests": total // req, "readers": readers, "request_bytes": req,
           "device": device_key(path), "at": time.time(), "note": None}
    _store(key, out)
    return {**out, "cached": False}


def _miss_path(kind: str, g, seconds: float, fresh: bool, prepare, one_round, counter=None) -> dict:
    """The median and spread of :data:`BANDWIDTH_PASSES` passes of ``seconds / passes`` each through
    one mode's miss path on the file of ``g`` (``kind`` names it in the cache): ``prepare(fd, view)``
    once, the file's pages evicted, then rounds of ``one_round(fd, view, rng)`` (one seeded random
    MoE layer's experts read and dropped; it returns their bytes) until the pass's time is up; a
    pass's bytes are the rounds' own, or, with ``counter``, its growth over the pass (bytes the
    process read). Cached per (``kind``, file, size, mtime) for a day."""
    path = g.path
    key, hit = _file_entry(kind, path, fresh)
    if hit is not None:
        return hit
    rng = random.Random(0)
    fd = os.open(path, os.O_RDONLY)
    try:
        view = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        try:
            prepare(fd, view)
            evict_file_pages([path])
            passes = _passes(fd, view, rng, seconds, one_round, counter)
        finally:
            view.close()
    finally:
        os.close(fd)
    return _store_rates(key, [r for r, _ in passes], sum(n for _, n in passes), path)


def _file_entry(kind: str, path: str, fresh: bool) -> tuple[str, dict | None]:
    """``(key, cached record or None)`` of a measurement ``kind`` of file ``path`` (its size and
    mtime in the key)."""
    st = os.stat(path)
    key = f"{kind} {os.path.realpath(path)} {st.st_size} {int(st.st_mtime)}"
    hit = _cached(key, fresh)
    return key, None if hit is None else {**hit, "cached": True}


def _store_rates(key: str, rates: list[float], total: int, path: str, **extra) -> dict:
    """A miss path's record (median, spread, passes, bytes, ``extra``), cached under ``key``."""
    out = {"bytes_per_s": statistics.median(rates), "bytes_per_s_min": min(rates), "bytes_per_s_max": max(rates),
           "passes": len(rates), "bytes": total, **extra, "at": time.time(), "note": None,
           "file": os.path.realpath(path)}
    _store(key, out)
    return {**out, "cached": False}


def _passes(fd, view, rng, seconds: float, one_round, counter=None) -> list[tuple[float, int]]:
    """``(bytes/s, bytes)`` of each of :data:`BANDWIDTH_PASSES` passes of ``seconds / passes``:
    rounds of ``one_round(fd, view, rng)`` until the pass's time is up, its bytes the rounds' own or,
    with ``counter``, its growth over the pass."""
    out = []
    for _ in range(BANDWIDTH_PASSES):
        done, t0 = 0, time.monotonic()
        before = counter() if counter else 0
        stop = t0 + seconds / BANDWIDTH_PASSES
        while time.monotonic() < stop:
            done += one_round(fd, view, rng)
        done = counter() - before if counter else done
        out.append((done / (time.monotonic() - t0), done))
    return out


def _touch(view, ranges) -> int:
    """Every page of ``ranges`` touched in order (a fault each where it is not resident); their bytes."""
    for off, n in ranges:
        for a in range(off - off % BLOCK, off + n, BLOCK):
            view[a]
    return sum(n for _, n in ranges)


def _touch_and_drop(view, ranges, size: int, fd: int | None = None, spill: int = 0) -> int:
    """:func:`_touch`, then the ranges, widened by ``spill`` bytes each side (what a fault's
    readahead read beside them), dropped from the mapping (and, with ``fd``, from the file's page
    cache); their bytes."""
    done = _touch(view, ranges)
    for off, n in ranges:
        lo, hi = max(0, off - off % BLOCK - spill), -(-(off + n) // BLOCK) * BLOCK + spill
        view.madvise(MADV_DONTNEED, lo, min(hi, size) - lo)
        if fd is not None:
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
    return done


def _hinted_path(g, drop: bool = True):
    """``(prepare, one_round)`` of :func:`hinted_bandwidth`'s miss path (:func:`_miss_path`); without
    ``drop`` nothing read is dropped (:func:`full_bandwidth`: the kernel reclaims instead)."""
    piece = hint_piece(g.path)
    size = os.stat(g.path).st_size

    def one_round(fd, view, rng) -> int:
        layer = rng.choice(g.moe_layers)
        ranges = [r for e in rng.sample(range(g.num_experts), min(g.top_k, g.num_experts))
                  for r in g.expert_ranges(layer, e)]
        for off, n in ranges:
            hint_range(fd, off, n, piece)
        return _touch_and_drop(view, ranges, size, fd) if drop else _touch(view, ranges)
    return (lambda fd, view: view.madvise(MADV_RANDOM)), one_round


def _faulted_path(g, drop: bool = True):
    """``(prepare, one_round)`` of :func:`faulted_bandwidth`'s miss path (:func:`_miss_path`); without
    ``drop`` nothing read is dropped (:func:`full_bandwidth`)."""
    from ..tier.readers import readahead_bytes as device_readahead  # as advice.py reads it

    size = os.stat(g.path).st_size
    spill = 2 * SEQUENTIAL * device_readahead(g.path)  # two of the windows POSIX_FADV_SEQUENTIAL makes

    def one_round(fd, view, rng) -> int:
        layer = rng.choice(g.moe_layers)
        ranges = g.compute_ranges(layer, rng.sample(range(g.num_experts), min(g.top_k, g.num_experts)))
        return _touch_and_drop(view, ranges, size, fd, spill) if drop else _touch(view, ranges)

    def prepare(fd, view) -> None:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # as llama.cpp opens it
    return prepare, one_round


def hinted_bandwidth(g, *, seconds: float = 1.5, fresh: bool = False) -> dict:
    """``{"bytes_per_s", "bytes_per_s_min", "bytes_per_s_max", "passes", "bytes", "cached", "note"}``:
    bytes per second through the hinted miss path of ``advise`` and ``managed`` on the file of
    ``g`` (:func:`_miss_path`): each round one random MoE layer's ``top_k`` random experts' slices
    hinted (:func:`~expertcache.llama.advice.hint_range` in
    :func:`~expertcache.llama.advice.hint_piece` pieces, as the step hints its loads), every page of
    them then touched through a ``MADV_RANDOM`` mapping (a fault per page waiting for its read, as
    the matmul that needs them does), then dropped (``MADV_DONTNEED``, then ``POSIX_FADV_DONTNEED``,
    as the step drops a victim). Unlike :func:`device_bandwidth` it goes through the page cache: page
    allocation, the per-page faults and the system calls are in it (measured 1.02-1.7 GB/s here on
    the OLMoE-geometry benchmark file against 1.5-2.3 GB/s of ``O_DIRECT`` reads of a slice)."""
    prepare, one_round = _hinted_path(g)
    return _miss_path("hinted", g, seconds, fresh, prepare, one_round)


def faulted_bandwidth(g, *, seconds: float = 1.5, fresh: bool = False) -> dict:
    """``{"bytes_per_s", "bytes_per_s_min", "bytes_per_s_max", "passes", "bytes", "cached", "note"}``:
    bytes read per second through the ``mmap`` mode's miss path on the file of ``g``
    (:func:`_miss_path`), as llama.cpp maps it: the file opened with ``POSIX_FADV_SEQUENTIAL``
    (which doubles its readahead window) and mapped plainly; each round every page of one random MoE
    layer's ``top_k`` random experts' slices touched in the graph's order (a fault reads the window
    around it, the next faults find the rest), then dropped with the pages the windows read beside
    them (the spill: two windows each side; a range's drop, not the whole file's eviction, whose 18
    ms a round had been timed as reads). The bytes are the process's own ``read_bytes``
    (``/proc/self/io``: what the faults' read-around read, the spill beyond the slices included);
    ``bytes_per_s`` None, with a note, where this kernel does not count them."""
    io, why = read_self_io()
    if io is None:
        return {"bytes_per_s": None, "cached": False, "note": why}
    prepare, one_round = _faulted_path(g)
    return _miss_path("faulted", g, seconds, fresh, prepare, one_round, counter=_read_bytes)


def _read_bytes() -> int:
    """This process's ``read_bytes`` (``/proc/self/io``): what its faults and hints read from the device."""
    return read_self_io()[0]["read_bytes"]


FULL_ROOM_BYTES = 64 << 20
"""The most :func:`full_bandwidth`'s cgroup may hold of the file beyond the reading process's own
memory (a quarter of the expert tensors where that is less): small beside a model file, so that
nearly every page read is one the kernel makes room for by reclaiming another, as at a wall."""
FULL_TIMEOUT_S = 120.0
"""The longest :func:`full_bandwidth`'s reading process may take (it reads about 2 s)."""
FULL_KINDS = ("hinted", "faulted")
"""The miss paths :func:`full_bandwidth` times at a full cgroup: ``advise``'s and ``mmap``'s."""


def full_room(g) -> int:
    """The page cache :func:`full_bandwidth`'s cgroup holds of the file of ``g`` (whole pages)."""
    return max(BLOCK, min(FULL_ROOM_BYTES, g.expert_tensor_bytes // 4) // BLOCK * BLOCK)


def full_bandwidth(g, kind: str, *, seconds: float = 1.5, fresh: bool = False) -> dict:
    """``{"bytes_per_s", "bytes_per_s_min", "bytes_per_s_max", "passes", "bytes", "room_bytes",
    "limit_hits", "cached", "note"}``: the miss path of ``kind`` (``hinted``:
    :func:`hinted_bandwidth`'s, as ``advise`` reads; ``faulted``: :func:`faulted_bandwidth`'s, as
    ``mmap`` reads) with nothing dropped, timed by a child process in a memory cgroup of its own
    whose limit is the child's memory plus ``room_bytes`` of the file (:func:`full_room`), filled
    before the passes: every page read is then one the kernel makes room for by reclaiming another
    (a mapped page among them, unmapped first), the work a kernel mode's read does at a wall, which
    the modes' dropped passes leave out (measured here: 17-33% slower, medians). The bytes are the
    child's own ``read_bytes``; ``limit_hits`` how often its charges met the limit (the cgroup's
    ``failcnt`` of :func:`~expertcache.wall.cgroupfs.cgroup_state`: v1 ``memory.failcnt``, v2
    ``memory.events`` ``max``). Cached per (``kind``, file, size, mtime) for a day.
    ``bytes_per_s`` None, with a note, where no memory cgroup can be made here (no permission, a
    systemd scope only), the kernel does not count a process's reads, or the reading process failed
    (it says what, in one line)."""
    if kind not in FULL_KINDS:
        raise ConfigError(f"full_bandwidth: kind {kind!r} is not one of {', '.join(FULL_KINDS)}")
    path = g.path
    key, hit = _file_entry(f"{kind}-full", path, fresh)
    if hit is not None:
        return hit
    io, why = read_self_io()
    if io is None:
        return {"bytes_per_s": None, "cached": False, "note": why}
    target, why = cgroup_target()
    if target is None or target["placement"] == "systemd-scope":
        return {"bytes_per_s": None, "cached": False,
                "note": f"no memory cgroup of its own to read in ({why or 'only a systemd scope'})"}
    d = os.path.join(target["dir"], f"expertcache-full-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        make_wall_cgroup(d, target["version"], cg.UNLIMITED)
    except WallUnavailable as exc:
        return {"bytes_per_s": None, "cached": False, "note": str(exc)}
    argv = [sys.executable, "-c", "from expertcache.llama.roofline import full_child; full_child()", path, kind, d,
            target["version"], repr(float(seconds))]
    try:
        rc, out, err, timed_out = spawn(argv, os.path.join(d, "cgroup.procs"), FULL_TIMEOUT_S)
    except WallUnavailable as exc:
        return {"bytes_per_s": None, "cached": False, "note": str(exc)}
    finally:
        cg.kill_members(d)
        cg.rmdir_retry(d)
    try:
        res = json.loads(out.strip().splitlines()[-1])
        if isinstance(res, dict) and isinstance(res.get("error"), str):
            return {"bytes_per_s": None, "cached": False, "note": f"the reading process failed: {res['error']}"}
        rates, total = [float(r) for r in res["rates"]], int(res["bytes"])
    except (ValueError, IndexError, KeyError, TypeError):
        said = " ".join(err.split())[-300:] or f"exit status {rc}"
        return {"bytes_per_s": None, "cached": False,
                "note": f"the reading process {'timed out' if timed_out else 'failed'}: {said}"}
    if not rates or min(rates) <= 0:
        return {"bytes_per_s": None, "cached": False, "note": "the reading process read nothing"}
    return _store_rates(key, rates, total, path, room_bytes=int(res.get("room_bytes", 0)),
                        limit_hits=res.get("limit_hits"))


def full_child() -> None:
    """The reading process of :func:`full_bandwidth` (``argv``: file, kind, cgroup, its version,
    seconds), started inside the cgroup: the path prepared, the file evicted, the limit set to this
    process's usage plus :func:`full_room`, rounds read until twice that has been read (the cgroup
    full), then :data:`BANDWIDTH_PASSES` timed passes; prints ``{"rates", "bytes", "room_bytes",
    "limit_hits"}``, or ``{"error"}``: what failed, in one line."""
    try:
        out = _full_read(*sys.argv[1:5], float(sys.argv[5]))
    except (OSError, ValueError, ExpertcacheError) as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))


def _full_read(path: str, kind: str, d: str, version: str, seconds: float) -> dict:
    g = read_geometry(path)
    prepare, one_round = (_hinted_path if kind == "hinted" else _faulted_path)(g, drop=False)
    names = cg.FILES[version]
    rng = random.Random(0)
    fd = os.open(path, os.O_RDONLY)
    view = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    prepare(fd, view)
    evict_file_pages([path])
    room = full_room(g)
    usage = cg.read_int(os.path.join(d, names["usage"]))
    cg.write(os.path.join(d, names["limit"]), str(int(usage or 0) + room))
    before, t0 = _read_bytes(), time.monotonic()
    while _read_bytes() - before < 2 * room and time.monotonic() - t0 < FULL_TIMEOUT_S / 4:
        one_round(fd, view, rng)
    passes = _passes(fd, view, rng, seconds, one_round, _read_bytes)
    return {"rates": [r for r, _ in passes], "bytes": sum(n for _, n in passes), "room_bytes": room,
            "limit_hits": cg.cgroup_state(d, version)["failcnt"]}


COMPUTE_REPEATS = 3
"""Timed passes of :func:`compute_rate` and :func:`prefill_compute_rate` after the one that reads the
experts in; the median is kept. One pass moved by 20-50% on this shared 2-core host (a Qwen3 2-thread
decode timed 147 tok/s once, 96-103 in three passes an hour later)."""


PAGE_STATES = ("faulted", "hinted")
"""How :func:`compute_rate` brings the file's pages into the page cache before it times, for the
compute rate depends on it (docs/llama.md, "The pages' structure and the compute rate"):

* ``faulted``: the file's pages evicted, then read by llama.cpp's load (``MAP_POPULATE``: page
  faults, whose read-around puts the file in large folios, 128 KB each on a device that reads
  ahead 128 KB) -- as an ``mmap`` run reads;
* ``hinted``: after that load, every page of the file dropped and read back by
  ``POSIX_FADV_WILLNEED`` in :func:`~expertcache.llama.advice.hint_piece` pieces, which the kernel
  reads into single 4 KB pages -- as the ``managed`` mode holds the whole file (it drops the load's
  pages and hints back what it keeps), and as the other hinting modes read what they read.

Measured (``benchmarks/page_state.py``, 6 rounds): hinted / faulted 0.85 in medians on a random
OLMoE-geometry f16 GGUF with 1 thread (31.9 [30.7-37.5] against 37.5 [30.2-41] tok/s; 4 of 6 rounds
slower), 0.98 with 2 threads, 1.03 and 1.04 on a Qwen3-geometry Q4_K_M one: ties by the spread
rule, and in the benchmark's own compute cells 0.87 on the first, within 4% on the others."""
STEPS = ("managed", "advise")
"""Modes whose step :func:`compute_rate` can time observing (``step=``), whose forecasts take the
compute rate as they run (docs/sizing.md): ``managed`` (its pool's step), ``advise`` (its callback,
which splits the graph at every routing and hints every routed expert, resident or not: with nothing
to read, 57.2 tok/s against 76-82 for llama.cpp alone on the OLMoE-geometry benchmark file)."""
HINT_WAIT_S = 60.0
"""The longest :func:`bring_in` waits for hinted pages to arrive (it stops earlier once the file is
resident, or its residency has not grown for :data:`HINT_STALL_S`)."""
HINT_STALL_S = 1.0
"""How long :func:`bring_in`'s residency may stand still before it stops waiting: a file larger than
memory, or pages the kernel's readahead declined (it is best-effort: an allocation it cannot get at
once is skipped, and the first pass then faults those pages in)."""
HINT_ASSUMED_BYTES_PER_S = 1e9
"""Where the file's residency cannot be read (a file this process neither owns nor may write:
``mincore`` and ``cachestat`` would report every page resident), :func:`bring_in` waits the file's
size at this rate instead (at most :data:`HINT_WAIT_S`), and says so."""


def pages_of(mode: str) -> str:
    """The page state (:data:`PAGE_STATES`) a ``llama run`` mode's reads leave the experts in:
    ``faulted`` for ``mmap``, ``prefetch`` (whose readers' ``pread`` reads ahead as a fault's
    read-around does) and ``nommap`` (whose weights are copied out of the page cache: its reference
    is plain llama.cpp's), ``hinted`` for every mode that reads by hints or single-page faults
    (``MADV_RANDOM``)."""
    return "faulted" if mode in ("mmap", "prefetch", "nommap") else "hinted"


def bring_in(path: str, pages: str) -> str | None:
    """After an engine has mapped and loaded ``path`` in this process: leave its pages as the load
    faulted them in (``faulted``), or drop every one of them (unmapped from this process, then
    evicted) and read the file back by ``POSIX_FADV_WILLNEED`` hints (``hinted``), waiting for them
    (:data:`HINT_WAIT_S`). Returns None, or a note where the wait could not watch the residency
    (:data:`HINT_ASSUMED_BYTES_PER_S`)."""
    if pages == "faulted":
        return None
    maps = OpenProcFile("/proc/self/maps")
    try:
        base, ranges = mapping_base(path, maps), mapped_ranges(path, maps)
    finally:
        maps.close()
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_file(fd, base, ranges)  # as the managed mode starts empty
        size = os.fstat(fd).st_size
        hint_range(fd, 0, size, hint_piece(path))
    finally:
        os.close(fd)
    t0 = last_t = time.monotonic()
    last = -1
    while time.monotonic() - t0 < HINT_WAIT_S:
        try:
            have, total = residency([path])
        except PermissionError as exc:
            wait = min(HINT_WAIT_S, size / HINT_ASSUMED_BYTES_PER_S)
            time.sleep(wait)
            return f"hinted pages not watched ({exc}): waited {wait:.1f} s"
        if have >= total:
            return None
        if have > last:
            last, last_t = have, time.monotonic()
        elif time.monotonic() - last_t > HINT_STALL_S:
            return None
        time.sleep(0.05)
    return None


def _timed(kind: str, extra: str, path: str, prompt: list, threads: int, n_ctx: int, one_pass, fresh: bool,
           pages: str = "faulted", step: str | None = None) -> dict:
    """The median and spread of ``one_pass(engine)`` (a rate, or None) over :data:`COMPUTE_REPEATS`
    passes after one that reads the experts in, in one process with ``path`` mapped, its pages
    first evicted and brought in as ``pages`` says (:func:`bring_in`); with ``step`` (a mode of
    :data:`STEPS`) that mode's own advisor observes every pass (``managed``: its pool every expert of
    the file, which it brings in itself, the file dropped first; ``advise``: its hints over the pages
    :func:`bring_in` left); cached per (``kind``, file, size, mtime, threads, ``extra``, prompt,
    ``pages``, ``step``)."""
    if pages not in PAGE_STATES:
        raise ConfigError(f"page state {pages!r} is not one of {', '.join(PAGE_STATES)}")
    if step is not None and (step not in STEPS or pages != pages_of(step)):
        raise ConfigError(f"step {step!r}: one of {', '.join(STEPS)}, in its own page state")
    st = os.stat(path)
    digest = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:16]
    key = f"{kind} {os.path.realpath(path)} {st.st_size} {int(st.st_mtime)} {threads}{extra} {digest} {pages}"
    key += f" {step}" if step else ""
    hit = _cached(key, fresh)
    if hit is not None:
        return {**hit, "cached": True}
    from .engine import Engine

    evict_file_pages([path])  # whatever the last run left (its own page state) is gone
    # made before the load, as a run makes it (it opens /proc/self/maps while there is room)
    advisor = PageAdvisor(read_geometry(path), step) if step is not None else None
    try:
        with Engine(path, n_ctx=n_ctx, threads=threads) as eng:
            if advisor is None or step != "managed":
                note = bring_in(path, pages)
            else:  # the managed mode starts empty: the file dropped, its dense part hinted back
                note = None
            if advisor is not None:
                advisor.start()
                eng.attach(advisor)
            one_pass(eng)
            rates = [r for r in (one_pass(eng) for _ in range(COMPUTE_REPEATS)) if r]
    finally:
        if advisor is not None:
            advisor.close()
    if not rates:
        return {"tokens_per_s": None, "cached": False, "note": "nothing timed"}
    out = {"tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates),
           "tokens_per_s_max": max(rates), "repeats": len(rates), "pages": pages, "step": step, "at": time.time(),
           "note": note, "file": os.path.realpath(path)}
    _store(key, out)
    return {**out, "cached": False}


def compute_rate(path: str, prompt, tokens: int, threads: int = 1, *, fresh: bool = False,
                 pages: str = "faulted", step: str | None = None) -> dict:
    """``{"tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "repeats", "pages", "step", "cached",
    "note"}``: greedy decodes of ``tokens`` after ``prompt`` in one process, the file's pages brought
    in as ``pages`` says (:data:`PAGE_STATES`), the first reading every expert the others route
    (their one-token forwards time the compute alone), then :data:`COMPUTE_REPEATS` timed ones: their
    median rate and its spread. ``step``: a mode of :data:`STEPS` observing every forward as it does
    in a run (``managed``'s pool holding every expert), so that nothing is read after the first
    pass: the compute rate as that mode decodes with nothing to read, its step's own cost included."""
    prompt = [int(x) for x in prompt]
    steps = max(2, int(tokens))

    def one(eng):
        _, t = eng.generate(prompt, steps)
        return t["decode_steps"] / t["decode_seconds"] if t["decode_seconds"] else None
    return _timed("compute", f" {tokens}", path, prompt, threads, len(prompt) + steps + 1, one, fresh, pages, step)


def prefill_compute_rate(path: str, prompt, threads: int = 1, *, fresh: bool = False) -> dict:
    """``{"tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "repeats", "cached", "note"}``: the
    prefill's compute rate, forwards of ``prompt`` in one process with the file mapped, the first
    reading every expert the others route, then :data:`COMPUTE_REPEATS` timed ones (the compute with
    them resident, no eval callback): their median and spread. Cached as :func:`compute_rate`."""
    prompt = [int(x) for x in prompt]

    def one(eng):
        eng.reset()
        t0 = time.perf_counter()
        eng.forward(prompt, logits="last")
        return len(prompt) / (time.perf_counter() - t0)
    return _timed("prefill", "", path, prompt, threads, len(prompt) + 1, one, fresh)


def limits(compute_tokens_per_s: float | None, missed_bytes_per_token: float | None, bw1: float | None,
           bw4: float | None, measured_tokens_per_s: float | None = None, observed: float | None = None) -> dict:
    """The roofline fields (module docstring); None where an input is missing. ``observed``: a rate
    this file's data was measured read at another way (a mode's own miss path): the device reads at
    least that fast, so the overlapped limit takes the largest of ``bw1``, ``bw4`` and it (with small
    slices, ``O_DIRECT`` requests of one slice read slower than a fault's read-around windows, and a
    limit under the serial forecast had been printed)."""
    c, d = compute_tokens_per_s, missed_bytes_per_token
    out = {"limit_tokens_per_s": None, "serial_limit_tokens_per_s": None, "efficiency": None}
    if not c:
        return out
    if d is not None and d <= 0:
        out["limit_tokens_per_s"] = out["serial_limit_tokens_per_s"] = c
    elif d is not None:
        best = max(bw1 or 0, bw4 or 0, observed or 0)
        if best:
            out["limit_tokens_per_s"] = min(c, best / d)
        if bw1:
            out["serial_limit_tokens_per_s"] = 1.0 / (1.0 / c + d / bw1)
    if measured_tokens_per_s is not None and out["limit_tokens_per_s"]:
        out["efficiency"] = measured_tokens_per_s / out["limit_tokens_per_s"]
    return out


def device_bandwidths(path: str, request_bytes: int, *, fresh: bool = False) -> dict[int, dict]:
    """:func:`device_bandwidth`'s record for each reader count of :data:`READERS`."""
    return {readers: device_bandwidth(path, request_bytes, readers, fresh=fresh) for readers in READERS}


def roofline(path: str, request_bytes: int, prompt, tokens: int, threads: int = 1, *, fresh: bool = False,
             pages: str = "faulted") -> dict:
    """Everything a run's limits need, measured (or taken from the cache): both bandwidths at
    ``request_bytes`` and the compute rate in the page state ``pages``."""
    bw = device_bandwidths(path, request_bytes, fresh=fresh)
    b1, b4 = bw[1], bw[4]
    c = compute_rate(path, prompt, tokens, threads, fresh=fresh, pages=pages)
    return {"device_read_bytes_per_s_1": b1["bytes_per_s"], "device_read_bytes_per_s_4": b4["bytes_per_s"],
            "device_request_bytes": b1["request_bytes"], "compute_tokens_per_s": c["tokens_per_s"],
            "compute_pages": pages,
            "roofline_cached": bool(b1["cached"] and b4["cached"] and c["cached"]),
            "roofline_note": "; ".join(x["note"] for x in (b1, b4, c) if x.get("note")) or None}
