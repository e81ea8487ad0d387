"""Packaging: what pip users build and install (`pip install .`, a wheel, an sdist)."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_build_requirement_accepts_the_license_expression():
    """`license = "Apache-2.0"` (an SPDX expression, PEP 639) needs setuptools 77: 69 to 76 refuse
    pyproject.toml ("`project.license` must be valid exactly by one definition"), so a build with one of
    them (`--no-build-isolation`, an offline or distribution build) failed although the declared
    minimum allowed it."""
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    if not isinstance(data["project"].get("license"), str):
        pytest.skip("the license is not given as an SPDX expression")
    (setuptools,) = [
        Requirement(text) for text in data["build-system"]["requires"] if re.match(r"setuptools\b", text)
    ]
    assert not setuptools.specifier.contains("76.1.0") and setuptools.specifier.contains("77.0.3")
