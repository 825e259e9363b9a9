"""Forecast of decode on CPU with the experts read from disk through the page cache (docs/sizing.md,
"Forecast for CPU and disk"): ``expertcache size MODEL.gguf --memory SIZE``.

For each page-cache mode of ``expertcache llama run`` (``mmap``, ``advise``, ``managed``; docs/llama.md)
the forecast replays a router trace through a model of what that mode keeps in ``SIZE`` bytes of
memory and counts the bytes a decode token reads from disk, ``D``; the decode rate is then the
roofline (:func:`expertcache.llama.roofline.limits`) with ``c`` the compute rate with every expert
resident (:func:`timing_of`): for ``mmap`` in the page state its reads leave (the large folios of
faults' read-around; ``roofline.PAGE_STATES``), for ``advise`` and ``managed`` as they run (hinted
pages, the mode's callback observing every forward: its own cost is in ``c``); ``B`` the rate of
the mode's own miss path measured on the file (``mmap``: faults through a mapping opened as
llama.cpp opens it; ``advise``: hints and a fault per page; each in a memory cgroup full of the
file, so that every page read makes the kernel reclaim another, as at a wall,
:func:`expertcache.llama.roofline.full_bandwidth`, or where no cgroup can be made here, the same
path with its pages dropped after each read, :func:`~expertcache.llama.roofline.faulted_bandwidth`
and :func:`~expertcache.llama.roofline.hinted_bandwidth`, which the forecast's source says;
``managed``, which drops its own victims and so never leaves the kernel a page to reclaim: hints,
a fault per page, drops, :func:`~expertcache.llama.roofline.hinted_bandwidth`); and ``B1``
(``B4``) the device's ``O_DIRECT`` bandwidth with one (four) readers:

* ``predicted_tokens_per_s = 1 / (1/c + D/B)``: in these modes a missed expert's read blocks the
  compute that needs it (a page fault, or a hint the layer then waits on), so that each forecast is
  a sum of measured costs over a model of the reads;
* ``limit_tokens_per_s = min(c, max(B1, B4, B) / D)``: reads entirely overlapped with compute, for
  reference (``B`` too: the device reads at least as fast as the mode's own path was timed, so this
  limit is never under the forecast).

Every replay starts where a run starts: with the kernel modes, the file just loaded; with
``managed``, an empty pool. Every read is counted, first reads too (on a disk a cold fill is a read
like any other), and kept across the trace's sequences (the page cache outlives a request). A
trace that carries its prompts (``capture --generate N --keep-prompt``: a ``prefill`` flag per row,
:func:`prompt_rows`) has each sequence's prompt replayed first as one forward, uncounted, as a run's
prefill reads before its decode (the run's own demand model, ``runner.demand``, does the same).
``D`` = the decode's bytes read / its tokens.

Each mode's reads:

* ``managed``: exactly an LRU pool of :func:`~expertcache.llama.advice.managed_budget` bytes over
  items of :func:`~expertcache.llama.advice.managed_item_bytes` (the whole pages an expert's slices
  cover); a miss reads the expert's bytes. This is how the mode runs (docs/llama.md: its decode
  reads equalled the bytes it hinted; 1.05x the LRU demand at a 25% wall).
* ``advise``: the kernel's two file lists (:mod:`expertcache.llama.pagelists`) in ``SIZE`` bytes,
  over experts of their own sizes, a use never a reference (the expert tensors are mapped
  ``MADV_RANDOM``, whose references the kernel ignores): the load leaves the file active, the
  inactive list turns into a FIFO of about half the wall, and the experts a decode uses leave it in
  their turn, where an LRU would keep them. On the
  benchmark's captured routing (docs/llama.md, "The kernel's two lists") it read within 16% of
  the measured bytes in 4 of 6 cells, and within the runs' own spread in a fifth (the sixth,
  Qwen3 at 50%: 0.80 against 1.4 MB a token).
* ``mmap``: the same lists over **readahead windows** instead of experts, a use a reference: a
  fault reads the readahead window around it, and the window's pages then take room
  (:func:`expert_windows`: the file cut into aligned windows of :data:`~expertcache.llama.advice.SEQUENTIAL` times the
  device's ``read_ahead_kb``, :func:`readahead_bytes`, read when the forecast runs, as llama.cpp's
  ``POSIX_FADV_SEQUENTIAL`` doubles the file's readahead; each expert access touching the windows
  its slices lie in; windows that exactly the same experts touch are one item); and never less than
  ``advise``'s model (measured, ``mmap`` read more than ``advise`` in 5 of those 6 cells). It read
  0.66-1.00x what ``mmap`` measured there (docs/llama.md says what it may leave out).

In the LRU replays (:func:`replay_bytes`: ``managed``'s, and the LRU demand every record prints), a
group (one token's routed experts at one layer) larger than the whole pool cannot stay resident:
every item of it is read, and the pool is emptied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import ConfigError, is_int
from ..costmodel.sizing import MB
from .advice import SEQUENTIAL, managed_budget, managed_item_bytes
from .pagelists import two_lists
from . import roofline as rl  # its measurements called through the module (tests stand in for them there)
from .roofline import COMPUTE_REPEATS, PAGE_STATES, STEPS, limits, pages_of
from .runner import request_bytes

MODES = ("mmap", "advise", "managed")
"""The page-cache modes forecast, in the order printed (docs/llama.md defines them)."""
HINTED = ("advise", "managed")
"""The modes whose misses are read by hints and single-page faults (``MADV_RANDOM``): their ``B`` is
the rate of that path on the file (:func:`measure_hinted`; ``advise``'s at a full cgroup,
:func:`measure_full`), not ``O_DIRECT``'s."""
COMPUTE_PROMPT_TOKENS = 16
COMPUTE_TOKENS = 16
"""``--compute auto``: the prompt (ids 1..16) and the tokens decoded (once to read the experts in,
then timed :data:`~expertcache.llama.roofline.COMPUTE_REPEATS` times) by
:func:`expertcache.llama.roofline.compute_rate`."""
SYNTHETIC_USES = 20
"""Without ``--trace``: the synthetic stream is long enough for each expert to be routed about this
many times (``20 E / k`` tokens, at least 512 and at most 4096), so the first reads it counts are a
small part of a steady decode's (:func:`synthetic_tokens`)."""
KEYS = ("mode", "gguf", "memory_wall", "dense_bytes", "expert_tensor_bytes", "cache_bytes", "cache_fraction",
        "demand_bytes_per_token", "amplification", "missed_bytes_per_token", "fill_bytes_per_token",
        "readahead_bytes", "device_request_bytes", "device_read_bytes_per_s_1", "device_read_bytes_per_s_4",
        "disk_bandwidth_source", "read_bytes_per_s", "read_source", "compute_tokens_per_s", "compute_source",
        "compute_pages", "threads", "predicted_tokens_per_s",
        "limit_tokens_per_s", "bound_by", "trace", "tokens", "note")
