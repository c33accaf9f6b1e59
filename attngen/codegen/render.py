"""Render kernel sources: thin Jinja over each family's template and the shared CUDA headers.

A family's folder holds its template (`*.cu.j2`) and its own headers; attngen/cuda/ holds the
headers every family shares. `include_header(name)` pastes a header verbatim (inline asm braces
such as "{%0, ...}" are not Jinja), searching the family's folder first, so a rendered source is
self-contained and its hash covers every line the compiler sees.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2
from jinja2 import nodes

SHARED_HEADERS = Path(__file__).resolve().parent.parent / "cuda"


@functools.lru_cache(maxsize=None)
def environment(family_dir: str) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([family_dir, str(SHARED_HEADERS)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals["include_header"] = lambda name: env.loader.get_source(env, name)[0]
    return env


def render(family_dir: Path, template: str, **context) -> str:
    return environment(str(family_dir)).get_template(template).render(**context)


def template_files(family_dir: Path, template: str) -> list[str]:
    """The template and every header it inlines, in the order it names them (for manifests)."""
    env = environment(str(family_dir))
    tree = env.parse(env.loader.get_source(env, template)[0])
    headers = [
        call.args[0].value
        for call in tree.find_all(nodes.Call)
        if isinstance(call.node, nodes.Name) and call.node.name == "include_header" and call.args
        and isinstance(call.args[0], nodes.Const)
    ]
    return [template, *headers]


def write_if_different(path: Path, text: str) -> bool:
    """Write text to path unless it already holds exactly that; True when written."""
    path = Path(path)
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True
