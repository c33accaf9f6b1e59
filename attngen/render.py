"""Render a KernelPlan to CUDA source through the Jinja templates in templates/."""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import jinja2

from attngen.plan import KernelPlan, make_plan
from attngen.spec import AttentionSpec

FORWARD_TEMPLATE = "fwd.cu.j2"


def templates_dir() -> Path:
    """templates/ of a source checkout, else the copy installed as attngen.templates."""
    checkout = Path(__file__).resolve().parent.parent / "templates"
    if (checkout / FORWARD_TEMPLATE).is_file():
        return checkout
    return Path(str(resources.files("attngen.templates")))


@functools.lru_cache(maxsize=None)
def _environment(root: str) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(root),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    # Plain CUDA headers are pasted verbatim: inline asm braces ("{%0, ...}") are not Jinja.
    env.globals["include_header"] = lambda name: env.loader.get_source(env, name)[0]
    return env


def render_plan(plan: KernelPlan) -> str:
    # Headers are inlined, so the source is self-contained and its hash
    # covers every line the compiler sees.
    return _environment(str(templates_dir())).get_template(FORWARD_TEMPLATE).render(plan=plan)


def render(spec: AttentionSpec, arch: str | None = None) -> str:
    return render_plan(make_plan(spec, arch))


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
