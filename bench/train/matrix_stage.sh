# Sourced by bench/train/run_on_gpu.sh after its GPT-2 B16 stage: more (model, micro-batch) cases
# of issue [cuda]'s targets, each as ours then torch_anchor.py (torch.compile) on the same model,
# batch and sequence length, back to back in this call. MATRIX lists the cases as
# preset:batch[:extra key=value,...] (preset: torch_anchor.py's name; ours maps it to a config;
# an extra written env.VAR=value is an environment variable of our run instead of a config key;
# cases of one preset and batch share one anchor run),
# default "gpt2-124M:32 llama3.2-1B:8". MATRIX=none skips the stage.
# Uses run_on_gpu.sh's BIN, OUT, CARRY, ATTN, DEVICE, COMMIT, STEPS, MEASURE; appends rows to
# $OUT/train.jsonl and prints one line per case.
matrix_stage() {
  local cases=${MATRIX:-"gpt2-124M:32 llama3.2-1B:8"}
  [ "$cases" = none ] && return 0
  local ws=/tmp/primus-matrix-ws
  for c in $cases; do
    local preset=${c%%:*} rest=${c#*:}
    local batch=${rest%%:*} extra=""
    [ "$rest" != "$batch" ] && extra=${rest#*:}
    local cfg seq
    case $preset in
      gpt2-124M) cfg=examples/cuda/gpt2-124M-shakespeare.yaml; seq=1024 ;;
      llama3.2-1B) cfg=examples/cuda/llama3.2-1B.yaml; seq=2048 ;;
      *) echo "matrix: unknown preset $preset"; continue ;;
    esac
    local name="${preset}_b${batch}${extra:+_$(echo "$extra" | sed -e 's/,/_/g' -e 's|[=/]|-|g')}"
    # Extras are config keys, or environment variables of our run when written env.VAR=value
    # (e.g. llama3.2-1B:8:env.PRIMUS_TURBO_CUBLASLT_ORDER=auto,env.PRIMUS_TURBO_CUBLASLT_ALGO_CACHE=/tmp/a.json).
    local keys="" envs=""
    for kv in $(echo "$extra" | tr ',' ' '); do
      case $kv in env.*) envs="$envs ${kv#env.}" ;; *) keys="$keys $kv" ;; esac
    done
    rm -rf "$ws"
    # shellcheck disable=SC2086
    env $envs timeout 170 "$BIN/primus" train pretrain --config "$cfg" mock_data=true train_iters="$STEPS" \
      micro_batch_size="$batch" global_batch_size="$batch" seq_length="$seq" lr_warmup_iters=5 log_interval=5 \
      eval_interval=0 save_interval=0 save_at_end=false attention_backend="$ATTN" workspace="$ws" exp_name=m \
      $keys > "$OUT/matrix_$name.log" 2>&1
    echo "rc=$?" >> "$OUT/matrix_$name.log"
    cp "$ws"/*/*/m/metrics.jsonl "$OUT/matrix_$name.metrics.jsonl" 2>/dev/null
    rm -rf "$ws"
    # One anchor run per (preset, batch) in this call: variants of ours (extra keys) share it.
    local akey="$OUT/matrix_anchor_${preset}_b${batch}.json"
    # GPT-2 B16: the main stage's anchor of this call (anchor.json) serves.
    if [ ! -s "$akey" ] && [ "$preset:$batch" = gpt2-124M:16 ] && [ -s "$OUT/anchor.json" ]; then
      cp "$OUT/anchor.json" "$akey"
    fi
    if [ ! -s "$akey" ]; then
      timeout 200 python3 "$CARRY/torch_anchor.py" --model "$preset" --batch "$batch" --mode compile \
        > "$akey" 2> "${akey%.json}.err"
    fi
    cp "$akey" "$OUT/matrix_${name}_anchor.json"
    python3 - "$OUT" "$name" "$preset" "$batch" "$seq" "$DEVICE" "$COMMIT" "$MEASURE" "$extra" <<'PY'
import json, os, sys, datetime
out, name, preset, batch, seq, device, commit, measure, extra = sys.argv[1:10]
measure = int(measure)
rows = []
try:
    m = [json.loads(l) for l in open(os.path.join(out, f"matrix_{name}.metrics.jsonl")) if '"tokens_per_s"' in l][-measure:]
except OSError:
    m = []
try:
    a = json.loads(open(os.path.join(out, f"matrix_{name}_anchor.json")).read().strip().splitlines()[-1])
except Exception:
    a = None
ours = sum(s["tokens_per_s"] * s["step_s"] for s in m) / sum(s["step_s"] for s in m) if m else None
case = f"{preset}/b{batch}/t{seq}/mock" + (f"/{extra}" if extra else "")
base = {"bench": "train", "case": case, "device": device, "date": datetime.date.today().isoformat(), "commit": commit}
if ours and a:
    rows.append(dict(base, metric="tokens_per_s", ours=round(ours), anchor=a["tok_s"],
                     anchor_name=f"torch.compile ({a['anchor']})", ratio=round(ours / a["tok_s"], 4)))
    mem = max(s.get("arena_gib", 0) for s in m)
    peak = max(s.get("mem_gib", 0) for s in m)
    rows.append(dict(base, metric="memory_gib (arenas; device peak in note)", ours=mem, anchor=a["mem_gib"],
                     anchor_name="torch.cuda.max_memory_allocated", ratio=round(a["mem_gib"] / mem, 4) if mem else None,
                     note=f"device peak incl. CUDA context and libraries {peak} GiB"))
    mfu = sum(s.get("mfu", 0) for s in m) / len(m)
    print(f"matrix {case}: ours {ours:,.0f} tok/s (MFU {mfu:.3f}), torch.compile {a['tok_s']:,} tok/s "
          f"(MFU {a['mfu']}): {ours / a['tok_s']:.3f}x; memory {mem} vs {a['mem_gib']} GiB")
else:
    print(f"matrix {case}: no comparison (ours {'ok' if ours else 'missing'}, anchor {'ok' if a else 'missing'}); "
          f"see matrix_{name}.log / matrix_{name}_anchor.err")
with open(os.path.join(out, "train.jsonl"), "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
PY
    tail -3 "$OUT/matrix_$name.log" | head -2
  done
}
