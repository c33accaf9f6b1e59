#!/usr/bin/env bash
# Device calls for the offline builds of 2026-12-07 (docs/perf-notes.md "Two builders, each of a fixed
# width", "A tile's partial blocks last", "K a block ahead of V" with its two-stage variant), from a clean tree at the commit that
# added this script; each part fits one call (<= 10 minutes; kernels compile on first use):
#   bash bench/results/dev/offline-builds-run-2026-12-07.sh tests   (GPU tests, racecheck)
#   bash bench/results/dev/offline-builds-run-2026-12-07.sh timing  (the builders; K ahead as configs)
#   bash bench/results/dev/offline-builds-run-2026-12-07.sh variants  (partial blocks last; the K-ahead order)
#   bash bench/results/dev/offline-builds-run-2026-12-07.sh timeline  (the tile timeline, default and both K-ahead forms)
# Each part copies the committed tree to .ab/base, makes .ab/partial-last (the committed fwd_sm90 headers with
# the partial-blocks-last patch), then applies the K-ahead patch to the tree (no generated/: the device checks
# kernels; regenerate before landing). Logs under $OUT. Run on 2026-12-08: timing (builders landed, the k config
# lost); 2026-12-08 again: variants and timeline (neither kept as it was; docs/perf-notes.md).
set -u
part=${1:?tests, timing, variants or timeline}
OUT=${OUT:-/tmp/attngen-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ATTNGEN_CACHE_DIR=/tmp/attngen-cache
DEV=bench/results/dev
rm -rf .ab/base .ab/partial-last && mkdir -p .ab/base && cp -r attngen .ab/base/
cp -r attngen/families/fwd_sm90 .ab/partial-last
patch -s -d .ab/partial-last -p4 < $DEV/fwd-sm90-partial-blocks-last-untested-2026-12-07.patch || exit 1
# (the builders' patch landed on 2026-12-08; the K-ahead one, not kept, is still what the variants need)
patch -s --no-backup-if-mismatch -p1 < $DEV/fwd-sm90-k-a-block-ahead-of-v-not-kept-2026-12-07.patch || exit 1  # (without generated/)
rm -rf .ab/k-order && cp -r attngen/families/fwd_sm90 .ab/k-order  # the K-ahead order on two K stages (a variant)
patch -s -d .ab/k-order -p4 < $DEV/fwd-sm90-k-ahead-order-on-two-stages-not-kept-2026-12-07.patch || exit 1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
if [ "$part" = tests ]; then
  echo "== GPU tests: the varlen files (both builders; documents on the deeper K ring), the deeper K ring forward"
  PYTHONPATH=. timeout 330 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_varlen_tiles.py \
      tests/test_gpu_varlen.py "tests/test_gpu_forward.py::test_a_k_ring_a_stage_deeper_than_v_ring" \
      > $OUT/gpu-tests.log 2>&1; echo rc=$?; tail -3 $OUT/gpu-tests.log
  echo "== racecheck, both builders"
  PYTHONPATH=. timeout 150 compute-sanitizer --tool racecheck --report-api-errors no --kernel-name kns=_tiles \
      python3 bench/varlen_builder_sanitize.py > $OUT/racecheck-builders.log 2>&1; echo rc=$?
  tail -4 $OUT/racecheck-builders.log
  exit 0
fi
if [ "$part" = timeline ]; then
  echo "== tile timeline: the default, K a block ahead on three K stages, the K-ahead order on two"
  for how in "" "--config m128n128s2kopd" "--headers .ab/k-order"; do
    echo "-- ${how:-default}"
    PYTHONPATH=.:bench timeout 150 python3 bench/tile_timeline.py $how documents 2>&1 | grep -v "late CTA"
  done 2>&1 | tee $OUT/tile-timeline-k-ahead.txt
  exit 0
fi
if [ "$part" = variants ]; then
  echo "== partial blocks last; the K-ahead order on two K stages (base: the committed headers; new: the tree's, a control)"
  PYTHONPATH=.:bench timeout 540 python3 bench/sm90_ab_probe.py --base .ab/base/attngen/families/fwd_sm90 \
      --variant partial-last=.ab/partial-last --variant k-order=.ab/k-order --rounds 3 documents d128-causal-2k \
      window4096-16k d128-causal-16k 2>&1 | tee $OUT/partial-last-and-k-order-ab.txt | tail -6
  exit 0
fi
[ "$part" = timing ] || { echo "part $part: allowed tests, timing, variants, timeline" >&2; exit 2; }
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
echo "== K a block ahead of V, and three stages of each at 96 keys (configs of the tree)"
PYTHONPATH=.:bench timeout 200 python3 bench/sm90_ab_probe.py --configs --rounds 3 \
    --labels m128n128s2opd,m128n128s2kopd,m128n96s3opd,m128n128s2opr,m128n128s2kopr documents d128-causal-2k \
    d128-causal-16k \
    2>&1 | tee $OUT/k-ahead-ab.txt | tail -6