"""The fields of every ``size --memory --json`` record, in order (docs/sizing.md)."""


@dataclass(frozen=True)
class Replayed:
    """Bytes read over a replay: ``missed_bytes`` every miss (cold fills included), ``fill_bytes``
    the first reads of items never read before, over ``tokens`` tokens."""

    missed_bytes: int
    fill_bytes: int
    tokens: int

    @property
    def per_token(self) -> float:
        return self.missed_bytes / self.tokens if self.tokens else 0.0

    @property
    def fill_per_token(self) -> float:
        return self.fill_bytes / self.tokens if self.tokens else 0.0


def replay_bytes(groups: Iterator[tuple[np.ndarray, bool]], capacity_bytes: int, item_bytes, read_bytes,
                 tokens: int, steps_per_token: int = 1, policy: str = "lru") -> Replayed:
    """Replay ``groups`` (``(item ids, counted)``, one per token and layer, in order) through one
    :class:`~expertcache.cache.SizedCache` of ``capacity_bytes`` over items of ``item_bytes``,
    started empty and never reset; a miss reads ``read_bytes[item]``, counted where the group is (a
    prompt's forward is replayed uncounted: its reads are the prefill's, not the decode's). A group
    whose items exceed the capacity is read whole and empties the pool (every group, where one item
    exceeds it)."""
    from ..cache import SizedCache

    item_bytes = np.asarray(item_bytes, dtype=np.int64)
    read_bytes = np.asarray(read_bytes, dtype=np.int64)
    fits = int(capacity_bytes) >= int(item_bytes.max())  # else no pool: every group is read whole
    cache = SizedCache(int(capacity_bytes), policy, item_bytes, steps_per_token=steps_per_token) if fits else None
    seen = np.zeros(item_bytes.size, dtype=bool)
    missed = fill = 0
    for items, counted in groups:
        if not items.size:
            continue
        if cache is None or int(item_bytes[items].sum()) > capacity_bytes:  # cannot all be resident: each read
            loads = items
            if cache is not None:
                cache.reset()  # the pool cycled
        else:
            step = cache.prepare(items)
            if not step.loads:
                continue
            loads = np.fromiter((i for i, _ in step.loads), dtype=np.int64, count=len(step.loads))
        new = loads[~seen[loads]]
        seen[new] = True
        if counted:
            missed += int(read_bytes[loads].sum())
            fill += int(read_bytes[new].sum())
    return Replayed(missed, fill, tokens)


