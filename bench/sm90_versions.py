"""Versions of fwd_sm90's kernel for same-process A/B (bench/sm90_ab_probe.py, bench/sm90_clock_ab.py): a
version is the text of the kernel's headers (family.py KERNEL_HEADERS) as the template pastes them, one
after another, and a kernel built from a version has that text in place of the working tree's. A version is
read from:
  - a directory holding the headers (a copy of attngen/families/fwd_sm90 with changes);
  - git:REV, the headers at a commit (before they were split, the one flash_fwd_sm90.cuh);
  - any other path: a file holding the whole text (what this script prints, or a flash_fwd_sm90.cuh from
    before the split).
The device machine has no git history: write a commit's version to a file here and carry it,

    python bench/sm90_versions.py git:HEAD~1 > .ab/base.cuh
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

from attngen.families import get_family
from attngen.families.fwd_sm90 import family as sm90
from attngen.runtime import dispatch

REPO = Path(sm90.FOLDER).parents[2]
FOLDER_IN_REPO = Path(sm90.FOLDER).relative_to(REPO).as_posix()
SINGLE_HEADER = "flash_fwd_sm90.cuh"  # the whole kernel, before the split


def joined(texts) -> str:
    """Headers as the template pastes them: each on its own lines, nothing between."""
    return "\n".join(texts)


def tree() -> str:
    """The working tree's version."""
    return joined(Path(sm90.FOLDER, name).read_text() for name in sm90.KERNEL_HEADERS)


def load(source: str) -> str:
    """The version that `source` names (the module docstring says how); SystemExit naming what is missing."""
    if source.startswith("git:"):
        return _at_commit(source[4:])
    path = Path(source)
    if path.is_dir():
        family_py = path / "family.py"
        names = _kernel_headers(family_py.read_text()) if family_py.is_file() else sm90.KERNEL_HEADERS
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise SystemExit(f"{source}: a version's directory holds the kernel's headers ({', '.join(names)}); "
                             f"missing: {', '.join(missing)}")
        return joined((path / name).read_text() for name in names)
    if not path.is_file():
        raise SystemExit(f"{source}: no such file or directory; a version is git:REV, a directory of the kernel's "
                         "headers or a file")
    return path.read_text()


def named(text: str) -> tuple[str, str]:
    """NAME=VERSION (an argparse type): VERSION git:REV or an existing file or directory."""
    import argparse

    name, sep, source = text.partition("=")
    if not sep or not name or name in ("base", "new", "cudnn"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VERSION with NAME other than base, new and cudnn")
    if not source.startswith("git:") and not Path(source).exists():
        raise argparse.ArgumentTypeError(f"{text!r}: {source!r} is neither git:REV nor an existing file or directory")
    return name, source


def _kernel_headers(family_py: str) -> tuple[str, ...]:
    """family.py's KERNEL_HEADERS; (flash_fwd_sm90.cuh,) where it has none (before the split)."""
    for node in ast.parse(family_py).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "KERNEL_HEADERS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return (SINGLE_HEADER,)


def _at_commit(rev: str) -> str:
    def show(name):
        done = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{FOLDER_IN_REPO}/{name}"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise SystemExit(f"git:{rev}: {FOLDER_IN_REPO}/{name}: {done.stderr.strip()}")
        return done.stdout

    return joined(show(name) for name in _kernel_headers(show("family.py")))


def use(version: str | None) -> None:
    """Build fwd_sm90 kernels of this process from `version` (None: the working tree's)."""
    family = get_family("fwd_sm90")
    family.render = functools.partial(_render, version)
    dispatch._kernels.clear()
    dispatch.forget()


def _render(version, plan):
    source = sm90.Sm90Forward.render(get_family("fwd_sm90"), plan)
    if version is None:
        return source
    ours = tree()
    if ours not in source:
        raise RuntimeError("the template no longer pastes family.py KERNEL_HEADERS one after another")
    return source.replace(ours, version)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} git:REV | DIR | FILE   (prints the version)")
    sys.stdout.write(load(sys.argv[1]))
