"""The README's examples run as written, in order, in a fresh folder: every ``sh`` block through
bash and every ``python`` block as its own script, with the project's environment first on PATH.
The folder holds what a clone carries that the examples read (``models/``, linked).

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


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced sh/python block, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(sh|python)\n(.*?)```", text, re.S)]


def commands(block: str) -> list[str]:
    """The block's commands (backslash continuations joined), setup lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
            and not SETUP.match(line)]


def test_readme_examples_run_as_written(tmp_path):
    pytest.importorskip("torch")  # the offload examples need the hf extra, which make test installs
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "models").symlink_to(REPO / "models", target_is_directory=True)  # committed in every clone
    have_shared = SHARED_TRACES.is_dir()
    if have_shared:
        (tmp_path / "shared").symlink_to(SHARED_TRACES.parent, target_is_directory=True)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("EXPERTCACHE_MAX_TRACE_BYTES", None)
    ran = 0
    for lang, block in readme_blocks():
        if lang == "python":
            script = work / f"readme_{ran}.py"
            script.write_text(block, encoding="utf-8")
            runs = [[sys.executable, str(script)]]
        else:
            runs = [["bash", "-eo", "pipefail", "-c", cmd] for cmd in commands(block)
                    if have_shared or "../shared" not in cmd]
        for argv in runs:
            with ray_lock() if "--ray" in argv[-1] else contextlib.nullcontext():
                proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"README example failed: {argv[-1][:300]}\n{proc.stderr[-2000:]}"
            ran += 1
    assert ran >= 25
    assert (work / "olmoe.npz").is_file() and (work / "cap.npz").is_file() and (work / "mrc.svg").is_file()