def routing(trace, g, where: str = "--trace") -> np.ndarray:
    """The trace's experts ``[T, L, k]`` checked against the GGUF: the same E and one trace layer per
    MoE layer of the file (in order); a one-line ConfigError otherwise."""
    E, L = g.num_experts, len(g.moe_layers)
    if trace.num_experts != E:
        raise ConfigError(f"{where}: E={trace.num_experts}, the model has E={E}")
    if trace.num_layers != L:
        raise ConfigError(f"{where}: {trace.num_layers} layer(s), the model has {L} MoE layers: the page cache is "
                          "shared by every layer, so the forecast needs the routing of all of them (capture it with "
                          "'expertcache capture --model MODEL.gguf --generate N')")
    return np.asarray(trace.experts, dtype=np.int64)


def prompt_rows(trace, where: str = "--trace") -> np.ndarray | None:
    """The trace's ``prefill`` extra (``capture --generate N --keep-prompt``): a 0/1 flag per row,
    1 for a prompt's rows (one forward per sequence's run of them); None where the trace has none. A
    one-line ConfigError where it is not a flag per row, or flags every row (no decode step)."""
    flags = trace.extras.get("prefill")
    if flags is None:
        return None
    flags = np.asarray(flags)
    if flags.shape != (trace.num_tokens,):
        raise ConfigError(f"{where}: its 'prefill' array must hold a 0 or 1 per row ({trace.num_tokens} rows), "
                          f"got shape {flags.shape}")
    if not np.isin(flags, (0, 1)).all():
        bad = int(np.flatnonzero(~np.isin(flags, (0, 1)))[0])
        raise ConfigError(f"{where}: its 'prefill' array must hold 0 or 1, row {bad} holds {flags[bad].item()!r}")
    if flags.all():
        raise ConfigError(f"{where}: every row is a prompt's ('prefill' all 1): no decode step to forecast")
    return flags.astype(bool)


