"""Enforced capacity: run a measured child process behind a memory wall and prove the wall held.

Walls, in order of preference (``wall="auto"``):

* ``cgroup``: a child memory cgroup created under this process's OWN memory cgroup (cgroup v2, or
  v1's memory controller), limit = capacity + headroom, swap excluded; the child writes its own
  pid into it before exec, so every page it touches (anonymous and page cache) is charged there.
  Afterwards the peak, the failure count and the OOM events are read and the cgroup is removed.
  A cgroup the user names (``cgroup=PATH``) is used as it is: its limit is read and recorded,
  never changed.
* ``balloon``: a helper process mlocks anonymous memory until MemAvailable is about capacity +
  headroom; refused when that would leave the machine under :data:`MIN_LEFT` bytes.
* ``none``: nothing enforced; the run is marked unproven.

Invariants: no cgroup other than the one created here is ever written (a named one only receives
the child's pid); every :class:`WallRun` says what enforced the capacity (``enforced_by``) and
carries the proof; ``proof_ok`` is False whenever a piece of the proof is missing or shows the wall
failed (limit not read back, the tier's page cache + locked memory above or squeezed below the
capacity, OOM kill, balloon not fully locked or dead, timeout, cgroup not removed). The cgroup
files and the memory.stat sampler live in :mod:`expertcache.tier.cgroupfs`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, field

from ..errors import ConfigError, ExpertcacheError
from . import cgroupfs as cg
from .procfs import read_meminfo, read_text

WALLS = ("auto", "cgroup", "balloon", "none")
DEFAULT_HEADROOM = 64 * 10**6
"""Default headroom (bytes) above the capacity: the measured worker's own anonymous memory. A
Python worker with numpy peaked at about 42 MB here; a caller with read buffers (threads x expert
size) must add them. Too much headroom lets the page cache grow past the capacity, too little
squeezes it below; either fails the proof. The paper used C + 6 GiB for a large native engine."""
MIN_LEFT = 2 * 10**9
"""A balloon never leaves the machine with less than this much available memory (bytes)."""
CAPACITY_SLACK = 0.02
"""The tier (page cache + locked memory) may exceed the capacity by this fraction (plus 4 MiB)
before the proof fails: the headroom was then larger than what the worker used for itself."""


class WallUnavailable(ExpertcacheError):
    """The wall asked for cannot be built on this machine (the message says why)."""


@dataclass
class WallRun:
    """One child run behind a wall: its exit status and output, what enforced its capacity, the
    proof (JSON-able) and whether the proof is complete and clean (``proof_ok``)."""

    returncode: int | None
    stdout: str
    stderr: str
    enforced_by: str
    proof: dict = field(default_factory=dict)
    proof_ok: bool = False
    note: str = ""
    timed_out: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def detect_walls() -> dict:
    """What this machine can enforce: ``{"cgroup": {"ok", "version", "parent", "reason"},
    "balloon": {"ok", "mem_available_bytes", "memlock_limit", "reason"}, "none": {...}}``. The cgroup
    answer is tested, not guessed: an empty child cgroup is created and removed at once."""
    own, why = cg.own_memory_cgroup()
    group = {"ok": False, "version": own and own["version"], "parent": own and own["dir"], "reason": why}
    if own:
        why = cg.probe_child(own["dir"])
        group.update(ok=why is None, reason=why or f"child cgroups can be made under {own['dir']}")
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


def _spawn(argv: list[str], procs_file: str | None, timeout: float | None,
           sampler: "cg.Sampler | None" = None) -> tuple[int | None, str, str, bool]:
    """Run ``argv``; with ``procs_file`` the child joins that cgroup before exec; ``sampler`` runs
    while the child does. Returns (returncode, stdout, stderr, timed_out); a timeout kills the
    child's whole session."""
    def join():
        with open(procs_file, "w") as fh:
            fh.write(str(os.getpid()))

    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=join if procs_file else None)
    except (OSError, subprocess.SubprocessError) as exc:
        raise WallUnavailable(f"cannot start {argv[0]!r}" + (f" inside {os.path.dirname(procs_file)}" if procs_file
                              else "") + f": {getattr(exc, 'strerror', None) or exc}") from None
    if sampler is not None:
        sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return proc.returncode, out, err, True
    finally:
        if sampler is not None:
            sampler.stop()


