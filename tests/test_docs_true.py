"""The documentation says true things (issue 24, item 8): every policy string written in README.md
and docs/*.md parses, every option default the docs state is the one ``--help`` states, and the
stale claims found by a new user stay fixed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from expertcache.cli.main import build_parser
from expertcache.errors import ExpertcacheError
from expertcache.policies import available_policies, make_policy

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HOLDING = ("dwell", "prefix", "static", "controller")
NAMES = "|".join(re.escape(n) for n in sorted({*available_policies(), *HOLDING}, key=len, reverse=True))
SPEC = rf"(?:{NAMES})(?::[^\s`'\"|),\]]*)?"
POLICY_STRINGS = [
    re.compile(rf"(?:-p|--policy|--replay-policy)[ =]({SPEC})"),  # on command lines
    re.compile(rf"`({SPEC})`"),                                      # in prose
    re.compile(rf"\"({SPEC})\""),                                    # in Python examples
]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _policy_strings() -> dict[str, str]:
    found = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for pat in POLICY_STRINGS:
            for m in pat.finditer(text):
                found.setdefault(m.group(1).rstrip(".:"), f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}")
    return found


def _concrete(spec: str) -> bool:
    """A spec with real values (``decayed:0.9``, ``learned:scorer.npz``), not a template
    (``decayed:b``, ``dwell:k[:w]``, ``learned:PATH``, ``foresight:1/2/4``)."""
    name, *params = spec.split(":")
    if not params and name in ("learned", "controller", "dwell", "prefix"):  # the family's name in prose
        return False
    if name in ("learned", "controller"):
        path, params = params[0], params[1:]
        if not re.fullmatch(r"[\w./-]+\.(npz|pt)", path):
            return False
    return all(_NUMBER.fullmatch(p) for p in params)


def _parses(spec: str) -> None:
    name, *params = spec.split(":")
    if name == "learned":  # the scorer file is written by an earlier example: check the syntax only
        assert len(params) == 1 and params[0].endswith(".npz"), spec
        return
    if name == "controller":  # controller:HEADS.pt:THR[:W]; the heads file comes from 'controller train'
        assert len(params) in (2, 3) and params[0].endswith(".pt") and float(params[1]) >= 0, spec
        return
    try:
        make_policy(spec)
        return
    except ExpertcacheError:
        if name not in HOLDING:
            raise
    pytest.importorskip("torch")
    from expertcache.hf.holding import parse_holding

    assert parse_holding(spec) is not None, spec


def test_the_docs_name_policies():
    specs = _policy_strings()
    assert {"lru", "belady", "decayed:0.95", "foresight:16", "dwell:16:128", "prefix:64", "learned:scorer.npz",
            "controller:heads.pt:0.5"} <= set(specs)


@pytest.mark.parametrize("spec, where", sorted(_policy_strings().items()))
def test_every_policy_string_in_the_docs_parses(spec, where):
    name = spec.split(":")[0]
    assert name in available_policies() or name in HOLDING, f"{where}: {spec}"
    if _concrete(spec):
        _parses(spec)


# ------------------------------------------------------------------------------------ defaults
DEFAULT = re.compile(r"`(--[a-z][a-z0-9-]*)(?:[ =][^`]*)?`[^`.;]{0,60}?\(?\bdefault\b:? "
                     r"(\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)(?! x )")


def _documented_defaults() -> list[tuple[str, str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in DEFAULT.finditer(text):
            where = f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}"
            out.append((m.group(1), m.group(2).rstrip(",").replace(",", ""), where))
    return out


def _options() -> dict[str, list]:
    """Every option string of every (sub)command: its argparse actions."""
    found: dict[str, list] = {}

    def walk(parser):
        for action in parser._actions:
            for opt in action.option_strings:
                found.setdefault(opt, []).append(action)
            for sub in getattr(action, "choices", None) or {}:
                if isinstance(action.choices, dict):
                    walk(action.choices[sub])

    walk(build_parser())
    return found


def _same(value: str, action) -> bool:
    helps = re.findall(r"default:? (\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)", (action.help or "").replace("\n", " "))
    shown = [h.rstrip(",").replace(",", "") for h in helps] + [str(action.default)]
    try:
        return any(float(s) == float(value) for s in shown if _NUMBER.fullmatch(s))
    except ValueError:
        return False


def test_the_docs_state_defaults():
    assert len(_documented_defaults()) >= 15


@pytest.mark.parametrize("option, value, where", _documented_defaults())
def test_every_documented_default_is_the_one_help_states(option, value, where):
    actions = _options().get(option)
    if actions is None:
        pytest.fail(f"{where}: {option} is documented but no command has it")
    assert any(_same(value, a) for a in actions), \
        f"{where}: docs say {option} defaults to {value}; --help says " + \
        "; ".join(f"{a.default!r} ({a.help})" for a in actions)


# ------------------------------------------------------------------------------------ stale claims
def test_the_stale_claims_stay_fixed():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    offload = (ROOT / "docs" / "offload.md").read_text(encoding="utf-8")
    tier_row = next(line for line in readme.splitlines() if line.startswith("| **tier**"))
    assert "not yet" not in tier_row and "expertcache tier" in tier_row
    assert "learned set controller is not implemented" not in offload
    layout = readme[readme.index("## Layout"):readme.index("## Measured")]
    assert layout.count("runner.py") == 1 and "engine-jsonl" in layout
    measured = readme[readme.index("## Measured"):readme.index("## Tests")]
    assert "the predicted winner equals the measured one at\n  50×" not in measured
    assert "tie" in measured


def test_readme_examples_do_not_reuse_one_output_for_two_traces():
    """A file written by two README examples with different content (small.npz was both a synthetic
    trace and a captured one) breaks rerunning the first: every --out/--capture is written by one
    example only, unless it is the same command."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    writers: dict[str, set[str]] = {}
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for m in re.finditer(r"(?:--out|--capture|-o)[ =](\S+)", line):
                writers.setdefault(m.group(1), set()).add(line.split()[1] if len(line.split()) > 1 else line)
    shared = {path: cmds for path, cmds in writers.items() if len(cmds) > 1}
    assert not shared, f"written by more than one command: {shared}"
