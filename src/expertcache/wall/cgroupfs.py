"""This process's memory cgroup and the files of the cgroups expertcache makes under it.

Invariants: the only cgroups written are children created by :mod:`expertcache.wall.capacity`
(and a probe made and removed at once by :func:`probe_child`); the process's own cgroup and every
other one are only read. v1 (the memory controller's hierarchy) and v2 (cgroup2 with memory
enabled in the own cgroup's ``cgroup.subtree_control``) use the file names in :data:`FILES`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import secrets
import signal
import threading
import time

from .pagecache import FileCache
from .procfs import keyed_numbers, read_text

SAMPLE_S = 0.05
"""Interval (s) at which a cgroup's memory.stat is sampled during the run."""
SAMPLE_FAST_S = 0.01
"""The interval of a following wall while its worker grows (waits for memory, or grew by a margin
since the last sample): a server's start-up grew 3.8 MB within one 50 ms sample, and on v1 a
system call that meets the limit fails with ENOMEM."""
FOLLOW_WINDOW = 20
"""Samples (one second) over which a following wall takes the least own memory it saw."""
FLOOR_BYTES = 4 << 20
"""The least room a following wall leaves above its worker's usage, free or in reclaimable page
cache (at least one margin, never more than the room the tier may take): on v1 a system call's
charge at the limit fails with ENOMEM where nothing is reclaimable (:meth:`Sampler._follow`)."""
SAMPLER_NICE = -10
"""Nice value of a following wall's sampler thread, where the process may raise its priority."""
TIER_CPU_SHARE = 0.02
"""Once a following wall's worker has settled or said it is steady (:data:`STEADY_SUFFIX`), the most
of one core its tier's readings may take: the next sample waits ``cost / TIER_CPU_SHARE`` (at least
:data:`SAMPLE_S`, at most :data:`SETTLED_MAX_S`; ``cost`` the sampler thread's CPU time for them). A
reading walks the page cache of the tier's files (``cachestat``: 3.2 ms for a 1.2 GB cached GGUF;
two readings a sample once settled), so at 20 samples a second they took 13% of a core, which a
two-thread decode on two cores lost (docs/llama.md, "What the wall's samples cost": 46.7 against
51.9 tok/s)."""
SETTLED_MAX_S = 1.0
"""The longest a settled following wall waits between samples."""
OOM_STEP = 8 << 20
"""The least a following wall raises its limit by when its worker waits for memory (v1)."""
OOM_PATIENCE_S = 5.0
"""How long a worker may wait for memory at the ceiling before its wall lets the kernel kill it."""
UNLIMITED = 2**60
"""cgroup limits at or above this count as no limit (v1 reports 9223372036854771712)."""


def mountinfo() -> list[tuple[str, str, str, list[str]]]:
    """``(root, mount point, fstype, super options)`` of every mount."""
    text, _ = read_text("/proc/self/mountinfo")
    out = []
    for line in (text or "").splitlines():
        left, sep, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if sep and len(f) >= 5 and len(r) >= 3:
            out.append((f[3], f[4], r[0], r[2].split(",")))
    return out


def locate_memory_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> tuple[dict | None, str]:
    """``({"version", "dir", "mount"}, "")`` for the memory cgroup of the process whose
    ``/proc/<pid>/cgroup`` is ``proc_cgroup`` (v2 when cgroup2 carries it, else v1's memory
    hierarchy), whether or not it may have children; ``(None, reason)`` otherwise."""
    text, why = read_text(proc_cgroup)
    if text is None:
        return None, why or f"{proc_cgroup} unreadable"
    v1_path = v2_path = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            if "memory" in parts[1].split(","):
                v1_path = parts[2]
            elif parts[0] == "0" and parts[1] == "":
                v2_path = parts[2]
    mounts = mountinfo()
    for version, own, match in (("v2", v2_path, lambda fs, o: fs == "cgroup2"),
                                ("v1", v1_path, lambda fs, o: fs == "cgroup" and "memory" in o)):
        if own is None:
            continue
        for root, point, fstype, opts in mounts:
            if not match(fstype, opts):
                continue
            rel = os.path.relpath(own, root)
            if rel.startswith(".."):
                continue
            d = os.path.normpath(os.path.join(point, rel))
            if version == "v2":
                ctl, _ = read_text(os.path.join(d, "cgroup.controllers"))
                if v1_path is not None and "memory" not in (ctl or "").split():
                    break  # hybrid host: the memory controller lives on the v1 hierarchy
            return {"version": version, "dir": d, "mount": point}, ""
    return None, "no memory cgroup controller is mounted for this process"


