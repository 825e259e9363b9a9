"""Enforced capacity: run a measured child process behind a memory wall and prove the wall held.

Walls (``wall="auto"`` takes a cgroup wall, else runs unenforced and says why; it never builds a
balloon on its own, since a balloon locks MemAvailable - C of a possibly shared host):

* ``cgroup``: a memory cgroup made for the run, limit = capacity + headroom, swap excluded: a child
  of this process's OWN memory cgroup (v1's memory controller, or cgroup v2 when the own cgroup
  enables memory for its children); on cgroup v2 where it does not (the no-internal-process rule
  of systemd hosts), a sibling leaf beside the own cgroup when the parent enables memory, else a
  transient ``systemd-run --scope -p MemoryMax=`` unit where systemd runs. The child writes its own
  pid into the cgroup before exec (or systemd moves it), so every page it touches (anonymous and
  page cache) is charged there.
  Afterwards the peak, the failure count and the OOM events are read and the cgroup is removed.
  A cgroup the user names (``cgroup=PATH``) is used as it is: its limit is read and recorded,
  never changed.
* ``balloon`` (only when asked): a helper process mlocks anonymous memory until MemAvailable is
  about capacity + headroom; refused when that would leave the machine under :data:`MIN_LEFT` bytes.
* ``none``: nothing enforced; the run is marked unproven.

Invariants: no cgroup other than the one created here is ever written (a named one only receives
the child's pid); every :class:`WallRun` says what enforced the capacity (``enforced_by``) and
carries the proof; ``proof_ok`` is False whenever a piece of the proof is missing or shows the wall
failed (limit not read back, the tier's page cache + locked memory above or squeezed below the
capacity by more than :func:`proof_slack`, OOM kill, balloon not fully locked or dead, timeout,
cgroup not removed); a capacity + headroom above what the machine can hold
(:func:`enforceable_bytes`) is refused, since a wall there enforces nothing. The cgroup files and
the memory.stat sampler live in :mod:`expertcache.wall.cgroupfs`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import warnings

from ..errors import ConfigError, is_int
from . import cgroupfs as cg
from .cgroupwall import (CAPACITY_SLACK, SLACK_BYTES, WallRun, WallUnavailable, cgroup_target, child_result,
                         proof_slack, read_limit_chain, run_cgroup, run_scope)
from .cgroupwall import spawn as _spawn
from .procfs import read_meminfo, read_text

__all__ = ["WALLS", "DEFAULT_HEADROOM", "FOLLOW_CEILING", "follow_plan", "begin_following", "model_load", "settled", "MIN_LEFT", "CAPACITY_SLACK", "SLACK_BYTES", "WallRun", "WallUnavailable",
           "proof_slack", "enforceable_bytes", "detect_walls", "balloon_plan", "run_walled", "worker_spec", "cgroup_target",
           "child_result"]

WALLS = ("auto", "cgroup", "balloon", "none")
DEFAULT_HEADROOM = 64 * 10**6
"""Headroom (bytes) above the capacity when the caller gives none: about the measured worker's own
memory. A Python worker with numpy peaked at about 42-46 MB here; a caller with read buffers
(threads x expert size) must add them. Too much headroom lets the page cache grow past the
capacity, too little squeezes it below; either fails the proof. The paper used C + 6 GiB for a
large native engine. (``tier replay``/``sweep`` measure it instead: a calibration run per mode.)"""
FOLLOW_CEILING = 4 << 30
"""The most a following wall's limit may rise above the capacity (with its worker's own memory)
unless a headroom is given; clipped to what the machine can give."""
MIN_LEFT = 2 * 10**9
"""A balloon never leaves the machine with less than this much available memory (bytes)."""


def enforceable_bytes() -> tuple[int | None, str]:
    """The most memory a wall here can hand a run, and what sets it: MemAvailable, lowered by the
    limit of this process's own memory cgroup (v1 ``hierarchical_memory_limit``; v2 the smallest
    ``memory.max`` from the own cgroup up). ``(None, reason)`` when MemAvailable is unreadable."""
    mem, why = read_meminfo()
    avail = (mem or {}).get("MemAvailable")
    if avail is None:
        return None, f"MemAvailable unreadable ({why})"
    best, what = avail, f"MemAvailable {avail}"
    loc, _ = cg.locate_memory_cgroup()
    if loc is not None:
        for d, lim in read_limit_chain(loc):
            if lim is not None and lim < best:
                best, what = lim, f"the memory limit {lim} of {d}"
    return best, what


def detect_walls() -> dict:
    """What this machine can enforce: ``{"cgroup": {"ok", "version", "parent", "reason"},
    "balloon": {"ok", "mem_available_bytes", "memlock_limit", "reason"}, "none": {...}}``. The cgroup
    answer is tested, not guessed: an empty child cgroup is created and removed at once."""
    target, why = cgroup_target()
    group = {"ok": target is not None, "version": target and target["version"], "parent": target and target["dir"],
             "placement": target and target["placement"],
             "reason": why or f"{target['placement']} cgroups can be made under {target['dir']}"}
    mem, _ = read_meminfo()
    avail = (mem or {}).get("MemAvailable")
    try:
        import resource
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        lim = None if soft == resource.RLIM_INFINITY else soft
    except (ImportError, OSError, ValueError):
        lim = None
    root = os.geteuid() == 0
    bal_ok = avail is not None and (root or lim is None or lim > MIN_LEFT)
    bal_reason = ("MemAvailable unreadable" if avail is None else
                  "mlock possible (root)" if root else
                  f"RLIMIT_MEMLOCK {lim} bytes" if lim is not None else "RLIMIT_MEMLOCK unlimited")
    return {"cgroup": group,
            "balloon": {"ok": bal_ok, "mem_available_bytes": avail, "memlock_limit": lim, "reason": bal_reason},
            "none": {"ok": True, "reason": "always possible; nothing is enforced"}}


def follow_plan(capacity: int, headroom: int | None) -> tuple[int, int, str]:
    """``(headroom, follow margin, note)`` of a wall whose limit follows its worker from the start
    (:class:`~.cgroupfs.Sampler`): ``capacity + own + margin`` after every sample, ``own`` the
    worker's memory beyond the tier, at most ``capacity + headroom`` (``headroom`` None: up to
    :data:`FOLLOW_CEILING`, within what the machine can give). The margin is half the proof's
    slack, so the room it leaves never takes the tier past what the proof allows. A following limit
    needs no measure of the worker's own memory beforehand: no calibration run."""
    margin = max(1 << 16, int(proof_slack(capacity) / 2))
    if headroom is None:
        most, _ = enforceable_bytes()
        headroom = FOLLOW_CEILING if most is None else max(0, min(FOLLOW_CEILING, most - capacity - (256 << 20)))
        note = f"the limit follows the worker: capacity + its own memory + {margin} bytes, at most capacity + {headroom}"
    else:
        note = f"headroom given: the limit follows the worker (margin {margin} bytes), at most capacity + {headroom}"
    return headroom, margin, note


