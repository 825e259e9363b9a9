"""Accounting at the layer that cannot lie: block-device, reclaim, pressure, memory and residency
counters around a measured interval.

Invariants:

* Every value is read from the kernel at the moment of the snapshot; a counter that cannot be
  read is ``None`` with a reason beside it (``*_note``), never estimated or carried over.
* ``/proc`` and ``/sys`` files are read with a byte cap (:data:`READ_CAP`), so a hostile or huge
  file cannot exhaust memory.
* Residency is measured with ``mincore`` over read-only mappings of at most :data:`WINDOW` bytes at
  a time (bounded memory whatever the file size); a file whose residency the kernel would fake
  (Linux >= 5.0 reports every page resident for a file the caller neither owns nor may write)
  is refused rather than counted.
* Nothing here changes the machine, except :func:`evict_file_pages`, which drops the clean page-cache
  pages of the named files only (``posix_fadvise(DONTNEED)``).
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from . import cgroupfs
from .pagecache import residency
from .procfs import (cgroup_version, read_meminfo, read_memcg, read_pressure, read_self_io, read_text, read_vmstat,
                     vmlck_bytes)

__all__ = ["snapshot", "delta", "reclaim_setup", "block_device", "diskstats_row"]

SECTOR = 512
"""/proc/diskstats counts sectors of 512 bytes, whatever the device's block size."""

RECLAIMERS = ("kswapd", "direct", "khugepaged", "proactive")
"""Who scans: pgscan_<who> / pgsteal_<who> partition the reclaim work (pgscan_anon/_file split it again)."""
OTHER_READERS_SLACK = 0.03
"""A device that read more than the process's own ``read_bytes`` by this fraction (plus 1 MiB) had
other readers in the interval: the cell is flagged (``device_other_readers``)."""
DISKSTATS_FIELDS = ("reads", "reads_merged", "sectors_read", "ms_reading",
                    "writes", "writes_merged", "sectors_written", "ms_writing")


# ---------------------------------------------------------------------- block device
def _mount_of(path: str) -> tuple[str | None, str | None]:
    """``(mount point, filesystem type)`` of the mount holding ``path`` (longest prefix in mountinfo)."""
    text, _ = read_text("/proc/self/mountinfo")
    real = os.path.realpath(path)
    best = (None, None)
    for line in (text or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0] or ""):
            best = (point, right.split()[0] if right.split() else None)
    return best


