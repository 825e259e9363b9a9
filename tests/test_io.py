"""Atomic writes: a missing folder is named, a killed writer leaves nothing behind after the next
run, and a live writer's temporary is never touched. Bounded JSON reads: every malformed file is one
line naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import expertcache as ec
from expertcache._io import atomic_open, clean_stale_temporaries, read_json
from expertcache.errors import ConfigError

KILLED_WRITER = """
import os, sys
from expertcache._io import atomic_open
cm = atomic_open(sys.argv[1], "wb")
fh = cm.__enter__()
fh.write(b"partial " * 1000)
fh.flush()
os.kill(os.getpid(), 9)   # killed mid-write: no cleanup can run
"""


def test_killed_writer_leaves_no_partial_file_and_the_next_run_removes_its_temporary(tmp_path):
    target = tmp_path / "t.npz"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(target)], capture_output=True)
    assert proc.returncode == -9
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert not target.exists() and len(leftovers) == 1 and leftovers[0].startswith(".t.npz.")
    path = ec.Trace.from_arrays(np.array([[0, 1], [2, 3]]), num_experts=4).save(target)  # the next run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]
    assert ec.load_trace(path).num_tokens == 2


ABORTED_WRITER = """
import ctypes, sys
from expertcache._io import atomic_open
from expertcache.llama.ggml import _libggml_base, abort_in_one_line
abort_in_one_line("m.gguf")
lib, _ = _libggml_base()
lib.ggml_abort.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
with atomic_open(sys.argv[1], "wb") as fh:
    fh.write(b"partial " * 1000)
    fh.flush()
    lib.ggml_abort(b"/src/ggml-quants.c", 7, b"a check failed")  # as a GGML_ASSERT inside llama.cpp stops
"""


def test_an_abort_inside_llama_cpp_removes_the_temporaries_being_written(tmp_path):
    """ggml's abort callback ends the process with os._exit, which runs no ``finally``: it removes
    the outputs' temporaries itself (an abort in llama.cpp's quantizer had left its ``.tmp``)."""
    pytest.importorskip("llama_cpp")
    target = tmp_path / "q.gguf"
    proc = subprocess.run([sys.executable, "-c", ABORTED_WRITER, str(target)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "expertcache: error: MODEL m.gguf: llama.cpp stopped on it (ggml-quants.c:7: a check failed)"]
    assert list(tmp_path.iterdir()) == []


TERMINATED_WRITER = """
import os, signal, sys
import numpy as np
from expertcache.cli.main import main
real = np.savez_compressed
def terminated(fh, **arrays):
    fh.write(b"partial " * 1000)
    fh.flush()
    os.kill(os.getpid(), signal.SIGTERM)  # a service manager stopping the run mid-write
    real(fh, **arrays)
