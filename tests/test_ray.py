"""The Ray backend (``--ray``): grid rows and stream-parallel replay equal to the process pool's
and to serial replay, on a local Ray of 2 CPUs (skipped, with the reason, where Ray can't start)."""

from __future__ import annotations

import json

import pytest

from expertcache.cli.main import main
from expertcache.errors import ConfigError
from expertcache.sim import build_layout, replay_layout
from expertcache.sim.backends import init_local
from expertcache.sim.parallel import StreamReplayer
from expertcache.trace.synth import synthesize_preset

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'expertcache[ray]')")
pytest.importorskip("pyarrow")

from expertcache.grid import load_spec  # noqa: E402
from expertcache.grid.runner import run_grid  # noqa: E402
from expertcache.grid.store import Store  # noqa: E402
from conftest import GRID_CELLS, GRID_SPEC as SPEC, ray_lock, strip_seconds as strip  # noqa: E402

@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 2 CPUs for the module; ``ray_session`` uses a connection already made."""
    with ray_lock():  # no other test worker's --ray auto joins this cluster while it lives
        try:
            init_local(ray, 2, logging_level="ERROR", log_to_driver=False)
        except Exception as err:  # noqa: BLE001 - any reason Ray can't start here is a skip, said
            pytest.skip(f"a local Ray could not start here: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        yield ray
        ray.shutdown()


def test_a_local_rays_workers_run_at_our_niceness(local_ray):
    """Ray starts workers at nice 15 unless told; beside busy neighbours they then crawl (sim/backends)."""
    import os

    @local_ray.remote
    def niceness():
        return os.nice(0)

    assert local_ray.get(niceness.remote()) == os.nice(0)


def test_grid_on_ray_equals_the_process_pool(local_ray, grid):
    spec = load_spec(grid / "grid.toml")
    on_ray = run_grid(spec, grid / "ray", jobs=2, ray="auto")
    run_grid(spec, grid / "pool", jobs=2)
    rows = Store(grid / "ray").read_rows()
    assert on_ray["computed"] == len(rows) == GRID_CELLS
    assert strip(rows) == strip(Store(grid / "pool").read_rows())
    again = run_grid(spec, grid / "ray", jobs=2, ray="auto")  # resumes: nothing left to compute
    assert (again["skipped"], again["computed"]) == (on_ray["cells"], 0)


def test_grid_cell_error_on_ray_is_one_line(local_ray, grid):
    (grid / "grid.toml").write_text(SPEC.replace("capacities = [8, 12]", "capacities = [2]"))
    with pytest.raises(ConfigError) as err:
        run_grid(load_spec(grid / "grid.toml"), grid / "res", jobs=2, ray="auto")
    assert "\n" not in str(err.value) and "capacity 2 is below" in str(err.value)


@pytest.mark.parametrize("pool, reset, warm", [("layer", "sequence", 0.0), ("global", "sequence", 0.3),
                                               ("layer", "none", 0.5)])
def test_stream_parallel_replay_on_ray_equals_serial(local_ray, pool, reset, warm):
    trace = synthesize_preset("olmoe", 0, tokens=50, sequences=3, num_layers=4)
    layout = build_layout(trace, pool=pool, reset=reset, warm=warm)
    policies = ["lru", "belady", "foresight:4", "decayed:0.9", "random:3"]
    with StreamReplayer(layout, 2, ray="auto") as rp:
        for capacity in (12, 20):
            got = rp.replay(capacity, policies)
            want = [replay_layout(layout, capacity, p) for p in policies]
            assert [strip([r.to_dict()]) for r in got] == [strip([r.to_dict()]) for r in want]


def test_cli_replay_ray_matches_serial(local_ray, tmp_path, capsys):
    path = synthesize_preset("olmoe", 1, tokens=40, sequences=2, num_layers=4).save(tmp_path / "t.npz")

    def records(*extra):
        assert main(["replay", str(path), "-c", "16", "-p", "lru", "-p", "belady", "--json", *extra]) == 0
        return strip([json.loads(line) for line in capsys.readouterr().out.splitlines()])

    assert records("--ray", "auto", "--jobs", "2") == records()


def test_chunks_replayed_as_ray_tasks_equal_serial(local_ray, tmp_path):
    from expertcache.sim.chunked import replay_chunked, sweep_chunked
    from expertcache.trace.chunked import ChunkWriter, open_chunked
    from expertcache.trace.synth import PRESETS, synthesize_chunks

    params = PRESETS["olmoe"].params.with_overrides(tokens=60, sequences=6)
    with ChunkWriter(tmp_path / "ch") as w:
        for piece in synthesize_chunks(params, 0, chunk_sequences=2, preset="olmoe"):
            w.add(piece)
    ct = open_chunked(tmp_path / "ch")
    serial = replay_chunked(ct, 16, ["lru", "belady"])
    on_ray = replay_chunked(ct, 16, ["lru", "belady"], jobs=2, ray="auto")
    assert strip([r.to_dict() for r in on_ray]) == strip([r.to_dict() for r in serial])
    a = sweep_chunked(ct, [8, 24], ["lru", "arc"], ray="auto")
    b = sweep_chunked(ct, [8, 24], ["lru", "arc"])
    assert [list(map(int, c.copies_steady)) for c in a] == [list(map(int, c.copies_steady)) for c in b]


def test_a_local_ray_under_an_address_space_limit_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """Under ``ulimit -v`` a local Ray's processes die at start and ``ray.init`` waited for ever,
    printing nothing (a 120 s timeout ended it): the limit is said before a local Ray is started."""
    import resource

    import expertcache.sim.backends as backends

    def no_cluster(*args, **kwargs):
        if kwargs.get("address") == "auto":
            raise ConnectionError("no running cluster")
        raise AssertionError("a local Ray was started under the limit")

    monkeypatch.setattr(ray, "init", no_cluster)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process, whatever this one holds
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster recorded by a `ray start` on this machine
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(backends.resource, "getrlimit", lambda what: (8_000_000_000, resource.RLIM_INFINITY))
    synthesize_preset("olmoe", seed=0, tokens=16, sequences=2, num_layers=2).save(tmp_path / "t.npz")
    assert main(["replay", str(tmp_path / "t.npz"), "-c", "8", "--ray", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["expertcache replay: error: --ray auto: a local Ray does not start under an address-space limit "
                   "(ulimit -v: 8,000,000,000 bytes here); lift it, or join a running cluster with --ray ADDRESS"]


@pytest.fixture
def listener():
    """A loopback TCP server that answers each connection with the bytes given (after reading the
    client's first bytes), on a thread; yields ``start(reply) -> 'host:port'``."""
    import socket
    import threading

    servers = []

    def start(reply: bytes) -> str:
        srv = socket.create_server(("127.0.0.1", 0))
        servers.append(srv)

        def serve():
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(64)
                    conn.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{srv.getsockname()[1]}"

    yield start
    for srv in servers:
        srv.close()


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """As in a process that has not connected yet, with its own Ray temp folder and no RAY_ADDRESS;
    ``ray.init`` must not be reached (the refusals below come before it)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def no_init(*args, **kwargs):
        raise AssertionError(f"ray.init was called ({kwargs.get('address')})")

    monkeypatch.setattr(ray, "init", no_init)
    synthesize_preset("olmoe", seed=0, tokens=16, sequences=2, num_layers=2).save(tmp_path / "t.npz")
    return tmp_path


@pytest.fixture
def refusing_port():
    """A loopback port that refuses connections for the test's length: bound, never listening (so
    no other process can take it meanwhile)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_dead_ray_address_is_one_line_before_ray_waits(fresh_process, monkeypatch, capsys, refusing_port):
    """Ray 2.60 retried a dead ``RAY_ADDRESS`` for ever under ``--ray auto`` (past 200 s, printing a
    warning every 5 s): the address is tried first."""
    port = refusing_port
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert main(["replay", str(fresh_process / "t.npz"), "-c", "8", "--ray", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"expertcache replay: error: --ray auto (RAY_ADDRESS=127.0.0.1:{port}): cannot reach "
                   f"127.0.0.1:{port} (Connection refused); is a Ray cluster running there?"]



@pytest.mark.parametrize("value", ["  ", "host", "127.0.0.1:99999"])
def test_a_ray_address_that_is_no_address_is_one_line(fresh_process, monkeypatch, capsys, value):
    """Ray reads any non-empty ``RAY_ADDRESS`` but ``auto`` as the address (blanks too: it said
    "Invalid address format:" and nothing more); it is checked as ``--ray ADDRESS`` is."""
    monkeypatch.setenv("RAY_ADDRESS", value)
    assert main(["replay", str(fresh_process / "t.npz"), "-c", "8", "--ray", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    said = (f"expertcache replay: error: --ray auto (RAY_ADDRESS={value}) {value!r}: expected 'auto' or a "
            "cluster address such as 'host:6379' or 'ray://host:10001'")
    assert err == [" ".join(said.split())]  # an error line folds white space

def test_a_stale_ray_start_record_is_one_line(fresh_process, capsys, refusing_port):
    """A ``ray start`` whose cluster died (killed, not stopped) leaves its address recorded in Ray's
    temp folder, and ``ray.init(address="auto")`` waited on it for ever."""
    port = refusing_port
    (fresh_process / "ray").mkdir()
    (fresh_process / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}\n")
    assert main(["replay", str(fresh_process / "t.npz"), "-c", "8", "--ray", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("expertcache replay: error: --ray auto (the address the last `ray start` recorded in ")
    assert err[0].endswith(f"ray_current_cluster; `ray stop` forgets it): cannot reach 127.0.0.1:{port} "
                           "(Connection refused); is a Ray cluster running there?")


@pytest.mark.parametrize("reply, said", [
    (b"HTTP/1.0 400 Bad Request\r\n\r\n", "sent b'HTTP/1.0 '"),
    (b"", "closed the connection"),
])
def test_a_port_that_is_not_ray_is_one_line(fresh_process, listener, capsys, reply, said):
    """An HTTP port (the dashboard's 8265, say) given as the cluster: Ray waited for ever."""
    address = listener(reply)
    assert main(["replay", str(fresh_process / "t.npz"), "-c", "8", "--ray", address]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"expertcache replay: error: --ray {address}: {address} answers, but not as a Ray cluster (no gRPC "
                   f"SETTINGS frame: it {said}); give the GCS port (6379 by default) or ray://host:10001"]


def test_the_probe_accepts_a_running_clusters_gcs(local_ray):
    """The same check passes on a real Ray's GCS (the local one of this module)."""
    from expertcache.sim.backends import check_ray_port

    check_ray_port(local_ray.get_runtime_context().gcs_address)


def test_a_cluster_that_refuses_auto_is_reported_not_replaced_by_a_local_one(fresh_process, listener, monkeypatch,
                                                                              capsys):
    """``--ray auto`` starts a local Ray only where no cluster is named or recorded: a named one that
    refuses (here a missing token, as Ray 2.60 says it) is the error, with the reason at its root."""
    import expertcache.sim.backends as backends

    settings = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # an empty HTTP/2 SETTINGS frame, as gRPC sends first
    address = listener(settings)
    monkeypatch.setenv("RAY_ADDRESS", address)

    def refused(*args, **kwargs):
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
                               '  File "x.py", line 1\nAuthenticationError: InvalidAuthToken: token is missing')
        except RuntimeError as err:
            raise ConnectionError(f"Failed to connect to Ray cluster at {address}") from err

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setattr(backends, "init_local", lambda *a, **k: pytest.fail("a local Ray was started instead"))
    assert main(["replay", str(fresh_process / "t.npz"), "-c", "8", "--ray", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"expertcache replay: error: --ray auto: could not join Ray: Failed to connect to Ray cluster at "
                   f"{address} (AuthenticationError: InvalidAuthToken: token is missing)"]


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_the_deadline_interrupts_a_wait_in_one_line_and_leaves_nothing_behind(sigint):
    """``ray.init`` runs under a deadline; a block that ends in time gets no stray interrupt later,
    and the previous SIGALRM handler is back. It holds where SIGINT is ignored, as in a process a
    shell started in the background (an interrupt by SIGINT had waited out the block there), and
    through a retry loop that catches Exception, as Ray's do."""
    import signal
    import time

    from expertcache.sim.backends import _deadline

    sigint_before = signal.signal(signal.SIGINT, signal.SIG_IGN) if sigint == "ignored" else None
    try:
        before = signal.getsignal(signal.SIGALRM)
        start = time.monotonic()
        with pytest.raises(ConfigError, match="^late$"):
            with _deadline(0.2, "late"):
                while time.monotonic() - start < 30:
                    try:
                        time.sleep(0.01)
                    except Exception:  # noqa: BLE001 - as Ray's retry loops do: the deadline gets through
                        pass
        assert time.monotonic() - start < 10
        with _deadline(0.2, "late"):
            pass
        time.sleep(0.5)  # past the deadline: a stray exception here would fail the test
        assert signal.getsignal(signal.SIGALRM) == before
    finally:
        if sigint_before is not None:
            signal.signal(signal.SIGINT, sigint_before)