# ---------------------------------------------------------------------- balloon
def balloon_plan(mem_available: int, capacity_bytes: int, headroom_bytes: int, min_left: int = MIN_LEFT) -> tuple[int, str | None]:
    """``(bytes to lock, None)`` so that MemAvailable falls to capacity + headroom, or ``(0, reason)``
    when the balloon must refuse: what would remain (capacity + headroom) is under ``min_left``.
    A machine that already has no more than capacity + headroom available needs no balloon (0, None)."""
    target = capacity_bytes + headroom_bytes
    if target < min_left:
        return 0, (f"a balloon would leave {target / 1e9:.3g} GB available, under the {min_left / 1e9:.3g} GB floor "
                   "(use a cgroup wall for this capacity)")
    return max(0, mem_available - target), None


_BALLOON = r"""
import ctypes, mmap, os, sys
n = int(sys.argv[1]); chunk = 64 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
held = []
done = 0
while done < n:
    size = min(chunk, n - done)
    try:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # an address-space limit (ulimit -v, overcommit 2): one line, as mlock's
        print("mmap failed:", exc.strerror or exc, flush=True); sys.exit(3)
    buf = (ctypes.c_char * size).from_buffer(m)
    if libc.mlock(ctypes.addressof(buf), size) != 0:
        print("mlock failed:", os.strerror(ctypes.get_errno()), flush=True); sys.exit(3)
    held.append((m, buf)); done += size
print("locked", done, flush=True)
sys.stdin.read()
"""


