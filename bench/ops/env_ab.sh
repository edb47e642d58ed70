#!/usr/bin/env bash
# A/B of an environment switch on `primus benchmark` in one device call: FAMILIES (default norm)
# run ROUNDS times (default 2) without and with ENV_B ("VAR=value ..."), interleaved, from the
# carried CUDA build (.carry-cuda/primus.gz); prints each run's table against a same-size copy and
# a median summary of every case (ours, both sides). GTEST=<binary:filter> first runs those GPU
# tests of the carried test binary (e.g. test_turbo_gpu:*Norm*).
#   run(command="ENV_B=PRIMUS_TURBO_NORM_BWD_FINISH=launch GTEST='test_turbo_gpu:*Norm*' bash bench/ops/env_ab.sh",
#       carry=[".carry-cuda"])
set -u
CARRY=${CARRY:-.carry-cuda}
OUT=${OUT:-/tmp/env-ab-out}
BIN=/tmp/env-ab-bin
FAMILIES=${FAMILIES:-norm}
ROUNDS=${ROUNDS:-2}
lt=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null)
cudnn=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=${lt:-/nonexistent}:${cudnn:-/nonexistent}:${LD_LIBRARY_PATH:-}
export PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
# shellcheck disable=SC1091
source bench/ops/carry_setup.sh  # $BIN (the carry unpacked) first on LD_LIBRARY_PATH, COMMIT, $OUT/env.txt
# shellcheck disable=SC1091
source bench/ops/gtest_stage.sh
gtest_stage "$BIN" "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  timeout 240 "$BIN/primus" benchmark $FAMILIES --backend TURBO --json "$OUT/a_$r.jsonl" --commit "$COMMIT" \
    > "$OUT/a_$r.log" 2>&1
  env ${ENV_B:-} timeout 240 "$BIN/primus" benchmark $FAMILIES --backend TURBO --json "$OUT/b_$r.jsonl" \
    --commit "$COMMIT" > "$OUT/b_$r.log" 2>&1
done
echo "== round 1, A (default), against a copy:"; sed -n '/against a copy/,$p' "$OUT/a_1.log"
echo "== round 1, B (${ENV_B:-}):"; sed -n '/against a copy/,$p' "$OUT/b_1.log"
python3 - "$OUT" "$ROUNDS" "${ENV_B:-}" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys
out, rounds, envb = sys.argv[1], int(sys.argv[2]), sys.argv[3]
vals = {}
for side in "ab":
    for r in range(1, rounds + 1):
        try:
            for line in open(f"{out}/{side}_{r}.jsonl"):
                j = json.loads(line)
                if j["case"].startswith(("copy/", "ceiling/")): continue
                vals.setdefault((j["case"], j["metric"]), {}).setdefault(side, []).append(j["ours"])
        except FileNotFoundError:
            pass
print(f"median of {rounds} rounds; B = {envb}")
print(f"{'case':44} {'metric':8} {'A':>10} {'B':>10} {'A/B':>7}")
for (case, metric), v in sorted(vals.items()):
    a = statistics.median(v.get("a", [float("nan")])); b = statistics.median(v.get("b", [float("nan")]))
    print(f"{case:44} {metric:8} {a:10.1f} {b:10.1f} {a / b:7.3f}")
PY
