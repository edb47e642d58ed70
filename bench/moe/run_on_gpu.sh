#!/usr/bin/env bash
# One device call for MoE: the MoE GPU tests (TEST_FILTER, default the MoE parity tests of
# test_cuda_gpu; OPS_TEST_FILTER, default the routing, permutation and grouped-GEMM fixture tests of
# test_turbo_gpu, whose per-shape lanes against the CPU reference in double, bf16 and FP8, would not
# fit the 240 s given here on an H100: bench/ops/grouped_gemm_on_gpu.sh runs those; TESTS=0 skips
# them all), then
# for each preset (PRESETS, default "olmoe-mini deepseek-mini mixtral-mini") our training
# (examples/cuda/<preset>.yaml: mock data, micro-batch BATCH x 2048, default 4) and the anchor
# ../shared/bench/torch_moe_anchor.py (torch.compile, --impl grouped) on the same preset, batch and
# sequence length, back to back. Appends rows in DESIGN.md's "Measurements" format to
# $OUT/train.jsonl (case <preset>/b<batch>/t2048/mock; tokens_per_s and memory) and prints a
# short table last. Run from the repository root with .carry-moe (bench/moe/prepare_carry.sh):
#   run(command="bash bench/moe/run_on_gpu.sh", carry=[".carry-moe"])
# STEPS (default 30) and MEASURE (default 20: the last steps averaged) shape our run; EXTRA adds
# key=value overrides to it (e.g. EXTRA="profile_steps=5": the per-phase table is in logs.tar.gz);
# ANCHOR=0 skips the anchor (no ratio), HF_PARITY=0 the export check. VARIANTS runs ours several
# times per preset against the one anchor run: "label:overrides;label:overrides" (label "default"
# keeps the plain case name, others are appended to it), e.g.
#   VARIANTS="default:;inbwd:optimizer_in_bwd=true clip_grad=0"
# (the anchor clips nothing, so clip_grad=0 is its recipe too). Words PRIMUS_NAME=value in a
# variant's overrides set that run's environment.
set -u
CARRY=${CARRY:-.carry-moe}
OUT=${OUT:-/tmp/moe-out}
W=/tmp/moe-work  # per-run logs and metrics; $OUT gets train.jsonl, table.txt, tests.log, env.txt, logs.tar.gz
BIN=/tmp/moe-bin
STEPS=${STEPS:-30}
MEASURE=${MEASURE:-20}
BATCH=${BATCH:-4}
PRESETS=${PRESETS-"olmoe-mini deepseek-mini mixtral-mini"}  # set but empty: tests only
mkdir -p "$OUT" "$BIN" "$W"
# shellcheck source=scripts/gpu_carry.sh
source scripts/gpu_carry.sh
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  echo "commit $COMMIT"; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

: > "$OUT/tests.log"
if [ "${TESTS:-1}" != 0 ]; then
  [ -x "$BIN/test_turbo_gpu" ] && timeout 240 "$BIN/test_turbo_gpu" --gtest_brief=1 \
    --gtest_filter="${OPS_TEST_FILTER:-*Moe*:*Router*:*Permute*:GroupedGemmGpuTest.*}" >> "$OUT/tests.log" 2>&1
  echo "test_turbo_gpu rc=$?" >> "$OUT/tests.log"
  [ -x "$BIN/test_cuda_gpu" ] && timeout 300 "$BIN/test_cuda_gpu" --gtest_brief=1 \
    --gtest_filter="${TEST_FILTER:-*Moe*}" >> "$OUT/tests.log" 2>&1
  echo "test_cuda_gpu rc=$?" >> "$OUT/tests.log"
  grep -E "^\[ *(FAILED|PASSED) *\]|rc=|MoE\]" "$OUT/tests.log" | tail -20
fi

# Hugging Face parity of an exported MoE checkpoint (a Mixtral-style model trained by the reference
# backend here, carried as $CARRY/ckpt): transformers loads it as MixtralForCausalLM and must give
# Primus' greedy text and loss (tests/reference/hf_parity.py).
if [ -d "$CARRY/ckpt" ] && [ "${HF_PARITY:-1}" != 0 ]; then
  timeout 180 python3 tests/reference/hf_parity.py "$BIN/primus" "$CARRY/ckpt" /tmp/hfp-moe > "$OUT/hf_parity.json" \
    2> "$W/hf_parity.err"
  echo "hf parity (MoE, Mixtral export): rc=$? $(head -c 600 "$OUT/hf_parity.json")" | tee -a "$OUT/table.txt"
