"""A paged decode case on disk (`attngen fuzz --decode`), and its replay.

The directory is a forward reproducer's (attngen/fuzz/reproducer.py): spec.yaml and case.json. Its
case.json says "kind": "decode" (format DECODE_FORMAT) and holds
  case      every DecodeCase field but the spec: lengths, seq_q, heads_kv, page_size (null:
            contiguous), extra_pages, shared_pages, spare_pages, num_splits (null: the kernel's
            choice), logit_scale, data_seed; the inputs, NaN guards and page table follow from them
  derived   what follows from the case and spec.yaml (shapes, capacity, dtype, scale): checked on
            loading, so an edited file is refused rather than replaying another case
and, as a forward one, the digest of the inputs, the kernel (the decode plan's name), the
failure and the machine. `attngen fuzz --replay DIR` reads the kind and replays it with a decode
runner; warnings as for a forward replay.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import attngen
from attngen.fuzz.check import CaseResult
from attngen.fuzz.decode_check import run_decode_case
from attngen.fuzz.paged import DecodeCase, decode_input_digest
from attngen.fuzz.reproducer import (
    SPEC_FILE,
    Reproducer,
    json_leaves,
    json_lookup,
    machine_warnings,
    replay_command,
    write_files,
)
from attngen.fuzz.runners import Machine
from attngen.specfile import load_spec

DECODE_FORMAT = 1
CASE_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeCase) if f.name != "spec")


def decode_case_record(case: DecodeCase) -> dict:
    """What case.json says about the case itself (also the basis of the directory name)."""
    fields = {name: getattr(case, name) for name in CASE_FIELDS}
    fields["lengths"] = list(case.lengths)
    paged = case.page_size is not None
    head_dim = case.spec.head_dim
    return {
        "case": fields,
        "derived": {
            "batch": case.batch, "heads_q": case.heads_q, "head_dim": head_dim, "dtype": case.spec.dtype,
            "effective_scale": case.spec.effective_scale, "capacity": case.capacity,
            "q": [case.batch, case.seq_q, case.heads_q, head_dim],
            "k_cache": ([case.num_pages, case.page_size, case.heads_kv, head_dim] if paged
                        else [case.batch, case.capacity, case.heads_kv, head_dim]),
            "page_table": [case.batch, case.capacity // case.page_size] if paged else None,
        },
    }


def write_decode_reproducer(directory: Path, case: DecodeCase, *, kernel: str, machine: Machine,
                            failure: CaseResult | None = None) -> Path:
    record = {
        "kind": "decode",
        "format": DECODE_FORMAT,
        "attngen_version": attngen.__version__,
        "torch_version": torch.__version__,
        "machine": dataclasses.asdict(machine),
        "kernel": kernel,
        **decode_case_record(case),
        "data": {"sha256": decode_input_digest(case)},
        "failure": None if failure is None else {"kind": failure.kind, "detail": failure.detail},
        "replay": replay_command(Path(directory)),
    }
    return write_files(directory, case.spec, kernel, record)


def load_decode_reproducer(directory: Path, record: dict) -> Reproducer:
    """The Reproducer of a case.json of kind "decode" (reproducer.load_reproducer reads the file and
    names it in any error raised here)."""
    if record["format"] != DECODE_FORMAT:
        raise ValueError(f"format={record['format']!r} is not supported for a decode case; allowed: {DECODE_FORMAT} "
                         "(rerun `attngen fuzz --decode` to write a new reproducer)")
    case = _case_from_record(record, load_spec(Path(directory) / SPEC_FILE))
    return Reproducer(Path(directory), case, record["kernel"], None, record["data"]["sha256"], record["failure"],
                      Machine(**record["machine"]), record["attngen_version"], kind="decode")


def _case_from_record(record: dict, spec) -> DecodeCase:
    fields = record["case"]
    if not isinstance(fields, dict):
        raise ValueError(f"case={fields!r} is invalid; allowed: an object of the fields {', '.join(CASE_FIELDS)}")
    for name in CASE_FIELDS:
        if name not in fields:
            raise KeyError(f"case.{name}")
    unknown = sorted(set(fields) - set(CASE_FIELDS))
    if unknown:
        raise ValueError(f"case.{unknown[0]} is not a decode case field; allowed: {', '.join(CASE_FIELDS)}")
    lengths = fields["lengths"]
    case = DecodeCase(spec, **{**fields, "lengths": tuple(lengths) if isinstance(lengths, list) else lengths})
    # Every derived field must agree with spec.yaml and the case: an edited file would otherwise
    # replay another case than the one it describes.
    for name, actual in json_leaves({"derived": decode_case_record(case)["derived"]}):
        recorded = json_lookup(record, name)
        if recorded != actual:
            raise ValueError(f"{name}={recorded!r} disagrees with {SPEC_FILE} and the case's fields (was the file "
                             f"edited?); allowed: {actual!r}")
    return case


def replay_decode(reproducer: Reproducer, runner) -> tuple[CaseResult, list[str]]:
    """Run the reproducer's decode case with a decode runner; also return warnings about what differs
    from when it was written."""
    case = reproducer.case
    warnings = []
    if decode_input_digest(case) != reproducer.digest:
        warnings.append(f"the inputs regenerated from seed {case.data_seed} differ from the recorded ones (another "
                        "torch version?): this replay may not reproduce the failure")
    kernel = runner.kernel_name(case.spec, case.page_size)
    if kernel != reproducer.kernel:
        warnings.append(f"recorded for kernel {reproducer.kernel}; this GPU runs {kernel} (another target, or "
                        "default config?)")
    return run_decode_case(case, runner), warnings + machine_warnings(reproducer, runner)
