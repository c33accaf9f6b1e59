#!/usr/bin/env bash
# Device calls for "Causal's diagonal last, by rule" (docs/perf-notes.md, 2026-12-08), each part one call:
#   bash bench/results/dev/forward-walk-run-2026-12-08.sh ab      (the committed headers against the tree's)
#   bash bench/results/dev/forward-walk-run-2026-12-08.sh tests1  (GPU forward file)
#   bash bench/results/dev/forward-walk-run-2026-12-08.sh tests2  (masks, varlen, block sparsity, backward, a fuzz sample)
# Each part applies bench/results/dev/fwd-sm90-causal-diagonal-last-by-rule-untested-2026-12-08.patch to the
# device's copy of the tree first (built offline on 2026-12-08, never run: no device was lent after it was
# written). The base, the committed headers, is written here first and carried (run's carry: .ab/base.cuh):
#   python bench/sm90_versions.py git:HEAD > .ab/base.cuh
# A fourth part runs the GPU tests of the committed int(name) reads on the committed tree (no patch):
#   bash bench/results/dev/forward-walk-run-2026-12-08.sh intreads
set -u
part=${1:?ab, tests1, tests2 or intreads}
if [ "$part" = intreads ]; then
  OUT=${OUT:-/tmp/attngen-out}; mkdir -p "$OUT"
  PYTHONPATH=. timeout 400 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_masks.py \
      tests/test_gpu_backward.py tests/test_gpu_varlen.py -k "shares_the_masks_offsets or over_shared_int_offsets or \
      reads_int_offsets_exactly or context_parallel" > $OUT/gpu-tests-int-reads.log 2>&1
  echo rc=$?; tail -4 $OUT/gpu-tests-int-reads.log; exit 0
fi
patch -s --no-backup-if-mismatch -p1 < bench/results/dev/fwd-sm90-causal-diagonal-last-by-rule-untested-2026-12-08.patch || exit 1
OUT=${OUT:-/tmp/attngen-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ATTNGEN_CACHE_DIR=/tmp/attngen-cache PYTHONPATH=.:bench
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
case $part in
  ab)
    timeout 560 python3 bench/sm90_ab_probe.py --base .ab/base.cuh --rounds 3 documents d128-causal-512 \
        d128-causal-1k d128-causal-2k d128-causal-8k gqa-causal-8k d64-causal-2k d256-causal-2k window4096-16k \
        d128-none-2k d128-causal-16k 2>&1 | tee $OUT/forward-walk-ab.txt | tail -12 ;;
  tests1)
    timeout 560 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_forward.py \
        > $OUT/gpu-tests-forward.log 2>&1; echo rc=$?; tail -4 $OUT/gpu-tests-forward.log ;;
  tests2)
    timeout 420 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_masks.py tests/test_gpu_varlen.py \
        tests/test_gpu_varlen_tiles.py tests/test_gpu_block_sparse.py tests/test_gpu_backward.py \
        > $OUT/gpu-tests-masks-varlen-sparse-backward.log 2>&1; echo rc=$?; tail -4 $OUT/gpu-tests-masks-varlen-sparse-backward.log
    timeout 120 python3 -m attngen.cli fuzz --examples 1500 --time-budget 100 --seed 311 --out $OUT/fuzz > $OUT/fuzz.log 2>&1
    echo fuzz rc=$?; tail -3 $OUT/fuzz.log ;;
  *) echo "part $part: allowed ab, tests1, tests2" >&2; exit 2 ;;
esac
