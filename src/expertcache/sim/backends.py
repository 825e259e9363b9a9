"""Where parallel work runs: a local process pool (the default) or a Ray cluster (``--ray``).

``--ray auto`` joins the Ray instance this machine already runs (``RAY_ADDRESS``, or the last one
``ray start`` started) and otherwise starts a local one with ``jobs`` CPUs for the life of the
command; ``--ray ADDRESS`` joins that cluster (``ray://host:10001`` or ``host:6379``), whose
nodes must have expertcache installed. Ray is an optional extra: without it ``--ray`` is one
line saying how to install it. A Ray instance the command started is shut down when it ends; one
it joined keeps running (the command only disconnects).

A local instance's workers run at the command's own niceness (:func:`init_local`). Ray's default
starts them at nice 15, so that a cluster's raylet stays responsive; on a shared machine that
starved them: beside two CPU-bound neighbours at nice 0, a first `--ray` replay whose workers
compile their loops took 275 s against 7.8 s on a quiet machine (serial: 6.7 s beside the same
neighbours). A joined cluster keeps its own setting.

Ray retries a cluster that does not answer for ever (measured with Ray 2.60: a dead ``RAY_ADDRESS``,
a stale ``ray start`` record, and an HTTP port given as the address each waited past 200 s). So the
address a command would join is checked first (:func:`check_ray_port`: a TCP connection, then an
HTTP/2 SETTINGS frame, which every gRPC server and no HTTP/1 server sends), a cluster named or
recorded that refuses the join is the error (not a cue to start a local Ray instead), and a join
runs under a deadline of :data:`CONNECT_TIMEOUT_S` (:func:`_deadline`); each failure is one line.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import resource
import signal
import socket
import threading
from typing import Iterator

from .._text import first_line
from ..errors import ConfigError

INSTALL = "pip install 'expertcache[ray]'"
CONNECT_TIMEOUT_S = 120.0
"""How long ``ray.init`` may take to join a cluster before the command gives up in one line."""
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9)  # then an empty SETTINGS frame


def require_ray(option: str = "--ray"):
    """The ``ray`` module, or a one-line ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{option} needs Ray, which is not installed: {INSTALL}") from None
    return ray


def check_address(address: str, option: str = "--ray") -> str:
    """``auto`` or a cluster address (``host:port`` or ``ray://host:port``), else a ConfigError."""
    text = str(address).strip()
    if text == "auto":
        return text
    host, _, port = text.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{option} {address!r}: expected 'auto' or a cluster address such as 'host:6379' "
                          "or 'ray://host:10001'")
    return text


@contextlib.contextmanager
def _stderr_silenced(on: bool) -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block (a failure is then reported as our one line)."""
    if not on:
        yield
        return
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def check_ray_port(address: str, where: str = "--ray", timeout: float = 5.0) -> None:
    """A ConfigError unless ``address``'s host accepts a TCP connection on its port and answers an
    HTTP/2 preface with a SETTINGS frame, as a Ray cluster's gRPC server (GCS or Ray Client) does.

    ``where`` starts the message (the option, and where the address came from). Reads at most 9
    bytes back; any other answer, or none within ``timeout``, is refused."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(HTTP2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = sock.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
    except (socket.timeout, TimeoutError):
        head = None
    except OSError as err:
        raise ConfigError(f"{where}: cannot reach {host}:{port} ({err.strerror or type(err).__name__}); "
                          "is a Ray cluster running there?") from None
    if head is None or len(head) < 9 or head[3] != 0x4:
        said = (f"sent nothing within {timeout:g} s" if head is None else "closed the connection" if not head
                else f"sent {head!r}")
        raise ConfigError(f"{where}: {host}:{port} answers, but not as a Ray cluster (no gRPC SETTINGS frame: it "
                          f"{said}); give the GCS port (6379 by default) or ray://host:10001")


def auto_address() -> tuple[str | None, str]:
    """The cluster ``ray.init(address="auto")`` would join, and where that address comes from.

    ``RAY_ADDRESS`` first (``local``: start one), then the address the last ``ray start`` recorded
    in Ray's temp folder (``ray stop`` forgets it). ``(None, "")`` where neither names one: Ray then
    joins a cluster whose processes run here, or the command starts a local one."""
    env = os.environ.get("RAY_ADDRESS", "")
    if env and env != "auto":  # as Ray reads it: any other non-empty value, blanks too, is the address
        return env, f"RAY_ADDRESS={env}"
    try:
        from ray._private import utils
        address = utils.read_ray_address(None)
        record = utils.get_ray_address_file(None)
    except Exception:  # noqa: BLE001 - a private helper of Ray; without it Ray's own lookup stands
        return None, ""
    if not address:
        return None, ""
    return address, f"the address the last `ray start` recorded in {record}; `ray stop` forgets it"


