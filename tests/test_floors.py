"""constraints/floors.txt pins exactly the lower bounds pyproject.toml declares (issue 33: declared floors are
true only if `make test-min` installs those very versions)."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# The extras `make test-min` installs beside the core (Makefile, target test-min).
TESTED_EXTRAS = ("lmeval", "mteb", "train", "peft", "compare")
# torch: only the local 2.13.0 CPU build installs here (floors.txt's header says so).
NOT_EXERCISED = {"torch"}


def _lower_bounds(requirements):
    bounds = {}
    for line in requirements:
        req = Requirement(line)
        lows = [s.version for s in req.specifier if s.operator in (">=", "==")]
        if lows:
            bounds[req.name.lower()] = lows[0]
    return bounds


def _declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _lower_bounds(project["dependencies"])
    for extra in TESTED_EXTRAS:
        for name, low in _lower_bounds(project["optional-dependencies"][extra]).items():
            assert declared.setdefault(name, low) == low, f"{name}: two different floors in pyproject.toml"
    return declared


def _pinned():
    pins = {}
    for line in (ROOT / "constraints" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
            pins[name.lower()] = version
    return pins


def _same_version(declared, pinned):
    pad = lambda v: tuple(int(x) for x in v.split(".")) + (0,) * (3 - len(v.split(".")))  # noqa: E731
    return pad(declared) == pad(pinned)


def test_every_declared_floor_is_the_pinned_one():
    declared, pinned = _declared(), _pinned()
    missing = sorted(set(declared) - set(pinned) - NOT_EXERCISED)
    assert not missing, f"floors.txt lacks {missing}: make test-min would install newer ones than pyproject allows"
    wrong = {n: (declared[n], pinned[n]) for n in declared if n in pinned and not _same_version(declared[n], pinned[n])}
    assert not wrong, f"declared floor != pinned version (declared, pinned): {wrong}"


def test_floors_pin_nothing_undeclared_but_known_transitive_ones():
    extra = set(_pinned()) - set(_declared())
    # floors.txt's comments say why each of these is pinned although no dependency of ours names it.
    assert extra <= {"pyarrow"}, extra


def test_the_check_sees_a_mismatch():
    assert not _same_version("0.22", "0.22.2")
    assert _same_version("6", "6.0")