def own_memory_cgroup() -> tuple[dict | None, str]:
    """``({"version", "dir"}, "")`` for this process's memory cgroup directory when children with a
    memory limit can be made under it (v1 always; v2 when its ``cgroup.subtree_control`` enables
    memory), or ``(None, reason)``."""
    loc, why = locate_memory_cgroup()
    if loc is None:
        return None, why
    if loc["version"] == "v2":
        ctl, _ = read_text(os.path.join(loc["dir"], "cgroup.subtree_control"))
        if "memory" not in (ctl or "").split():
            return None, (f"cgroup v2: memory is not enabled in {loc['dir']}/cgroup.subtree_control "
                          "(expertcache does not change it; run in a delegated cgroup or pass --cgroup)")
    return {"version": loc["version"], "dir": loc["dir"]}, ""


def v2_sibling_parent(own_dir: str, mount: str) -> tuple[str | None, str]:
    """cgroup v2's no-internal-process rule keeps ``memory`` out of the subtree_control of a cgroup
    that holds processes, but a cgroup whose ``cgroup.controllers`` lists memory has a parent that
    enables it for its children: a sibling leaf made there can carry ``memory.max`` without
    changing any existing cgroup. ``(parent dir, "")`` or ``(None, reason)``."""
    ctl, why = read_text(os.path.join(own_dir, "cgroup.controllers"))
    if ctl is None:
        return None, why or f"{own_dir}/cgroup.controllers unreadable"
    if "memory" not in ctl.split():
        return None, f"cgroup v2: the memory controller is not enabled for {own_dir} (its parent's subtree_control)"
    if os.path.normpath(own_dir) == os.path.normpath(mount):
        return None, "cgroup v2: this process is in the root cgroup, which has no parent to hold a sibling"
    parent = os.path.dirname(os.path.normpath(own_dir))
    why = probe_child(parent)
    return (parent, "") if why is None else (None, why)


def probe_child(parent: str) -> str | None:
    """None if a child cgroup can be made (and removed) under ``parent``, else the reason."""
    probe = os.path.join(parent, f"expertcache-probe-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"cannot create a child cgroup in {parent}: {exc.strerror or exc}"
    rmdir_retry(probe)
    return None



FILES = {
    "v1": {"limit": "memory.limit_in_bytes", "follow": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes",
           "peak": "memory.max_usage_in_bytes", "failcnt": "memory.failcnt", "events": "memory.oom_control",
           "usage": "memory.usage_in_bytes"},
    "v2": {"limit": "memory.max", "follow": "memory.high", "swap": "memory.swap.max", "peak": "memory.peak",
           "failcnt": None, "events": "memory.events", "usage": "memory.current"},
}


def read_int(path: str) -> int | None:
    text, _ = read_text(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def rmdir_retry(path: str, tries: int = 40) -> bool:
    """Remove an empty cgroup, retrying for ``tries`` x 50 ms while the kernel lets go of it; True when gone."""
    for _ in range(tries):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.05)
    return False


def cgroup_state(d: str, version: str) -> dict:
    """Limit, swap limit, peak, failure count (v2: ``max`` events) and OOM events of cgroup ``d``;
    each None where its file is absent or unreadable."""
    f = FILES[version]
    events_text, _ = read_text(os.path.join(d, f["events"]))
    events = keyed_numbers(events_text or "")
    swap = os.path.join(d, f["swap"])
    return {"limit_bytes": read_int(os.path.join(d, f["limit"])),
            "swap_limit_bytes": read_int(swap) if os.path.exists(swap) else None,
            "peak_bytes": read_int(os.path.join(d, f["peak"])),
            "failcnt": read_int(os.path.join(d, f["failcnt"])) if f["failcnt"] else events.get("max"),
            "oom_events": events.get("oom", events.get("under_oom")),
            "oom_kill": events.get("oom_kill")}


def kill_members(d: str) -> None:
    """SIGKILL what is left in a cgroup made here (only the child's own descendants can be there)."""
    text, _ = read_text(os.path.join(d, "cgroup.procs"))
    for tok in (text or "").split():
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(tok), signal.SIGKILL)



def own_bytes(d: str, version: str) -> tuple[int | None, str | None]:
    """What cgroup ``d`` is charged for beyond the tier at this instant: usage (``memory.usage_in_bytes``
    / ``memory.current``) minus page cache on the LRU lists minus locked pages = the worker's anonymous
    memory, its kernel memory (page tables, slab, sockets) and whatever else is not the tier."""
    usage = read_int(os.path.join(d, FILES[version]["usage"]))
    text, why = read_text(os.path.join(d, "memory.stat"))
    st = keyed_numbers(text or "")
    if usage is None or not {"active_file", "inactive_file"} <= st.keys():
        return None, why or f"{d}: usage or memory.stat unreadable"
    return max(0, usage - st["active_file"] - st["inactive_file"] - st.get("unevictable", 0)), None


