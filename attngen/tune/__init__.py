"""Block-size search (`attngen tune`, `attngen check --configs`), one job per module:

  space.py      the candidate tiles of a spec (the spec's and the plan's own rules)
  resources.py  nvcc resource reports in parallel processes, and the pruning verdicts
  model.py      occupancy and the roofline time model (no GPU)
  ranking.py    prune + estimate + order: what is known before touching a GPU
  search.py     timing on the GPU within a budget, verification, storing the winner
  db.py         the SQLite tuning database, export and import
  lookup.py     the runtime's question: which tile for this untiled spec and shape?
  report.py     progress bars, tables, rank correlation
  commands.py   the bodies of the CLI commands

Importing this package is cheap (attngen.attention consults lookup.py on every call).
"""
