#!/usr/bin/env bash
# One device call: `primus projection` against runs on this GPU. It fills the rates cache with
# `primus benchmark ... --cache` (the ops of a training step, on this device), then per case
# (CASES, default GPT-2 124M at micro-batch 16 x 1024, Llama-3.2-1B at 8 x 2048, olmoe-mini at
# 4 x 2048, all on mock data, one micro-batch per step) projects memory and step time
# (`primus projection both --json`, same overrides as the run) and trains STEPS steps (default
# 30), then compares:
#   peak memory   projected total per GPU vs max(mem_gib) of metrics.jsonl (device-wide: cudaMemGetInfo,
#                 the CUDA context and libraries included)
#   arenas        projected parts inside the model's arenas vs max(arena_gib) (the plan's own sizes:
#                 should agree to the metric's rounding)
#   step time     projected step_seconds vs the median step_s of the last MEASURE steps (default 20)
# and prints that table last. Rows in DESIGN.md's "Measurements" format go to
# $OUT/projection.jsonl (bench "projection"; ours = projected, anchor = measured in the same call,
# ratio = projected / measured, rel_error = (projected - measured) / measured); the projections,
# the rates cache and the benchmark lines are in $OUT too. From the repository root, with
# .carry-projection (bench/projection/prepare_carry.sh):
#   run(command="bash bench/projection/run_on_gpu.sh", carry=[".carry-projection"])
# BENCH=0 skips the benchmark (the projection then uses the roofline of the device's name);
# BENCH_OPS, BENCH_ITERS (default 20) and BENCH_TIMEOUT (default 300 s) shape it.
set -u
CARRY=${CARRY:-.carry-projection}
OUT=${OUT:-/tmp/projection-out}
W=/tmp/projection-work
BIN=/tmp/projection-bin
STEPS=${STEPS:-30}
MEASURE=${MEASURE:-20}
CASES=${CASES:-"gpt2-124M:gpt2-124M-shakespeare:16:1024 llama3.2-1B:llama3.2-1B:8:2048 olmoe-mini:olmoe-mini:4:2048"}
mkdir -p "$OUT" "$BIN" "$W"
# shellcheck source=scripts/gpu_carry.sh
source scripts/gpu_carry.sh
export PRIMUS_RATES_CACHE=$OUT/rates.json
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  echo "commit $COMMIT"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${BENCH:-1}" != 0 ]; then
  rm -f "$PRIMUS_RATES_CACHE"
  # shellcheck disable=SC2086  # the op families are words
  timeout "${BENCH_TIMEOUT:-300}" "$BIN/primus" benchmark ${BENCH_OPS:-gemm grouped_gemm attention norm activation loss optimizer} \
    --iters "${BENCH_ITERS:-20}" --json "$OUT/benchmark.jsonl" --cache > "$W/benchmark.log" 2>&1
  echo "benchmark rc=$?"
  grep -E "^rates of|error" "$W/benchmark.log" | tail -3
fi

ws=/tmp/primus-projection-ws
: > "$OUT/table.txt"
for c in $CASES; do
  IFS=: read -r name example mb seq <<< "$c"
  # The run's overrides; the projection gets the same ones.
  ov="mock_data=true micro_batch_size=$mb global_batch_size=$mb train_iters=$STEPS eval_interval=0 save_interval=0
      save_at_end=false log_interval=5 workspace=$ws exp_name=p"
  # shellcheck disable=SC2086  # the overrides are words
  timeout 120 "$BIN/primus" projection both --json --config "examples/cuda/$example.yaml" $ov \
    > "$OUT/$name.projection.json" 2> "$W/$name.projection.err"
  echo "$name projection rc=$?"
  rm -rf "$ws"
  # shellcheck disable=SC2086
  timeout 300 "$BIN/primus" train pretrain --config "examples/cuda/$example.yaml" $ov > "$W/$name.log" 2>&1
  echo "$name train rc=$?"
  cp "$ws"/*/*/p/metrics.jsonl "$W/$name.metrics.jsonl" 2>/dev/null
  python3 - "$W" "$OUT" "$name" "$mb" "$seq" "$DEVICE" "$COMMIT" "$MEASURE" <<'PY'
import datetime, json, os, statistics, sys
work, out, name, mb, seq, device, commit, measure = sys.argv[1:9]
measure = int(measure)
case = f"{name}/b{mb}/t{seq}/mock"
def tail_of(path):
    try:
        return " ".join(open(path).read().split()[-40:])
    except OSError:
        return "no output"
try:
    proj = json.load(open(os.path.join(out, f"{name}.projection.json")))
except Exception:
    proj = None
try:
    steps = [json.loads(l) for l in open(os.path.join(work, f"{name}.metrics.jsonl")) if '"step_s"' in l]
except OSError:
    steps = []
if not proj or not steps:
    why_p = "ok" if proj else "failed: " + tail_of(os.path.join(work, f"{name}.projection.err"))
    why_r = "ok" if steps else "failed: " + tail_of(os.path.join(work, f"{name}.log"))
    line = f"{case}: no comparison (projection {why_p}; run {why_r})"
else:
    gib = float(1 << 30)
    parts = proj["memory"]["parts"]
    pred = {
        "peak_memory_gib": proj["memory"]["total_bytes"] / gib,
        "arena_gib": sum(p["bytes"] for p in parts if p["name"] not in ("runtime", "comm")) / gib,
        "step_s": proj["time"]["step_seconds"],
    }
    tail = steps[-measure:]
    meas = {
        "peak_memory_gib": max(s.get("mem_gib", 0) for s in steps),
        "arena_gib": max(s.get("arena_gib", 0) for s in steps),
        "step_s": statistics.median(s["step_s"] for s in tail),
    }
    what = {
        "peak_memory_gib": "measured: max mem_gib of the run's metrics.jsonl (device-wide, CUDA context included)",
        "arena_gib": "measured: max arena_gib of the run's metrics.jsonl (the model's arenas)",
        "step_s": f"measured: median step_s of the run's last {len(tail)} steps",
    }
    base = {"bench": "projection", "case": case, "device": device, "date": datetime.date.today().isoformat(),
            "commit": commit}
    cells = []
    with open(os.path.join(out, "projection.jsonl"), "a") as f:
        for k in ("peak_memory_gib", "arena_gib", "step_s"):
            p, m = pred[k], meas[k]
            rel = (p - m) / m if m else None
            f.write(json.dumps(dict(base, metric=k, ours=round(p, 4), anchor=round(m, 4), anchor_name=what[k],
                                    ratio=round(p / m, 4) if m else None,
                                    rel_error=round(rel, 4) if rel is not None else None,
                                    rates=proj["time"]["rates_source"])) + "\n")
            unit = "s" if k == "step_s" else " GiB"
            cells.append(f"{k} {p:.3f}{unit} vs {m:.3f}{unit} ({100 * rel:+.1f}%)" if rel is not None else f"{k} n/a")
    line = f"{case}: " + "; ".join(cells)
with open(os.path.join(out, "table.txt"), "a") as f:
    f.write(line + "\n")
print(line, flush=True)
PY
done
tar -czf "$OUT/logs.tar.gz" -C "$W" . 2>/dev/null
echo
echo "projected vs measured on $DEVICE (commit $COMMIT; projected (measured), relative error):"
cat "$OUT/table.txt"
