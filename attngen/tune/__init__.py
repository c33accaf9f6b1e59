"""The search over kernel families and their configs (`attngen tune`, `attngen check --configs`), one job
per module. It reaches kernels only through the family protocol (attngen/families/base.py):

  space.py      the candidates of a spec on a target: (family, config) of every family that can run it
  resources.py  nvcc resource reports in parallel processes, and the pruning verdicts
  model.py      what every family's time model shares: GPU rates, occupancy, shapes (no GPU)
  ranking.py    prune + each family's estimate() + order: what is known before touching a GPU
  search.py     timing on the GPU within a budget, verification, storing the winner
  db.py         the SQLite tuning database (schema version 2, migrating version 1), export and import
  lookup.py     the dispatcher's questions: has a result changed (stamp), which family and config (tuned)
  report.py     tables, rank correlation
  commands.py   the bodies of the CLI commands

Importing this package is cheap (the dispatcher consults lookup.py on every call).
"""
