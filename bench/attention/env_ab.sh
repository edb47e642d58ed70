#!/usr/bin/env bash
# A/B of one TURBO attention environment switch in one device call: the attention GPU tests
# (GTEST_FILTER, default all), then `primus benchmark attention --backend TURBO` over SHAPES, ROUNDS
# times alternating VAR=A and VAR=B, then CUDNN once on the same shapes; a table of medians last.
# Defaults: VAR=PRIMUS_TURBO_ATTN_BWD_KERNEL A=sm90 B=sm90ws (the backward's two wgmma kernels).
# Carry: .carry-cuda with primus.gz, test_attention_gpu.gz (optional), libgomp.so.1.
# Two builds instead of (or besides) two settings: A_BIN / B_BIN name the binary each side runs
# (default primus; e.g. A_BIN=primus_base with .carry-cuda/primus_base.gz from the older commit);
# then the sides alternate as separate processes. Otherwise (INPROC=1, the default) one process
# alternates the two values per product (`primus benchmark --ab`); INPROC=0 forces processes.
# BACKEND (default TURBO; empty: CUDNN and TURBO in each process) is what the A/B runs time.
# Separate processes log the GPU's clocks, power and temperature before each to $OUT/smi.log.
# Process modes (on an H200 the same binary has read fast or slow per process): INPROC=0 VAR=PRIMUS_NONE
# A=0 B=1 BACKEND= ROUNDS=4 SHAPES=<shape>,<shape>:pad64,... gives 8 processes, each timing both
# backends at several addresses (:padN), one file per process.
#   run(command="OUT=$OUT bash bench/attention/env_ab.sh", carry=[".carry-cuda"])
set -u
OUT=${OUT:-/tmp/attn-ab-out}
VAR=${VAR:-PRIMUS_TURBO_ATTN_BWD_KERNEL}
A=${A:-sm90}
B=${B:-sm90ws}
ROUNDS=${ROUNDS:-2}
BACKEND=${BACKEND-TURBO}
BIN=/tmp/attn-ab-bin
mkdir -p "$OUT" "$BIN"
for f in .carry-cuda/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp .carry-cuda/lib*.so* "$BIN/" 2>/dev/null
cudnn=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
lt=$(ls /usr/local/cuda*/lib*/libcublasLt.so.13 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$BIN:${cudnn:-/x}:$(dirname "${lt:-/x/x}"):${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
SHAPES=${SHAPES:-8x2048x16x16x128,2x8192x16x16x128,4x4096x32x8x128,16x1024x12x12x64}
if [ -x "$BIN/test_attention_gpu" ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-400}" "$BIN/test_attention_gpu" --gtest_brief=1 --gtest_filter="${GTEST_FILTER:-*}" > "$OUT/tests.log" 2>&1
  echo "test_attention_gpu rc=$?"; grep -E "FAILED|PASSED|Failure|rel_l2" "$OUT/tests.log" | tail -12
fi
if [ -z "${A_BIN:-}${B_BIN:-}" ] && [ "${INPROC:-1}" = 1 ]; then
  # One process, the two values alternating per product (`primus benchmark --ab`): both sides share
  # the process's state. Separate processes on the H200 read either "fast" or "slow" as a whole
  # (GPT-2's TURBO forward 246 vs 205 TFLOP/s in alternate processes of the same binary).
  "$BIN/primus" benchmark attention ${BACKEND:+--backend "$BACKEND"} --iters 20 --shapes "$SHAPES" --ab "$VAR=$A,$B" --ab-rounds "$ROUNDS" \
    --json "$OUT/ab.jsonl" > "$OUT/ab.log" 2>&1 || echo "in-process A/B rc=$?"
else
  for r in $(seq "$ROUNDS"); do
    for tag in A B; do
      val=${!tag}
      bin_var=${tag}_BIN
      echo "$tag round $r: $(nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader)" >> "$OUT/smi.log"
      env "$VAR=$val" "$BIN/${!bin_var:-primus}" benchmark attention ${BACKEND:+--backend "$BACKEND"} --iters 20 --shapes "$SHAPES" \
        --json "$OUT/${tag}_$r.jsonl" > "$OUT/${tag}_$r.log" 2>&1 || echo "$tag ($VAR=$val) round $r rc=$?"
    done
  done
fi
"$BIN/primus" benchmark attention --backend CUDNN --iters 20 --shapes "$SHAPES" --json "$OUT/cudnn.jsonl" > "$OUT/cudnn.log" 2>&1
python3 - "$OUT" "$ROUNDS" "$VAR" "$A" "$B" <<'PY' | tee "$OUT/summary.txt"
import json, os, statistics, sys
out, rounds, var, a, b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
v = {}  # (case, side) -> values; side A / B (TURBO lines) or cudnn
per_process = {}  # (case, side) -> one value per process, in run order (separate processes only)
def read(path, tag):
    try:
        for l in open(path):
            j = json.loads(l)
            if j.get("metric") != "TFLOP/s" or j["case"].startswith("ceiling"): continue
            side = "cudnn" if j.get("backend") == "CUDNN" else tag
            v.setdefault((j["case"], side), []).append(j["ours"])
            if tag in ("A", "B"): per_process.setdefault((j["case"], side if side != "cudnn" else tag + ":CUDNN"), []).append(j["ours"])
    except FileNotFoundError:
        pass
for tag in ("A", "B"):
    for r in range(1, rounds + 1): read(f"{out}/{tag}_{r}.jsonl", tag)
try:  # in-process: "<case> [VAR=value]" lines, each already the median of its rounds
    for l in open(f"{out}/ab.jsonl"):
        j = json.loads(l)
        if j.get("metric") != "TFLOP/s" or j["case"].startswith("ceiling"): continue
        case, _, tail = j["case"].partition(" [")
        if j.get("backend") == "CUDNN": v.setdefault((case, "cudnn"), []).append(j["ours"]); continue
        if not tail: v.setdefault((case, "A"), []).append(j["ours"]); v.setdefault((case, "B"), []).append(j["ours"]); continue
        val = tail[len(var) + 1:-1]
        v.setdefault((case, "A" if val == a else "B"), []).append(j["ours"])
except FileNotFoundError:
    pass
read(f"{out}/cudnn.jsonl", "cudnn")
if per_process:  # separate processes: each one's figure, to see per-process modes
    print("per process (TFLOP/s, in run order):")
    for (case, side), vals in per_process.items():
        print(f"  {case:<40}{side:<9}" + "".join(f"{x:7.1f}" for x in vals))
print(f"{var}: A={a} B={b} (TFLOP/s, medians of {rounds} rounds" + (", in one process" if os.path.exists(f"{out}/ab.jsonl") else "") + ")" + "".join(f", {k}={os.environ[k]}" for k in ("A_BIN", "B_BIN") if os.environ.get(k)))
print(f"{'case':<40}{'A':>9}{'B':>9}{'B/A':>8}{'CUDNN':>8}{'B/CUDNN':>9}")
for case in dict.fromkeys(c for c, _ in v):
    m = {t: statistics.median(v[(case, t)]) for t in ("A", "B", "cudnn") if (case, t) in v}
    g = lambda x, y: f"{m[x] / m[y]:.3f}" if x in m and y in m else "-"
    print(f"{case:<40}{m.get('A', 0):>9.1f}{m.get('B', 0):>9.1f}{g('B', 'A'):>8}{m.get('cudnn', 0):>8.1f}{g('B', 'cudnn'):>9}")
PY
# Separate processes leave two files a round and side; a device call returns 8 files, so they go
# into one archive (summary.txt has every process's figures).
if ls "$OUT"/[AB]_*.jsonl > /dev/null 2>&1; then
  (cd "$OUT" && tar czf rounds.tgz [AB]_*.jsonl [AB]_*.log 2>/dev/null && rm -f [AB]_*.jsonl [AB]_*.log)
fi