def expert_groups(experts: np.ndarray, num_experts: int, prompt: np.ndarray | None = None,
                  seq: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, bool]]:
    """``(item ids j * E + e, counted)`` of every (token, layer) in order (padding dropped). With
    ``prompt`` (a flag per row) and ``seq``, each sequence's run of prompt rows is one forward, as
    llama.cpp runs a prefill: per layer, the union of its rows' experts, uncounted."""
    T, L, _ = experts.shape
    offsets = np.arange(L, dtype=np.int64)[:, None] * num_experts
    t = 0
    while t < T:
        if prompt is not None and prompt[t]:
            end = t + 1
            while end < T and prompt[end] and (seq is None or seq[end] == seq[t]):
                end += 1
            rows = experts[t:end] + offsets
            for j in range(L):
                yield np.unique(rows[:, j][experts[t:end, j] >= 0]), False
            t = end
            continue
        row = experts[t] + offsets
        for j in range(L):
            yield np.unique(row[j][experts[t, j] >= 0]), True
        t += 1


def expert_windows(g, window: int) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """``(units, sizes)`` of the readahead-window model: the file cut into ``window``-byte aligned
    windows; an expert's access touches every window one of its slices overlaps. A window's bytes
    are the expert bytes in it: its other pages (the dense part, read every token) are resident
    already, so a fault neither reads them again nor takes more room for them (a window model that
    counted them read 1.28 MB a token from a 0.43 MB file whose every byte fits). Windows touched by
    exactly the same experts are always read and used together, so they are one item (a *unit*, its
    bytes the sum of its windows'; units numbered in the file order of their first window): per MoE
    layer and expert, the ids of the units it touches, and each unit's bytes.

    O(slices): the windows strictly inside a slice belong to it alone; only the two end windows of
    each slice can be shared."""
    E = g.num_experts
    ends: dict[int, set] = {}  # a slice's end window -> the experts touching it
    inside: dict[int, int] = {}  # an end window -> the expert bytes in it
    spans = []
    for j, layer in enumerate(g.moe_layers):
        for e in range(E):
            for off, n in g.expert_ranges(layer, e):
                a, b = off // window, (off + n - 1) // window
                spans.append((j, e, a, b))
                for w in {a, b}:
                    inside[w] = inside.get(w, 0) + min(off + n, (w + 1) * window) - max(off, w * window)
                ends.setdefault(a, set()).add((j, e))
                ends.setdefault(b, set()).add((j, e))
    unit_of: dict[frozenset, int] = {}
    sizes: list[int] = []
    first: list[int] = []  # each unit's first window: units are numbered in file order

    def unit(key: frozenset, nbytes: int, w: int) -> int:
        if key not in unit_of:
            unit_of[key] = len(sizes)
            sizes.append(0)
            first.append(w)
        u = unit_of[key]
        sizes[u] += nbytes
        first[u] = min(first[u], w)
        return u

    for j, e, a, b in spans:
        if b - a > 1:
            unit(frozenset([(j, e)]), (b - a - 1) * window, a + 1)
    window_unit = {w: unit(frozenset(who), inside[w], w) for w, who in ends.items()}
    touched: list[list[set]] = [[set() for _ in range(E)] for _ in g.moe_layers]
    for j, e, a, b in spans:
        touched[j][e].update((window_unit[a], window_unit[b]))
        if b - a > 1:
            touched[j][e].add(unit_of[frozenset([(j, e)])])
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(np.asarray(first), kind="stable")] = np.arange(len(first))
    units = [[np.sort(rank[np.fromiter(t, dtype=np.int64, count=len(t))]) for t in per] for per in touched]
    return units, np.asarray(sizes, dtype=np.int64)[np.argsort(np.asarray(first), kind="stable")]


def unit_groups(groups: Iterator[tuple[np.ndarray, bool]], units: list[np.ndarray]) -> Iterator[tuple[np.ndarray, bool]]:
    """Each group of item ids mapped to the units (:func:`expert_windows`) its items touch, each once."""
    for items, counted in groups:
        parts = [units[int(i)] for i in items]
        yield (np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)), counted


