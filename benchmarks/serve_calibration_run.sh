#!/usr/bin/env bash
# One measured serve run for the simulator's serving overheads (benchmarks/RESULTS.md,
# "Simulator vs a measured serve run"): starts `pdcluster serve` (tiny, disaggregated, fp8
# KV wire) on its own ports, snapshots it (benchmarks/serve_probe.py), runs
# `pdcluster bench serve` at RATE req/s, snapshots again, stops the server.
#
#   flock /tmp/pdcluster-bench.lock bash benchmarks/serve_calibration_run.sh RATE TAG [DURATION]
#
# Writes benchmarks/out/serve_TAG.json (bench), serve_TAG.idle.json / .before.json /
# .after.json (snapshots: 10 s idle, then the run), serve_TAG.bench_cpu and
# .client_startup_cpu (the load generator's CPU seconds: the run, and its imports alone),
# serve_TAG.engine_before.json / .engine_after.json (`sim_bench measure-cpu` right before
# and after the run: the bare engine's speed then) and serve_TAG.log.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=$1
TAG=$2
DURATION=${3:-30}
PORT=${PORT:-8021}
GRPC_PORT=${GRPC_PORT:-50071}
OUT=benchmarks/out
mkdir -p "$OUT"
export PDCLUSTER_STATE="$OUT/serve_$TAG.state.json"
rm -f "$PDCLUSTER_STATE"

.venv/bin/pdcluster serve --mode disaggregated --kv-wire-dtype fp8 --port "$PORT" \
  --grpc-port "$GRPC_PORT" >"$OUT/serve_$TAG.log" 2>&1 &
SERVER=$!
stop() { kill -INT "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap stop EXIT
for _ in $(seq 180); do
  if [ -s "$PDCLUSTER_STATE" ] && curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
    break
  fi
  kill -0 "$SERVER" || { echo "server exited"; cat "$OUT/serve_$TAG.log"; exit 1; }
  sleep 1
done
sleep 5  # let start-up work (calibration, first stats) settle
# An idle window first: what the router, Ray and the actors use with no traffic.
.venv/bin/python -m benchmarks.serve_probe snapshot --state "$PDCLUSTER_STATE" \
  --out "$OUT/serve_$TAG.idle.json"
sleep 10
/usr/bin/time -f "%U %S %e" -o "$OUT/serve_$TAG.client_startup_cpu" \
  .venv/bin/pdcluster bench serve --help >/dev/null
# The bare engine's speed on this machine now (it drifts by up to ~2x on this shared host).
.venv/bin/python -m benchmarks.sim_bench measure-cpu --out "$OUT/serve_$TAG.engine_before.json"
.venv/bin/python -m benchmarks.serve_probe snapshot --state "$PDCLUSTER_STATE" \
  --out "$OUT/serve_$TAG.before.json"
/usr/bin/time -f "%U %S %e" -o "$OUT/serve_$TAG.bench_cpu" \
  .venv/bin/pdcluster bench serve --url "http://127.0.0.1:$PORT" --rate "$RATE" \
  --duration "$DURATION" --input-len uniform:64:512 --output-len uniform:16:128 \
  --slo-ttft-ms 500 --slo-tpot-ms 50 --seed 1 --json-out "$OUT/serve_$TAG.json"
.venv/bin/python -m benchmarks.serve_probe snapshot --state "$PDCLUSTER_STATE" \
  --out "$OUT/serve_$TAG.after.json"
.venv/bin/python -m benchmarks.sim_bench measure-cpu --out "$OUT/serve_$TAG.engine_after.json"
