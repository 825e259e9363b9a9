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
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
from typing import Iterator

from ..errors import ConfigError

INSTALL = "pip install 'expertcache[ray]'"


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


def check_reachable(address: str, option: str = "--ray", timeout: float = 5.0) -> None:
    """A ConfigError unless ``address``'s host accepts a TCP connection on its port (Ray itself
    retries an unreachable cluster for minutes, printing warnings)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConfigError(f"{option} {address}: cannot reach {host}:{port} "
                          f"({err.strerror or type(err).__name__}); is a Ray cluster running there?") from None


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
    if address != "auto" and not ray.is_initialized():
        check_reachable(address, option)
    quiet = {"logging_level": "ERROR", "log_to_driver": False}
    if ray.is_initialized():  # a caller (a notebook, a test) already connected: use it as it is
        yield ray
        return
    try:
        try:
            with _stderr_silenced(address != "auto"):  # Ray's C++ client logs each retry to fd 2
                ray.init(address=address, **quiet)
        except ConnectionError:
            if address != "auto":
                raise
            check_address_space(option)
            init_local(ray, cpus, **quiet)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - Ray's own errors vary by version; report one line
        from .._text import first_line

        raise ConfigError(f"{option} {address}: could not {'start' if address == 'auto' else 'join'} Ray: "
                          f"{first_line(err)}") from None
    try:
        yield ray
    finally:
        ray.shutdown()  # disconnects; a local instance started above stops, a joined cluster runs on
