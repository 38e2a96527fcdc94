#!/usr/bin/env bash
# One `pdcluster bench serve` run per mode on the default model, the same load for both:
#   RATE=0.3 DUR=60 TAG=run OUT=/tmp/serve benchmarks/serve_pair.sh
# 128 in / 32 out, Poisson, seed 1; each server on 127.0.0.1:8000, stopped after its run.
set -u
cd "$(dirname "$0")/.."
RATE=${RATE:-0.3}; DUR=${DUR:-60}; TAG=${TAG:-run}; OUT=${OUT:-/tmp/serve}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
for MODE in disaggregated colocated; do
  .venv/bin/pdcluster serve --mode $MODE $EXTRA > "$OUT/$TAG-$MODE-serve.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 1 240); do
    curl -sf localhost:8000/health 2>/dev/null | grep -q '"ok"' && break
    sleep 1
  done
  .venv/bin/pdcluster bench serve --rate "$RATE" --duration "$DUR" --input-len 128 \
    --output-len 32 --seed 1 --json-out "$OUT/$TAG-$MODE.json" > "$OUT/$TAG-$MODE.txt" 2>&1
  curl -s localhost:8000/metrics > "$OUT/$TAG-$MODE-metrics.txt"
  kill -INT $SERVE; wait $SERVE
  echo "== $MODE"; cat "$OUT/$TAG-$MODE.txt"
done
