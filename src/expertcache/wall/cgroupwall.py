"""The cgroup wall: where its memory cgroup goes, running the child in it, and the proof.

Placement (:func:`cgroup_target`), in order:

* ``child``: under this process's own memory cgroup (v1; v2 when the own cgroup's
  ``cgroup.subtree_control`` enables memory);
* ``sibling`` (v2): the no-internal-process rule keeps memory out of a populated cgroup's
  subtree_control (most non-root cgroups of a systemd host), but the own cgroup's parent enables it
  for its children (the own ``cgroup.controllers`` lists memory): a leaf made beside the own
  cgroup carries ``memory.max`` without changing any existing cgroup;
* ``systemd-scope`` (v2, where systemd runs): ``systemd-run --scope -p MemoryMax=LIMIT -p
  MemorySwapMax=0`` puts the child in a transient scope unit; its cgroup is found from the child's
  ``/proc/<pid>/cgroup`` and sampled like the others (the unit is collected when the child exits,
  so the proof keeps the last limit, peak and events read while it ran).

Invariants: the only cgroups written are the ones made here (a named ``--cgroup`` only receives
the child's pid; systemd makes and removes a scope); no subtree_control is ever changed; every run
says what enforced it and carries the proof; ``proof_ok`` is False whenever a piece is missing or
shows the wall failed (see :func:`cgroup_problems`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from ..errors import ConfigError, ExpertcacheError, one_line, raised_at
from . import cgroupfs as cg
from .procfs import read_meminfo, read_text

CAPACITY_SLACK = 0.02
"""The tier (page cache + locked memory) may stray from the capacity by this fraction (plus
min(4 MiB, C/4): :func:`proof_slack`) before the proof fails."""
SLACK_BYTES = 4 << 20
"""The absolute part of :func:`proof_slack`, capped at a quarter of the capacity."""
SCOPE_WAIT_S = 10.0
"""How long the child of ``systemd-run --scope`` may take to appear in its scope's cgroup."""


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


def child_result(run: WallRun, where: str, timeout: float | None = None) -> dict:
    """The walled child's result: the last line of its stdout as a JSON object. A timeout, a failed
    or killed child (its last stderr line, or the signal and the wall's note) or no JSON is one
    ConfigError naming ``where``."""
    if run.timed_out:
        raise ConfigError(f"{where}: timed out after {timeout:g} s (--timeout); the run was killed" if timeout
                          else f"{where}: timed out; the run was killed")
    if run.returncode != 0:
        lines = [ln for ln in (run.stderr or "").splitlines() if ln.strip()]
        why = lines[-1].removeprefix("expertcache: ").removeprefix("error: ") if lines else \
            f"exit status {run.returncode}"  # "expertcache: error:" from llama.cpp's abort callback
        if run.returncode is not None and run.returncode < 0:
            why = (f"the measured process was killed by signal {-run.returncode} inside the {run.enforced_by} "
                   f"wall ({run.note or 'no note'})")
        elif run.proof_ok is False and run.note and run.enforced_by not in (None, "none"):
            # a system call's charge at the wall fails (ENOMEM, EFAULT) where a fault would wait: the
            # child's own error, then why the wall was where it was ("raise the headroom")
            why = f"{why} (inside the {run.enforced_by} wall: {run.note})"
        raise ConfigError(f"{where}: {why}")
    try:
        rec = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(f"{where}: the measured process printed no JSON result") from None
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: the measured process printed no JSON object")
    return rec


