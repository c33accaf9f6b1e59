"""Spec files: a YAML mapping of AttentionSpec fields, read strictly.

- Numbers and booleans read as YAML 1.2's core schema does: `softmax_scale: 1e-3` is a float
  (PyYAML's YAML 1.1 rules would make it the text "1e-3"), `010` is ten (not 1.1's octal eight),
  `1:04`, `1_28` and `yes` are text (not 1.1's 64, 128 and true), which the fields then refuse.
- A key given twice is an error (YAML loaders silently keep the last one), in `config` too.
- Anchors and aliases are refused: a spec file has no use for them, and an alias bomb
  (a few lines that expand to billions of elements) must not reach the validator.
- The read is bounded (MAX_BYTES): a device file such as /dev/zero or a huge file is refused,
  not read forever.
- A file that is not UTF-8 text, not YAML or not a mapping gets an error naming the file.
- Every problem in the file is reported at once (SpecError.problems), each naming the file,
  the field, the bad value and what is allowed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from attngen.errors import SpecError, type_article
from attngen.spec import AttentionSpec, spec_error

MAX_BYTES = 1 << 20

# YAML 1.2 core schema floats: 1e-3, .5, 1.0e+3, .inf, .nan (1.1's resolver wants a dot and a signed exponent).
_FLOAT_12 = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
# ... its integers (decimal, 0o octal, 0x hex: no 1.1 leading-zero octal, base 60 or underscores) and booleans.
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_TAG = "tag:yaml.org,2002:"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats that refuses aliases and collects duplicate keys in `duplicates`
    as (field, message): a duplicate inside `config` is attributed to the field `config`."""

    def __init__(self, stream, source: str):
        super().__init__(stream)
        self.name = source  # YAML error marks say `in "<file>", line 2, column 3`
        self.duplicates: list[tuple[str, str]] = []
        self._field_of: dict[int, str] = {}  # id(value node of a top-level field) -> the field

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} is not allowed in a spec file "
                                                          "(write the value out)", event.start_mark)
        if self.check_event(yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent):
            anchor = self.peek_event().anchor
            if anchor is not None:
                raise yaml.composer.ComposerError(None, None, f"anchor &{anchor} is not allowed in a spec file",
                                                  self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        self.flatten_mapping(node)  # merge keys (<<) first, so a merged key given again counts as a duplicate
        top = node is self._root
        seen = set()
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    line = key_node.start_mark.line + 1
                    if top:
                        self.duplicates.append((key, f"field {key!r} is given twice (again on line {line}); "
                                                     "allowed: each field once"))
                    else:
                        parent = self._field_of.get(id(node))
                        where = f"{parent}.{key}" if parent else repr(key)
                        self.duplicates.append((parent or key, f"{where} is given twice (again on line {line}); "
                                                               "allowed: each key once"))
                seen.add(key)
                if top and isinstance(key, str):
                    self._field_of[id(value_node)] = key
            except TypeError:  # an unhashable key: SafeLoader reports it
                pass
        return super().construct_mapping(node, deep=deep)

    def get_single_data(self):
        self._root = self.get_single_node()
        return self.construct_document(self._root) if self._root is not None else None


def _construct_int_12(loader: yaml.SafeLoader, node) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


# The 1.1 resolvers of ints, floats and bools out (null's are the same in 1.2), the 1.2 ones in:
# ints before floats, so that 10 is an int.
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_TAG + "int", _TAG + "float", _TAG + "bool")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(_TAG + "int", _INT_12, list("-+0123456789"))
_StrictLoader.add_implicit_resolver(_TAG + "float", _FLOAT_12, list("-+0123456789."))
_StrictLoader.add_implicit_resolver(_TAG + "bool", _BOOL_12, list("tTfF"))
_StrictLoader.add_constructor(_TAG + "int", _construct_int_12)


def parse(text: str, source: str) -> AttentionSpec:
    """The spec in YAML `text`; `source` names it in errors."""
    try:
        loader = _StrictLoader(text, source)
    except yaml.reader.ReaderError as exc:  # a control character: a binary file that happens to be UTF-8
        raise SpecError(f"{source}: not a text file (unprintable character #x{exc.character:04x} at offset "
                        f"{exc.position}); a spec file is a YAML mapping", field=None) from None
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: not valid YAML: {exc}", field=None) from None
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply; a spec file is a flat YAML mapping", field=None) from None
    finally:
        loader.dispose()
    try:
        spec = AttentionSpec.from_dict(data if data is not None else {}, source=source)
    except SpecError as exc:
        if not loader.duplicates:
            raise
        problems = loader.duplicates + exc.problems
    else:
        if not loader.duplicates:
            return spec
        problems = loader.duplicates
    raise spec_error(source, problems)


def load_spec(path: str | Path) -> AttentionSpec:
    """Load one spec from a YAML file (keys are AttentionSpec fields)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise SpecError(f"path is {type_article(path)}; allowed: a spec file's path (str or os.PathLike)", field=None)
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # bounded: /dev/zero or a huge file is refused, not read forever
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec file ({exc.strerror or exc})", field=None) from None
    if len(raw) > MAX_BYTES:
        raise SpecError(f"{path}: larger than {MAX_BYTES} bytes; a spec file is a short YAML mapping", field=None)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not a UTF-8 text file (invalid byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                        "a spec file is a YAML mapping", field=None) from None
    return parse(text, str(path))
