"""Entry point: ``expertcache <command> ...``.

Each command lives in its own module exposing ``add_parser(subparsers)``, which registers the
subcommand and sets ``func(args) -> int`` as its handler. Building the parser imports every command
module, so a command module imports what it runs inside its handler, not at its top: the 69 modules
the commands import so had taken ``expertcache --help`` from 0.7 s to 4.3 s (torch, transformers,
llama_cpp and FastAPI among them; measured beside two busy neighbours, 2026-12-05). That is why
most imports inside functions in this package are in ``cli/``.

The contract with users: whatever the input, the command either succeeds or prints ONE line on
stderr naming what is wrong and where, and exits with 2. User mistakes raise
:class:`~expertcache.errors.ExpertcacheError`; argument errors print one line too (the usage
is shown by ``--help`` only); running out of memory, a full disk or a refused permission is one
line; warnings are one line each.
Anything else is a bug in expertcache: it is reported as one line asking for a report, exit 70
(``EXPERTCACHE_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading
import warnings

from .. import __version__
from ..errors import ExpertcacheError, one_line, raised_at
from .common import refuse_overwriting_inputs

EXIT_USAGE = 2
EXIT_BUG = 70


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``expertcache replay: error: ... (see --help)``.

    Every command's parser (subparsers are of this class too) also: refuses a single-value option
    given twice (``-c 8 -c 16``) and a repeatable one given the same value twice (``-p lru -p lru``),
    instead of keeping the last or running it twice; and reads an argument that starts with a minus
    and a digit (``--budget -4GB``, ``--c -1ms``) as a value, so that its type says what is wrong
    rather than argparse's "expected one argument".
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.register("action", "append", _AppendDistinct)
        self._negative_number_matcher = _NEGATIVE_VALUE

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 (argparse API)
        namespace, rest = super().parse_known_args(args, namespace)
        vars(namespace).pop(_SEEN, None)
        return namespace, rest

    def error(self, message: str):  # noqa: D102 (argparse API)
        first = message.strip().splitlines()[0] if message.strip() else "invalid arguments"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {first} (see '{self.prog} --help')\n")


_NEGATIVE_VALUE = re.compile(r"^-\.?\d")
"""Arguments argparse takes as values, not options: a minus then a digit (-4GB, -1ms, -0.5, -.5)."""

_SEEN = "_expertcache_options_seen"


class _StoreOnce(argparse._StoreAction):
    """``store``, refusing a second occurrence of the option (or of another spelling of it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.option_strings:
            seen = vars(namespace).setdefault(_SEEN, {})
            if self.dest in seen:
                parser.error(f"{_spelling(self)} given twice ({seen[self.dest]} and {option_string} {_shown(values)}): "
                             "give it once")
            seen[self.dest] = f"{option_string} {_shown(values)}"
        super().__call__(parser, namespace, values, option_string)


class _AppendDistinct(argparse._AppendAction):
    """``append``, refusing the same value twice (a duplicate policy would be a duplicate row)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values in (getattr(namespace, self.dest, None) or ()):
            parser.error(f"{option_string} {_shown(values)} given twice: give each value once")
        super().__call__(parser, namespace, values, option_string)


def _spelling(action) -> str:
    return "/".join(action.option_strings)


def _shown(values) -> str:
    text = values if isinstance(values, str) else " ".join(map(str, values)) if isinstance(values, list) else str(values)
    return text if len(text) <= 40 else text[:37] + "..."

COMMAND_MODULES = [
    "replay_cmd",
    "import_cmd",
    "export_cmd",
    "bounds_cmd",
    "synth_cmd",
    "stats_cmd",
    "curves_cmd",
    "eval_cmd",
    "capture_cmd",
    "choose_cmd",
    "calibrate_cmd",
    "demo_cmd",
    "batch_cmd",
    "tier_cmd",
    "learn_cmd",
    "grid_cmd",
    "controller_cmd",
    "router_tune_cmd",
    "size_cmd",
    "llama_cmd",
    "convert_cmd",
    "serve_cmd",
]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's, or with ``command`` (a command's name) that
    command's only, the others registering nothing (:class:`_OnlyCommand`): building all of them
    took 29 ms a run (80 ms under tracemalloc, which the fuzz tests run every command under); a name
    no command has gets them all, so that the refusal lists them."""
    parser = Parser(
        prog="expertcache",
        description="Measure, bound and run expert caches for offloaded mixture-of-experts models.",
    )
    parser.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    only = _OnlyCommand(sub, command) if command is not None else sub
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").add_parser(only)
    if command is not None and not only.found:
        return build_parser()
    return parser


class _OnlyCommand:
    """The top-level subparsers as one command's ``add_parser`` sees them: the command ``name``'s
    parser is built; any other's is a :class:`_Skipped`, on which the module's calls build nothing."""

    def __init__(self, sub, name: str):
        self.sub, self.name, self.found = sub, name, False

    def add_parser(self, name: str, **kw):
        if name == self.name or self.name in kw.get("aliases", ()):
            self.found = True
            return self.sub.add_parser(name, **kw)
        return _Skipped()


class _Skipped:
    """A parser, group or subparsers of a command not being run: any attribute of it, and any call,
    is it again (``p.prog.endswith(...)`` too); it holds nothing to iterate."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kw):
        return self

    def __iter__(self):
        return iter(())


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that ``finally``
    blocks run and an atomic write removes its temporary (a killed run used to leave a partial
    ``.<name>.<pid>.<hex>.tmp`` beside its output)."""


def _terminate(signum, frame):
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    args = parser.parse_args(argv)
    name = f"expertcache {args.command}"
    stops = (signal.SIGTERM, signal.SIGHUP)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # a command's own handlers (serve's) replace these
        previous = {sig: signal.signal(sig, _terminate) for sig in stops}
    try:
        return _run(args, name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args, name: str) -> int:
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            refuse_overwriting_inputs(args)  # every command: no output may replace an input
            return int(args.func(args) or 0)
        except Terminated as stop:
            signum = int(stop.args[0])
            print(f"expertcache: terminated ({signal.Signals(signum).name})", file=sys.stderr)
            return 128 + signum
        except ExpertcacheError as err:
            print(f"{name}: error: {one_line(err)}", file=sys.stderr)
            return EXIT_USAGE
        except MemoryError:
            print(f"{name}: error: not enough memory for this input (try fewer layers, tokens or capacities)",
                  file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print("expertcache: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            return 0
        except OSError as err:  # the machine, not the input: a full disk, a permission, a vanished file
            if os.environ.get("EXPERTCACHE_DEBUG"):
                raise
            where = f"{err.filename}: " if err.filename else ""
            print(f"{name}: error: {where}{err.strerror or one_line(err)}{raised_at(err)}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as err:  # a bug: still one line, unless asked for the traceback
            if os.environ.get("EXPERTCACHE_DEBUG"):
                raise
            print(f"{name}: internal error (a bug in expertcache {__version__}; please report it with the command): "
                  f"{type(err).__name__}: {one_line(err)}", file=sys.stderr)
            return EXIT_BUG


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"expertcache: warning: {one_line(Warning(str(message)))}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
