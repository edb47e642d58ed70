#!/usr/bin/env bash
# One device call on the `nvidia-h200-x2` machine for data parallelism on NCCL (issue [multi-gpu]):
#   0. the NCCL tests (test_nccl_gpu: collectives on 2 GPUs, a stopped and an exiting rank named)
#   1. `primus preflight` (GPUs, NCCL, all-reduce bus bandwidth across both GPUs)
#   2. loss equality over 50 steps: 2 GPUs vs 1 GPU at the same global batch, a small GPT-2,
#      without and with ZeRO-1 (use_distributed_optimizer)
#   3. tokens/s on 1 and 2 GPUs (micro-batch per GPU fixed, global batch x2) for GPT-2 124M and
#      the Llama-3.2-1B shape, and per-GPU optimizer memory without and with ZeRO-1
#   4. kill one rank mid-run: the job ends naming it; the last checkpoint resumes on 1 GPU
# and writes $OUT/scaling.jsonl (DESIGN.md "Measurements"; append it to bench/results/) and a
# table last (stage 4 runs before stage 3). Every stage runs under `timeout`, cut to the time left
# before BUDGET_S (540 s); throughput runs skip the final checkpoint (save_at_end=false).
#
# Build here first: bash bench/scaling/prepare_carry.sh (fills .carry-scaling), then:
#   run(kind="nvidia-h200-x2", command="bash bench/scaling/run_on_gpu.sh", carry=[".carry-scaling"])
# NCCL comes from PyTorch's pip wheel (nvidia-nccl-cu13) found by primus' loader; NVLink
# multicast stays off (NCCL_NVLS_ENABLE=0, also primus' default when unset).
# SKIP=tests,preflight,equality,scaling,kill skips stages.
set -u
CARRY=${CARRY:-.carry-scaling}
OUT=${OUT:-/tmp/scaling-out}
BIN=/tmp/scaling-bin
SKIP=${SKIP:-}
# The device call ends at 600 s: every stage is cut to what is left before DEADLINE (default 540 s
# from now) so the summary and the archive are always written (a hang cost a whole call once).
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-540} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local want=$1 l; l=$(( $(left) - 25 )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz; do
  gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"
done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$BIN:${LD_LIBRARY_PATH:-}
export PRIMUS_GPT2_VOCAB_DIR=$PWD/third_party/gpt2 PRIMUS_SOURCE_DIR=$PWD PRIMUS_CONFIG_DIR=$PWD/configs
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
P=$BIN/primus
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4
  echo "commit $COMMIT; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
skip() { [[ ",$SKIP," == *",$1,"* ]]; }
WS=/tmp/scaling-ws
rm -rf "$WS"

# 0. NCCL process-group tests.
if ! skip tests; then
  PRIMUS_NCCL_TEST_WORKER=$BIN/nccl_test_worker PRIMUS_BIN=$P timeout "$(cap 150)" "$BIN/test_nccl_gpu" \
    --gtest_filter=-*TwoGpuTraining* > "$OUT/tests.log" 2>&1  # stage 2 below measures the same over 50 steps
  echo "test_nccl_gpu rc=$?" >> "$OUT/tests.log"
  grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|rc=" "$OUT/tests.log"
fi

# 1. preflight.
if ! skip preflight; then
  timeout "$(cap 60)" "$P" preflight --json "$OUT/preflight.json" > "$OUT/preflight.log" 2>&1
  echo "preflight rc=$?" >> "$OUT/preflight.log"
  cat "$OUT/preflight.log"
fi

# One training run: train NAME GPUS [key=value ...]; metrics in $WS/NAME.metrics.jsonl.
train() {
  local name=$1 gpus=$2 limit
  limit=$(cap "$3")
  shift 3
  if [ "$(left)" -lt 40 ]; then echo "$name skipped: device time nearly over" | tee "$OUT/$name.log"; return 1; fi
  local cmd=("$P")
  [ "$gpus" -gt 1 ] && cmd+=(launch --nproc-per-node "$gpus" --timeout 60 --)
  cmd+=(train pretrain workspace="$WS" exp_name="$name" save_at_end=false "$@")
  timeout "$limit" "${cmd[@]}" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" >> "$OUT/$name.log"
  cp "$WS"/*/*/"$name"/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
  rm -rf "$WS"/*/*/"$name"  # its checkpoint: 1.5 GB for GPT-2 124M, ~15 GB for Llama-3.2-1B
  grep -E "optimizer state per GPU|data parallel:|rc=" "$OUT/$name.log" | tail -3
  return $rc
}

# 2. Loss equality: a small GPT-2 (4 layers, hidden 256, head dim 64), mock data, global batch 16
#    of 256 tokens; 1 GPU accumulates 2 micro-batches of 8, 2 GPUs one each.
SMALL=(--config examples/cuda/gpt2-124M-shakespeare.yaml mock_data=true num_layers=4 hidden_size=256
       num_attention_heads=4 ffn_hidden_size=1024 seq_length=256 micro_batch_size=8 global_batch_size=16
       train_iters=50 lr=1e-3 lr_warmup_iters=5 log_interval=1 eval_interval=0 save_interval=0 keep_last_k=1)
# EQ_VARIANTS: more settings to compare the same way, ';'-separated lists of key=value, e.g.
# EQ_VARIANTS="deterministic=true;fp8=hybrid deterministic=true" (runs eq_1gpu__V, eq_2gpu__V, ...).
if ! skip equality; then
  train eq_1gpu 1 120 "${SMALL[@]}"
  train eq_2gpu 2 120 "${SMALL[@]}"
  train eq_2gpu_zero1 2 120 "${SMALL[@]}" use_distributed_optimizer=true
  IFS=';' read -ra _variants <<< "${EQ_VARIANTS:-}"
  for v in "${_variants[@]}"; do
    tag=$(echo "$v" | tr ' =' '_-')
    # shellcheck disable=SC2086
    train "eq_1gpu__$tag" 1 120 "${SMALL[@]}" $v
    # shellcheck disable=SC2086
    train "eq_2gpu__$tag" 2 120 "${SMALL[@]}" $v
    # shellcheck disable=SC2086
    train "eq_2gpu_zero1__$tag" 2 120 "${SMALL[@]}" use_distributed_optimizer=true $v
  done
fi

# 4. Kill rank 1 (SIGKILL) after step 12 of a 2-GPU run that checkpoints every 5 steps; the
#    launcher must end the job naming rank 1; then resume the last checkpoint on 1 GPU.
if ! skip kill && [ "$(left)" -gt 90 ]; then
  KW=$WS/kill
  rm -rf "$KW"
  "$P" launch --nproc-per-node 2 --timeout 60 --grace 10 -- train pretrain "${SMALL[@]}" train_iters=200 \
    save_interval=5 keep_last_k=2 use_distributed_optimizer=true workspace="$KW" exp_name=kill \
    > "$OUT/kill.log" 2>&1 &
  lpid=$!
  killed_at=""
  for i in $(seq 1 600); do
    sleep 0.2
    if grep -qE "step +1[2-9]|step 12" "$OUT/kill.log"; then
      for c in $(pgrep -P "$lpid"); do
        if tr '\0' '\n' < /proc/"$c"/environ 2>/dev/null | grep -qx "RANK=1"; then
          kill -9 "$c"; killed_at=$(date +%s.%N); echo "scaling: killed rank 1 (pid $c)" >> "$OUT/kill.log"
        fi
      done
      break
    fi
    kill -0 "$lpid" 2>/dev/null || break
  done
  timeout "$(cap 90)" tail --pid="$lpid" -f /dev/null
  wait "$lpid"; krc=$?
  ended_at=$(date +%s.%N)
  echo "launcher rc=$krc; seconds from kill to exit: $(python3 -c "print(round($ended_at - ${killed_at:-$ended_at}, 2))")" >> "$OUT/kill.log"
  tail -4 "$OUT/kill.log"
  timeout "$(cap 60)" "$P" train pretrain "${SMALL[@]}" train_iters=30 auto_continue_train=true save_interval=0 \
    workspace="$KW" exp_name=kill > "$OUT/kill_resume.log" 2>&1
  echo "resume rc=$?" >> "$OUT/kill_resume.log"
  grep -E "resumed from|rc=" "$OUT/kill_resume.log"
fi

# 3. Throughput and memory. Per GPU: GPT-2 124M micro-batch 16 x 1024, Llama-3.2-1B 4 x 2048;
#    no accumulation, 30 steps (the last 20 measured).
if ! skip scaling; then
  G2=(--config examples/cuda/gpt2-124M-shakespeare.yaml mock_data=true seq_length=1024 micro_batch_size=16
      train_iters=30 lr_warmup_iters=5 log_interval=5 eval_interval=0 save_interval=0 keep_last_k=1)
  LL=(--config examples/cuda/llama3.2-1B.yaml mock_data=true micro_batch_size=4 train_iters=30 lr_warmup_iters=5
      log_interval=5 eval_interval=0 save_interval=0 keep_last_k=1)
  train gpt2_1gpu 1 100 "${G2[@]}" global_batch_size=16
  train gpt2_2gpu 2 100 "${G2[@]}" global_batch_size=32
  train gpt2_2gpu_zero1 2 100 "${G2[@]}" global_batch_size=32 use_distributed_optimizer=true
  train llama_1gpu 1 150 "${LL[@]}" global_batch_size=4
  train llama_2gpu 2 150 "${LL[@]}" global_batch_size=8
  train llama_2gpu_zero1 2 150 "${LL[@]}" global_batch_size=8 use_distributed_optimizer=true
fi
# 3b. BF16_REDUCE=1: the same 2-GPU runs with grad_reduce_in_bf16=true (bf16 gradient buckets on
#     the wire, averaged in fp32), measured against this call's 1-GPU runs.
if [ "${BF16_REDUCE:-0}" = 1 ] && ! skip scaling; then
  train gpt2_2gpu_bf16 2 100 "${G2[@]}" global_batch_size=32 grad_reduce_in_bf16=true
  train gpt2_2gpu_zero1_bf16 2 100 "${G2[@]}" global_batch_size=32 use_distributed_optimizer=true grad_reduce_in_bf16=true
  train llama_2gpu_bf16 2 150 "${LL[@]}" global_batch_size=8 grad_reduce_in_bf16=true
  train llama_2gpu_zero1_bf16 2 150 "${LL[@]}" global_batch_size=8 use_distributed_optimizer=true grad_reduce_in_bf16=true
fi

# scaling.jsonl and the table.
python3 - "$OUT" "$DEVICE" "$COMMIT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, os, re, sys, datetime
out, device, commit = sys.argv[1:4]
date = datetime.date.today().isoformat()
rows = []
def row(case, metric, ours, anchor, anchor_name, higher_better=True):
    r = None
    if ours is not None and anchor:
        r = ours / anchor if higher_better else (anchor / ours if ours else None)
    rows.append({"bench": "scaling", "case": case, "device": device, "date": date, "commit": commit, "metric": metric,
                 "ours": ours, "anchor": anchor, "anchor_name": anchor_name, "ratio": round(r, 4) if r else None})
def metrics(name):
    p = os.path.join(out, name + ".metrics.jsonl")
    if not os.path.exists(p): return []
    return [json.loads(l) for l in open(p) if '"tokens_per_s"' in l]
def tok_s(name, last=20):
    m = metrics(name)[-last:]
    if not m: return None
    secs = sum(s["step_s"] for s in m)
    return sum(s["tokens_per_s"] * s["step_s"] for s in m) / secs
def opt_gib(name):
    try:
        txt = open(os.path.join(out, name + ".log")).read()
    except OSError:
        return None
    m = re.search(r"optimizer state per GPU ([0-9.]+) GiB", txt)
    return float(m.group(1)) if m else None
def arena(name):
    m = metrics(name)
    return max(s.get("arena_gib", 0) for s in m) if m else None
# loss equality (the default settings, then each EQ_VARIANTS entry: names eq_*__<tag>)
tags = sorted({f.split("__", 1)[1].rsplit(".metrics.jsonl", 1)[0] for f in os.listdir(out)
               if f.startswith("eq_1gpu__") and f.endswith(".metrics.jsonl")})
for tag in [""] + tags:
    at = f"__{tag}" if tag else ""
    one = {s["step"]: s["loss"] for s in metrics("eq_1gpu" + at)}
    for name, label in [("eq_2gpu", "2gpu"), ("eq_2gpu_zero1", "2gpu-zero1")]:
        two = {s["step"]: s["loss"] for s in metrics(name + at)}
        common = sorted(set(one) & set(two))
        if common:
            worst = max(abs(two[k] - one[k]) / abs(one[k]) for k in common)
            last = common[-1]
            case = f"gpt2-small/g16/t256/{label}-vs-1gpu" + (f"/{tag}" if tag else "")
            row(case, "final_loss", two[last], one[last], "1 GPU, same global batch", False)
            row(case, "max_rel_loss_diff_50_steps", worst, None, "")
            print(f"loss equality {label}{' ' + tag if tag else ''}: {len(common)} steps, worst relative difference "
                  f"{worst:.2e} ({'PASS' if worst < 2e-2 and len(common) >= 50 else 'FAIL'} at 2e-2)")
# throughput
for model, case in [("gpt2", "gpt2-124M/b16/t1024/mock"), ("llama", "llama3.2-1B/b4/t2048/mock")]:
    t1 = tok_s(f"{model}_1gpu")
    for suffix in ["2gpu", "2gpu_zero1", "2gpu_bf16", "2gpu_zero1_bf16"]:
        t2 = tok_s(f"{model}_{suffix}")
        if t2 is None and suffix.endswith("_bf16"):
            continue  # BF16_REDUCE was not asked for
        row(f"{case}/{suffix}", "tokens_per_s", t2, t1, "1 GPU, same micro-batch per GPU")
        if t1 and t2:
            print(f"{model} {suffix}: {t2:,.0f} tok/s vs 1 GPU {t1:,.0f}: {t2 / t1:.3f}x (target >= 1.9)")
    # ZeRO-1's per-GPU optimizer state (fp32 master + 2 moments) against the replicated one
    o_full, o_zero = opt_gib(f"{model}_2gpu"), opt_gib(f"{model}_2gpu_zero1")
    row(f"{case}/2gpu", "optimizer_gib_per_gpu", o_zero, o_full, "2 GPUs without ZeRO-1", False)
    row(f"{case}/2gpu", "arena_gib_per_gpu", arena(f"{model}_2gpu_zero1"), arena(f"{model}_2gpu"),
        "2 GPUs without ZeRO-1", False)
    if o_full and o_zero:
        print(f"{model} optimizer state per GPU: ZeRO-1 {o_zero:.3f} GiB vs {o_full:.3f} GiB ({o_full / o_zero:.2f}x less)")
# preflight bus bandwidth (a figure: NCCL's own number has no anchor here)
try:
    pf = json.load(open(os.path.join(out, "preflight.json")))
    big = max(pf.get("allreduce", []), key=lambda r: r["bytes"])
    row(f"allreduce/{pf.get('allreduce_gpus')}gpu/{big['bytes']}B", "busbw_gbs", big["busbw_gbs"], None, "")
    print(f"preflight: NCCL {pf['nccl']['version']}, all-reduce busbw {big['busbw_gbs']:.1f} GB/s at {big['bytes']} bytes")
except Exception as e:
    print("preflight: no result:", e)
# kill test
try:
    k = open(os.path.join(out, "kill.log")).read()
    named = "rank 1" in k and "FAILED" in k
    m = re.search(r"seconds from kill to exit: ([0-9.]+)", k)
    r = open(os.path.join(out, "kill_resume.log")).read()
    res = re.search(r"resumed from \S+ at step (\d+)", r)
    print(f"kill rank 1: launcher named it: {named}; {m.group(1) if m else '?'} s to exit; "
          f"resume on 1 GPU: {'step ' + res.group(1) if res else 'FAILED'}")
    if m: row("kill-rank-1/2gpu-zero1", "seconds_to_job_exit", float(m.group(1)), None, "")
except Exception as e:
    print("kill test: no result:", e)
with open(os.path.join(out, "scaling.jsonl"), "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print(f"{len(rows)} rows in {out}/scaling.jsonl")
EOF

# The device returns at most 8 files: scaling.jsonl, summary.txt and one archive of the rest.
(cd "$OUT" && tar czf logs.tar.gz --exclude=logs.tar.gz --exclude=scaling.jsonl --exclude=summary.txt ./* \
  && find . -maxdepth 1 -type f ! -name logs.tar.gz ! -name scaling.jsonl ! -name summary.txt -delete)
ls -la "$OUT"
