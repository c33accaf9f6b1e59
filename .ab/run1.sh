#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 ATTNGEN_CACHE_DIR=/tmp/attngen-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee $OUT/gpu.txt
timeout 200 python3 bench/prefix_probe.py --out $OUT > $OUT/probe.log 2>&1; echo "probe rc $?"
tail -30 $OUT/probe.log
timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_masks.py tests/test_gpu_varlen_tiles.py -k "fwd_sm90 or test_gpu_varlen_tiles" > $OUT/gpu-tests.log 2>&1; echo "tests rc $?"
grep -E "^(FAILED|ERROR)" $OUT/gpu-tests.log | head; tail -2 $OUT/gpu-tests.log
timeout 120 python3 -m attngen.cli fuzz --examples 2000 --time-budget 100 --seed 17 --out $OUT/fuzz > $OUT/fuzz.log 2>&1; echo "fuzz rc $?"
grep -E "FAILED|replay|cases in" $OUT/fuzz.log | tail -5