def worker_main(argv: list[str] | None, run, module: str, exit_codes: tuple = (), default=None) -> int:
    """The walled child's side of :func:`child_result`: ``python -m MODULE SPEC.json`` reads the spec,
    calls ``run(spec)`` and prints its result as one JSON object (``default`` serialises what json
    cannot). Any refusal is one ``error: ...`` line on stderr and exit 2 (``exit_codes``: pairs of an
    exception type and its own status, tried first); anything else is a bug, one line too, exit 70
    (``EXPERTCACHE_DEBUG=1`` shows its traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} SPEC.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0], encoding="utf-8") as fh:
            spec = json.load(fh)
        result = run(spec)
    except Exception as exc:
        code = next((c for kind, c in exit_codes if isinstance(exc, kind)), None)
        if code is not None or isinstance(exc, ExpertcacheError):
            why = one_line(exc)
        elif isinstance(exc, OSError):
            why = f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}{raised_at(exc)}"
        elif isinstance(exc, (ValueError, KeyError, IndexError, TypeError)):  # a bad spec: one line
            why = f"measured process: {type(exc).__name__}: {one_line(exc)}"
        elif os.environ.get("EXPERTCACHE_DEBUG"):
            raise
        else:
            why, code = f"measured process: internal error (a bug): {type(exc).__name__}: {one_line(exc)}", 70
        print(f"error: {why}", file=sys.stderr)
        return code or 2
    print(json.dumps(result, default=default))
    return 0


def proof_slack(capacity_bytes: int) -> float:
    """How far (bytes) the tier may exceed, or fall short of, the capacity before the proof fails:
    ``CAPACITY_SLACK * C + min(SLACK_BYTES, C / 4)``. Relative, so a tiny capacity (1 byte) cannot
    pass with megabytes of page cache."""
    return CAPACITY_SLACK * capacity_bytes + min(SLACK_BYTES, capacity_bytes / 4)


def systemd_available() -> bool:
    """True where ``systemd-run`` exists and systemd is the running init (``/run/systemd/system``)."""
    return shutil.which("systemd-run") is not None and os.path.isdir("/run/systemd/system")


def cgroup_target() -> tuple[dict | None, str]:
    """Where a wall's cgroup can go: ``({"version", "dir", "placement"}, "")`` with placement
    ``child`` (made in ``dir``), ``sibling`` (made in ``dir``, the own cgroup's parent) or
    ``systemd-scope`` (``dir`` = the cgroup2 mount), or ``(None, every reason)``."""
    own, why = cg.own_memory_cgroup()
    if own is not None:
        probe = cg.probe_child(own["dir"])
        if probe is None:
            return own | {"placement": "child"}, ""
        why = probe
    loc, _ = cg.locate_memory_cgroup()
    if loc is None or loc["version"] != "v2":
        return None, why
    parent, why_sibling = cg.v2_sibling_parent(loc["dir"], loc["mount"])
    if parent is not None:
        return {"version": "v2", "dir": parent, "placement": "sibling"}, ""
    if systemd_available():
        return {"version": "v2", "dir": loc["mount"], "placement": "systemd-scope"}, ""
    return None, f"{why}; no sibling leaf: {why_sibling}; no systemd-run scope: systemd is not running here"


def scope_argv(argv: list[str], limit: int, unit: str, user: bool) -> list[str]:
    """The ``systemd-run`` command that runs ``argv`` in transient scope ``unit`` with MemoryMax=limit."""
    return ["systemd-run", *(["--user"] if user else []), "--scope", "--quiet", "--collect", f"--unit={unit}",
            "-p", f"MemoryMax={limit}", "-p", "MemorySwapMax=0", "--", *argv]


def scope_dir(pid: int, unit: str, mount: str, wait_s: float = SCOPE_WAIT_S) -> str | None:
    """The cgroup directory of scope ``unit`` once process ``pid`` is in it (None after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        loc, _ = cg.locate_memory_cgroup(f"/proc/{pid}/cgroup")
        if loc is not None and os.path.basename(loc["dir"]) == unit:
            return loc["dir"]
        if loc is None and not os.path.exists(f"/proc/{pid}"):
            return None
        time.sleep(0.01)
    return None


def spawn(argv: list[str], procs_file: str | None, timeout: float | None, sampler=None,
          locate=None, passthrough: bool = False) -> tuple[int | None, str, str, bool]:
    """Run ``argv``; with ``procs_file`` the child joins that cgroup before exec; ``sampler`` runs
    while the child does (or ``locate(pid)`` builds it once the child exists). Returns (returncode,
    stdout, stderr, timed_out); a timeout kills the child's whole session. ``passthrough``: the
    child writes to this process's stdout and stderr (a server), and SIGTERM / SIGINT sent here are
    passed on to it (its session does not get the terminal's)."""
    def join():
        with open(procs_file, "w") as fh:
            fh.write(str(os.getpid()))

    pipe = None if passthrough else subprocess.PIPE
    try:
        proc = subprocess.Popen(argv, stdout=pipe, stderr=pipe, text=True,
                                start_new_session=True, preexec_fn=join if procs_file else None)
    except (OSError, subprocess.SubprocessError) as exc:
        raise WallUnavailable(f"cannot start {argv[0]!r}" + (f" inside {os.path.dirname(procs_file)}" if procs_file
                              else "") + f": {getattr(exc, 'strerror', None) or exc}") from None
    if locate is not None:
        sampler = locate(proc.pid)
    if sampler is not None:
        sampler.start()
    previous = {}
    if passthrough:
        def forward(signum, frame):
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signum)
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out or "", err or "", False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return proc.returncode, out or "", err or "", True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if sampler is not None:
            sampler.stop()


def make_wall_cgroup(d: str, version: str, limit: int) -> None:
    """Create cgroup ``d`` and set its limit (and swap: v1 memory+swap = limit, v2 none)."""
    f = cg.FILES[version]
    try:
        os.mkdir(d)
    except OSError as exc:
        raise WallUnavailable(f"cannot create cgroup {d}: {exc.strerror or exc}") from None
    try:
        cg.write(os.path.join(d, f["limit"]), str(limit))
        swap = os.path.join(d, f["swap"])
        if os.path.exists(swap):
            cg.write(swap, str(limit) if version == "v1" else "0")
    except OSError as exc:
        cg.rmdir_retry(d)
        raise WallUnavailable(f"cannot set the limit of {d}: {exc.strerror or exc}") from None


def follow_setup(proof: dict, capacity: int, limit: int, margin: int | None) -> tuple[int, int, int] | None:
    """The :class:`~.cgroupfs.Sampler`'s ``follow`` for a wall whose limit follows its worker
    (``margin`` bytes; None: a fixed limit), recorded in the proof as ``follow_margin_bytes``."""
    if margin is None:
        return None
    proof["follow_margin_bytes"] = int(margin)
    return capacity, limit, int(margin)


def run_cgroup(argv, limit, timeout, target: dict, named: str | None, capacity: int,
               follow_margin: int | None = None, follow_flag: str | None = None, tier_files=None,
               tier_locked: bool = True, passthrough: bool = False) -> WallRun:
    """Run ``argv`` in a cgroup made at ``target`` (or the ``named`` one, used as it is); with
    ``follow_margin`` the limit follows the worker's own memory (:class:`~.cgroupfs.Sampler`, which
    also measures the tier: ``tier_files``, ``tier_locked``)."""
    version = target["version"]
    made = named is None
    d = named or os.path.join(target["dir"], f"expertcache-{os.getpid()}-{secrets.token_hex(4)}")
    proof: dict = {"mechanism": f"cgroup-{version}", "path": d, "created_here": made,
                   "placement": "named" if named else target.get("placement", "child"),
                   "requested_limit_bytes": limit, "capacity_bytes": capacity, "headroom_bytes": limit - capacity}
    follow = follow_setup(proof, capacity, limit, follow_margin if made else None)
    if made:
        make_wall_cgroup(d, version, limit)
        if follow is not None and version == "v1":
            proof["oom_killer_disabled"] = cg.oom_guard(d)
    try:
        proof["at_start"] = cg.cgroup_state(d, version)
        proof["meminfo_at_entry"], _ = read_meminfo()
        sampler = cg.Sampler(d, version, follow, follow_flag, tier_files, tier_locked)
        proof["tier_measure"] = sampler.tier_measure
        rc, out, err, timed_out = spawn(argv, os.path.join(d, "cgroup.procs"), timeout, sampler,
                                        passthrough=passthrough)
        proof.update(cg.cgroup_state(d, version))
        proof.update(sampler.peaks)
        if follow is not None:
            proof.update(sampler.limits)
    finally:
        if made:
            cg.kill_members(d)
            proof["removed"] = cg.rmdir_retry(d)
    problems = cgroup_problems(proof, limit, capacity, made, timeout if timed_out else None)
    return WallRun(rc, out, err, f"cgroup-{version}:{d}", proof, not problems, "; ".join(problems), timed_out)


def run_scope(argv, limit, timeout, target: dict, capacity: int, follow_margin: int | None = None,
              follow_flag: str | None = None, tier_files=None, tier_locked: bool = True,
              passthrough: bool = False) -> WallRun:
    """Run ``argv`` in a transient ``systemd-run --scope`` unit with MemoryMax = ``limit``."""
    unit = f"expertcache-{os.getpid()}-{secrets.token_hex(4)}.scope"
    proof: dict = {"mechanism": "cgroup-v2", "placement": "systemd-scope", "unit": unit, "created_here": True,
                   "requested_limit_bytes": limit, "capacity_bytes": capacity, "headroom_bytes": limit - capacity,
                   "meminfo_at_entry": read_meminfo()[0]}
    follow = follow_setup(proof, capacity, limit, follow_margin)
    found: dict = {}

    def locate(pid: int):
        d = scope_dir(pid, unit, target["dir"])
        found["dir"] = d
        if d is None:
            return None
        sampler = cg.Sampler(d, "v2", follow, follow_flag, tier_files, tier_locked)
        proof["tier_measure"] = sampler.tier_measure
        sampler.keep_state = True
        sampler.sample()
        found["sampler"] = sampler
        return sampler

    rc, out, err, timed_out = spawn(scope_argv(argv, limit, unit, os.geteuid() != 0), None, timeout, locate=locate,
                                    passthrough=passthrough)
    d = found.get("dir")
    proof["path"] = d
    sampler = found.get("sampler")
    state = (sampler.last_state if sampler else None) or {k: None for k in cg.cgroup_state("/nonexistent", "v2")}
    proof.update(state)
    proof.update(sampler.peaks if sampler else {"tier_peak_bytes": None})
    if follow is not None and sampler:
        proof.update(sampler.limits)
    deadline = time.monotonic() + 2.0
    while d and os.path.exists(d) and time.monotonic() < deadline:
        time.sleep(0.05)
    proof["removed"] = d is None or not os.path.exists(d)
    problems = [] if d else [f"the child never appeared in scope {unit} (systemd-run: "
                             f"{(err or '').strip().splitlines()[-1:] or 'no message'})"]
    problems += cgroup_problems(proof, limit, capacity, True, timeout if timed_out else None)
    return WallRun(rc, out, err, f"cgroup-v2:{d or unit}", proof, not problems, "; ".join(problems), timed_out)


def cgroup_problems(proof: dict, limit: int, capacity: int, made: bool, timed_out_after: float | None) -> list[str]:
    """What is wrong with a cgroup wall's proof (empty when it held): the limit, the peak, the tier
    against the capacity (within :func:`proof_slack`), OOM kills, a timeout, a cgroup left behind."""
    problems = []
    lim = proof.get("limit_bytes")
    followed = proof.get("follow_margin_bytes") is not None
    if lim is None or lim >= cg.UNLIMITED:
        problems.append("the cgroup has no memory limit")
    elif made and followed and not lim <= limit:
        problems.append(f"limit read back as {lim}, above the requested {limit}")
    elif made and not followed and not (0 <= limit - lim < 1 << 16):
        problems.append(f"limit read back as {lim}, asked {limit}")
    elif not made and lim > limit:
        problems.append(f"the named cgroup's limit {lim} is above capacity + headroom {limit}")
    if followed:
        lim = limit  # the wall moved with the worker: "reached" means the requested ceiling
    peak = proof.get("peak_bytes")
    if peak is None:
        problems.append("no peak (memory.peak / memory.max_usage_in_bytes unreadable)")
    tier, slack = proof.get("tier_peak_bytes"), proof_slack(capacity)
    own = proof.get("own_peak_bytes")
    own_txt = (f"the rest charged to the wall (anonymous and kernel memory, other files' pages) peaked at {own} "
               "bytes" if own is not None else f"anonymous peak {proof.get('anon_peak_bytes')} bytes")
    what = (f"its files' page cache ({proof['tier_measure']})" if str(proof.get("tier_measure", "")).startswith(
        ("cachestat", "mincore")) else "page cache + locked")
    if tier is None:
        problems.append("memory.stat was never sampled: the tier's size is unknown")
    elif tier > capacity + slack and followed:
        problems.append(f"the tier held up to {tier} bytes ({what}), above the capacity {capacity} + slack "
                        f"{int(slack)}, although the limit followed the worker ({proof.get('limit_writes')} writes, "
                        f"margin {proof.get('follow_margin_bytes')}; {own_txt})")
    elif tier > capacity + slack:
        problems.append(f"the tier held up to {tier} bytes ({what}), above the capacity {capacity}: "
                        f"the headroom {limit - capacity} exceeds what the worker needed ({own_txt}); lower the headroom")
    elif peak is not None and lim is not None and peak >= lim - cg.AT_LIMIT_BYTES and tier < capacity - slack:
        problems.append(f"the wall ({lim} bytes) was reached while the tier held at most {tier} bytes, below the "
                        f"capacity {capacity}: the worker's own memory outgrew the headroom {limit - capacity} "
                        f"({own_txt}); raise the headroom")
    elif followed and squeezed(proof, capacity - slack):
        problems.append(f"the following limit held the tier below the capacity: at the limit in "
                        f"{proof['at_limit_samples']} of {proof['steady_samples']} samples after the first forward, "
                        f"the tier at most {proof['at_limit_tier_max_bytes']} bytes, under the capacity {capacity} "
                        f"less the slack {int(slack)}: the run measured a smaller cache than its wall "
                        f"({own_txt}; bias {proof.get('min_bias_bytes', 0)} to {proof.get('max_bias_bytes', 0)} bytes)")
    if proof.get("oom_kill"):
        problems.append(f"the wall OOM-killed {proof['oom_kill']} process(es): raise the headroom")
    if timed_out_after is not None:
        problems.append(f"timed out after {timed_out_after:g} s")
    if made and not proof.get("removed"):
        problems.append(f"could not remove {proof.get('path')}")
    return problems


SQUEEZE_SAMPLES = 3
"""Samples at the limit (after the first forward) that make a squeezed tier a failed proof."""


def squeezed(proof: dict, floor: float) -> bool:
    """Whether a following wall was at its limit in at least :data:`SQUEEZE_SAMPLES` samples after
    the first forward while the tier never reached ``floor`` (the capacity less the slack) in any of
    them: the kernel reclaimed the tier, not the policy, and the run's figures are a smaller cache's."""
    n, best = proof.get("at_limit_samples") or 0, proof.get("at_limit_tier_max_bytes")
    return n >= SQUEEZE_SAMPLES and best is not None and best < floor


def read_limit_chain(loc: dict) -> list[tuple[str, int | None]]:
    """``(dir, limit)`` of the own memory cgroup and, on v2, each ancestor up to the mount (v1: the
    ``hierarchical_memory_limit`` of memory.stat, which already is the smallest up the tree)."""
    if loc["version"] == "v1":
        text, _ = read_text(os.path.join(loc["dir"], "memory.stat"))
        lim = cg.keyed_numbers(text or "").get("hierarchical_memory_limit")
        return [(loc["dir"], lim if lim is not None and lim < cg.UNLIMITED else None)]
    out, d, mount = [], os.path.normpath(loc["dir"]), os.path.normpath(loc["mount"])
    while d.startswith(mount) and d != mount:
        lim = cg.read_int(os.path.join(d, "memory.max"))
        out.append((d, lim if lim is not None and lim < cg.UNLIMITED else None))
        d = os.path.dirname(d)
    return out
