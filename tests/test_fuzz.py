"""Fuzzing the CLI with hostile inputs: only success or one line, exit 2.

Every case is built and judged by ``tests/fuzzing.py`` (see its docstring): no traceback or
internal error, no hang, bounded memory, invalid inputs refused by every command, valid ones
accepted, and whatever is accepted found valid by an independent checker (for routing logs: the
imported trace equals an independent reading of the log). ``benchmarks/fuzz.py`` runs the same
generators for 10,000 cases.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzzing import make_case, run_case  # noqa: E402

BLOCKS = [("trace", 0, 60), ("trace", 1, 60), ("trace", 2, 60), ("log", 0, 80), ("log", 1, 80),
          ("args", 0, 100), ("sglang", 0, 30)]


@pytest.mark.parametrize("kind, seed, cases", BLOCKS, ids=[f"{k}-{s}" for k, s, _ in BLOCKS])
def test_hostile_inputs_give_success_or_one_line(tmp_path, kind, seed, cases):
    if kind == "sglang":
        pytest.importorskip("torch")  # the dumps are written with torch.save, as SGLang writes them
    rng = random.Random(f"{kind}-{seed}")
    failures, verdicts = [], []
    for i in range(cases):
        case = make_case(rng, (kind,))
        got, ok = run_case(case, tmp_path / f"c{i}")
        failures += got
        verdicts.append(ok)
    assert not failures, "\n".join(failures[:20])
    assert True in verdicts and False in verdicts  # the mix really holds accepted and refused inputs