def block_device(path: str) -> tuple[dict | None, str | None]:
    """The block device holding ``path``: ``({"device", "major", "minor", "partition"}, None)`` or
    ``(None, reason)``. A partition maps to its whole disk (the diskstats row read is the disk's)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    point, fstype = _mount_of(path)
    sysdir = f"/sys/dev/block/{major}:{minor}"
    if major == 0 or not os.path.exists(sysdir):
        return None, (f"{path} is on {fstype or 'a filesystem'} (device {major}:{minor}) with no block device "
                      "(overlay, tmpfs or another virtual filesystem): device reads cannot be counted")
    real = os.path.realpath(sysdir)
    partition = None
    if os.path.exists(os.path.join(real, "partition")):
        partition = os.path.basename(real)
        real = os.path.dirname(real)
        text, _ = read_text(os.path.join(real, "dev"))
        try:
            major, minor = (int(x) for x in (text or "").strip().split(":"))
        except ValueError:
            return None, f"{real}/dev: cannot read the disk of partition {partition}"
    return {"device": os.path.basename(real), "major": major, "minor": minor, "partition": partition,
            "fstype": fstype, "mount": point}, None


def diskstats_row(major: int, minor: int) -> tuple[dict | None, str | None]:
    text, why = read_text("/proc/diskstats")
    if text is None:
        return None, why
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 + len(DISKSTATS_FIELDS) and parts[0] == str(major) and parts[1] == str(minor):
            try:
                return {k: int(v) for k, v in zip(DISKSTATS_FIELDS, parts[3:])}, None
            except ValueError:
                return None, f"/proc/diskstats: unreadable row for {major}:{minor}"
    return None, f"/proc/diskstats has no row for device {major}:{minor}"


# ---------------------------------------------------------------------- snapshots
def snapshot(paths: Sequence[str]) -> dict:
    """Counters at this instant, JSON-able. Keys: ``time_monotonic``, ``block_device`` (+``_note``),
    ``diskstats`` (the device's row, +``_note``), ``vmstat`` (+``_note``), ``pressure`` (io and memory,
    each null with a note where unreadable), ``meminfo`` (bytes, +``_note``), ``vmlck_bytes``,
    ``residency`` (``{"resident_bytes", "total_bytes"}``, +``_note``), ``self_io`` (/proc/self/io,
    +``_note``), ``memcg`` (the counters of this process's memory cgroup: the wall's, when run in
    one; +``_note``)."""
    paths = [os.fspath(p) for p in paths]
    snap: dict = {"time_monotonic": time.monotonic(), "files": len(paths)}
    dev, why = block_device(paths[0]) if paths else (None, "no pool files given")
    snap["block_device"], snap["block_device_note"] = dev, why
    row, why = diskstats_row(dev["major"], dev["minor"]) if dev else (None, why)
    snap["diskstats"], snap["diskstats_note"] = row, why
    snap["vmstat"], snap["vmstat_note"] = read_vmstat()
    snap["pressure"], snap["pressure_note"] = {}, {}
    for res in ("io", "memory"):
        snap["pressure"][res], note = read_pressure(res)
        if note:
            snap["pressure_note"][res] = note
    snap["meminfo"], snap["meminfo_note"] = read_meminfo()
    snap["vmlck_bytes"] = vmlck_bytes()
    snap["self_io"], snap["self_io_note"] = read_self_io()
    loc, why = cgroupfs.locate_memory_cgroup()
    snap["memcg"] = read_memcg(loc["dir"], loc["version"], dev and f"{dev['major']}:{dev['minor']}") if loc else None
    snap["memcg_note"] = why or None
    try:
        r, t = residency(paths)
        snap["residency"], snap["residency_note"] = {"resident_bytes": r, "total_bytes": t}, None
    except OSError as exc:
        snap["residency"], snap["residency_note"] = None, str(exc.strerror or exc) if not exc.filename else \
            f"{exc.filename}: {exc.strerror or exc}"
    return snap


def delta(pre: dict, post: dict) -> dict:
    """What happened between two snapshots of the same files.

    ``device_read_bytes`` = (sectors read after - before) x 512 on the pool's block device, or None
    with ``device_read_note`` (no device, unreadable row, device changed, counter went backwards).
    ``vmstat`` holds counter deltas; ``pgscan_total``/``pgsteal_total`` sum the pgscan*/pgsteal*
    counters and ``reclaim_scan_per_steal`` is their ratio (None when nothing was stolen).
    ``pressure`` holds the stall-time deltas in microseconds; ``meminfo_at_entry`` and
    ``vmlck_bytes_at_entry`` are the pre snapshot's; residency before and after are both given.
    """
    out: dict = {"seconds": post.get("time_monotonic", 0.0) - pre.get("time_monotonic", 0.0)}
    dev_pre, dev_post = pre.get("block_device"), post.get("block_device")
    row_pre, row_post = pre.get("diskstats"), post.get("diskstats")
    out["device"] = dev_pre["device"] if dev_pre else None
    read_bytes = write_bytes = reads = None
    note = pre.get("diskstats_note") or post.get("diskstats_note")
    if row_pre and row_post:
        if (dev_pre["major"], dev_pre["minor"]) != (dev_post["major"], dev_post["minor"]):
            note = "the pool's block device changed between the snapshots"
        elif row_post["sectors_read"] < row_pre["sectors_read"]:
            note = "/proc/diskstats counter went backwards (device reset or counter wrap)"
        else:
            read_bytes = (row_post["sectors_read"] - row_pre["sectors_read"]) * SECTOR
            write_bytes = max(0, row_post["sectors_written"] - row_pre["sectors_written"]) * SECTOR
            reads = row_post["reads"] - row_pre["reads"]
            note = None
    out.update(device_read_bytes=read_bytes, device_read_note=note, device_reads=reads,
               device_write_bytes=write_bytes)
    vm_pre, vm_post = pre.get("vmstat"), post.get("vmstat")
    if vm_pre is not None and vm_post is not None:
        vm = {k: vm_post[k] - vm_pre[k] for k in vm_post if k in vm_pre and not k.startswith("nr_")}
        scan, steal = reclaim_totals(vm)
        out.update(vmstat=vm, vmstat_note=None, pgscan_total=scan, pgsteal_total=steal,
                   reclaim_scan_per_steal=(scan / steal) if steal > 0 else None)
    else:
        out.update(vmstat=None, vmstat_note=pre.get("vmstat_note") or post.get("vmstat_note"),
                   pgscan_total=None, pgsteal_total=None, reclaim_scan_per_steal=None)
    pressure, pnote = {}, {}
    for res in ("io", "memory"):
        a, b = (pre.get("pressure") or {}).get(res), (post.get("pressure") or {}).get(res)
        if a and b:
            pressure[res] = {f"{kind}_us": b[kind]["total"] - a[kind]["total"]
                             for kind in ("some", "full") if "total" in a.get(kind, {}) and "total" in b.get(kind, {})}
        else:
            pressure[res] = None
            pnote[res] = (pre.get("pressure_note") or {}).get(res) or (post.get("pressure_note") or {}).get(res) \
                or "unreadable"
    out.update(pressure=pressure, pressure_note=pnote)
    out.update(_self_and_memcg(pre, post, read_bytes))
    out.update(meminfo_at_entry=pre.get("meminfo"), meminfo_note=pre.get("meminfo_note"),
               vmlck_bytes_at_entry=pre.get("vmlck_bytes"),
               residency_before=pre.get("residency"), residency_after=post.get("residency"),
               residency_note=pre.get("residency_note") or post.get("residency_note"))
    return out


def reclaim_totals(vm: dict) -> tuple[int, int]:
    """(pgscan, pgsteal) of a vmstat (or v2 memory.stat) delta. ``pgscan_anon + pgscan_file`` when the
    kernel has them: they count every reclaim, while ``pgscan_kswapd/_direct/...`` leave out reclaim
    forced by a cgroup limit (it is charged to the memcg only); else the sum over the reclaimers."""
    if "pgscan_file" in vm or "pgscan_anon" in vm:
        return (vm.get("pgscan_anon", 0) + vm.get("pgscan_file", 0), vm.get("pgsteal_anon", 0) + vm.get("pgsteal_file", 0))
    return (sum(vm.get(f"pgscan_{who}", 0) for who in RECLAIMERS), sum(vm.get(f"pgsteal_{who}", 0) for who in RECLAIMERS))


def _self_and_memcg(pre: dict, post: dict, device_bytes: int | None) -> dict:
    """The process's own read bytes (and the other-readers flag), and its memory cgroup's deltas."""
    a, b = pre.get("self_io"), post.get("self_io")
    own = b["read_bytes"] - a["read_bytes"] if a and b else None
    out: dict = {"read_bytes_self": own, "read_bytes_self_note": None if own is not None else
                 (pre.get("self_io_note") or post.get("self_io_note") or "unreadable"),
                 "device_other_readers": None, "device_other_bytes": None}
    if own is not None and device_bytes is not None:
        out["device_other_bytes"] = device_bytes - own
        out["device_other_readers"] = device_bytes - own > OTHER_READERS_SLACK * own + (1 << 20)
    ma, mb = pre.get("memcg"), post.get("memcg")
    if not (ma and mb and ma.get("stat") is not None and mb.get("stat") is not None and ma["path"] == mb["path"]):
        out["memcg"] = None
        out["memcg_note"] = pre.get("memcg_note") or "the memory cgroup's memory.stat is unreadable or changed"
        return out
    counters = {k: mb["stat"][k] - ma["stat"][k] for k in mb["stat"]
                if k in ma["stat"] and k.startswith(("pg", "workingset_"))}
    m: dict = {"path": mb["path"], "version": mb["version"], "stat": counters, "stat_at_entry": ma["stat"]}
    if "pgscan" in mb["stat"] or "pgscan_file" in mb["stat"]:  # v2
        scan = counters.get("pgscan", sum(counters.get(f"pgscan_{w}", 0) for w in ("anon", "file")))
        steal = counters.get("pgsteal", sum(counters.get(f"pgsteal_{w}", 0) for w in ("anon", "file")))
        m.update(pgscan=scan, pgsteal=steal, reclaim_scan_per_steal=scan / steal if steal > 0 else None, reclaim_note=None)
    else:
        m.update(pgscan=None, pgsteal=None, reclaim_scan_per_steal=None,
                 reclaim_note="cgroup v1 memory.stat has no pgscan/pgsteal: the global pgscan_file/pgsteal_file "
                              "(which count reclaim forced by a cgroup limit) stand in")
    pa, pb = ma.get("pressure"), mb.get("pressure")
    m["pressure"] = ({f"{k}_us": pb[k]["total"] - pa[k]["total"] for k in ("some", "full")
                      if "total" in pa.get(k, {}) and "total" in pb.get(k, {})} if pa and pb else None)
    m["pressure_note"] = mb.get("pressure_note") or ma.get("pressure_note")
    ia, ib = ma.get("io_read_bytes"), mb.get("io_read_bytes")
    m["io_read_bytes"] = ib - ia if ia is not None and ib is not None else None
    m["io_read_note"] = mb.get("io_read_note") or ma.get("io_read_note")
    out["memcg"], out["memcg_note"] = m, None
    return out


# ---------------------------------------------------------------------- reclaim setup
def reclaim_setup() -> dict:
    """The kernel's reclaim configuration, read only: ``mglru`` (bool, from
    /sys/kernel/mm/lru_gen/enabled), ``swap`` (devices and total bytes from /proc/swaps), ``thp``
    (the selected transparent_hugepage mode), ``kernel`` (release), ``cgroup`` ("v1", "v2",
    "hybrid" or None). Each unreadable value is None with ``<key>_note``."""
    out: dict = {"kernel": os.uname().release}
    text, why = read_text("/sys/kernel/mm/lru_gen/enabled")
    if text is None:
        out["mglru"], out["mglru_note"] = None, f"{why} (kernel without MGLRU, or not exposed here)"
    else:
        try:
            out["mglru"], out["mglru_raw"] = int(text.strip(), 0) != 0, text.strip()
        except ValueError:
            out["mglru"], out["mglru_note"] = None, f"/sys/kernel/mm/lru_gen/enabled: unreadable value {text.strip()[:20]!r}"
    text, why = read_text("/proc/swaps")
    if text is None:
        out["swap"], out["swap_note"] = None, why
    else:
        devices, total = [], 0
        for line in text.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3:
                devices.append(parts[0])
                total += int(parts[2]) * 1024 if parts[2].isdigit() else 0
        out["swap"] = {"devices": devices, "total_bytes": total, "on": bool(devices)}
    text, why = read_text("/sys/kernel/mm/transparent_hugepage/enabled")
    if text is None:
        out["thp"], out["thp_note"] = None, why
    else:
        sel = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
        out["thp"] = sel[0] if sel else None
        if not sel:
            out["thp_note"] = "no selected mode in /sys/kernel/mm/transparent_hugepage/enabled"
    text, why = read_text("/proc/sys/vm/swappiness")
    out["swappiness"] = int(text.strip()) if text and text.strip().isdigit() else None
    out["cgroup"], note = cgroup_version()
    if note:
        out["cgroup_note"] = note
    return out