class _Late(BaseException):
    """Raised in the main thread by :func:`_deadline`'s handler. A BaseException, as
    KeyboardInterrupt is: Ray's retry loops catch Exception (an Exception here was retried over)."""


@contextlib.contextmanager
def _deadline(seconds: float, message: str) -> Iterator[None]:
    """Raise ``ConfigError(message)`` in the main thread if the block runs past ``seconds``.

    A timer thread simulates a SIGALRM (``_thread.interrupt_main``: no signal is sent, so no system
    call is interrupted) whose handler, ours for the block, raises. Not SIGINT: a process started
    in the background by a shell inherits SIGINT ignored, and then Python has no handler for it to
    run (the first version of this waited out its block under ``make test`` run so). Ray waits
    inside its C++ client with the interpreter's lock released; the handler runs when control next
    returns to Python, within Ray's own retry period (about 30 s). Elsewhere than the main thread
    the block runs without a deadline."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    lock = threading.Lock()
    state = {"done": False}

    def late(signum, frame):
        if not state["done"]:
            raise _Late

    def fire():
        with lock:
            if not state["done"]:
                _thread.interrupt_main(signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, late)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except _Late:
        raise ConfigError(message) from None
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        signal.signal(signal.SIGALRM, previous)


def check_address_space(option: str = "--ray") -> None:
    """A ConfigError where this process runs under an address-space limit (``ulimit -v``): a local
    Ray's processes do not start under one, and ``ray.init`` then waited for them for ever, saying
    nothing."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        raise ConfigError(f"{option} auto: a local Ray does not start under an address-space limit (ulimit -v: "
                          f"{soft:,} bytes here); lift it, or join a running cluster with {option} ADDRESS")


def init_local(ray, cpus: int | None = None, **options) -> None:
    """``ray.init`` of a local instance of ``cpus`` CPUs whose workers run at this process's niceness
    (Ray's own default is 15: see the module docstring), without the dashboard."""
    ray.init(num_cpus=cpus, include_dashboard=False, _system_config={"worker_niceness": os.nice(0)}, **options)


@contextlib.contextmanager
def ray_session(address: str, cpus: int | None = None, option: str = "--ray") -> Iterator[object]:
    """A connected ``ray`` module for the ``with`` block (see the module docstring)."""
    address = check_address(address, option)
    ray = require_ray(option)
    if ray.is_initialized():  # a caller (a notebook, a test) already connected: use it as it is
        yield ray
        return
    target, source = auto_address() if address == "auto" else (address, "")
    if target not in (None, "local"):
        where = f"{option} {address}" + (f" ({source})" if source else "")
        check_ray_port(check_address(target, where), where)
    quiet = {"logging_level": "ERROR", "log_to_driver": False}
    verb = "start" if target in (None, "local") else "join"
    late = f"{option} {address}: Ray did not join {target} within {CONNECT_TIMEOUT_S:g} s"
    try:  # only a join has a deadline: a local start beside busy neighbours may be slow, and is not stuck
        with _deadline(CONNECT_TIMEOUT_S, late) if verb == "join" else contextlib.nullcontext():
            joined = False
            if target != "local":
                try:
                    with _stderr_silenced(address != "auto"):  # Ray's C++ client logs each retry to fd 2
                        ray.init(address=address, **quiet)
                    joined = True
                except ConnectionError:  # "auto" with no cluster found: start one; else a refusal
                    if target is not None:
                        raise
            if not joined:
                check_address_space(option)
                init_local(ray, cpus, **quiet)
    except ConfigError:
        _shutdown_quietly(ray)
        raise
    except Exception as err:  # noqa: BLE001 - Ray's own errors vary by version; report one line
        _shutdown_quietly(ray)
        raise ConfigError(f"{option} {address}: could not {verb} Ray: {first_line(err)}{_root_cause(err)}") from None
    try:
        yield ray
    finally:
        ray.shutdown()  # disconnects; a local instance started above stops, a joined cluster runs on


def _root_cause(err: BaseException) -> str:
    """`` (why)``: the first line of the exception at the root of ``err``'s chain, or ``""``.

    Ray's ConnectionError says where it failed and its root says why (a missing token, a version);
    where Ray pasted a traceback into a message, the traceback's last line is the why."""
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()] if cause is not err else []
    if lines and lines[0].endswith("Traceback (most recent call last):"):
        lines = lines[-1:]
    return f" ({lines[0][:200]})" if lines else ""


def _shutdown_quietly(ray) -> None:
    """Undo what a failed ``ray.init`` left connected or started (nothing, usually)."""
    if ray.is_initialized():
        with contextlib.suppress(Exception):
            ray.shutdown()
