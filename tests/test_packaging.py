"""The wheel (CPU, no network when the running Python has setuptools >= 77): it ships every template,
header and table of every kernel family and the shared CUDA headers, the LICENSE, the version of
attngen/__init__.py, and, unpacked outside the repository, renders what generated/ holds.

The wheel is built once per session from a copy of what a build reads (pyproject.toml, the README
and LICENSE it names, attngen/), so nothing left in the checkout (build/, caches) gets in.
"""

from __future__ import annotations

import email
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import attngen

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attngen"
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "attngen")
DATA_SUFFIXES = (".j2", ".cuh", ".yaml")
# What pip prints when it cannot reach an index for the build's own requirements.
OFFLINE = ("No matching distribution found", "Could not find a version that satisfies", "Network is unreachable")


def _setuptools_can_build() -> bool:
    """The running Python's setuptools can build this pyproject (PEP 639 license fields need 77)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    from importlib.metadata import version

    return int(version("setuptools").split(".")[0]) >= 77


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in this Python: cannot build the wheel")
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    # Offline when this Python's setuptools can build; else pip fetches setuptools from its index.
    isolated = not _setuptools_can_build()
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(out), str(src)]
    if not isolated:
        cmd.insert(4, "--no-build-isolation")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if isolated and any(phrase in log for phrase in OFFLINE):
            pytest.skip(f"cannot build the wheel offline: this Python has no setuptools >= 77 and pip cannot reach "
                        f"an index for it:\n{log[-2000:]}")
        pytest.fail(f"building the wheel failed:\n{log}")
    (path,) = out.glob("attngen-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def _package_files(suffixes=None) -> list[str]:
    """Files under attngen/ (as paths in the wheel), optionally only those with the given suffixes."""
    return sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and (suffixes is None or p.suffix in suffixes))


def test_every_template_header_and_table_of_every_family_is_shipped(wheel):
    names = set(wheel.namelist())
    data = _package_files(DATA_SUFFIXES)
    # The folders the renderer reads: each family's and the shared headers.
    assert any(f.startswith("attngen/families/fwd_sm80/") for f in data)
    assert any(f.startswith("attngen/cuda/") for f in data)
    missing = [f for f in data if f not in names]
    assert not missing, f"the wheel lacks {missing}: see [tool.setuptools.package-data] in pyproject.toml"


def test_every_module_is_shipped_and_nothing_else(wheel):
    names = set(wheel.namelist())
    modules = _package_files((".py",))
    missing = [f for f in modules if f not in names]
    assert not missing, f"the wheel lacks {missing}: see [tool.setuptools.packages.find] in pyproject.toml"
    stray = sorted(n for n in names if not n.startswith(("attngen/", f"attngen-{attngen.__version__}.dist-info/"))
                   or "__pycache__" in n or n.endswith(".pyc"))
    assert not stray, stray


def _metadata(wheel) -> email.message.Message:
    return email.message_from_bytes(wheel.read(f"attngen-{attngen.__version__}.dist-info/METADATA"))


def test_license_is_shipped_and_declared(wheel):
    license_text = (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in license_text and b"Version 2.0" in license_text
    assert b"the attngen authors" in license_text
    assert wheel.read(f"attngen-{attngen.__version__}.dist-info/licenses/LICENSE") == license_text
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"


def test_version_and_extras(wheel):
    meta = _metadata(wheel)
    assert meta["Version"] == attngen.__version__
    extras = set(meta.get_all("Provides-Extra"))
    assert {"cuda12", "cuda13", "torch", "test", "fuzz", "bench"} <= extras
    requires = meta.get_all("Requires-Dist")
    for extra, cupy in (("cuda12", "cupy-cuda12x"), ("cuda13", "cupy-cuda13x")):
        assert any(r.startswith(cupy) and f'extra == "{extra}"' in r for r in requires), requires
        assert any(r.startswith("cuda-bindings") and f'extra == "{extra}"' in r for r in requires), requires
    # Rendering and checking kernels needs neither torch nor CuPy.
    assert not any(r.startswith(("torch", "cupy")) and "extra ==" not in r for r in requires), requires


def test_unpacked_wheel_renders_what_generated_holds(wheel, tmp_path):
    """A pure-Python wheel unpacked is the package installed: run `attngen generate` from it, outside the
    repository, on a spec copied there (the .ci/run smoke test installs it for real)."""
    site = tmp_path / "site"
    wheel.extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    spec = sorted((ROOT / "specs").glob("*.yaml"))[0]
    shutil.copy2(spec, work / spec.name)
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "import attngen\n"
        f"assert attngen.__file__.startswith({str(site)!r}), attngen.__file__\n"
        "from attngen.cli import main\n"
        f"main(['generate', {spec.name!r}, '-o', 'out'], standalone_mode=False)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=work, check=True, capture_output=True, text=True)
    written = sorted((work / "out").iterdir())
    assert [p.suffix for p in written] == [".cu", ".json"]
    for path in written:
        assert path.read_bytes() == (ROOT / "generated" / path.name).read_bytes(), path.name
