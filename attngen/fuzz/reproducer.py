"""A case on disk, and its replay.

A reproducer is a directory of two files:
  spec.yaml   the spec, readable by attngen.load_spec
  case.json   shape, layout and strides, dtype, scale, the data seed (and a digest of the data it
              gives), the kernel, the injected fault if any, and the failure
`attngen fuzz --replay DIR` regenerates the inputs from the seed, runs that one case and exits
non-zero when it still fails. The fuzzer writes one for a failure it found, and one per sampled
kernel for the sanitizer, which replays them under compute-sanitizer.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

import attngen
from attngen.fuzz.case import FuzzCase, input_digest, strides
from attngen.fuzz.check import CaseResult, run_case
from attngen.fuzz.runners import Runner
from attngen.spec import load_spec

FORMAT = 1
SPEC_FILE = "spec.yaml"
CASE_FILE = "case.json"


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
    }


def reproducer_dir(root: Path, case: FuzzCase, kernel: str) -> Path:
    record = json.dumps({"spec": case.spec.to_dict(), **case_record(case)}, sort_keys=True)
    return Path(root) / f"{kernel}-{hashlib.sha256(record.encode()).hexdigest()[:8]}"


def write_reproducer(directory: Path, case: FuzzCase, *, kernel: str, arch: str, fault: str | None = None,
                     failure: CaseResult | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    header = f"# attngen fuzz reproducer for {kernel}; replay: {replay_command(directory)}\n"
    (directory / SPEC_FILE).write_text(header + yaml.safe_dump(case.spec.to_dict(), sort_keys=False))
    record = {
        "format": FORMAT,
        "attngen_version": attngen.__version__,
        "torch_version": torch.__version__,
        "kernel": kernel,
        "arch": arch,
        "fault": fault,
        **case_record(case),
        "failure": None if failure is None else {"kind": failure.kind, "detail": failure.detail},
        "replay": replay_command(directory),
    }
    record["data"]["sha256"] = input_digest(case)
    # Indented for reading, with each shape and stride list on one line.
    text = re.sub(r"\[\s*([-\d,\s]*?)\s*\]", lambda m: f"[{' '.join(m.group(1).split())}]", json.dumps(record, indent=2))
    (directory / CASE_FILE).write_text(text + "\n")
    return directory


@dataclass(frozen=True)
class Reproducer:
    path: Path  # the directory
    case: FuzzCase
    kernel: str
    fault: str | None
    digest: str | None
    failure: dict | None


def load_reproducer(path: Path) -> Reproducer:
    """Read a reproducer directory (or its case.json)."""
    path = Path(path)
    directory = path.parent if path.name == CASE_FILE else path
    case_file = directory / CASE_FILE
    if not case_file.is_file():
        raise ValueError(f"--replay {path}: no {CASE_FILE} there; allowed: a directory `attngen fuzz` wrote, "
                         f"or its {CASE_FILE}")
    try:
        record = json.loads(case_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{case_file}: not valid JSON: {exc}") from exc
    spec = load_spec(directory / SPEC_FILE)
    try:
        case = _case_from_record(record, spec)
        return Reproducer(directory, case, record["kernel"], record.get("fault"), record["data"].get("sha256"),
                          record.get("failure"))
    except KeyError as exc:
        raise ValueError(f"{case_file}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{case_file}: {exc}") from None


def _case_from_record(record: dict, spec) -> FuzzCase:
    if record["format"] != FORMAT:
        raise ValueError(f"format={record['format']!r} is not supported; allowed: {FORMAT}")
    shape, data = record["shape"], record["data"]
    case = FuzzCase(spec, batch=shape["batch"], seq_q=shape["seq_q"], seq_k=shape["seq_k"], heads_kv=shape["heads_kv"],
                    layout=record["layout"]["name"], logit_scale=data["logit_scale"],
                    softmax_scale=record["softmax_scale"], data_seed=data["seed"])
    # Derived fields must agree with spec.yaml: an edited spec would otherwise replay another case.
    for name, recorded, actual in (("dtype", record["dtype"], spec.dtype),
                                   ("shape.head_dim", shape["head_dim"], spec.head_dim),
                                   ("shape.heads_q", shape["heads_q"], case.heads_q)):
        if recorded != actual:
            raise ValueError(f"{name}={recorded!r} disagrees with {SPEC_FILE}; allowed: {actual!r}")
    return case


def replay(reproducer: Reproducer, runner: Runner) -> tuple[CaseResult, list[str]]:
    """Run the reproducer's case; also return warnings about what differs from when it was written."""
    warnings = []
    if reproducer.digest is not None and input_digest(reproducer.case) != reproducer.digest:
        warnings.append(f"the inputs regenerated from seed {reproducer.case.data_seed} differ from the recorded "
                        f"ones (another torch version?): this replay may not reproduce the failure")
    kernel = runner.kernel_name(reproducer.case.spec)
    if kernel != reproducer.kernel:
        warnings.append(f"recorded for kernel {reproducer.kernel}; this GPU runs {kernel} (another arch or fault?)")
    return run_case(reproducer.case, runner), warnings
