"""cgroup v2 walls on systemd hosts (issue 22, item 8), against a fake cgroupfs tree: these machines
only have cgroup v1. The no-internal-process rule keeps memory out of a populated cgroup's
subtree_control, so the wall goes into a sibling leaf (when the parent enables memory) or a
transient systemd scope; ``auto`` never falls back to a balloon."""

from __future__ import annotations

import os
import sys

import pytest

from expertcache.wall import capacity as cap
from expertcache.wall import cgroupfs as cg
from expertcache.wall import cgroupwall as cw

MB = 10**6


def _tree(tmp_path, monkeypatch, *, own="system.slice/app.service", controllers="cpu memory", subtree="",
          parent_subtree="memory pids"):
    """A cgroup2 mount at tmp/cg with this process in ``own``; /proc/self/cgroup and mountinfo faked."""
    mount = tmp_path / "cg"
    d = mount / own if own else mount
    d.mkdir(parents=True)
    (d / "cgroup.controllers").write_text(controllers + "\n")
    (d / "cgroup.subtree_control").write_text(subtree + "\n")
    if own:
        (d.parent / "cgroup.subtree_control").write_text(parent_subtree + "\n")
    fake = {"/proc/self/cgroup": f"0::/{own}\n",
            "/proc/self/mountinfo": f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"}
    real = cg.read_text
    monkeypatch.setattr(cg, "read_text", lambda p: (fake[p], None) if p in fake else real(p))
    return mount, d


def test_populated_v2_cgroup_gets_a_sibling_leaf(tmp_path, monkeypatch):
    mount, own = _tree(tmp_path, monkeypatch)
    assert cg.own_memory_cgroup()[0] is None  # memory not in the own subtree_control: no child
    loc, _ = cg.locate_memory_cgroup()
    assert loc == {"version": "v2", "dir": str(own), "mount": str(mount)}
    target, why = cw.cgroup_target()
    assert why == "" and target == {"version": "v2", "dir": str(own.parent), "placement": "sibling"}
    # the wall cgroup made there carries the limit; nothing else is written
    d = str(own.parent / "expertcache-test")
    cw.make_wall_cgroup(d, "v2", 123 * MB)
    assert open(os.path.join(d, "memory.max")).read() == str(123 * MB)
    assert (own / "cgroup.subtree_control").read_text().strip() == ""
    assert (own.parent / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]


def test_sibling_run_joins_the_child_and_records_the_placement(tmp_path, monkeypatch):
    """A whole run_walled on the fake tree: the child writes its pid into the sibling's cgroup.procs
    before exec; the fake files cannot be sampled, so the proof says what is missing (not ok)."""
    mount, own = _tree(tmp_path, monkeypatch)
    monkeypatch.setattr(cg, "rmdir_retry", lambda path, tries=40: False)  # a fake cgroup has files in it
    monkeypatch.setattr(cg, "kill_members", lambda d: None)  # its cgroup.procs names an exited pid
    monkeypatch.setattr(cap, "enforceable_bytes", lambda: (10**12, "test"))
    run = cap.run_walled([sys.executable, "-c", "print('hi')"], capacity_bytes=64 * MB, headroom_bytes=MB)
    assert run.returncode == 0 and run.stdout.strip() == "hi"
    assert run.enforced_by.startswith(f"cgroup-v2:{own.parent}/expertcache-")
    assert run.proof["placement"] == "sibling" and run.proof["requested_limit_bytes"] == 65 * MB
    made = run.proof["path"]
    assert open(os.path.join(made, "memory.max")).read() == str(65 * MB)
    assert open(os.path.join(made, "cgroup.procs")).read().strip().isdigit()
    assert run.proof_ok is False and "never sampled" in run.note


def test_root_cgroup_or_no_parent_memory_goes_to_systemd_or_nowhere(tmp_path, monkeypatch):
    _tree(tmp_path, monkeypatch, controllers="cpu")  # the parent does not enable memory for us
    monkeypatch.setattr(cw, "systemd_available", lambda: False)
    target, why = cw.cgroup_target()
    assert target is None and "subtree_control" in why and "no sibling leaf" in why and "systemd" in why
    monkeypatch.setattr(cw, "systemd_available", lambda: True)
    target, _ = cw.cgroup_target()
    assert target["placement"] == "systemd-scope" and target["version"] == "v2"


def test_in_the_root_cgroup_there_is_no_sibling(tmp_path, monkeypatch):
    _tree(tmp_path, monkeypatch, own="")
    parent, why = cg.v2_sibling_parent(str(tmp_path / "cg"), str(tmp_path / "cg"))
    assert parent is None and "root cgroup" in why


def test_auto_never_falls_back_to_a_balloon(tmp_path, monkeypatch):
    _tree(tmp_path, monkeypatch, controllers="cpu")
    monkeypatch.setattr(cw, "systemd_available", lambda: False)
    monkeypatch.setattr(cap, "enforceable_bytes", lambda: (10**12, "test"))

    def no_balloon(*a, **k):
        raise AssertionError("auto built a balloon")

    monkeypatch.setattr(cap, "_run_balloon", no_balloon)
    run = cap.run_walled([sys.executable, "-c", "pass"], capacity_bytes=64 * MB)
    assert run.enforced_by == "none" and run.proof_ok is False
    assert "only when asked (--wall balloon)" in run.note and "no sibling leaf" in run.note
    with pytest.raises(cap.WallUnavailable, match="cgroup wall"):
        cap.run_walled(["true"], capacity_bytes=64 * MB, wall="cgroup")


def test_systemd_scope_command_and_scope_lookup(tmp_path, monkeypatch):
    argv = cw.scope_argv(["python", "-m", "w"], 5 * MB, "expertcache-1-ab.scope", user=False)
    assert argv[:5] == ["systemd-run", "--scope", "--quiet", "--collect", "--unit=expertcache-1-ab.scope"]
    assert "MemoryMax=5000000" in argv and "MemorySwapMax=0" in argv and argv[-4:] == ["--", "python", "-m", "w"]
    assert cw.scope_argv(["x"], 1, "u.scope", user=True)[1] == "--user"
    mount, _ = _tree(tmp_path, monkeypatch)
    scope = mount / "system.slice" / "expertcache-1-ab.scope"
    scope.mkdir()
    real = cg.read_text
    monkeypatch.setattr(cg, "read_text", lambda p: ("0::/system.slice/expertcache-1-ab.scope\n", None)
                        if p == "/proc/4242/cgroup" else real(p))
    assert cw.scope_dir(4242, "expertcache-1-ab.scope", str(mount), wait_s=1.0) == str(scope)


def test_v2_limit_chain_and_enforceable_bytes(tmp_path, monkeypatch):
    mount, own = _tree(tmp_path, monkeypatch)
    (own / "memory.max").write_text("max\n")
    (own.parent / "memory.max").write_text(f"{3 * 10**9}\n")
    loc, _ = cg.locate_memory_cgroup()
    assert cw.read_limit_chain(loc) == [(str(own), None), (str(own.parent), 3 * 10**9)]
    most, what = cap.enforceable_bytes()
    assert most <= 3 * 10**9 and (str(own.parent) in what or "MemAvailable" in what)
