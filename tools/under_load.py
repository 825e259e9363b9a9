"""Run chosen tests N times beside a busy neighbour, and count passes (the load harness).

    python tools/under_load.py --runs 20 [--burners 2] [--disk-reader] [--json] -- -n 2 --dist loadfile tests/test_x.py

Each run is one ``pytest`` (the arguments after ``--``) while ``--burners`` CPU-bound processes spin
(pure Python arithmetic, one core each) and, with ``--disk-reader``, one process reads a scratch file
with ``O_DIRECT`` in 4 MiB requests (device bandwidth taken, page cache untouched). The neighbours
start before the first run and stop after the last. Per run: the exit status, the passed / failed /
error / skipped counts (from pytest's JUnit XML) and the seconds; then the totals, and the failing
test ids with how often each failed. Nothing is retried: a run that fails is a failure.

With ``--fresh-clone``, each run is what CI does on a clean machine: ``git clone`` of this checkout
beside it (so ``../shared`` is found as it is here), checked out at the commit HEAD named when the
harness started (commits made meanwhile do not change what later runs test), the Makefile's install
(timed on its own and not counted), then ``make test`` (the pytest arguments after ``--`` are not
used; ``make test`` is the measure). The clone is removed after the run.

    python tools/under_load.py --fresh-clone --runs 5 --burners 2
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def burn(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(200_000):
            x = (x * 1103515245 + i) % 2147483648


def read_direct(stop, path: str, size: int) -> None:
    """Read ``path`` over and over with O_DIRECT in 4 MiB aligned requests."""
    block = 4 << 20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        while not stop.is_set():
            for off in range(0, size - block + 1, block):
                if stop.is_set():
                    break
                os.preadv(fd, [buf], off)
    finally:
        os.close(fd)


def counts(xml_path: str) -> dict:
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors, "skipped": skipped,
            "failures": bad}


def fresh_clone_run(xml: str, commit: str):
    """Clone this checkout beside it at ``commit``, install with the Makefile, run ``make test``:
    ``(process, {"seconds": make test's, "install_seconds": the install's})``; the clone is removed after."""
    clone = Path(tempfile.mkdtemp(prefix=".under-load-clone-", dir=REPO.parent))
    try:
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        t0 = time.monotonic()
        stamp = subprocess.run(["make", "-s", "-f", "-", "stamp"], cwd=clone, input="include Makefile\nstamp:\n\t@echo $(TEST_STAMP)\n",
                               capture_output=True, text=True, check=True).stdout.strip()
        done = subprocess.run(["make", stamp], cwd=clone, capture_output=True, text=True)
        install = round(time.monotonic() - t0, 1)
        if done.returncode != 0:
            return done, {"seconds": 0.0, "install_seconds": install}
        env = dict(os.environ, PYTEST_ADDOPTS=f"--junitxml={xml} -p no:cacheprovider")
        t0 = time.monotonic()
        done = subprocess.run(["make", "test"], cwd=clone, env=env, capture_output=True, text=True)
        return done, {"seconds": round(time.monotonic() - t0, 1), "install_seconds": install}
    finally:
        subprocess.run(["rm", "-rf", str(clone)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="pytest runs (default 20)")
    p.add_argument("--burners", type=int, default=2, help="CPU-bound neighbours, one core each (default 2)")
    p.add_argument("--disk-reader", action="store_true", help="also an O_DIRECT reader of a scratch file")
    p.add_argument("--disk-mb", type=int, default=1024, help="size of the reader's scratch file (default 1024 MB)")
    p.add_argument("--json", action="store_true", help="one JSON object per run, then the totals")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="write each failing run's pytest output to DIR (with --fresh-clone: every run's)")
    p.add_argument("--fresh-clone", action="store_true",
                   help="each run: clone this checkout's HEAD (as it was at the start) beside it, install with the Makefile, "
                        "time 'make test' there")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest arguments")
    args = p.parse_args(argv)
    pytest_args = [a for a in args.pytest_args if a != "--"] or ["tests"]
    if args.runs < 1 or args.burners < 0:
        p.error("--runs must be >= 1 and --burners >= 0")
    commit = None
    if args.fresh_clone:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        if head.returncode != 0:
            p.error(f"--fresh-clone: {REPO} is not a git checkout ({head.stderr.strip()})")
        commit = head.stdout.strip()
        print(f"fresh clones of {commit[:12]} beside {REPO}", flush=True)
    stop = mp.Event()
    workers = [mp.Process(target=burn, args=(stop,), daemon=True) for _ in range(args.burners)]
    scratch = None
    if args.disk_reader:
        scratch = tempfile.NamedTemporaryFile(prefix="under-load-", suffix=".bin", dir=REPO.parent, delete=False)
        chunk = os.urandom(1 << 20)
        for _ in range(args.disk_mb):
            scratch.write(chunk)
        scratch.close()
        os.sync()
        workers.append(mp.Process(target=read_direct, args=(stop, scratch.name, args.disk_mb << 20), daemon=True))
    for w in workers:
        w.start()
    results, failing = [], {}
    try:
        for run in range(1, args.runs + 1):
            with tempfile.TemporaryDirectory() as tmp:
                xml = os.path.join(tmp, "junit.xml")
                extra = {}
                if args.fresh_clone:
                    done, extra = fresh_clone_run(xml, commit)
                else:
                    t0 = time.monotonic()
                    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                           f"--junitxml={xml}", *pytest_args], cwd=REPO, capture_output=True, text=True)
                    extra = {"seconds": round(time.monotonic() - t0, 1)}
                rec = {"run": run, "returncode": done.returncode, **extra, **counts(xml)}
            for t in rec["failures"]:
                failing[t] = failing.get(t, 0) + 1
            if args.keep and (done.returncode != 0 or args.fresh_clone):  # a fresh clone's output: its slowest tests
                os.makedirs(args.keep, exist_ok=True)
                Path(args.keep, f"run-{run}.txt").write_text(done.stdout + done.stderr, encoding="utf-8")
            results.append(rec)
            if args.json:
                print(json.dumps(rec), flush=True)
            else:
                print(f"run {run}/{args.runs}: rc {rec['returncode']}, {rec['passed']} passed, {rec['failed']} failed, "
                      f"{rec['errors']} errors, {rec['skipped']} skipped, {rec['seconds']} s"
                      + (f" (install {rec['install_seconds']} s, not counted)" if "install_seconds" in rec else "")
                      + (f"; failed: {', '.join(rec['failures'])}" if rec["failures"] else ""), flush=True)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
        if scratch is not None:
            os.unlink(scratch.name)
    green = sum(r["returncode"] == 0 for r in results)
    summary = {"runs": len(results), "green_runs": green, "burners": args.burners, "disk_reader": args.disk_reader,
               "pytest_args": ["make test (fresh clone)"] if args.fresh_clone else pytest_args, "failing_tests": failing,
               "seconds": [r["seconds"] for r in results]}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{green} of {len(results)} runs green beside {args.burners} CPU burner(s)"
              + (" and an O_DIRECT reader" if args.disk_reader else "")
              + (f"; failing tests: {failing}" if failing else ""))
    return 0 if green == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
