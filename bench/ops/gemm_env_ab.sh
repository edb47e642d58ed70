#!/usr/bin/env bash
# A/B of an environment switch on the GEMM benchmark in one device call: `primus benchmark gemm`
# (TURBO and CUBLASLT interleaved per case, so each run's TURBO / cuBLASLt ratio is a same-process
# comparison) over SHAPES, ROUNDS times (default 2) without and with ENV_B ("VAR=value ..."),
# alternating A and B. Prints per case the medians of TURBO under A and B, cuBLASLt (all runs),
# B / A and both ratios to cuBLASLt; raw lines in $OUT/{a,b}_<round>.jsonl. GTEST=<binary:filter>
# first runs those GPU tests of the carried test binary. B_BIN=<primus.gz in the tree> makes side
# B another build (with ENV_B too, if given): an A/B of two binaries.
#   run(command="ENV_B=PRIMUS_TURBO_GEMM_TMA_STORE=0 GTEST='test_turbo_gpu:*Staged*' bash bench/ops/gemm_env_ab.sh",
#       carry=[".carry-cuda"])
set -u
CARRY=${CARRY:-.carry-cuda}
OUT=${OUT:-/tmp/gemm-ab-out}
BIN=/tmp/gemm-ab-bin
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-30}
# GPT-2's training products (with their epilogues) and plain products of GPT-2 and Llama-3.2-1B.
SHAPES=${SHAPES:-16384x3072x768+gelu,16384x768x3072+dgelu,16384x2304x768+bias,16384x768x768+bias,16384x2304x768,16384x3072x768,16384x768x3072,16384x2048x2048,16384x1024x2048,16384x2048x8192}
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname "${lt:-/x/x}"):${LD_LIBRARY_PATH:-}
# shellcheck disable=SC1091
source bench/ops/carry_setup.sh  # $BIN (the carry unpacked) first on LD_LIBRARY_PATH, COMMIT, $OUT/env.txt
PRIMUS_B=$BIN/primus
if [ -n "${B_BIN:-}" ]; then gunzip -c "$B_BIN" > "$BIN/primus_b" && chmod +x "$BIN/primus_b" && PRIMUS_B=$BIN/primus_b; fi
# shellcheck disable=SC1091
source bench/ops/gtest_stage.sh
gtest_stage "$BIN" "$OUT" 400
for r in $(seq 1 "$ROUNDS"); do
  timeout 240 "$BIN/primus" benchmark gemm --shapes "$SHAPES" --iters "$ITERS" --json "$OUT/a_$r.jsonl" \
    --commit "$COMMIT" > "$OUT/a_$r.log" 2>&1 || echo "A round $r: rc=$?"
  env ${ENV_B:-} timeout 240 "$PRIMUS_B" benchmark gemm --shapes "$SHAPES" --iters "$ITERS" \
    --json "$OUT/b_$r.jsonl" --commit "$COMMIT" > "$OUT/b_$r.log" 2>&1 || echo "B round $r: rc=$?"
done
python3 - "$OUT" "$ROUNDS" "${ENV_B:-}" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys
out, rounds, envb = sys.argv[1], int(sys.argv[2]), sys.argv[3]
vals = {}  # (case, side) -> [TFLOP/s]
for side in "ab":
    for r in range(1, rounds + 1):
        try:
            lines = open(f"{out}/{side}_{r}.jsonl").read().splitlines()
        except OSError:
            continue
        for l in lines:
            j = json.loads(l)
            if j.get("metric") != "TFLOP/s" or not j["case"].startswith("gemm/"):
                continue
            key = "lt" if j["backend"] == "CUBLASLT" else side if j["backend"] == "TURBO" else None
            if key:
                vals.setdefault((j["case"], key), []).append(j["ours"])
med = {k: statistics.median(v) for k, v in vals.items()}
print(f"A: default, B: {envb or 'B_BIN'}; medians of {rounds} rounds, TFLOP/s")
print(f"{'case':<46}{'TURBO A':>9}{'TURBO B':>9}{'cuBLASLt':>9}{'B/A':>7}{'A/LT':>7}{'B/LT':>7}")
for case in sorted({c for c, _ in med}, key=lambda c: list(dict.fromkeys(c for c, _ in vals)).index(c)):
    a, b, lt = med.get((case, "a")), med.get((case, "b")), med.get((case, "lt"))
    f = lambda x: f"{x:9.1f}" if x else f"{'-':>9}"
    g = lambda x, y: f"{x / y:7.3f}" if x and y else f"{'-':>7}"
    print(f"{case:<46}{f(a)}{f(b)}{f(lt)}{g(b, a)}{g(a, lt)}{g(b, lt)}")
PY