fi

ws=/tmp/primus-moe-ws
VARIANTS=${VARIANTS:-"default:"}
for p in $PRESETS; do
  [ "${ANCHOR:-1}" != 0 ] && timeout 300 python3 "$CARRY/torch_moe_anchor.py" --model "$p" --batch "$BATCH" \
    --mode compile --impl grouped > "$W/${p}_anchor.json" 2> "$W/${p}_anchor.err"
  IFS=';' read -ra variants <<< "$VARIANTS"
  for v in "${variants[@]}"; do
  label=${v%%:*}
  overrides=${v#*:}
  run=$p.$label
  rm -rf "$ws"
  # Words PRIMUS_NAME=value among the overrides go to the environment of that run.
  envs=(); keys=()
  for w in $overrides; do case "$w" in PRIMUS_*=*) envs+=("$w") ;; *) keys+=("$w") ;; esac; done
  # shellcheck disable=SC2086  # EXTRA's overrides are words
  timeout 240 env "${envs[@]}" "$BIN/primus" train pretrain --config "examples/cuda/$p.yaml" train_iters="$STEPS" \
    micro_batch_size="$BATCH" global_batch_size="$BATCH" save_at_end=false workspace="$ws" exp_name=m ${EXTRA:-} \
    "${keys[@]}" > "$W/$run.log" 2>&1
  echo "rc=$?" >> "$W/$run.log"
  cp "$ws"/*/*/m/metrics.jsonl "$W/$run.metrics.jsonl" 2>/dev/null
  python3 - "$W" "$OUT" "$p" "$BATCH" "$DEVICE" "$COMMIT" "$MEASURE" "$label" "$overrides" <<'PY'
import json, os, sys, datetime
work, out, p, batch, device, commit, measure, label, overrides = sys.argv[1:10]
measure = int(measure)
try:
    m = [json.loads(l) for l in open(os.path.join(work, f"{p}.{label}.metrics.jsonl")) if '"tokens_per_s"' in l][-measure:]
except OSError:
    m = []
try:
    a = json.loads(open(os.path.join(work, f"{p}_anchor.json")).read().strip().splitlines()[-1])
except Exception:
    a = None
ours = sum(s["tokens_per_s"] * s["step_s"] for s in m) / sum(s["step_s"] for s in m) if m else None
case = f"{p}/b{batch}/t2048/mock" + ("" if label == "default" else f"/{label}")
base = {"bench": "train", "case": case, "device": device, "date": datetime.date.today().isoformat(), "commit": commit}
if overrides.strip():
    base["overrides"] = overrides.strip()
rows = []
if ours and a:
    rows.append(dict(base, metric="tokens_per_s", ours=round(ours), anchor=a["tok_s"],
                     anchor_name=f"torch.compile, torch._grouped_mm experts ({a['anchor']})", ratio=round(ours / a["tok_s"], 4)))
    mem = max(s.get("arena_gib", 0) for s in m)
    peak = max(s.get("mem_gib", 0) for s in m)
    rows.append(dict(base, metric="memory_gib (arenas; device peak in note)", ours=mem, anchor=a["mem_gib"],
                     anchor_name="torch.cuda.max_memory_allocated", ratio=round(a["mem_gib"] / mem, 4) if mem else None,
                     note=f"device peak incl. CUDA context and libraries {peak} GiB"))
    mfu = sum(s.get("mfu", 0) for s in m) / len(m)
    line = (f"{case}: ours {ours:,.0f} tok/s (MFU {mfu:.3f}, loss {m[-1]['loss']:.3f}), torch.compile {a['tok_s']:,} "
            f"tok/s (MFU {a['mfu']}): {ours / a['tok_s']:.3f}x; memory {mem} vs {a['mem_gib']} GiB (peak {peak})")
else:
    line = f"{case}: no comparison (ours {'ok' if ours else 'missing'}, anchor {'ok' if a else 'missing'})"
with open(os.path.join(out, "train.jsonl"), "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
with open(os.path.join(out, "table.txt"), "a") as f:
    f.write(line + "\n")
print(line, flush=True)
PY
  done
done
rm -rf "$ws"
tar czf "$OUT/logs.tar.gz" -C "$W" . 2>/dev/null
echo "== MoE training vs torch.compile ($DEVICE, $COMMIT)"
cat "$OUT/table.txt" 2>/dev/null
