"""Entry point: ``expertcache <command> ...``.

Each command lives in its own module exposing ``add_parser(subparsers)``, which registers the
subcommand and sets ``func(args) -> int`` as its handler. User mistakes raise
:class:`~expertcache.errors.ExpertcacheError`; they are printed as one line and exit with 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ..errors import ExpertcacheError

COMMAND_MODULES = [
    "replay_cmd",
    "trace_cmds",
    "bounds_cmd",
    "synth_cmd",
    "stats_cmd",
    "curves_cmd",
    "eval_cmd",
    "demo_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertcache",
        description="Measure, bound and run expert caches for offloaded mixture-of-experts models.",
    )
    parser.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ExpertcacheError as err:
        print(f"expertcache {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("expertcache: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