def _run_cgroup(argv, limit, timeout, own: dict, named: str | None, capacity: int) -> WallRun:
    version = own["version"]
    f = cg.FILES[version]
    made = named is None
    d = named or os.path.join(own["dir"], f"expertcache-{os.getpid()}-{secrets.token_hex(4)}")
    if made:
        try:
            os.mkdir(d)
        except OSError as exc:
            raise WallUnavailable(f"cannot create cgroup {d}: {exc.strerror or exc}") from None
    proof: dict = {"mechanism": f"cgroup-{version}", "path": d, "created_here": made, "requested_limit_bytes": limit,
                   "capacity_bytes": capacity, "headroom_bytes": limit - capacity}
    try:
        if made:
            try:
                cg.write(os.path.join(d, f["limit"]), str(limit))
                swap = os.path.join(d, f["swap"])
                if os.path.exists(swap):  # v1: memory+swap = limit; v2: no swap at all
                    cg.write(swap, str(limit) if version == "v1" else "0")
            except OSError as exc:
                raise WallUnavailable(f"cannot set the limit of {d}: {exc.strerror or exc}") from None
        proof["at_start"] = cg.cgroup_state(d, version)
        proof["meminfo_at_entry"], _ = read_meminfo()
        sampler = cg.Sampler(d, version)
        rc, out, err, timed_out = _spawn(argv, os.path.join(d, "cgroup.procs"), timeout, sampler)
        proof.update(cg.cgroup_state(d, version))
        proof.update(sampler.peaks)
    finally:
        if made:
            cg.kill_members(d)
            proof["removed"] = cg.rmdir_retry(d)
    problems = []
    lim = proof["limit_bytes"]
    if lim is None or lim >= cg.UNLIMITED:
        problems.append("the cgroup has no memory limit")
    elif made and not (0 <= limit - lim < 1 << 16):
        problems.append(f"limit read back as {lim}, asked {limit}")
    elif not made and lim > limit:
        problems.append(f"the named cgroup's limit {lim} is above capacity + headroom {limit}")
    if proof["peak_bytes"] is None:
        problems.append(f"no peak ({f['peak']} unreadable)")
    tier = proof["tier_peak_bytes"]
    if tier is None:
        problems.append("memory.stat was never sampled: the tier's size is unknown")
    elif tier > capacity * (1 + CAPACITY_SLACK) + (4 << 20):
        problems.append(f"the tier held up to {tier} bytes (page cache + locked), above the capacity {capacity}: "
                        f"the headroom {limit - capacity} exceeds the worker's own memory (anonymous peak "
                        f"{proof['anon_peak_bytes']} bytes); lower the headroom")
    elif (proof["peak_bytes"] is not None and lim is not None and proof["peak_bytes"] >= lim - (1 << 20)
          and tier < capacity * (1 - CAPACITY_SLACK) - (4 << 20)):
        problems.append(f"the wall was reached while the tier held at most {tier} bytes, below the capacity "
                        f"{capacity}: the worker's own memory (anonymous peak {proof['anon_peak_bytes']} bytes) "
                        f"outgrew the headroom {limit - capacity}; raise the headroom")
    if proof["oom_kill"]:
        problems.append(f"the wall OOM-killed {proof['oom_kill']} process(es): raise the headroom")
    if timed_out:
        problems.append(f"timed out after {timeout} s")
    if made and not proof.get("removed"):
        problems.append(f"could not remove {d}")
    return WallRun(rc, out, err, f"cgroup-{version}:{d}", proof, not problems, "; ".join(problems), timed_out)


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
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
                               stdout=subprocess.PIPE, text=True)
        line = bal.stdout.readline().strip()
        if not line.startswith("locked"):
            bal.kill()
            bal.wait()
            raise WallUnavailable(f"balloon: {line or 'helper died'} (fail-stop)")
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
def run_walled(argv: list[str], *, capacity_bytes: int, wall: str = "auto", cgroup: str | None = None,
               headroom_bytes: int | None = None, timeout: float | None = None) -> WallRun:
    """Run ``argv`` as a child process behind a memory wall of ``capacity_bytes + headroom_bytes``.

    ``wall``: one of :data:`WALLS`; ``auto`` takes a cgroup, else a balloon, else none (the reasons
    are kept in ``note``). An explicit wall that cannot be built raises :class:`WallUnavailable`
    (one line). ``cgroup`` names an existing cgroup directory to use as it is. ``timeout`` (s) kills
    the child and still cleans up.
    """
    if wall not in WALLS:
        raise ConfigError(f"--wall: {wall!r} is not one of {', '.join(WALLS)}")
    if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ConfigError(f"--capacity: {capacity_bytes!r} is not a positive number of bytes")
    headroom = DEFAULT_HEADROOM if headroom_bytes is None else headroom_bytes
    if not isinstance(headroom, int) or headroom < 0:
        raise ConfigError(f"--headroom: {headroom!r} is not a non-negative number of bytes")
    if not argv:
        raise ConfigError("run_walled: empty command")
    limit = capacity_bytes + headroom
    if cgroup is not None:
        version = "v2" if os.path.exists(os.path.join(cgroup, "memory.max")) else \
            "v1" if os.path.exists(os.path.join(cgroup, "memory.limit_in_bytes")) else None
        if version is None or not os.path.exists(os.path.join(cgroup, "cgroup.procs")):
            raise ConfigError(f"--cgroup {cgroup}: not a memory cgroup directory (no memory.max or memory.limit_in_bytes)")
        return _run_cgroup(argv, limit, timeout, {"version": version, "dir": os.path.dirname(cgroup)}, cgroup,
                           capacity_bytes)
    reasons = []
    if wall in ("auto", "cgroup"):
        own, why = cg.own_memory_cgroup()
        why = why if own is None else cg.probe_child(own["dir"])
        if why is None:
            return _run_cgroup(argv, limit, timeout, own, None, capacity_bytes)
        if wall == "cgroup":
            raise WallUnavailable(f"cgroup wall: {why}")
        reasons.append(f"cgroup: {why}")
    if wall in ("auto", "balloon"):
        try:
            run = _run_balloon(argv, capacity_bytes, headroom, timeout)
            run.note = "; ".join(reasons + [run.note]).strip("; ")
            return run
        except WallUnavailable as exc:
            if wall == "balloon":
                raise
            reasons.append(str(exc))
    mem, _ = read_meminfo()
    rc, out, err, timed_out = _spawn(argv, None, timeout)
    note = "; ".join(["capacity not enforced"] + reasons)
    return WallRun(rc, out, err, "none", {"mechanism": "none", "meminfo_at_entry": mem}, False, note, timed_out)
