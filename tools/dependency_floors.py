"""Install every dependency at the lowest version pyproject.toml allows, in a new virtual environment,
and run the tests there: a floor that no run has used is a promise nobody checked.

    python -m tools.dependency_floors /tmp/floors-venv                      # the default suite
    python -m tools.dependency_floors /tmp/floors-venv -- tests/test_modeling.py -x

Each requirement `name>=X` of the dependencies, of the test extra and of the extras named by `--extras`
is installed as `name==X`, torch first (from the package index: a CUDA build where the
index serves one, several GB), then the package itself without dependencies, editable, from this
checkout. pip is asked to check the set (`pip check`) before the tests run. Needs the package index.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
import venv
from collections.abc import Iterable, Sequence
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def floor_pins(requirements: Iterable[str]) -> list[str]:
    """`name==X` for each requirement's `>=X`; a requirement without one is refused (it has no floor to
    install). Self-references such as `vanilla_transformer[test]` are skipped."""
    pins = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name.replace("_", "-") == "vanilla-transformer":
            continue
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if len(floors) != 1:
            raise ValueError(f"{text!r} has no single lower bound (>=) to install as its floor.")
        pins.append(f"{requirement.name}=={floors[0]}")
    return pins


def project_floors(pyproject: Path, extras: Sequence[str]) -> list[str]:
    """The floors of pyproject.toml's dependencies and of the extras named, torch first."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise ValueError(f"No extra {unknown[0]!r} in {pyproject}; it has {sorted(optional)}.")
    requirements = [*project["dependencies"], *(text for extra in extras for text in optional[extra])]
    pins = list(dict.fromkeys(floor_pins(requirements)))
    return sorted(pins, key=lambda pin: not pin.startswith("torch=="))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("environment", type=Path, help="folder of the virtual environment (created)")
    parser.add_argument("--extras", nargs="*", default=[], help="extras whose floors join the test extra's")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (default: none)")
    args = parser.parse_args(argv)
    if args.environment.exists():
        parser.error(f"{args.environment} exists; name a new folder (the environment is built from scratch).")
    try:
        pins = project_floors(ROOT / "pyproject.toml", ["test", *args.extras])
    except ValueError as error:
        parser.error(str(error))
    print("floors:", " ".join(pins), flush=True)
    venv.create(args.environment, with_pip=True)
    python = str(args.environment / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run([*pip, pins[0]], check=True)  # torch alone first, as the README installs it
    subprocess.run([*pip, *pins[1:]], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    subprocess.run([python, "-m", "pip", "check"], check=True)
    sys.exit(subprocess.run([python, "-m", "pytest", *args.pytest_args], cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
