"""Every policy string through one parse (policies/registry.py), checked for every registered rule the
way scikit-learn checks every estimator with one test: kind, canonical round trip, fresh clones,
and one wrong-kind line shared by every entry point."""

from __future__ import annotations

import re

import numpy as np
import pytest

import expertcache as ec
from expertcache.errors import PolicyError
from expertcache.policies import KINDS, available_policies, kind_of, make_policy, parse_policy
from expertcache.policies.registry import HoldingSpec, check_kind

SET_HOLDING = ["dwell:4", "dwell:4:16", "prefix:8"]


def _strings(tmp_path):
    out = [n for n in available_policies() if n != "learned"]
    out += ["decayed:0.5", "foresight:3", "random:7"]
    from expertcache.scorer.models import Scorer
    from expertcache.scorer.file import save_scorer

    path = tmp_path / "s.npz"
    save_scorer(Scorer(kind="linear", features=("age",), mean=np.zeros(1), scale=np.ones(1),
                       weights=[np.ones(1)]), path)
    return out + [f"learned:{path}"]


def test_every_rule_parses_once_to_a_round_tripping_spec(tmp_path):
    for text in _strings(tmp_path) + SET_HOLDING:
        spec = parse_policy(text)
        assert spec.kind in KINDS and spec.kind == kind_of(text), text
        assert parse_policy(spec.to_spec()) == spec, text  # canonical: parsing it again changes nothing
        a, b = spec.clone(), spec.clone()
        assert a.spec == b.spec == spec.to_spec(), text
        if spec.kind == "set-holding":
            assert isinstance(a, HoldingSpec) and a == b
        else:
            assert a is not b and isinstance(a, ec.Policy) and a.spec == make_policy(text).spec
            assert (spec.kind == "eviction") == bool(a.admits)


def test_kinds_of_the_names_the_project_uses():
    assert [kind_of(t) for t in ("lru", "arc", "static", "prefix:32", "static:32", "dwell:8", "controller:h.pt:0.5",
                                 "nope")] == \
        ["eviction", "eviction", "admission", "set-holding", "set-holding", "set-holding", "set-holding", None]


def test_the_old_spelling_static_p_is_prefix_p_with_one_notice(capsys):
    """``static`` means one thing (the pin set with bypass); ``static:P`` is read as ``prefix:P``,
    with one notice line per string and process."""
    from expertcache.policies import registry as kinds

    kinds._NOTICED.discard("static:24")
    spec = parse_policy("static:24", ("set-holding",))
    assert (spec.kind, spec.name, spec.text, spec.params) == ("set-holding", "prefix", "prefix:24", ("24",))
    assert spec.clone() == parse_policy("prefix:24").clone()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'static:24' is now 'prefix:24'" in err
    parse_policy("static:24")
    assert capsys.readouterr().err == ""  # once per string


@pytest.mark.parametrize("text, kinds, says", [
    ("dwell:8", ("eviction", "admission"), "is a set-holding rule: it runs in eval and the offloaded runtime"),
    ("static", ("eviction", "set-holding"), "is an admission rule: it runs in replay, sweep and grid"),
    ("lru", ("set-holding",), "is an eviction rule"),
    ("static:32", ("eviction", "admission"), "in replay and sweep, 'static' is the pin set with bypass"),
    ("prefix:32", ("eviction", "admission"), "is a set-holding rule: it runs in eval and the offloaded runtime"),
])
def test_a_string_of_another_kind_is_one_line_naming_its_kind(text, kinds, says):
    with pytest.raises(PolicyError, match=re.escape(says)) as exc:
        parse_policy(text, kinds)
    assert "\n" not in str(exc.value)
    with pytest.raises(PolicyError, match=re.escape(says)):
        check_kind(text, kinds)


def test_make_policy_and_parse_policy_say_the_same_thing():
    for text in ("dwell:8", "prefix:32", "static:32", "controller:heads.pt:0.5"):
        with pytest.raises(PolicyError) as a:
            make_policy(text)
        with pytest.raises(PolicyError) as b:
            parse_policy(text, ("eviction", "admission"))
        assert str(a.value) == str(b.value)


def test_a_made_rule_object_is_checked_too():
    assert check_kind(make_policy("lru"), ("eviction",)).spec == "lru"
    with pytest.raises(PolicyError, match="is an admission rule"):
        check_kind(make_policy("static"), ("eviction", "set-holding"))
    for thing in (None, True, 2.5, object()):  # had ended as AttributeError (taken for a set-holding rule)
        with pytest.raises(PolicyError, match="expected a policy string"):
            check_kind(thing, ("eviction", "set-holding"))


def test_the_kinds_asked_for_are_checked():
    """kinds="eviction" had been read letter by letter: "lru" was refused with a message listing
    'e or v or i ...' over several lines."""
    assert parse_policy("lru", ["eviction"]).kind == "eviction"
    for kinds in ("eviction", (), ("eviction", "lossy"), None, ("eviction", [])):
        with pytest.raises(PolicyError, match="parse_policy: kinds must be") as exc:
            parse_policy("lru", kinds)
        assert "\n" not in str(exc.value)


@pytest.mark.parametrize("bad", ["", "  ", "nope", "dwell:x", "dwell:1:2:3", "static:0", "prefix:0", "random:-1", 3])
def test_bad_strings_are_one_line(bad):
    with pytest.raises(PolicyError) as exc:
        parse_policy(bad)
    assert "\n" not in str(exc.value)
