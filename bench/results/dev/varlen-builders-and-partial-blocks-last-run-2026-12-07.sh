#!/usr/bin/env bash
# One device call for two offline builds of 2026-12-07 (docs/perf-notes.md "Two builders, each of a fixed
# width" and "A tile's partial blocks last"), from a clean tree at the commit that added this script:
#   bash bench/results/dev/varlen-builders-and-partial-blocks-last-run-2026-12-07.sh
# It copies the committed tree to .ab/base, applies the builders' patch to the tree (with its tests and
# generated/), makes .ab/partial-last (the fwd_sm90 headers with the partial-blocks-last patch), then runs:
# the varlen GPU files, the builders' timing against the committed builder, the fwd_sm90 A/B of the block
# order, and racecheck of both builders. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/attngen-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ATTNGEN_CACHE_DIR=/tmp/attngen-cache
DEV=bench/results/dev
rm -rf .ab/base .ab/partial-last && mkdir -p .ab/base && cp -r attngen .ab/base/
cp -r attngen/families/fwd_sm90 .ab/partial-last
patch -s -d .ab/partial-last -p4 < $DEV/fwd-sm90-partial-blocks-last-untested-2026-12-07.patch || exit 1
patch -s -p1 < $DEV/varlen-builders-of-fixed-widths-untested-2026-12-07.patch || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
echo "== GPU tests, the varlen files"
PYTHONPATH=. timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_varlen_tiles.py \
    tests/test_gpu_varlen.py > $OUT/gpu-tests-varlen.log 2>&1; echo rc=$?; tail -3 $OUT/gpu-tests-varlen.log
echo "== builders against the committed one (each tree in its own process, two rounds)"
for round in 1 2; do
  for tree in committed new; do
    if [ $tree = committed ]; then PP=.ab/base:bench; else PP=.:bench; fi
    for spec in "16 16384" "128 65536" "1024 131072"; do
      set -- $spec
      echo "round $round $tree $1 docs: $(PYTHONPATH=$PP timeout 60 python3 bench/varlen_kernel_times.py --documents $1 --tokens $2 2>&1 | tr '\n' ' ')"
    done
  done
done 2>&1 | tee $OUT/builders-ab.txt
echo "== partial blocks last, fwd_sm90 A/B (base: the committed headers)"
PYTHONPATH=.:bench timeout 240 python3 bench/sm90_ab_probe.py --base .ab/base/attngen/families/fwd_sm90 \
    --variant partial-last=.ab/partial-last --rounds 3 documents d128-causal-2k d128-causal-16k window4096-16k \
    2>&1 | tee $OUT/partial-blocks-last-ab.txt | tail -12
echo "== racecheck, both builders"
PYTHONPATH=. timeout 150 compute-sanitizer --tool racecheck --report-api-errors no --kernel-name kns=_tiles \
    python3 bench/varlen_builder_sanitize.py > $OUT/racecheck-builders.log 2>&1; echo rc=$?
tail -4 $OUT/racecheck-builders.log
