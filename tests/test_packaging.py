"""Packaging: what pip users build and install (`pip install .`, a wheel, an sdist).

The build tests build from a copy of the checkout's files (those git does not ignore) with setuptools'
build backend, in a subprocess and without build isolation (nothing is downloaded): about a second each."""

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
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


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the list of files that git does not ignore)")
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    return [name for name in listing.split("\0") if name]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> tuple[Path, list[str]]:
    """A copy of the checkout's files that git does not ignore (links kept as links)."""
    pytest.importorskip("setuptools", minversion="77")  # pyproject.toml's build-system minimum
    names = tracked_files()
    copy = tmp_path_factory.mktemp("checkout")
    for name in names:
        source, target = ROOT / name, copy / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        elif source.is_file():  # a tracked file deleted in the working tree stays out
            shutil.copy2(source, target)
    return copy, names


def build(copy: Path, kind: str, output: Path) -> Path:
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(output)!r}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return output / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def wheel_names(checkout, tmp_path_factory) -> set[str]:
    with zipfile.ZipFile(build(checkout[0], "wheel", tmp_path_factory.mktemp("wheel"))) as wheel:
        return set(wheel.namelist())


def test_wheel_carries_the_package_data_the_code_reads(checkout, wheel_names, tmp_path):
    for name in (
        "vanilla_transformer/data/bible_en_es.jsonl.gz",
        "vanilla_transformer/data/README.md",
        "vanilla_transformer/metric_modules/bleu_chrf/bleu_chrf.py",
        "vanilla_transformer/model_card_template.md",
        # the files save_pretrained copies next to the weights (trust_remote_code loading)
        "vanilla_transformer/configuration_vanilla_transformer.py",
        "vanilla_transformer/modeling_vanilla_transformer.py",
        "vanilla_transformer/kernels_vanilla_transformer.py",
        "vanilla_transformer/pipeline_vanilla_transformer.py",
    ):
        assert name in wheel_names
    assert all(name.startswith(("vanilla_transformer/", "vanilla_transformer-")) for name in wheel_names)
    assert not [name for name in wheel_names if "__pycache__" in name or name.endswith(".pyc")]


def test_sdist_carries_what_its_tests_need_and_builds_the_same_wheel(checkout, wheel_names, tmp_path):
    copy, tracked = checkout
    path = build(copy, "sdist", tmp_path / "sdist")
    with tarfile.open(path) as sdist:
        members = {
            member.name.split("/", 1)[1]: member for member in sdist.getmembers() if "/" in member.name
        }
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        sdist.extractall(tmp_path / "unpacked", **extra)
    needed = [
        name
        for name in tracked
        if name.startswith(("tests/", "scripts/", "tools/", "configs/")) or name == "model_card.md"
    ]
    assert not [name for name in needed if name not in members]
    template = members["vanilla_transformer/model_card_template.md"]
    assert template.isfile() and template.size == (ROOT / "model_card.md").stat().st_size
    assert not [name for name in members if "__pycache__" in name or name.endswith(".pyc")]
    # pip falls back to the sdist where no wheel fits: the wheel it builds holds the same files
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    with zipfile.ZipFile(build(unpacked, "wheel", tmp_path / "wheel")) as wheel:
        assert set(wheel.namelist()) == wheel_names
        assert (
            wheel.read("vanilla_transformer/model_card_template.md") == (ROOT / "model_card.md").read_bytes()
        )


def test_dependency_floors_are_read_as_pins():
    """tools.dependency_floors installs each requirement at its `>=` bound; one without a bound has no
    floor to install, so it is refused rather than left to float to the newest release."""
    from tools.dependency_floors import floor_pins, project_floors

    assert floor_pins(["a>=1.2,<2", "b_c>=0.3", "vanilla_transformer[test]"]) == ["a==1.2", "b_c==0.3"]
    for unbounded in ("c", "c==1.0", "c<2"):
        with pytest.raises(ValueError, match="no single lower bound"):
            floor_pins([unbounded])
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins = project_floors(ROOT / "pyproject.toml", ["test"])
    assert pins[0].startswith("torch==")  # installed first, as the README does
    names = {
        Requirement(text).name
        for text in [*project["dependencies"], *project["optional-dependencies"]["test"]]
    }
    assert {pin.split("==")[0] for pin in pins} == names  # every dependency has a floor
    with pytest.raises(ValueError, match="No extra 'gpu'"):
        project_floors(ROOT / "pyproject.toml", ["gpu"])