def _run_balloon(argv, capacity_bytes, headroom_bytes, timeout, max_balloon_bytes: int | None = None) -> WallRun:
    mem, why = read_meminfo()
    avail = (mem or {}).get("MemAvailable")
    if avail is None:
        raise WallUnavailable(f"balloon: MemAvailable unreadable ({why})")
    size, refusal = balloon_plan(avail, capacity_bytes, headroom_bytes)
    if refusal:
        raise WallUnavailable(f"balloon refused: {refusal}")
    if max_balloon_bytes is not None and size > max_balloon_bytes:
        raise WallUnavailable(f"balloon refused: {size} bytes to lock exceeds the {max_balloon_bytes} allowed")
    warnings.warn("balloon wall: a host that is mostly mlocked memory distorts the deep-pressure end of the "
                  "capacity curve (paper section 5); prefer a cgroup wall")
    proof: dict = {"mechanism": "balloon", "mem_available_before": avail, "balloon_requested_bytes": size,
                   "target_available_bytes": capacity_bytes + headroom_bytes}
    bal = None
    if size:
        bal = subprocess.Popen([sys.executable, "-c", _BALLOON, str(size)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = bal.stdout.readline().strip()
        if not line.startswith("locked"):
            bal.kill()
            _, err = bal.communicate()
            last = (err or "").strip().splitlines()[-1:]  # a helper that died in Python: its last line, not a traceback
            raise WallUnavailable(f"balloon: {line or (last[0][:200] if last else 'helper died')} (fail-stop)")
        status, _ = read_text(f"/proc/{bal.pid}/status")
        proof["balloon_vmlck_bytes"] = next((int(ln.split()[1]) * 1024 for ln in (status or "").splitlines()
                                             if ln.startswith("VmLck:")), None)
    else:
        proof["balloon_vmlck_bytes"] = 0
    try:
        mem, _ = read_meminfo()
        proof["meminfo_at_entry"] = mem
        rc, out, err, timed_out = _spawn(argv, None, timeout)
        proof["balloon_alive_at_end"] = bal is None or bal.poll() is None
        mem, _ = read_meminfo()
        proof["mem_available_at_end"] = (mem or {}).get("MemAvailable")
    finally:
        if bal is not None:
            with contextlib.suppress(OSError):
                bal.stdin.close()
            try:
                bal.wait(timeout=10)
            except subprocess.TimeoutExpired:
                bal.kill()
                bal.wait()
    problems = []
    vmlck = proof["balloon_vmlck_bytes"]
    if vmlck is None or vmlck < size:
        problems.append(f"balloon locked {vmlck} of {size} bytes")
    if not proof["balloon_alive_at_end"]:
        problems.append("the balloon died during the run")
    if timed_out:
        problems.append(f"timed out after {timeout} s")
    note = "; ".join(problems) or ("no balloon needed: MemAvailable already at or below capacity + headroom"
                                   if size == 0 else "")
    return WallRun(rc, out, err, "balloon", proof, not problems, note, timed_out)


# ---------------------------------------------------------------------- entry point
@contextlib.contextmanager
def worker_spec(spec: dict, prefix: str, follow: bool):
    """``(spec_path, follow_flag)``: ``spec`` written as JSON to a temporary file for a walled worker
    (``python -m ... SPEC.json``), with ``spec["follow_flag"]`` the path the worker creates once the
    wall may follow its own memory (None when ``follow`` is false; :func:`run_walled`'s
    ``follow_flag``). Both files are removed afterwards."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    flag = path[: -len(".json")] + ".follow" if follow else None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(spec | {"follow_flag": flag}, fh)
        yield path, flag
    finally:
        os.unlink(path)
        if flag:
            for left in (flag, flag + cg.LOAD_SUFFIX, flag + cg.LOADED_SUFFIX, flag + cg.SETTLED_SUFFIX,
                         flag + cg.STEADY_SUFFIX, flag + cg.PEAK_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(left)


FOLLOW_WAIT_S = 5.0
"""How long a worker waits for its wall to take the first following limit (:func:`begin_following`)."""


def _handshake(mark: str, what: str) -> None:
    """Create ``mark`` and wait (at most :data:`FOLLOW_WAIT_S`) until the wall removes it; say so on
    stderr, and go on, where it does not (the proof then says whether the budget held)."""
    import time

    deadline = time.monotonic() + FOLLOW_WAIT_S
    # the end of a model's load leaves the cgroup at its limit, where creating the mark can fail
    # (seen: the .loaded mark of a 3 MB wall, beside two burners)
    cg.retry_at_limit(lambda: open(mark, "w").close(), FOLLOW_WAIT_S)
    while os.path.exists(mark) and time.monotonic() < deadline:
        time.sleep(0.002)
    if os.path.exists(mark):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mark)
        print(f"expertcache: the memory wall {what} within {FOLLOW_WAIT_S:g} s; going on (its proof says whether "
              "the budget held)", file=sys.stderr, flush=True)


def begin_following(flag: str | None) -> None:
    """The worker's side of a following wall: its start-up is over, so create ``flag`` and wait (at
    most :data:`FOLLOW_WAIT_S`) until the wall has taken its first following limit and removed the
    flag, before the worker touches the tier (a model that loads in less than a sample would
    otherwise fill the page cache under the start-up ceiling). A no-op without a flag."""
    if flag:
        _handshake(flag, "took no following limit")


@contextlib.contextmanager
def model_load(flag: str | None):
    """The worker's model load as a following wall's load phase (a no-op without a flag). On entry
    the worker creates ``flag + LOAD_SUFFIX`` and waits (at most :data:`FOLLOW_WAIT_S`) until the
    wall has written a limit that leaves the tier no more room than its bound, counting the other
    files' page cache charged to the wall as room (the kernel reclaims it to make room for the load:
    llama.cpp maps the GGUF with ``MAP_POPULATE``, which filled 4.5 MB of a 3.5 MB wall from the
    libraries' 24 MB of page cache within one sample); on exit it creates ``flag + LOADED_SUFFIX``
    and waits until the wall has written its limit after the load and removed the mark (the load
    leaves the cgroup at its limit, where a system call's charge fails: a server's next thread
    start did), then the wall follows as before. Hold it around the load and nothing else."""
    if not flag:
        yield
        return
    _handshake(flag + cg.LOAD_SUFFIX, "made no room for the model's load")
    try:
        yield
    finally:
        _handshake(flag + cg.LOADED_SUFFIX, "took no limit after the model's load")


def settled(flag: str | None) -> None:
    """The worker's own memory is at its steady state (a warm-up has touched what its first forward
    allocates): create ``flag + SETTLED_SUFFIX`` and wait until the wall has restarted its window of
    own-memory samples from now and written the limit, so that a pool sized to the capacity fills
    under a limit that already counts that memory (a no-op without a flag)."""
    if flag:
        _handshake(flag + cg.SETTLED_SUFFIX, "took no limit after the worker settled")


def steady(flag: str | None) -> None:
    """The worker's first forward has run, so its allocations are done: create ``flag +
    STEADY_SUFFIX`` (no wait, no window restart; a no-op without a flag) and the wall samples at
    the pace that bounds its tier readings' share of a core (:data:`~.cgroupfs.TIER_CPU_SHARE`)."""
    if flag:
        with contextlib.suppress(OSError):
            open(flag + cg.STEADY_SUFFIX, "x").close()