def retry_at_limit(call, seconds: float, errnos: tuple[int, ...] = (errno.ENOMEM,)):
    """``call()``'s result. On a v1 memory cgroup at its limit a system call's own kernel memory
    fails to charge (an ``OSError`` with ``errnos``) instead of waiting, as a fault would, while a
    following wall's next limit gives room: such an error is tried again every 5 ms for ``seconds``,
    then raised; any other error at once."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except OSError as exc:
            if exc.errno not in errnos or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


LOAD_SUFFIX, LOADED_SUFFIX, SETTLED_SUFFIX, STEADY_SUFFIX = ".load", ".loaded", ".settled", ".steady"
"""A following wall's worker about to load a model creates ``follow_flag + LOAD_SUFFIX`` and waits
until the wall removes it; it creates ``follow_flag + LOADED_SUFFIX`` when the load is over and waits
until the wall, its limit after the load written, removes that too
(:func:`~.capacity.model_load`; :meth:`Sampler._follow`, the load phase). A worker whose own memory
has reached its steady state after a warm-up creates ``follow_flag + SETTLED_SUFFIX`` and waits until
the wall, its window restarted from this sample and the limit written, removes it
(:func:`~.capacity.settled`). A worker whose first forward has run (its allocations done) creates
``follow_flag + STEADY_SUFFIX`` and goes on (:func:`~.capacity.steady`): no handshake, no restart;
from then on, as once settled, the wall samples at :data:`TIER_CPU_SHARE`'s pace."""
PEAK_SUFFIX = ".peak"
"""A wall with a follow flag publishes its tier's running peak (``tier_peak_bytes``, the proof's
measure) at ``follow_flag + PEAK_SUFFIX`` each time it rises: the decimal count, replaced whole
(written beside it, then renamed), so that a worker reporting its wall live (``serve``'s
``/metrics``) shows the proof's own number rather than a second sampler's."""


def publish_peak(path: str, value: int) -> None:
    """Replace ``path`` with ``value`` in decimal (a temporary beside it, renamed over it: a reader
    sees the old count or the new one). An error leaves the last count there."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(str(int(value)))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def read_published_peak(path: str) -> int | None:
    """The count :func:`publish_peak` last wrote at ``path``; None if there is none (or it is not a
    count: at most 32 bytes are read)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(32)
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) < 32 else None


CHARGED_CACHE = {"v1": "cache", "v2": "file"}
"""The ``memory.stat`` key of every page-cache byte charged to the cgroup (on its LRU lists or not:
pages being read in or reclaimed too), per cgroup version: a bound on a tier reading (:meth:`Sampler.sample`)."""

AT_LIMIT_BYTES = 1 << 20
"""A cgroup counts as at its limit when its usage (or peak) is within this of the limit."""

TRACE_ENV = "EXPERTCACHE_WALL_TRACE"
"""Environment variable: a file to which a following wall appends one line per sample."""