def synthetic_tokens(num_experts: int, top_k: int) -> int:
    """Tokens of the synthetic stream (:data:`SYNTHETIC_USES`)."""
    return int(min(4096, max(512, -(-SYNTHETIC_USES * num_experts // top_k))))


def readahead_bytes(path: str) -> tuple[int, str]:
    """``(bytes, source)``: the readahead window of the block device holding ``path``, by
    :func:`expertcache.tier.readers.readahead_bytes` (``queue/read_ahead_kb``, the disk's for a
    partition; 8 MiB where it cannot be read, said in ``source``)."""
    from ..tier.readers import DEFAULT_READAHEAD, readahead_bytes as device_readahead

    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    window = device_readahead(path)
    base = f"/sys/dev/block/{dev}"
    readable = any(os.path.isfile(os.path.join(base, *parts, "queue", "read_ahead_kb")) for parts in ((), ("..",)))
    if not readable and window == DEFAULT_READAHEAD:
        return window, f"device {dev} has no read_ahead_kb: {DEFAULT_READAHEAD >> 10} KB assumed"
    return window, f"read_ahead_kb {window >> 10} of device {dev}"


COMPUTE_TIMINGS = PAGE_STATES + STEPS
"""How each compute rate of a forecast is timed (:func:`timing_of`): with every expert resident in
each page state, and as the ``managed`` and ``advise`` modes decode with nothing to read (their
callback observing, hinted pages: :func:`expertcache.llama.roofline.compute_rate` ``step=``)."""


def timing_of(mode: str) -> str:
    """The compute rate (:data:`COMPUTE_TIMINGS`) a mode's forecast takes: ``managed`` and ``advise``
    their own, timed with their callback observing (its cost is the mode's: ``advise`` splits the
    graph at every routing and hints every routed expert); ``mmap`` that of its page state
    (:func:`~expertcache.llama.roofline.pages_of`), plain llama.cpp."""
    return mode if mode in STEPS else pages_of(mode)


@dataclass(frozen=True)
class Disk:
    """The forecast's inputs: bandwidths in bytes/s (``O_DIRECT``, one and four readers), the request
    size they were measured at, the rate of the hinted reads of ``advise`` and ``managed``
    (``hinted_bw``: :func:`~expertcache.llama.roofline.hinted_bandwidth`) and of ``mmap``'s faulted
    reads (``faulted_bw``: :func:`~expertcache.llama.roofline.faulted_bandwidth`), both also at a
    full cgroup (``*_full_bw``: :func:`~expertcache.llama.roofline.full_bandwidth`; None where not
    measured), the compute rate in tokens/s per timing of
    :data:`COMPUTE_TIMINGS`, and where each came from."""

    bw1: float
    bw4: float
    request_bytes: int
    bandwidth_source: str
    compute: dict
    compute_source: dict
    threads: int
    hinted_bw: float
    hinted_source: str
    faulted_bw: float
    faulted_source: str
    hinted_full_bw: float | None = None
    hinted_full_source: str = ""
    faulted_full_bw: float | None = None
    faulted_full_source: str = ""

    def read_rate(self, mode: str) -> tuple[float, str]:
        """``(B, source)`` of ``mode``'s reads: ``managed`` its dropped hinted path; ``advise`` and
        ``mmap`` theirs at a full cgroup (``*_full_bw``), or, where that was not measured, their
        dropped path, the source saying why."""
        if mode == "managed":
            return self.hinted_bw, self.hinted_source
        full, full_source, bw, source = ((self.hinted_full_bw, self.hinted_full_source, self.hinted_bw,
                                          self.hinted_source) if mode in HINTED else
                                         (self.faulted_full_bw, self.faulted_full_source, self.faulted_bw,
                                          self.faulted_source))
        if full:
            return full, full_source
        return bw, source + (f"; {full_source}" if full_source else "")

    @staticmethod
    def given_compute(rate: float, source: str) -> tuple[dict, dict]:
        """``(compute, compute_source)`` of one rate given for every timing."""
        return {p: rate for p in COMPUTE_TIMINGS}, {p: source for p in COMPUTE_TIMINGS}


def measure_bandwidth(g, fresh: bool = False) -> tuple[float, float, int, str]:
    """``(B1, B4, request bytes, source)`` by :func:`expertcache.llama.roofline.device_bandwidth` on
    the file itself at :func:`expertcache.llama.runner.request_bytes`; a one-line ConfigError where
    the device cannot be read with ``O_DIRECT``."""

    req = request_bytes(g)
    bw = rl.device_bandwidths(g.path, req, fresh=fresh)
    b1, b4 = bw[1], bw[4]
    for b in (b1, b4):
        if not b.get("bytes_per_s"):
            raise ConfigError(f"--disk-bandwidth auto: cannot measure the device of {g.path} ({b.get('note')}): "
                              "give --disk-bandwidth GB/s")
    how = "cached" if b1.get("cached") and b4.get("cached") else "measured"
    return (float(b1["bytes_per_s"]), float(b4["bytes_per_s"]), int(b1["request_bytes"]),
            f"{how}: O_DIRECT reads of {int(b1['request_bytes']):,} bytes")


def measure_hinted(g, fresh: bool = False) -> tuple[float, str]:
    """``(bytes/s, source)`` of the ``managed`` mode's miss path on the file
    (:func:`expertcache.llama.roofline.hinted_bandwidth`)."""
    r = rl.hinted_bandwidth(g, fresh=fresh)
    how = "cached" if r.get("cached") else "measured"
    return float(r["bytes_per_s"]), (f"{how}: {g.top_k} experts' slices hinted, their pages faulted in and dropped, "
                                     f"median of {r['passes']} passes")


def measure_faulted(g, fresh: bool = False) -> tuple[float, str]:
    """``(bytes/s, source)`` of the ``mmap`` mode's miss path on the file
    (:func:`expertcache.llama.roofline.faulted_bandwidth`); a one-line ConfigError where this kernel
    does not count a process's read bytes."""
    r = rl.faulted_bandwidth(g, fresh=fresh)
    if not r.get("bytes_per_s"):
        raise ConfigError(f"--disk-bandwidth auto: cannot measure faulted reads of {g.path} ({r.get('note')}): "
                          "give --disk-bandwidth GB/s")
    how = "cached" if r.get("cached") else "measured"
    return float(r["bytes_per_s"]), (f"{how}: {g.top_k} experts' slices faulted in through a mapping of the file "
                                     f"opened as llama.cpp opens it, then dropped, median of {r['passes']} passes")


def measure_full(g, kind: str, fresh: bool = False) -> tuple[float | None, str]:
    """``(bytes/s, source)`` of the miss path ``kind`` (``hinted``: ``advise``'s, ``faulted``:
    ``mmap``'s) at a full cgroup (:func:`expertcache.llama.roofline.full_bandwidth`), or ``(None,
    why not)``."""
    r = rl.full_bandwidth(g, kind, fresh=fresh)
    if not r.get("bytes_per_s"):
        return None, f"not timed at a full cgroup: {r.get('note')}"
    how = "cached" if r.get("cached") else "measured"
    path = ("hinted, their pages faulted in" if kind == "hinted" else
            "faulted in through a mapping of the file opened as llama.cpp opens it")
    room = r.get("room_bytes") or rl.full_room(g)
    return float(r["bytes_per_s"]), (f"{how}: {g.top_k} experts' slices {path}, nothing dropped, in a memory cgroup "
                                     f"holding {room / 2**20:.4g} MiB of the file beyond the reader (every page "
                                     f"read reclaims one, as at a wall), median of {r['passes']} passes")


def measure_compute(g, threads: int, fresh: bool = False, timing: str = "faulted") -> tuple[float, str]:
    """``(tokens/s, source)`` by :func:`expertcache.llama.roofline.compute_rate` on the file, timed as
    ``timing`` (:data:`COMPUTE_TIMINGS`) says (the median of timed greedy decodes of
    :data:`COMPUTE_TOKENS` after the prompt ids 1..16, once the first has read the experts in);
    needs the llama extra (a one-line ConfigError saying to give ``--compute`` otherwise). Where a
    step cannot run (its mode's refusal, such as an mlock of the dense part that ``RLIMIT_MEMLOCK``
    refuses), the rate of its page state, the source saying why."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ConfigError("--compute auto times llama.cpp on the file and needs the llama extra "
                          "(pip install 'expertcache[llama]'): give --compute TOK/S") from None
    if timing not in COMPUTE_TIMINGS:
        raise ConfigError(f"compute timing {timing!r} is not one of {', '.join(COMPUTE_TIMINGS)}")
    step = timing if timing in STEPS else None
    pages = pages_of(step) if step else timing
    vocab = g.metadata.get("tokenizer.ggml.tokens")
    n = vocab if is_int(vocab, 2) else 2
    prompt = [1 + i % (n - 1) for i in range(COMPUTE_PROMPT_TOKENS)]
    try:
        r = rl.compute_rate(g.path, prompt, COMPUTE_TOKENS, threads, fresh=fresh, pages=pages, step=step)
    except ConfigError as exc:
        if step is None:
            raise
        # the step cannot run here (its mlock of the dense part refused: RLIMIT_MEMLOCK): its page state's rate
        c, source = measure_compute(g, threads, fresh, pages)
        return c, f"{source} (the {step} step not timed: {exc})"
    if not r.get("tokens_per_s"):
        raise ConfigError(f"--compute auto: no decode step timed on {g.path} ({r.get('note')}): give --compute TOK/S")
    how = "cached" if r.get("cached") else "measured"
    note = f"; {r['note']}" if r.get("note") else ""
    observing = f", the {step} step observing" if step else ""
    return float(r["tokens_per_s"]), (f"{how}: llama.cpp, {COMPUTE_TOKENS} tokens decoded, median of "
                                      f"{COMPUTE_REPEATS} passes, {threads} thread{'s' if threads != 1 else ''}, "
                                      f"{pages} pages{observing}{note}")


def forecast(g, experts: np.ndarray, memory: int, disk: Disk, *, window: int, window_source: str,
             trace_label: str, prompt: np.ndarray | None = None, seq: np.ndarray | None = None) -> list[dict]:
    """One record (:data:`KEYS`) per mode of :data:`MODES` (module docstring). ``prompt`` (a flag per
    row of ``experts``, :func:`prompt_rows`; ``seq`` the rows' sequences): the prompts' rows are
    replayed first as one forward each, uncounted, as a run's prefill reads before its decode;
    ``tokens`` counts the decode rows."""
    T = int(experts.shape[0] if prompt is None else (~prompt).sum())
    E, L = g.num_experts, len(g.moe_layers)
    sizes = np.repeat(np.asarray(g.layer_expert_bytes, dtype=np.int64), E)
    total = g.expert_tensor_bytes
    room = min(memory - g.dense_bytes, total)  # a pool never holds more than every expert
    lru = replay_bytes(expert_groups(experts, E, prompt, seq), room, sizes, sizes, T, L)
    windows, wsizes = expert_windows(g, SEQUENTIAL * window)
    flat = [w for per in windows for w in per]  # item j * E + e -> its windows
    adv_read, adv_fill = two_lists(expert_groups(experts, E, prompt, seq), memory, sizes, g.dense_bytes,
                                   referenced=False)
    mm_read, mm_fill = two_lists(unit_groups(expert_groups(experts, E, prompt, seq), flat), memory, wsizes,
                                 g.dense_bytes, referenced=True)
    base = {"gguf": g.path, "memory_wall": int(memory), "dense_bytes": g.dense_bytes, "expert_tensor_bytes": total,
            "readahead_bytes": window, "device_request_bytes": disk.request_bytes,
            "device_read_bytes_per_s_1": disk.bw1, "device_read_bytes_per_s_4": disk.bw4,
            "disk_bandwidth_source": disk.bandwidth_source, "threads": disk.threads, "trace": trace_label, "tokens": T}
    demand = lru.per_token
    advise, windowed = adv_read / T, mm_read >= adv_read
    lists = "the kernel's two file lists (docs/llama.md, \"The kernel's two lists\")"
    rows = {
        "mmap": dict(cache_bytes=room, demand=demand, missed=max(mm_read, adv_read) / T,
                     fill=(mm_fill if windowed else adv_fill) / T,
                     amplification=max(mm_read, adv_read) / T / demand if demand else None,
                     note=(f"{lists} over {SEQUENTIAL * window:,}-byte readahead windows (twice {window_source}: "
                           "llama.cpp's POSIX_FADV_SEQUENTIAL), a use a reference" if windowed else
                           f"as advise: {lists} over {SEQUENTIAL * window:,}-byte readahead windows (twice "
                           f"{window_source}: llama.cpp's POSIX_FADV_SEQUENTIAL) read less "
                           f"({mm_read / T / MB:.4g} MB/token)") + ": a model, and an upper bound: every mmap cell "
                          "of the benchmark decoded slower than forecast, the most with 2 threads (docs/llama.md, "
                          "\"Benchmark\")"),
        "advise": dict(cache_bytes=room, demand=demand, missed=advise, fill=adv_fill / T,
                       amplification=advise / demand if demand else None,
                       note=f"{lists} over experts, a use no reference (MADV_RANDOM): a model"),
    }
    budget = managed_budget(g, memory)
    items = managed_item_bytes(g)
    need = g.top_k * int(items.max())
    if budget < need:
        rows["managed"] = dict(cache_bytes=budget, demand=None, missed=None, fill=None, amplification=None,
                               note=f"refused by llama run: {budget:,} bytes of pool beside the dense part hold fewer "
                                    f"than one layer routes ({g.top_k} experts, {need:,} bytes)")
    else:
        man = replay_bytes(expert_groups(experts, E, prompt, seq), budget, items, sizes, T, L)
        warmed = "" if prompt is None else f", warmed by the trace's {int(prompt.sum())} prompt rows as a run's prefill"
        rows["managed"] = dict(cache_bytes=budget, demand=man.per_token, missed=man.per_token,
                               fill=man.fill_per_token, amplification=1.0,
                               note=f"its LRU pool's misses, exactly as the mode runs{warmed}")
    out = []
    for mode in MODES:
        r = rows[mode]
        D = r["missed"]
        timing = timing_of(mode)
        c = disk.compute[timing]
        B, B_source = disk.read_rate(mode)
        lim = limits(c, D, disk.bw1, disk.bw4, observed=B)
        bound = None if D is None else ("disk" if D / B > 1.0 / c else "compute")
        rec = {"mode": mode, **base, "read_bytes_per_s": B, "read_source": B_source, "compute_tokens_per_s": c,
               "compute_source": disk.compute_source[timing], "compute_pages": pages_of(mode),
               "cache_bytes": int(r["cache_bytes"]),
               "cache_fraction": r["cache_bytes"] / total, "demand_bytes_per_token": r["demand"],
               "amplification": r["amplification"], "missed_bytes_per_token": D, "fill_bytes_per_token": r["fill"],
               "predicted_tokens_per_s": 1.0 / (1.0 / c + D / B) if D is not None else None,
               "limit_tokens_per_s": lim["limit_tokens_per_s"] if D is not None else None,
               "bound_by": bound, "note": r["note"]}
        out.append({k: rec[k] for k in KEYS})
    return out