def _ack_flag(flag: str | None, done) -> None:
    """Remove ``flag`` whenever it appears, until ``done`` is set: a wall that follows nothing (none,
    balloon) must not keep :func:`begin_following` or :func:`model_load` waiting."""
    import threading
    import time

    def run():
        while not done.is_set():
            for mark in (flag, flag + cg.LOAD_SUFFIX, flag + cg.LOADED_SUFFIX, flag + cg.SETTLED_SUFFIX):
                if os.path.exists(mark):
                    with contextlib.suppress(OSError):
                        os.unlink(mark)
            time.sleep(0.002)
    if flag:
        threading.Thread(target=run, daemon=True).start()


def run_walled(argv: list[str], *, capacity_bytes: int, wall: str = "auto", cgroup: str | None = None,
               headroom_bytes: int | None = None, timeout: float | None = None,
               follow_margin: int | None = None, follow_flag: str | None = None,
               tier_files=None, tier_locked: bool = True, passthrough: bool = False) -> WallRun:
    """Run ``argv`` as a child process behind a memory wall of ``capacity_bytes + headroom_bytes``.

    ``wall``: one of :data:`WALLS`; ``auto`` takes a cgroup wall (child, v2 sibling or systemd
    scope: :func:`cgroup_target`), else runs with nothing enforced (``none``, the reasons in
    ``note``): it never builds a balloon on its own. An explicit wall that cannot be built raises
    :class:`WallUnavailable` (one line). ``cgroup`` names an existing cgroup directory to use as it
    is. ``timeout`` (s, > 0) kills the child and still cleans up. A wall of more than the machine
    can hold (:func:`enforceable_bytes`) is refused (ConfigError): it would enforce nothing.
    ``follow_margin`` (bytes; cgroup walls made here): the limit follows the worker's own memory,
    ``capacity + min(headroom, own + follow_margin)`` after every sample (``own``: the most the
    worker has needed so far), so headroom the worker does not use never becomes page cache
    (:class:`~.cgroupfs.Sampler`); with ``follow_flag`` only once the worker has created that file.
    The proof then records the limits it took (``min_limit_bytes``, ``max_limit_bytes``,
    ``limit_writes``, ``oom_waits``). ``tier_files``: the files whose page cache is the tier (their
    cached bytes are the tier, plus locked memory when ``tier_locked``; without them every page-cache
    page charged to the wall counts, the worker's libraries included: :class:`~.cgroupfs.Sampler`).
    ``passthrough``: the child writes to this process's stdout/stderr and receives its SIGTERM and
    SIGINT (a server inside a wall); the run's ``stdout``/``stderr`` are then empty.
    """
    if wall not in WALLS:
        raise ConfigError(f"--wall: {wall!r} is not one of {', '.join(WALLS)}")
    if not is_int(capacity_bytes, 1):
        raise ConfigError(f"--capacity: {capacity_bytes!r} is not a positive number of bytes")
    headroom = DEFAULT_HEADROOM if headroom_bytes is None else headroom_bytes
    if not is_int(headroom, 0):
        raise ConfigError(f"--headroom: {headroom!r} is not a non-negative number of bytes")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"--timeout: {timeout!r} is not a positive number of seconds")
    if not argv:
        raise ConfigError("run_walled: empty command")
    limit = capacity_bytes + headroom
    if wall != "none" or cgroup is not None:
        most, what = enforceable_bytes()
        if most is not None and limit > most:
            raise ConfigError(f"--capacity {capacity_bytes}: capacity + headroom = {limit} bytes is more than this "
                              f"machine can give a run ({what}): a wall there would enforce nothing")
    if cgroup is not None:
        version = "v2" if os.path.exists(os.path.join(cgroup, "memory.max")) else \
            "v1" if os.path.exists(os.path.join(cgroup, "memory.limit_in_bytes")) else None
        if version is None or not os.path.exists(os.path.join(cgroup, "cgroup.procs")):
            raise ConfigError(f"--cgroup {cgroup}: not a memory cgroup directory (no memory.max or memory.limit_in_bytes)")
        return run_cgroup(argv, limit, timeout, {"version": version, "dir": os.path.dirname(cgroup)}, cgroup,
                          capacity_bytes, tier_files=tier_files, tier_locked=tier_locked)
    reasons = []
    if wall in ("auto", "cgroup"):
        target, why = cgroup_target()
        if target is not None and target["placement"] == "systemd-scope":
            return run_scope(argv, limit, timeout, target, capacity_bytes, follow_margin, follow_flag, tier_files,
                             tier_locked, passthrough)
        if target is not None:
            return run_cgroup(argv, limit, timeout, target, None, capacity_bytes, follow_margin, follow_flag,
                              tier_files, tier_locked, passthrough)
        if wall == "cgroup":
            raise WallUnavailable(f"cgroup wall: {why}")
        reasons.append(f"cgroup: {why}; a balloon is built only when asked (--wall balloon)")
    import threading

    done = threading.Event()
    _ack_flag(follow_flag, done)  # nothing below follows the worker
    try:
        if wall == "balloon":
            return _run_balloon(argv, capacity_bytes, headroom, timeout)
        mem, _ = read_meminfo()
        rc, out, err, timed_out = _spawn(argv, None, timeout, passthrough=passthrough)
    finally:
        done.set()
    note = "; ".join(["capacity not enforced"] + reasons + ([f"timed out after {timeout:g} s"] if timed_out else []))
    return WallRun(rc, out, err, "none", {"mechanism": "none", "meminfo_at_entry": mem}, False, note, timed_out)