class Sampler(threading.Thread):
    """Samples a cgroup's memory.stat (and usage) every :data:`SAMPLE_S` seconds while the child runs
    (same keys on v1 and v2): the peaks of the page cache on the LRU lists (``active_file +
    inactive_file``, every file the worker touched), of its own unlocked memory (``active_anon +
    inactive_anon``), of locked pages (``unevictable``), of what the *tier* holds, and of everything
    else charged (``own_peak_bytes`` = usage - tier: anonymous and kernel memory, and the page cache
    of files that are not the tier, such as the libraries the worker loads), per sample.

    The tier: with ``tier_files`` (the files whose page cache is the tier: a GGUF, a checkpoint's
    shards, a pool) their cached bytes (:class:`~.pagecache.FileCache`; never more than the page cache
    the cgroup had charged right after the reading, :data:`CHARGED_CACHE`, plus their bytes cached
    outside it when the sampler began), plus ``unevictable`` when
    ``tier_locked`` (the worker locks anonymous memory as part of its tier: the file tier's arena);
    without them, every file page and locked page charged to the cgroup (which counts the worker's
    libraries too: a cold import of torch charged 60-90 MB of them to a 50 MB wall). ``last_state``
    keeps the latest limit/peak/events read (a systemd scope's cgroup is gone once its process
    exits)."""

    def __init__(self, d: str, version: str, follow: tuple[int, int, int] | None = None, follow_flag: str | None = None,
                 tier_files=None, tier_locked: bool = True):
        super().__init__(daemon=True)
        self.dir, self.version = d, version
        self.path = os.path.join(d, "memory.stat")
        self.peaks = {"file_peak_bytes": None, "anon_peak_bytes": None, "unevictable_peak_bytes": None,
                      "tier_peak_bytes": None, "own_peak_bytes": None, "samples": 0}
        self.last_state: dict | None = None
        self.keep_state = False
        self.follow, self.follow_flag = follow, follow_flag
        """``follow = (capacity, ceiling, margin)``: after each sample, set the limit to ``capacity +
        own + margin``, ``own`` the least the last :data:`FOLLOW_WINDOW` samples found (up at once
        when the worker's memory stays up, down within the window), never above ``ceiling`` (the
        requested limit), so that room the worker does not use is never tier: ``tier <= capacity +
        margin + (own then - own now)``, and taking the window's least keeps the last term from
        growing when the worker's memory jitters (kernel memory of a page-cache thrash moved by
        MBs between samples and took the tier 10 MB past a 227 MB capacity), less a feedback term on
        the tier itself (:meth:`_correct`). Following begins once the
        tier has held half the capacity, or once the worker creates ``follow_flag`` (a path: it does
        so when its start-up is over, and waits until the sampler has written the first following
        limit and removed the flag before it touches the tier:
        :func:`~.capacity.begin_following`); until then the limit is the ceiling: a limit that follows a worker still importing its libraries fails its kernel
        allocations (system calls return ENOMEM on a v1 cgroup: seen at a 12 MB wall). On cgroup v1 a following wall disables the OOM
        killer (:func:`oom_guard`): a worker whose own memory grew faster than a sample waits in the
        kernel instead of dying, and the next sample raises the limit (``oom_waits`` counts them);
        at the ceiling it is killed after :data:`OOM_PATIENCE_S`."""
        self.tier_locked = tier_locked
        self.files = None
        self._outside = 0
        if tier_files:
            self.files = FileCache(tier_files)
            # the tier's pages cached before the worker touches them (the header the parent read),
            # charged elsewhere: the one part of the tier the cgroup's own page cache does not count
            with contextlib.suppress(OSError):
                self._outside = self.files.bytes()
        self.limits: dict = {"min_limit_bytes": None, "max_limit_bytes": None, "limit_writes": 0,
                             "limit_write_errors": 0, "oom_waits": 0, "steady_samples": 0, "at_limit_samples": 0,
                             "at_limit_tier_max_bytes": None}
        self._limit: int | None = None
        self._recent_own: collections.deque = collections.deque(maxlen=FOLLOW_WINDOW)
        self._following = False
        self._bias = 0
        self._short: int | None = None  # the last sample's tier, when it was short of the capacity at the limit
        self._oom_since: float | None = None
        self._halt = threading.Event()
        self.interval = SAMPLE_S
        """Until the next sample: :data:`SAMPLE_FAST_S` while a following worker grows."""
        self._last_usage: int | None = None
        self._settled = False  # the worker said its own memory is at its steady state (SETTLED_SUFFIX)
        self._steady = False  # ... or that its first forward has run (STEADY_SUFFIX): samples at TIER_CPU_SHARE's pace
        self._loading = False  # the worker's model load (LOAD_SUFFIX seen, LOADED_SUFFIX not yet)
        self._loaded = False  # ... and its end seen: a shortfall at the limit is given back from here
        self._squeezed = False  # a limit of the load phase is written: the worker may load
        self._written = False  # the last sample's limit is in place (written, or unchanged)

    @property
    def tier_measure(self) -> str:
        return f"{self.files.method} of {len(self.files.paths)} file(s)" if self.files else "memory.stat"

    def sample(self) -> None:
        text, _ = read_text(self.path)
        if text is None:
            return
        st = keyed_numbers(text)
        if not {"active_file", "inactive_file", "active_anon", "inactive_anon"} <= st.keys():
            return
        file = st["active_file"] + st["inactive_file"]
        unev = st.get("unevictable", 0)
        tier = file + unev
        moving = False
        if self.files is not None:
            try:
                # after a worker settled (:func:`~.capacity.settled`) the tier is read on both sides
                # of the usage: while a prefill reads at 1 GB/s a millisecond between them moves it
                # by a MB, and the own memory (usage - tier) came out 5-11 MB low, a dip the window's
                # least kept for a second, squeezing a pool sized to the capacity (the tier counted
                # is the later read, as before: the proof's side). Moved either way: a managed pool
                # drops its victims, then reads its loads, and a usage read between them came out
                # 18 MB low against the tier read after (the tier 52 MB lower than before it)
                t0 = time.thread_time()  # this thread's CPU: what the readings take from the worker
                before = self.files.bytes() if self._settled else None
                usage = read_int(os.path.join(self.dir, FILES[self.version]["usage"]))
                walked = self.files.bytes()
                charged = keyed_numbers(read_text(self.path)[0] or "").get(CHARGED_CACHE[self.version])
                tier_cost = time.thread_time() - t0
            except OSError:
                return
            moving = before is not None and self.follow is not None and abs(walked - before) > self.follow[2] // 4
            # cachestat walks the page-cache index unlocked: preempted while pages churn, a walk
            # counted pages added ahead of it after others evicted behind it, 4-15 MiB above every
            # page the cgroup had charged (docs/robustness.md). Never more than the page cache the
            # cgroup had charged right after it, plus the tier's pages outside the cgroup
            after = walked if charged is None else min(walked, charged + self._outside)
            tier = after + (unev if self.tier_locked else 0)
        else:
            usage = read_int(os.path.join(self.dir, FILES[self.version]["usage"]))
        vals = {"file_peak_bytes": file, "anon_peak_bytes": st["active_anon"] + st["inactive_anon"],
                "unevictable_peak_bytes": unev, "tier_peak_bytes": tier,
                "own_peak_bytes": None if usage is None else max(0, usage - tier)}
        rose = self.peaks["tier_peak_bytes"] is None or tier > self.peaks["tier_peak_bytes"]
        for k, v in vals.items():
            if v is not None:
                self.peaks[k] = v if self.peaks[k] is None else max(self.peaks[k], v)
        self.peaks["samples"] += 1
        if rose and self.follow_flag:
            publish_peak(self.follow_flag + PEAK_SUFFIX, tier)
        flagged = bool(self.follow_flag and os.path.exists(self.follow_flag))
        load_mark = self.follow_flag and not flagged and os.path.exists(self.follow_flag + LOAD_SUFFIX)
        loaded = bool(self.follow_flag) and os.path.exists(self.follow_flag + LOADED_SUFFIX)
        settled = bool(self.follow_flag) and os.path.exists(self.follow_flag + SETTLED_SUFFIX)
        self._steady = self._steady or settled or (bool(self.follow_flag)
                                                   and os.path.exists(self.follow_flag + STEADY_SUFFIX))
        if settled:  # the worker's memory is at its steady state: window and feedback restart from here
            self._recent_own.clear()  # (a warm-up in the page cache the load left, the tier a few MB
            self._bias = 0  # over the capacity, took the bias to 23 MB: a pool then squeezed by it)
            self._settled = True
        if self._loading and loaded:
            self._loading = False
            self._loaded = True
            self._note("load over")
        if load_mark and self._following:
            self._loading = True
        other = max(0, file - tier + (0 if self.tier_locked else unev)) if self.files is not None else 0
        if self.follow is not None and self._steady and usage is not None and self._limit is not None:
            # after the first forward: was the cgroup at its limit, and how much did the tier hold
            # then? A tier kept far below the capacity at the limit is a smaller cache than the wall
            # claims (cgroup_problems; 4.4 MB of an 8 MB wall, read 4-8 times the file a token)
            lim = self.limits
            lim["steady_samples"] += 1
            if usage >= self._limit - AT_LIMIT_BYTES:
                lim["at_limit_samples"] += 1
                best = lim["at_limit_tier_max_bytes"]
                lim["at_limit_tier_max_bytes"] = tier if best is None else max(best, tier)
        if self.follow is not None and vals["own_peak_bytes"] is not None:
            self._following = self._following or tier * 2 >= self.follow[0] or flagged
            if self._following:
                # a moving tier's sample does not measure own: kept out where it would lower the
                # window's least (the dip it makes), kept where it would not (the window still slides)
                own = vals["own_peak_bytes"]
                before_least = min(self._recent_own, default=None)
                if not (moving and before_least is not None and own < before_least):
                    self._recent_own.append(own)
                least = min(self._recent_own)
                if before_least is not None and self._bias < 0 and least > before_least:
                    # the window's least caught up with own memory a room given back stood for: the
                    # limit moves by neither twice (the tier would pass the capacity by the room)
                    self._bias = min(0, self._bias + least - before_least)
                if self._bias < 0 and not moving:
                    # room given back stands for own memory above the window's least: never more
                    # than there is now (a 512-token prefill's 100 MB of buffers, once freed, would
                    # leave the tier that room over its capacity). Not on a moving sample, whose own
                    # memory read 18 MB low: taking the room back on it squeezed a settled pool
                    self._bias = max(self._bias, least - own)
                self._correct(tier, usage)
                self._follow(least, usage, tier, file, other, moving)
                if self._steady and self.files is not None and self.interval == SAMPLE_S:
                    self.interval = min(SETTLED_MAX_S, max(SAMPLE_S, tier_cost / TIER_CPU_SHARE))
            if os.environ.get(TRACE_ENV):
                self._trace(tier, usage, vals["own_peak_bytes"], file, unev)
        if self.follow is not None and not self._following and self.version == "v1":
            self._start_up_oom()
        if flagged:
            self._note(f"flag seen, limit {'written' if self._limit is not None else 'not written'}")
        if load_mark and self._loading and self._squeezed:  # other files' cache is out: the load may begin
            self._note("load begins")
            with contextlib.suppress(OSError):
                os.unlink(self.follow_flag + LOAD_SUFFIX)
        if loaded and not self._loading and (not self._following or self._written):
            # the limit after the load is written: the worker goes on (model_load's exit); until then
            # its system calls would meet the load's limit, which the load filled (a server's next
            # thread start failed: "can't start new thread")
            with contextlib.suppress(OSError):
                os.unlink(self.follow_flag + LOADED_SUFFIX)
        if settled and (not self._following or self._written):
            with contextlib.suppress(OSError):
                os.unlink(self.follow_flag + SETTLED_SUFFIX)
        if flagged and (self.follow is None or self._limit is not None):
            # a following limit is written: let the worker go on (begin_following); a first write that
            # failed (v1 refuses a limit below a usage that grew meanwhile: EBUSY) is retried next sample
            # rather than leave the worker's model load under the start-up ceiling
            with contextlib.suppress(OSError):
                os.unlink(self.follow_flag)
        if self.keep_state:
            state = cgroup_state(self.dir, self.version)
            if state["limit_bytes"] is not None:
                self.last_state = state

    def _start_up_oom(self) -> None:
        """Before the limit follows the worker it is the start-up ceiling (capacity + headroom): a
        worker whose own memory needs more (``--headroom 1MB``) waits for memory for ever, since the
        OOM killer is off. After :data:`OOM_PATIENCE_S` of waiting the killer is turned back on, as
        at the ceiling of a following limit: the worker dies and the proof says why (the run had hung
        until a timeout, the worker in ``mem_cgroup_oom_synchronize``)."""
        if not under_oom(self.dir):
            self._oom_since = None
            return
        self.limits["oom_waits"] += 1
        self._oom_since = self._oom_since or time.monotonic()
        self.interval = SAMPLE_FAST_S
        if time.monotonic() - self._oom_since > OOM_PATIENCE_S:
            with contextlib.suppress(OSError):
                write(os.path.join(self.dir, "memory.oom_control"), "0")

    def _trace(self, tier: int, usage: int | None, own: int, file: int, unev: int) -> None:
        """One line per sample of a following wall, in KiB, appended to the file
        ``$EXPERTCACHE_WALL_TRACE`` names (how a wall's tier, own memory, feedback and limit moved:
        docs/robustness.md); the cgroup's name first, so that walls running at once can be told apart."""
        self._note(f"tier={tier >> 10} usage={(usage or 0) >> 10} own={own >> 10} "
                   f"min_own={min(self._recent_own, default=0) >> 10} bias={self._bias >> 10} "
                   f"limit={(self._limit or 0) >> 10} file={file >> 10} unevictable={unev >> 10}"
                   f"{'' if self._following else ' not-following'}")

    def _note(self, what: str) -> None:
        """A line of the ``$EXPERTCACHE_WALL_TRACE`` file (when set): the time, the cgroup's name, ``what``."""
        if os.environ.get(TRACE_ENV):
            with contextlib.suppress(OSError), open(os.environ[TRACE_ENV], "a", encoding="utf-8") as fh:
                fh.write(f"{time.monotonic():.3f} {os.path.basename(self.dir)} {what}\n")

    def _correct(self, tier: int, usage: int | None) -> None:
        """Feedback on the tier itself (cumulatively: ``bias``, subtracted from the limit): a tier
        above the capacity lowers the limit by half the excess; a tier below the capacity less the
        margin while the cgroup is at its limit, in two samples in a row, gives half the smaller of
        their shortfalls back (below a ``bias`` of 0, raising the limit, once the worker's model load
        has ended or it has run its first forward; a settled worker's sample after a first shortfall
        comes at :data:`SAMPLE_FAST_S`); a negative ``bias`` shrinks by what the window's least rises
        (:meth:`sample`). It
        corrects what ``own`` misjudges both ways: in a page-cache thrash the pages on
        their way out are charged but no longer in the file's cache, so ``own`` reads 10-20 MB high
        and swings (seen: 72-93 MB between samples, the tier 13 MB over a 480 MB wall); and own memory
        that steps up (a first forward's buffers, 16 MB in a Qwen3 2-thread decode) is in the
        window's least only a second later, which held an ``advise`` run's tier 11 MB under its 393
        MB capacity through a 0.6 s decode, and page-cache modes' tiers 25-31 MB under a 480 MB
        capacity through their prefill, the room given back then only after it (docs/robustness.md).
        None during the model's load, whose
        limit bounds the tier by its own rule (:meth:`_follow`)."""
        capacity, _, margin = self.follow
        if self._loading:  # the load's limit bounds the tier by its own rule (capacity + margin): a bias
            return  # summed there is never used, and it had squeezed the run after (46 MB at the load's end)
        short, self._short = self._short, None
        if tier > capacity:
            self._bias += (tier - capacity) // 2
        elif tier < capacity - margin and usage is not None and self._limit is not None \
                and usage >= self._limit - AT_LIMIT_BYTES:
            # a shortfall is given back once two samples in a row found it, and only what both
            # found: one reading of the tier taken while its pages churn can be tens of MB low (a
            # prefetch prefill read 436 MB where the cgroup's file pages were 470; the limit given
            # back on it let the tier end 0.2 MB past a 480 MB wall's slack)
            self._short = tier
            if short is not None:
                give = (capacity - margin - max(tier, short)) // 2
                # below 0 once the load has ended or the worker has run its first forward (steady),
                # settled or not: a settled managed run's window took a dip of own memory 20 MB deep
                # (the tier read while its pool churned in the prefill), and the decode after it ran
                # squeezed, its pool's pages taken by the kernel and faulted back (docs/robustness.md)
                self._bias -= give if self._steady or self._loaded else min(self._bias, give)
        self.limits["max_bias_bytes"] = max(self.limits.get("max_bias_bytes", 0), self._bias)
        self.limits["min_bias_bytes"] = min(self.limits.get("min_bias_bytes", 0), self._bias)

    def _follow(self, own: int, usage: int | None = None, tier: int = 0, file: int = 0, other: int = 0,
                moving: bool = False) -> None:
        """Write the limit: ``capacity + own + margin - bias`` (``own`` the window's least), with room
        above ``usage`` of at most ``capacity + 1.5 margins - tier`` (the proof's slack is 2 margins)
        and room plus reclaimable page cache (``file``: the cgroup's page cache on the LRU lists) of
        at least :data:`FLOOR_BYTES` (never above the first bound, so that the tier's bound holds
        whatever binds). The room is room the tier can take before the next sample; the floor is
        there because on v1 a system call's charge at the limit fails (ENOMEM: LLVM's code memory
        for a compiled rule, a ``read`` of a module, ``mlock``) where nothing can be reclaimed,
        instead of waiting as a fault does: a limit left at the usage (a sample that found the worker
        grown up to the last limit but not yet waiting) aborted a server's start-up. While the worker
        waits for memory the limit steps up from the last one, within the room; once it no longer
        waits, a limit below ``usage`` (the worker grew past the window's least) stays at the last
        one, within the room (v1 refuses a limit below the usage: EBUSY). Seen before the room's bound: 8 MiB
        steps during a server's start-up left room the model's load filled (5.1 MB of page cache
        against a 3.2 MB wall).

        During a model load (:func:`~.capacity.model_load`) the other files' page cache charged to
        the wall (``other``) counts as room too, since the kernel reclaims it for the load, and the
        tier's room is ``capacity + margin - tier``: the limit is ``usage - other`` plus that, and
        plus what makes one margin of reclaimable or free memory.

        A ``moving`` sample (a settled worker's tier moved between its two readings) lowers no limit
        unless its tier is over the capacity, and the next sample comes at :data:`SAMPLE_FAST_S`: its
        usage and tier are of different instants, and the room it leaves above that usage came out
        up to 35 MB short of the tier and own memory (a managed prefill's pool churning at 1-2 GB/s);
        the limit then sat below them through a 0.5 s decode until the next settled sample, and the
        kernel took the pool's pages (273-284 major faults a token, OLMoE's 25% wall, 3 runs of 8)."""
        capacity, ceiling, margin = self.follow
        limit = min(ceiling, capacity + own + margin - self._bias)
        room = max(margin, capacity + margin + margin // 2 - tier)
        waiting = self.version == "v1" and under_oom(self.dir)
        if waiting:  # the worker waits for memory: give it some now
            self.limits["oom_waits"] += 1
            self._oom_since = self._oom_since or time.monotonic()
            limit = max(limit, (self._limit or limit) + max(OOM_STEP, (self._limit or limit) // 20))
        else:
            self._oom_since = None
            if usage is not None and limit < usage and self._limit is not None:
                limit = max(limit, self._limit)  # own grew past the window's least: not below the last limit
        self._squeezed = False
        if usage is not None and self._loading:  # the other files' page cache is room the load would take
            base = usage - other  # and the load fills any room at once: the tier's bound less a margin's
            limit = max(base + max(0, margin - file), min(limit, base + max(0, capacity + margin - tier)))
        elif usage is not None:
            floor = max(margin, FLOOR_BYTES)
            limit = max(usage + min(room, max(0, floor - file)), min(limit, usage + room))
            if tier > capacity and not waiting:
                # the tier is over its capacity now: a limit below the usage by the excess has the
                # kernel reclaim it at once (page cache: nothing the worker needs), where a limit kept
                # at the usage waited for the bias to catch up (a tier 5-8 MB past a 480 MB wall's
                # slack in 4 of 8 advise and prefetch runs); never more than the cgroup's page cache
                # less the floor, so the worker keeps its room for system calls
                limit = min(limit, usage - min(tier - capacity, max(0, file - floor)))
        if moving and self._limit is not None and tier <= capacity and not self._loading:
            limit = max(limit, self._limit)
        limit = min(ceiling, limit)
        grew = usage is not None and self._last_usage is not None and usage - self._last_usage >= margin
        # a settled worker's shortfall at the limit (its pool squeezed): the sample that confirms it
        # comes at once, not a settled pace later. Only there: a prefetch run's tier, confirmed at
        # once, peaked at 487.1-493.6 MB against 487.1-487.6 at its pace (494.3 allowed; 6 runs each)
        confirm = self._short is not None and self._settled
        self.interval = SAMPLE_FAST_S if waiting or grew or moving or confirm else SAMPLE_S
        self._last_usage = usage
        if waiting and limit >= ceiling and time.monotonic() - self._oom_since > OOM_PATIENCE_S:
            with contextlib.suppress(OSError):  # it needs more than the ceiling: let the kernel kill it
                write(os.path.join(self.dir, "memory.oom_control"), "0")
        limit -= limit % 4096
        self._written = False
        if limit == self._limit:
            self._squeezed = self._loading
            self._written = True
            return
        try:
            write(os.path.join(self.dir, FILES[self.version]["follow"]), str(limit))
        except OSError as exc:  # v1 refuses (EBUSY) a limit it cannot reclaim down to: the next sample retries
            self.limits["limit_write_errors"] += 1
            self._note(f"limit {limit >> 10} KiB refused: {exc.strerror}")
            return
        self._limit = limit
        self._squeezed = self._loading
        self._written = True
        lim = self.limits
        lim["limit_writes"] += 1
        lim["min_limit_bytes"] = limit if lim["min_limit_bytes"] is None else min(lim["min_limit_bytes"], limit)
        lim["max_limit_bytes"] = limit if lim["max_limit_bytes"] is None else max(lim["max_limit_bytes"], limit)

    def run(self) -> None:
        if self.follow is not None:
            # A following wall is a control loop: a sample that comes late lets the worker grow up to
            # the limit, and on v1 its next system call's charge fails (a server died with "can't start
            # new thread" beside two CPU burners and two test workers). Where allowed (root, or
            # CAP_SYS_NICE), this thread runs at nice SAMPLER_NICE so a busy neighbour cannot starve it.
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAMPLER_NICE)
            self.sample()  # the first limit at once, not a period later
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.sample()  # charged page cache stays with the cgroup after the child exits
        if self.version == "v1":  # charges the limit refused (a fault waits; a system call's fails)
            self._note(" ".join(f"{name}={read_int(os.path.join(self.dir, name))}"
                                for name in ("memory.failcnt", "memory.kmem.failcnt")))
        if self.files is not None:
            self.files.close()


def under_oom(d: str) -> bool:
    """Whether a v1 cgroup's tasks wait for memory now (``under_oom 1`` in memory.oom_control)."""
    text, _ = read_text(os.path.join(d, "memory.oom_control"))
    return keyed_numbers(text or "").get("under_oom") == 1


def oom_guard(d: str) -> bool:
    """Disable a v1 cgroup's OOM killer (``oom_kill_disable 1``): a task over the limit waits until
    the limit is raised. True when set."""
    try:
        write(os.path.join(d, "memory.oom_control"), "1")
        return True
    except OSError:
        return False
