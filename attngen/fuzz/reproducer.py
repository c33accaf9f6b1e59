"""A case on disk, and its replay.

A reproducer is a directory of two files (this is the forward's; attngen/fuzz/decode_reproducer.py
writes paged decode cases, with the same spec.yaml and a case.json of kind "decode"):
  spec.yaml   the spec (AttentionSpec.to_dict(): its family and config when it pins them),
              readable by attngen.load_spec
  case.json   shape, layout and strides, dtype, scale, the data seed (and a digest of the data it
              gives), a packed case's documents, the kernel (the plan's name: family, problem, config and target), the
              injected fault if any, the failure, and where it was written: attngen and torch
              versions, the exact compile target, GPU and NVRTC
`attngen fuzz --replay DIR` regenerates the inputs from the seed, runs that one case and exits
1 when it still fails. The fuzzer writes one for a failure it found, and one per sampled kernel
for the sanitizer, which replays them under compute-sanitizer.

Loading recomputes every field case.json derives from the others and from spec.yaml (shapes,
strides, the effective scale) and rejects a file whose values disagree: it was edited, and would
replay another case than it describes. A replay on another target, GPU, NVRTC or attngen
version, or whose regenerated inputs differ, runs with a warning: it may not reproduce.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

import attngen
from attngen.errors import SpecError
from attngen.fuzz.case import FuzzCase, input_digest, strides
from attngen.fuzz.check import CaseResult, run_case
from attngen.fuzz.runners import Machine, Runner
from attngen.specfile import load_spec

# 2: the machine it was written on; guard rows in the padded layout's strides. 3: kernel families:
# spec.yaml may pin a family and config, the machine is the exact compile target (no arch family).
# 4: packed documents; runtime inputs drawn by what they are (attngen/fuzz/case.py).
FORMAT = 4
SPEC_FILE = "spec.yaml"
CASE_FILE = "case.json"
# case.json's "kind" says which case it holds, and each kind has its own format. Files written before
# decode reproducers existed have no kind: they are forward cases.
KINDS = ("forward", "decode")


def replay_command(path: Path) -> str:
    return f"attngen fuzz --replay {shlex.quote(str(path))}"


def case_record(case: FuzzCase) -> dict:
    """What case.json says about the case itself (also the basis of the directory name)."""
    return {
        "shape": {"batch": case.batch, "seq_q": case.seq_q, "seq_k": case.seq_k, "heads_q": case.heads_q,
                  "heads_kv": case.heads_kv, "head_dim": case.spec.head_dim, "q": list(case.q_shape),
                  "k": list(case.kv_shape), "v": list(case.kv_shape), "lse": list(case.lse_shape)},
        "layout": {"name": case.layout, "strides": strides(case)},
        "dtype": case.spec.dtype,
        "softmax_scale": case.softmax_scale,
        "effective_scale": case.scale,
        "data": {"seed": case.data_seed, "logit_scale": case.logit_scale},
        "documents": [list(d) for d in case.documents],
    }


def _is_decode(case) -> bool:
    from attngen.fuzz.paged import DecodeCase

    return isinstance(case, DecodeCase)


def reproducer_dir(root: Path, case, kernel: str) -> Path:
    """`root`/<kernel>-<hash of the case>: a FuzzCase's or a paged DecodeCase's."""
    if _is_decode(case):
        from attngen.fuzz.decode_reproducer import decode_case_record as record_of
    else:
        record_of = case_record
    record = json.dumps({"spec": case.spec.to_dict(), **record_of(case)}, sort_keys=True)
    return Path(root) / f"{kernel}-{hashlib.sha256(record.encode()).hexdigest()[:8]}"


def write_reproducer(directory: Path, case, *, kernel: str, machine: Machine, fault: str | None = None,
                     failure: CaseResult | None = None) -> Path:
    """Write a FuzzCase's reproducer, or a paged DecodeCase's (attngen/fuzz/decode_reproducer.py)."""
    if _is_decode(case):
        from attngen.fuzz.decode_reproducer import write_decode_reproducer

        if fault is not None:
            raise ValueError(f"fault={fault!r} is invalid for a decode case; allowed: None (faults break forward "
                             "kernels)")
        return write_decode_reproducer(directory, case, kernel=kernel, machine=machine, failure=failure)
    record = {
        "kind": "forward",
        "format": FORMAT,
        "attngen_version": attngen.__version__,
        "torch_version": torch.__version__,
        "machine": dataclasses.asdict(machine),
        "kernel": kernel,
        "fault": fault,
        **case_record(case),
        "failure": None if failure is None else {"kind": failure.kind, "detail": failure.detail},
        "replay": replay_command(directory),
    }
    record["data"]["sha256"] = input_digest(case)
    return write_files(directory, case.spec, kernel, record)


def write_files(directory: Path, spec, kernel: str, record: dict) -> Path:
    """spec.yaml (the spec, with a header saying how to replay it) and case.json (`record`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    header = f"# attngen fuzz reproducer for {kernel}; replay: {replay_command(directory)}\n"
    (directory / SPEC_FILE).write_text(header + yaml.safe_dump(spec.to_dict(), sort_keys=False))
    # Indented for reading, with each shape and stride list on one line.
    text = re.sub(r"\[\s*([-\d,\s]*?)\s*\]", lambda m: f"[{' '.join(m.group(1).split())}]", json.dumps(record, indent=2))
    (directory / CASE_FILE).write_text(text + "\n")
    return directory


@dataclass(frozen=True)
class Reproducer:
    path: Path  # the directory
    case: FuzzCase  # or a paged DecodeCase, for kind "decode"
    kernel: str
    fault: str | None
    digest: str | None
    failure: dict | None
    machine: Machine
    attngen_version: str
    kind: str = "forward"  # a KINDS entry


EXPECTED = f"a directory `attngen fuzz` wrote, with {SPEC_FILE} and {CASE_FILE} in it (or that {CASE_FILE})"


def load_reproducer(path: Path) -> Reproducer:
    """Read a reproducer directory (or its case.json). ValueError, naming the file, if it is not one."""
    path = Path(path)
    directory = path.parent if path.name == CASE_FILE else path
    for name in (CASE_FILE, SPEC_FILE):
        if not (directory / name).is_file():
            raise ValueError(f"{path}: no {name} there; expected {EXPECTED}")
    case_file = directory / CASE_FILE
    try:
        record = json.loads(case_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{case_file}: not valid JSON: {exc}") from exc
    try:
        kind = record.get("kind", "forward") if isinstance(record, dict) else None
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is invalid; allowed: {', '.join(map(repr, KINDS))}")
        if kind == "decode":
            from attngen.fuzz.decode_reproducer import load_decode_reproducer

            return load_decode_reproducer(directory, record)
        _check_format(record)  # first: an older spec.yaml may not load, and the format says why
        case = _case_from_record(record, load_spec(directory / SPEC_FILE))
        return Reproducer(directory, case, record["kernel"], record["fault"], record["data"]["sha256"],
                          record["failure"], Machine(**record["machine"]), record["attngen_version"])
    except KeyError as exc:
        raise ValueError(f"{case_file}: missing field {exc.args[0]!r}") from None
    except SpecError:  # names spec.yaml itself
        raise
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{case_file}: {exc}") from None


def _check_format(record: dict) -> None:
    if record["format"] != FORMAT:
        raise ValueError(f"format={record['format']!r} is not supported; allowed: {FORMAT} (rerun the fuzz to write "
                         "a new reproducer)")


def _case_from_record(record: dict, spec) -> FuzzCase:
    shape, data = record["shape"], record["data"]
    case = FuzzCase(spec, batch=shape["batch"], seq_q=shape["seq_q"], seq_k=shape["seq_k"], heads_kv=shape["heads_kv"],
                    layout=record["layout"]["name"], logit_scale=data["logit_scale"],
                    softmax_scale=record["softmax_scale"], data_seed=data["seed"],
                    documents=_documents(record["documents"]))
    # Every derived field must agree with spec.yaml and the fields the case was built from: an edited
    # file would otherwise replay another case than the one it describes.
    for name, actual in json_leaves(case_record(case)):
        recorded = json_lookup(record, name)
        if recorded != actual:
            raise ValueError(f"{name}={recorded!r} disagrees with {SPEC_FILE} and the case's other fields (was the "
                             f"file edited?); allowed: {actual!r}")
    return case


def _documents(value) -> tuple:
    """case.json's documents, [[rows, keys], ...], as FuzzCase takes them (which checks the values)."""
    if not isinstance(value, list) or not all(isinstance(d, list) for d in value):
        raise ValueError(f"documents={value!r} is invalid; allowed: a list of [rows, keys] lists")
    return tuple(tuple(d) for d in value)


def json_leaves(record: dict, prefix: str = ""):
    for key, value in record.items():
        if isinstance(value, dict):
            yield from json_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def json_lookup(record: dict, dotted: str):
    value = record
    for key in dotted.split("."):
        if not isinstance(value, dict):
            raise ValueError(f"{dotted} is missing: its parent is not a JSON object")
        value = value[key]
    return value


def replay(reproducer: Reproducer, runner: Runner) -> tuple[CaseResult, list[str]]:
    """Run the reproducer's case; also return warnings about what differs from when it was written. A
    decode reproducer needs a decode runner (attngen/fuzz/decode_runners.py)."""
    if reproducer.kind == "decode":
        from attngen.fuzz.decode_reproducer import replay_decode

        return replay_decode(reproducer, runner)
    warnings = []
    if input_digest(reproducer.case) != reproducer.digest:
        warnings.append(f"the inputs regenerated from seed {reproducer.case.data_seed} differ from the recorded "
                        f"ones (another torch version?): this replay may not reproduce the failure")
    kernel = runner.kernel_name(reproducer.case.spec)
    if kernel != reproducer.kernel:
        warnings.append(f"recorded for kernel {reproducer.kernel}; this GPU runs {kernel} (another target, default "
                        "family or config, or fault?)")
    return run_case(reproducer.case, runner), warnings + machine_warnings(reproducer, runner)


def machine_warnings(reproducer: Reproducer, runner) -> list[str]:
    """What differs between where the reproducer was written and where it replays."""
    warnings = []
    for name, what in (("target", "compile target"), ("gpu", "GPU"), ("nvrtc", "NVRTC")):
        recorded, actual = getattr(reproducer.machine, name), getattr(runner.machine, name)
        if recorded != actual:
            warnings.append(f"recorded with {what} {recorded}; this replay has {actual}: it may not reproduce")
    if reproducer.attngen_version != attngen.__version__:
        warnings.append(f"recorded with attngen {reproducer.attngen_version}; this is attngen {attngen.__version__}: "
                        "the kernel source may differ")
    return warnings