np.savez_compressed = np.savez = terminated
sys.exit(main(sys.argv[1:]))
"""


def test_a_terminated_command_removes_its_temporary_and_says_so(tmp_path):
    """SIGTERM (and SIGHUP) end a command like Ctrl-C: ``finally`` blocks run, the atomic write removes
    its temporary, one line says so, and the exit status is 128 + the signal's number."""
    target = tmp_path / "t.npz"
    proc = subprocess.run([sys.executable, "-c", TERMINATED_WRITER, "synth", "--preset", "olmoe", "--tokens", "5",
                           "--sequences", "2", "--out", str(target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143 and proc.stderr.strip() == "expertcache: terminated (SIGTERM)", proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_full_disk_names_the_output_and_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails for want of room (ENOSPC, EDQUOT, EFBIG) is one line naming the option and
    the output: zipfile's close raised it naming no file."""
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ConfigError, match=r"^--capture .*c\.npz: cannot write it \(No space left on device\)$"):
        with atomic_open(tmp_path / "c.npz", "wb", option="--capture") as fh:
            fh.write(b"x" * 100)
    assert list(tmp_path.iterdir()) == []


def test_a_live_writers_temporary_is_kept(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = tmp_path / f".t.npz.{sleeper.pid}.0123abcd.tmp"
        live.write_bytes(b"being written")
        dead = tmp_path / f".t.npz.{_dead_pid()}.89abcdef.tmp"
        dead.write_bytes(b"orphan")
        other = tmp_path / f".u.npz.{_dead_pid()}.89abcdef.tmp"  # another target's: not ours to judge here
        other.write_bytes(b"orphan of u")
        assert clean_stale_temporaries(tmp_path / "t.npz") == [dead]
        assert live.exists() and other.exists() and not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait()



def test_stale_temporary_folders_go_by_their_suffix(tmp_path):
    """``clean_stale_temporaries(path, *suffixes)``: a dead writer's folder goes with all it holds
    (a checkpoint being saved, a chunked trace's ``.partial``); another suffix's stays."""
    pid = _dead_pid()
    folder = tmp_path / f".out.{pid}.0123abcd.tmp"
    (folder / "inner").mkdir(parents=True)
    (folder / "inner" / "w.bin").write_bytes(b"x")
    partial = tmp_path / f".out.{pid}.0123abcd.partial"
    partial.mkdir()
    assert clean_stale_temporaries(tmp_path / "out") == [folder]
    assert not folder.exists() and partial.exists()
    assert clean_stale_temporaries(tmp_path / "out", "partial") == [partial]
    assert list(tmp_path.iterdir()) == []
    # several suffixes in one pass (a chunked trace's writer: its .partial and .old); others stay
    made = [tmp_path / f".out.{pid}.0123abcd.{s}" for s in ("partial", "old", "tmp")]
    for p in made:
        p.mkdir()
    assert sorted(clean_stale_temporaries(tmp_path / "out", "partial", "old")) == sorted(made[:2])
    assert list(tmp_path.iterdir()) == [made[2]]

def test_missing_folder_and_folder_targets_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=f"folder {tmp_path / 'nope'} does not exist"):
        with atomic_open(tmp_path / "nope" / "x.npz", "wb"):
            pass
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(ConfigError, match="is a folder, expected a file name"):
        with atomic_open(tmp_path / "d.npz", "wb"):
            pass
    assert not (tmp_path / "nope").exists()


def test_an_exception_removes_the_temporary_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "x.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_open(target, "w") as fh:
            fh.write("new, half")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"] and target.read_text() == "old"


def test_written_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_open(tmp_path / "x.txt", "w") as fh:
            fh.write("x")
    finally:
        os.umask(old)
    assert (tmp_path / "x.txt").stat().st_mode & 0o777 == 0o644


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    time.sleep(0.05)
    return proc.pid


def test_machine_errors_and_bugs_are_one_line(monkeypatch, capsys, tmp_path):
    """A full disk is the machine's fault (exit 2, one line naming the file); an unexpected
    exception is a bug (exit 70, one line asking for a report, no traceback)."""
    from expertcache.cli import stats_cmd
    from expertcache.cli.main import main

    monkeypatch.delenv("EXPERTCACHE_DEBUG", raising=False)  # with it, these errors raise their tracebacks on purpose

    def full_disk(args):
        raise OSError(28, "No space left on device", str(tmp_path / "t.npz"))

    monkeypatch.setattr(stats_cmd, "run", full_disk)
    assert main(["stats", "t.npz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"expertcache stats: error: {tmp_path / 't.npz'}: No space left on device"]

    def no_memory(args):  # a system call's error names no file: the line says where it was raised
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(stats_cmd, "run", no_memory)
    assert main(["stats", "t.npz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["expertcache stats: error: Cannot allocate memory (in test_io.py:"
                   f"{no_memory.__code__.co_firstlineno + 1}, no_memory)"]

    def bug(args):
        raise KeyError("oops")

    monkeypatch.setattr(stats_cmd, "run", bug)
    monkeypatch.delenv("EXPERTCACHE_DEBUG", raising=False)
    assert main(["stats", "t.npz"]) == 70
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error (a bug in expertcache" in err[0] and "KeyError" in err[0]
    monkeypatch.setenv("EXPERTCACHE_DEBUG", "1")
    with pytest.raises(KeyError):
        main(["stats", "t.npz"])


# ------------------------------------------------------------------------------------ progress
class _Terminal:
    """A stand-in stderr that says it is a terminal and keeps what is written to it."""

    def __init__(self, tty: bool = True):
        self.tty, self.text = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text.append(s)
        return len(s)

    def flush(self):
        pass


@pytest.mark.parametrize("tty,disable,shown", [(True, False, True), (True, True, False), (False, False, False)])
def test_progress_is_on_stderr_only_on_a_terminal_and_not_when_disabled(monkeypatch, capsys, tty, disable, shown):
    from expertcache._progress import progress

    term = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", term)
    assert list(progress(range(4), desc="work", disable=disable)) == [0, 1, 2, 3]
    with progress(total=3, desc="manual", disable=disable) as bar:
        bar.update(2)
        bar.update(1)
    text = "".join(term.text)
    assert ("work" in text and "/4" in text and "manual" in text and "/3" in text) == shown
    assert shown or text == ""
    assert capsys.readouterr().out == ""  # never on stdout


def test_verify_greedy_and_learn_eval_show_progress_on_a_terminal_and_not_with_json(monkeypatch, capsys, tmp_path):
    from expertcache.cli.main import main
    from test_learn import rich_trace

    term = _Terminal(True)
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["verify-greedy", "-n", "300", "-j", "1"]) == 0
    assert "verify-greedy" in "".join(term.text) and "/300" in "".join(term.text)
    term.text.clear()
    assert main(["verify-greedy", "-n", "300", "-j", "1", "--json"]) == 0
    assert term.text == []
    capsys.readouterr()
    t = tmp_path / "t.npz"
    rich_trace(T=80, L=1, E=8, k=2, seqs=2, seed=3).save(t)
    assert main(["learn", "eval", "--traces", str(t), "-c", "4", "--seeds", "0", "--rounds", "0"]) == 0
    text = "".join(term.text)
    assert "learn eval" in text and "/2 " in text  # 2 folds x 1 seed
    assert "learn eval" not in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    (b"[" * 100_000 + b"]" * 100_000, "x.json is nested too deeply to read as JSON"),  # had been exit 70 in convert
    (b'{"a": 1' + b"0" * 5000 + b"}",  # Python's limit on an integer's digits
     "x.json cannot be read as JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
    (b"\xff\xfe{}", "x.json is not UTF-8 text (byte 0)"),
    (b'{"a": 1,\n "b"}', "x.json is not valid JSON (Expecting ':' delimiter at line 2)"),
    (b" " * 10**6 + b"{}", "x.json is larger than 1,000,000 bytes"),
])
def test_read_json_is_bounded_and_every_refusal_is_one_line(tmp_path, content, message):
    (tmp_path / "x.json").write_bytes(content)
    with pytest.raises(ConfigError) as err:
        read_json(tmp_path / "x.json", "here", max_bytes=10**6)
    assert str(err.value) == f"here: {message}"
    (tmp_path / "x.json").write_bytes(b' {"a": [1, 2]}\n')
    assert read_json(tmp_path / "x.json", "here", max_bytes=15) == {"a": [1, 2]}  # exactly the bound


def test_read_json_refuses_what_is_not_a_regular_file_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")  # opening it to read would wait for a writer
    (tmp_path / "dir.json").mkdir()
    for name, why in (("fifo.json", "is not a regular file"), ("dir.json", "is not a regular file"),
                      ("none.json", "cannot read none.json (No such file or directory)")):
        with pytest.raises(ConfigError) as err:
            read_json(tmp_path / name, "here", max_bytes=64)
        assert str(err.value) in (f"here: {name} {why}", f"here: {why}")
