#!/usr/bin/env bash
# Muon and the WSD schedule (issue #40, item 5) on the GPU. Run from the repository root with $BIN
# (the built primus and test binaries, on PATH and LD_LIBRARY_PATH) and $OUT set; DATA may name
# tinyshakespeare.txt (bench/hf/run_on_gpu.sh sets it from .carry-hf; else the tree's
# examples/data copy, which travels with the working tree). About 2-3 minutes.
#   1. test_turbo_gpu MuonGpuTest: MultiMatrixMuon (bf16 Newton-Schulz GEMMs) against the CPU
#      reference over three steps, the non-finite veto, determinism, a captured graph; and
#      OptimizerTest (the AdamW kernels Muon runs beside).
#   2. test_cuda_unit CudaHostTrainer.Muon*: the cuda trainer with Muon in host mode equals the
#      reference trainer and each resumes the other's checkpoint.
#   3. The cuda trainer with Muon: a small GPT-2 (bytes) with CUDA graphs on and off gives the same
#      losses bit for bit (the captured step reads the lr from the device), learns, resumes from its
#      checkpoint with the uninterrupted losses, and follows the reference backend's Muon run
#      (fp32 CPU, same init and batches) within 2% at every one of its 30 steps.
#   4. GPT-2 124M on tinyshakespeare (examples/cuda/gpt2-124M-shakespeare.yaml): AdamW and Muon,
#      STEPS steps each (default 200) at the example's lr 6e-4 for both (Muon's update is scaled
#      to AdamW's RMS, 0.2 sqrt(max(rows, cols)), so it reuses AdamW's lr and weight decay, as
#      Moonlight does), WSD schedule (warmup 20, linear decay over the last 20%); `primus report`
#      draws both runs into $OUT/muon_vs_adamw.png (+ .svg, .json), and the steps each needs to
#      reach the best validation loss the slower one reaches are printed.
# Writes $OUT/muon.jsonl (one row per check, plus the steps-to-loss rows) and prints a PASS/FAIL
# table last.
PART=muon
# shellcheck source=bench/hf/common.sh
source bench/hf/common.sh
STEPS=${STEPS:-200}
DATA=${DATA:-$PWD/examples/data/tinyshakespeare.txt}
FAILED=0

record() {  # name rc seconds
  local status=PASS
  [ "$2" -eq 0 ] || { status=FAIL; FAILED=1; }
  ROWS+=("$(printf '%-34s %-5s %6ss' "$1" "$status" "$3")")
  printf '{"bench": "muon", "case": "%s", "device": "%s", "date": "%s", "commit": "%s", "metric": "pass", "ours": %d, "seconds": %s}\n' \
    "$1" "$DEVICE" "$DATE" "$COMMIT" "$([ "$2" -eq 0 ] && echo 1 || echo 0)" "$3" >> "$OUT/muon.jsonl"
}

run_check() {  # name command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$W/$name.log" 2>&1
  local rc=$?
  tail -4 "$W/$name.log"
  cp "$W/$name.log" "$OUT/$name.log"
  record "$name" "$rc" "$((SECONDS - t0))"
}

run_check muon_kernels_gpu "$BIN/test_turbo_gpu" --gtest_filter='MuonGpuTest.*:*OptimizerTest*'
run_check muon_host_trainer "$BIN/test_cuda_unit" --gtest_filter='CudaHostTrainer.Muon*'

