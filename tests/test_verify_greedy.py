"""verify-greedy: random small instances, belady against the exact optimum."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertcache.bounds import FAMILIES, check_instance, make_instance, verify_greedy
from expertcache.bounds import verify as verify_module
from expertcache.bounds.instances import MAX_UNIVERSE
from expertcache.cli.main import main


def summary(report):
    d = report.to_dict()
    return {k: v for k, v in d.items() if k not in ("seconds", "jobs")}


def test_instances_are_pure_functions_of_seed_and_index():
    a, b = make_instance(7, 123), make_instance(7, 123)
    assert a.family == b.family and a.capacity == b.capacity and np.array_equal(a.groups, b.groups)
    assert not all(np.array_equal(make_instance(8, i).groups, make_instance(7, i).groups) for i in range(5))


def test_instance_shapes():
    for i in range(600):
        inst = make_instance(1, i)
        g = inst.groups
        assert inst.family == FAMILIES[i % 3]
        assert 2 <= inst.k <= 4 and 12 <= inst.tokens <= 40
        assert inst.k < inst.capacity < inst.n_items <= MAX_UNIVERSE
        assert g.min() >= 0 and g.max() < inst.n_items
        assert all(np.unique(row).size == inst.k for row in g)
        in_band = 0.25 <= inst.served_ratio <= 1 / 3
        assert in_band == ((i // 3) % 2 == 0)


def test_families_differ_in_locality():
    """Bursty demand reuses the previous token's experts more than uniform demand does."""
    def reuse(family):
        rates = []
        for i in range(FAMILIES.index(family), 900, 3):
            g = make_instance(2, i).groups
            rates.append(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(g[1:], g[:-1])]))
        return np.mean(rates)

    assert reuse("bursty") > reuse("uniform") + 0.1


def test_check_instance_sandwich():
    for i in range(300):
        c = check_instance(make_instance(3, i))
        assert c.flat <= c.optimum <= c.greedy
        assert not c.violation


def test_run_is_deterministic_across_jobs():
    one = verify_greedy(700, seed=4, jobs=1)
    two = verify_greedy(700, seed=4, jobs=2)
    assert summary(one) == summary(two)
    assert one.instances == 700 and one.mismatches == [] and one.violations == []
    assert sum(row[0] for row in one.by_family.values()) == 700
    assert 0 < one.flat_loose < 700  # the exact program did real work on some instances


def test_a_mismatch_is_reported_not_hidden(monkeypatch, capsys):
    """If the optimum ever beat belady, the run says so, shows the instance and exits 1."""
    real = verify_module.optimal_total

    def one_better(groups, capacity, **kw):
        r = real(groups, capacity, **kw)
        return type(r)(total=r.total - 1 if groups.shape[0] % 4 == 0 else r.total, peak_states=r.peak_states)

    monkeypatch.setattr(verify_module, "optimal_total", one_better)
    report = verify_greedy(60, seed=0, jobs=1)
    bad = [i for i in range(60) if make_instance(0, i).tokens % 4 == 0]
    assert bad and report.mismatches == bad
    example = report.counterexample()
    assert example["index"] == bad[0] and example["greedy_total"] == example["optimal_total"] + 1
    assert main(["verify-greedy", "-n", "60", "-j", "1", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "first counterexample" in out and "requests per token" in out


def test_cli_verify_json(capsys):
    assert main(["verify-greedy", "--instances", "90", "--jobs", "1", "--seed", "5", "--json"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    rec = json.loads(line)
    assert rec["instances"] == 90 and rec["mismatches"] == 0 and rec["counterexample"] is None
    assert set(rec["by_family"]) == set(FAMILIES) and rec["seed"] == 5


def test_cli_verify_table(capsys):
    assert main(["verify-greedy", "-n", "30", "-j", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "matched the exact optimum on all 30 instances" in out


@pytest.mark.parametrize("argv", [["verify-greedy", "-n", "0"], ["verify-greedy", "-j", "x"]])
def test_cli_verify_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2



def test_arguments_are_checked_and_the_work_is_handed_out_lazily(monkeypatch):
    """jobs=2.5 had started 2 processes, seed=inf ended as OverflowError, instances=0 reported an
    empty check, and every unit was listed before the first ran: 10**30 instances took the whole
    machine's memory. The first unit now runs at once, whatever the count."""
    for kwargs in ({"instances": 0}, {"instances": 2.5}, {"instances": True}, {"instances": 2**70}, {"jobs": 0},
                   {"jobs": 2.5}, {"jobs": float("inf")}, {"seed": -1}, {"seed": float("inf")}, {"seed": 2**63}):
        with pytest.raises(verify_module.ConfigError, match="verify_greedy: .* must be an integer"):
            verify_greedy(**{"instances": 10, **kwargs})

    class Stop(Exception):
        pass

    seen = []

    def first_unit_only(unit):
        seen.append(unit)
        raise Stop

    monkeypatch.setattr(verify_module, "_check_unit", first_unit_only)
    with pytest.raises(Stop):
        verify_greedy(2**62, seed=3, jobs=1)
    assert seen == [(3, 0, verify_module.CHUNK)]
