"""The README's examples run as written: every ``sh`` block through bash (each command in a fresh
shell) and every ``python`` block as its own script, with the project's environment first on PATH.

The examples are grouped by chapter (a ``###`` section), and the chapters run in parallel, each in
a fresh folder that holds what a clone carries that the examples read (``models/``, linked). A
chapter that reads what another one writes runs that one first, in the same folder
(:data:`NEEDS`). Every block of the README belongs to a chapter that runs
(:func:`test_every_example_belongs_to_a_chapter`).

Lines that set the environment up (``make``, ``pip install``, ``. .venv/bin/activate``) are the
ones this test stands in for, and are skipped. Commands that read ``../shared/traces`` run when the
real traces sit beside the checkout (the folder is linked beside the test's working folder) and are
skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SHARED_TRACES, ray_lock

SETUP = re.compile(r"^\s*(make\s|pip\s|python -m pip\s|\.\s+\.venv/bin/activate)")
NEEDS = {
    "In your units: bytes, bandwidth, time, memory": ["Command line"],  # olmoe.npz
    "Budgets in bytes, pin sets, batches (the tiering paper's trace side)": ["Importing routing logs"],  # run.npz
}
"""Chapter -> the chapters whose files it reads, run before it in its folder."""
WRITES = {"Command line": ["olmoe.npz"], "Importing routing logs": ["imported.npz", "routing-chunks/chunks.json"], "In your units: bytes, bandwidth, time, memory": ["mrc.svg"],
          "Offloaded Hugging Face models": ["cap.npz"], "Run an MoE bigger than your RAM": ["toy-dsv3.gguf", "served.npz"],
          "Traces larger than memory": ["kimi-chunks/chunks.json", "kimi.npz"]}
"""Chapter -> files its examples must have written."""


def readme_chapters() -> list[tuple[str, list[tuple[str, str]]]]:
    """``(title, [(language, text), ...])`` of every ``###`` chapter holding sh/python blocks, in
    order; blocks before the first ``###`` belong to the ``##`` section above them."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    out: list[tuple[str, list]] = []
    for m in re.finditer(r"^(#{2,3}) ([^\n]+)$|```(sh|python)\n(.*?)```", text, re.S | re.M):
        if m.group(1):
            out.append((m.group(2).strip(), []))
        elif out:
            out[-1][1].append((m.group(3), m.group(4)))
    return [(title, blocks) for title, blocks in out if blocks]


def commands(block: str) -> list[str]:
    """The block's commands (backslash continuations joined), setup lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
            and not SETUP.match(line)]


def run_chapter(title: str, blocks: list, work: Path, env: dict, have_shared: bool) -> int:
    ran = 0
    for i, (lang, block) in enumerate(blocks):
        if lang == "python":
            script = work / f"readme_{re.sub(r'[^a-z0-9]+', '_', title.lower())[:40]}_{i}.py"
            script.write_text(block, encoding="utf-8")
            runs = [[sys.executable, str(script)]]
        else:
            runs = [["bash", "-eo", "pipefail", "-c", cmd] for cmd in commands(block)
                    if have_shared or "../shared" not in cmd]
        for argv in runs:
            with ray_lock() if "--ray" in argv[-1] else contextlib.nullcontext():
                proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"README example failed ({title}): {argv[-1][:300]}\n{proc.stderr[-2000:]}"
            ran += 1
    return ran


CHAPTERS = readme_chapters()
RUNNABLE = [t for t, blocks in CHAPTERS if any(lang == "python" or commands(b) for lang, b in blocks)]
"""Chapters with a command to run (Quick start and Install hold only the set-up lines this test stands in for)."""


@pytest.mark.parametrize("title", RUNNABLE)
def test_readme_examples_run_as_written(title, tmp_path, request):
    pytest.importorskip("torch")  # the offload examples need the hf extra, which make test installs
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "models").symlink_to(REPO / "models", target_is_directory=True)  # committed in every clone
    have_shared = SHARED_TRACES.is_dir()
    if have_shared:
        (tmp_path / "shared").symlink_to(SHARED_TRACES.parent, target_is_directory=True)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("EXPERTCACHE_MAX_TRACE_BYTES", None)
    blocks = dict(CHAPTERS)
    for before in NEEDS.get(title, []):
        run_chapter(before, blocks[before], work, env, have_shared)
    ran = run_chapter(title, blocks[title], work, env, have_shared)
    assert ran >= 1 or not have_shared
    for name in WRITES.get(title, []):
        assert (work / name).exists(), f"{title}: the examples wrote no {name}"


def test_every_example_belongs_to_a_chapter():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    every = re.findall(r"```(sh|python)\n(.*?)```", text, re.S)
    assert sum(len(blocks) for _, blocks in CHAPTERS) == len(every) >= 20
    titles = [t for t, _ in CHAPTERS]
    assert all(n in titles for needs in NEEDS.values() for n in needs) and set(NEEDS) | set(WRITES) <= set(titles)
    assert sum(len(commands(b)) if lang == "sh" else 1 for _, blocks in CHAPTERS for lang, b in blocks) >= 25