# 3. Graphs on/off bit-identical, learns, resumes; and the reference backend's curve (fp32 CPU,
#    the same init and batches) within 2% at every step.
sed 's/framework: cuda/framework: reference/' examples/cuda/gpt2-124M-shakespeare.yaml > "$W/reference.yaml"
# shellcheck disable=SC2086  # $3 is several overrides
small() {  # name config extra-overrides
  "$BIN/primus" train pretrain --config "$2" num_layers=2 hidden_size=256 ffn_hidden_size=1024 num_attention_heads=4 \
    seq_length=256 tokenizer_type=bytes vocab_size=256 micro_batch_size=8 global_batch_size=16 train_iters=30 eval_interval=0 \
    save_interval=15 log_interval=1 lr=3e-3 lr_warmup_iters=3 lr_decay_style=WSD lr_wsd_decay_iters=10 \
    optimizer=muon sample_tokens=0 "data_path=[$DATA]" workspace="$W/ws-$1" exp_name=s $3 > "$W/small-$1.log" 2>&1
}
cfg=examples/cuda/gpt2-124M-shakespeare.yaml
t0=$SECONDS
small graph "$cfg" "cuda_graph=true"; rc_g=$?
small eager "$cfg" "cuda_graph=false"; rc_e=$?
small resumed "$cfg" "cuda_graph=true load=$W/ws-graph/local/local/s/checkpoints/iter_0000015"; rc_r=$?
OMP_NUM_THREADS=$(nproc) small reference "$W/reference.yaml" ""; rc_f=$?
python3 - "$W" > "$W/small-check.log" 2>&1 <<'PY'
import json, sys
w = sys.argv[1]
def losses(name):
    rows = [json.loads(l) for l in open(f"{w}/ws-{name}/local/local/s/metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
g, e, r, f = losses("graph"), losses("eager"), losses("resumed"), losses("reference")
assert len(g) == 30 and len(e) == 30 and len(f) == 30, (len(g), len(e), len(f))
diff = [s for s in g if g[s] != e[s]]
assert not diff, f"graph vs eager differ at steps {diff[:5]}: {[(g[s], e[s]) for s in diff[:3]]}"
assert g[30] < g[1] - 0.5, f"does not learn: {g[1]} -> {g[30]}"
bad = [s for s in r if abs(r[s] - g[s]) > 1e-6 * abs(g[s])]
assert sorted(r) == list(range(16, 31)) and not bad, f"resume differs at {bad[:5]}"
rel = {s: abs(g[s] - f[s]) / f[s] for s in f}
worst = max(rel, key=rel.get)
print(f"graph == eager over 30 steps (loss {g[1]:.4f} -> {g[30]:.4f}); resumed steps 16-30 equal; "
      f"vs the reference backend: worst {rel[worst]:.2e} at step {worst} (reference {f[1]:.4f} -> {f[30]:.4f})")
assert rel[worst] < 0.02, "cuda Muon leaves the reference's curve"
PY
rc_c=$?
cat "$W/small-check.log"
record muon_cuda_graph_resume_vs_ref $(( rc_g || rc_e || rc_r || rc_f || rc_c )) $((SECONDS - t0))

# 4. GPT-2 124M, AdamW vs Muon.
run124() {  # name optimizer
  "$BIN/primus" train pretrain --config examples/cuda/gpt2-124M-shakespeare.yaml train_iters="$STEPS" \
    micro_batch_size=16 global_batch_size=16 lr=6e-4 min_lr=6e-5 lr_warmup_iters=20 lr_decay_style=WSD \
    lr_wsd_decay_iters=$((STEPS / 5)) lr_wsd_decay_style=linear eval_interval=10 eval_iters=4 save_interval=0 \
    save_at_end=false log_interval=10 sample_tokens=0 report_at_end=false optimizer="$2" "data_path=[$DATA]" \
    workspace="$W/ws124" exp_name="$1" > "$W/gpt2-124M-$1.log" 2>&1
}
t0=$SECONDS
run124 adamw adamw; rc_a=$?
run124 muon muon; rc_m=$?
tail -n 3 "$W/gpt2-124M-adamw.log" "$W/gpt2-124M-muon.log"
cp "$W/ws124/local/local/adamw/metrics.jsonl" "$OUT/gpt2-124M-adamw.metrics.jsonl" 2>/dev/null
cp "$W/ws124/local/local/muon/metrics.jsonl" "$OUT/gpt2-124M-muon.metrics.jsonl" 2>/dev/null
"$BIN/primus" report "$W/ws124/local/local/adamw" "$W/ws124/local/local/muon" --out "$OUT/muon_vs_adamw.png" \
  --json "$OUT/muon_vs_adamw.json" > "$W/report.log" 2>&1; rc_p=$?
# Without Cairo on the GPU machine the chart is drawn afterwards from the two metrics.jsonl copied to
# $OUT (`primus report DIR_WITH_METRICS...`); that is not a failure of the runs.
if [ $rc_p -ne 0 ] && grep -qi cairo "$W/report.log"; then echo "report: $(head -1 "$W/report.log")"; rc_p=0; fi
"$BIN/primus" report "$W/ws124/local/local/adamw" "$W/ws124/local/local/muon" --out "$OUT/muon_vs_adamw.svg" \
  >> "$W/report.log" 2>&1
python3 - "$W/ws124/local/local" "$OUT/muon.jsonl" "$DEVICE" "$DATE" "$COMMIT" > "$W/steps.log" 2>&1 <<'PY'
import json, sys
root, out, device, date, commit = sys.argv[1:6]
def read(name):
    rows = [json.loads(l) for l in open(f"{root}/{name}/metrics.jsonl")]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return val, (sorted(tps)[len(tps) // 2] if tps else float("nan"))
runs = {n: read(n) for n in ("adamw", "muon")}
# The target: the best validation loss that both runs reach (the worse of the two bests).
target = max(min(v.values()) for v, _ in runs.values())
print(f"target validation loss {target:.4f} (the worse of the two runs' best)")
steps = {}
for n, (val, tps) in runs.items():
    steps[n] = min(s for s, l in val.items() if l <= target)
    print(f"{n:6s} best val {min(val.values()):.4f} at step {min(val, key=val.get)}; reaches {target:.4f} at step "
          f"{steps[n]}; median {tps:,.0f} tok/s")
print(f"AdamW needs {steps['adamw'] / steps['muon']:.2f}x the steps of Muon to that loss")
with open(out, "a") as f:
    for n in ("adamw", "muon"):
        f.write(json.dumps({"bench": "muon", "case": f"gpt2-124M-shakespeare steps to val {target:.4f}", "device": device,
                            "date": date, "commit": commit, "metric": f"steps ({n})", "ours": steps[n]}) + "\n")
    f.write(json.dumps({"bench": "muon", "case": f"gpt2-124M-shakespeare steps to val {target:.4f}", "device": device,
                        "date": date, "commit": commit, "metric": "steps to loss, Muon vs AdamW",
                        "ours": steps["muon"], "anchor": steps["adamw"], "anchor_name": "AdamW (same lr, schedule, data)",
                        "ratio": steps["adamw"] / steps["muon"]}) + "\n")
PY
rc_s=$?
cat "$W/steps.log"
cp "$W/steps.log" "$OUT/steps_to_loss.txt"
record gpt2_124M_adamw_vs_muon $(( rc_a || rc_m || rc_p || rc_s )) $((SECONDS - t0))

echo
printf '%-34s %-5s %7s\n' check result time
for r in "${ROWS[@]}"; do echo "$r"; done
exit $FAILED
