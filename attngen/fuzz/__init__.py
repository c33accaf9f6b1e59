"""`attngen fuzz`: property-based correctness fuzzing of generated kernels against the reference.

One job per module:
  case.py        FuzzCase (spec, shape, memory layout, data seed) and its deterministic, poisoned inputs
  pool.py        the specs to fuzz, asked of the kernel families: every family that supports a problem
                 on the runner's target, with its default and a few other configs; random specs
  expressions.py random mask and score-modifier text from the whole grammar (random specs, CPU tests)
  strategies.py  hypothesis strategies over spec x shape x data, with the edge cases kernels get wrong
  runners.py     the thing under test: the compiled kernel for the GPU's target (optionally with a
                 deliberate fault), or the reference itself (to test the harness without a GPU)
  check.py       run one case, compare with the reference (attngen.tolerance), classify the failure
                 (a kernel failure kind, or a harness error)
  search.py      the hypothesis-driven search: examples, seed, time budget, shrinking, per-kernel stats
  reproducer.py  write a failing case to disk (spec YAML + case JSON); load and replay it
  sanitizer.py   compute-sanitizer (memcheck, racecheck, synccheck) over a sample of cases, one process each
  report.py      progress (attngen.progress) and summary tables (rich when installed, plain text otherwise)
  command.py     the `attngen fuzz` command
The paged decode regime (`attngen fuzz --decode`, attngen.decode against KV caches):
  paged.py              DecodeCase, its NaN-guarded caches and page tables, the check against the reference,
                        the hypothesis strategy
  decode_runners.py     the thing under test: attngen.decode on the GPU, or the reference on the CPU
  decode_check.py       run one decode case, classify the failure (or a harness error)
  decode_search.py      search.py's search over decode cases; per-kernel stats, the sanitizer's sample
  decode_reproducer.py  a decode case on disk (case.json of kind "decode"); load and replay it
  decode_command.py     what --decode does differently: its pool, limits, search and table

Nothing here imports torch or hypothesis at import time, so `attngen --help` needs neither.
"""
