#!/usr/bin/env bash
# One device call for issue #38 [fp8], convergence: GPT-2 124M on tinyshakespeare (GPT-2
# tokenizer), STEPS (1000) steps in bf16 and then with each FP8 recipe, same seed, data and batch;
# each recipe's validation loss against bf16's at the same steps (PASS: within 1% at every
# evaluation), and the curves in one chart. From the repository root with .carry-fp8
# (bench/fp8/converge_prepare.sh: prepare_carry.sh, tinyshakespeare.txt, Cairo):
#   run(command="bash bench/fp8/converge_on_gpu.sh", carry=[".carry-fp8"])
#
# Batch: micro 8 x 512 tokens, global 8 (MB, SEQ, GB): 4,096 tokens a micro-batch, a multiple of 128
# as blockwise FP8 needs (1x128 activation blocks along the tokens), and small enough that 1000
# steps should stay well under 40 s on an H200 (an estimate, not yet measured: 16 x 1024 runs
# ~590k tokens/s there, ~28 ms a step; a quarter of the tokens ~10-15 ms a step, FP8 ~10% slower on
# GPT-2's K = 768), so the seven runs fit in ~4 minutes with start-up. 1000 steps are 4.1M tokens, ~13 passes over the 314k training
# tokens: the validation loss bottoms out and then rises (overfitting), which the 1% criterion
# compares too. Validation: split 0.95 (the example's) leaves 16.5k tokens; EVAL_ITERS=4 batches
# (16,384 tokens) read nearly all of them, the same batches at every evaluation (cuda trainer).
# lr 6e-4 -> 6e-5 cosine (the example's), warm-up STEPS/10; seed SEED (1234) for every run.
#
# RECIPES (default "hybrid:tensorwise e4m3:tensorwise hybrid:rowwise e4m3:rowwise e4m3:blockwise
# hybrid:delayed"): format:recipe -> fp8=<format> fp8_recipe=<recipe>, run as <format>-<recipe>;
# none:none adds a second bf16 run (bf16-repeat: the bf16 noise floor). An entry format:recipe:variant
# adds the overrides in VARIANT_<variant> (comma-separated key=value) to that run alone, run as
# <format>-<recipe>-<variant> (none:none:<variant>: bf16-<variant>), e.g. RECIPES="none:none:bm
# hybrid:rowwise:bm" VARIANT_bm="use_precision_aware_optimizer=true,exp_avg_dtype=bf16,exp_avg_sq_dtype=bf16"
# sets bf16 AdamW moments against the fp32-moment bf16 run. EXTRA: key=value overrides
# (space-separated) for every run. CONFIG (examples/cuda/gpt2-124M-shakespeare.yaml) and CASE
# (gpt2-124M, the rows' case prefix) train another model, e.g. CONFIG=examples/cuda/olmoe-mini.yaml
# CASE=olmoe-mini-l4 EXTRA="mock_data=false num_layers=4 ...". A run that fails (a recipe refused, a
# timeout) is FAILED in the table, not fatal. RUN_CAP (90 s) bounds each run, BUDGET_S (470 s) the whole call.
# $OUT: fp8_convergence.png and .json (`primus report`), converge.jsonl (DESIGN.md "Measurements"
# rows: bench fp8_convergence, metric val_loss, anchor the bf16 run), summary.txt (the table
# printed last), converge.tar.gz (converge/<run>.metrics.jsonl, the logs, status.tsv, env.txt: the
# device returns at most 8 files). Without Cairo there the chart is drawn here afterwards:
#   tar xzf converge.tar.gz; for f in converge/*.metrics.jsonl; do n=$(basename "$f" .metrics.jsonl);
#   mkdir -p runs/$n; cp "$f" runs/$n/metrics.jsonl; done; build/bin/primus report runs/bf16 runs/...
set -u
CARRY=${CARRY:-.carry-fp8}
OUT=${OUT:-/tmp/fp8-conv-out}
BIN=/tmp/fp8-bin
STEPS=${STEPS:-1000}
MB=${MB:-8}
SEQ=${SEQ:-512}
GB=${GB:-$MB}
EVAL_ITERS=${EVAL_ITERS:-4}
EVAL_INTERVAL=${EVAL_INTERVAL:-50}
SEED=${SEED:-1234}
WARMUP=$(( STEPS / 10 > 0 ? STEPS / 10 : 1 ))
RECIPES=${RECIPES:-"hybrid:tensorwise e4m3:tensorwise hybrid:rowwise e4m3:rowwise e4m3:blockwise hybrid:delayed"}
EXTRA=${EXTRA:-}
RUN_CAP=${RUN_CAP:-90}
CONFIG=${CONFIG:-examples/cuda/gpt2-124M-shakespeare.yaml}
CASE=${CASE:-gpt2-124M}
source bench/tools/carry.sh
carry_deadline "${BUDGET_S:-470}"
C=$OUT/converge        # per run: <name>.metrics.jsonl, <name>.log; status.tsv
RUNS=/tmp/fp8-conv-runs  # per run: <name>/metrics.jsonl (`primus report` names a run after its folder)
WS=/tmp/fp8-conv-ws
rm -rf "$RUNS" "$WS"
mkdir -p "$C" "$BIN" "$RUNS"
carry_unpack "$CARRY" "$BIN"

DATA=$CARRY/tinyshakespeare.txt
if [ ! -e "$DATA" ]; then
  echo "no $DATA (bench/fp8/converge_prepare.sh); using the repository's examples/data/tinyshakespeare.txt"
  DATA=examples/data/tinyshakespeare.txt
fi
DATA=$(realpath "$DATA")
if (( MB * SEQ % 128 != 0 )); then echo "warning: $MB x $SEQ tokens a micro-batch is no multiple of 128 (blockwise refuses it)"; fi

DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
DATE=$(date -u +%Y-%m-%d)
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader 2>/dev/null
  echo "commit $COMMIT"; echo "data $DATA ($(wc -c < "$DATA") bytes)"
  echo "batch ${MB}x${SEQ} global $GB, $STEPS steps, warm-up $WARMUP, eval every $EVAL_INTERVAL x $EVAL_ITERS, seed $SEED, extra '$EXTRA'"
} | tee "$C/env.txt"
printf 'name\tfp8\trecipe\trc\tseconds\treason\toverrides\n' > "$C/status.tsv"

# run_one NAME FP8 [RECIPE [OVERRIDES]]: one training run; its metrics to $C and $RUNS, a status
# line. OVERRIDES: space-separated key=value for this run alone.
run_one() {
  local name=$1 fmt=$2 recipe=${3:-} more=${4:-} ws=$WS/$1 t0=$SECONDS rc m reason
  local -a rec=()
  [ -n "$recipe" ] && rec=(fp8_recipe="$recipe")
  rm -rf "$ws"
  # shellcheck disable=SC2086  # EXTRA is words
  # SIGKILL: SIGTERM would make the trainer finish its step and write a checkpoint (preemption).
  timeout -s KILL "$(cap "$RUN_CAP")" "$BIN/primus" train pretrain --config "$CONFIG" "data_path=[$DATA]" \
    train_iters="$STEPS" micro_batch_size="$MB" global_batch_size="$GB" seq_length="$SEQ" \
    lr_warmup_iters="$WARMUP" eval_interval="$EVAL_INTERVAL" eval_iters="$EVAL_ITERS" log_interval=10 \
    save_interval=0 save_at_end=false report_at_end=false seed="$SEED" workspace="$ws" exp_name="$name" \
    fp8="$fmt" "${rec[@]}" $EXTRA $more > "$C/$name.log" 2>&1
  rc=$?
  m=""
  for f in "$ws"/*/*/"$name"/metrics.jsonl; do [ -e "$f" ] && m=$f; done
  if [ -n "$m" ]; then
    cp "$m" "$C/$name.metrics.jsonl"
    mkdir -p "$RUNS/$name" && cp "$m" "$RUNS/$name/metrics.jsonl"
  fi
  reason=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then reason="timeout after $((SECONDS - t0)) s"
  elif [ "$rc" != 0 ]; then reason=$(grep -E "error|Error|refused|what\(\)" "$C/$name.log" | tail -1 | tr '\t' ' ' | cut -c1-160); fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$fmt" "${recipe:--}" "$rc" "$((SECONDS - t0))" "$reason" "$more" >> "$C/status.tsv"
  echo "== $name: rc=$rc $((SECONDS - t0))s $(grep -E 'validation loss' "$C/$name.log" | tail -1 | sed 's/^\[[^]]*\] //')${reason:+ ($reason)}"
  rm -rf "$ws"
}

ORDER=(bf16)
run_one bf16 none
for e in $RECIPES; do
  fmt=${e%%:*}; rest=${e#*:}; recipe=${rest%%:*}; variant="" more=""
  if [ "$rest" != "$recipe" ]; then
    variant=${rest#*:}; vv="VARIANT_${variant}"; more=${!vv:-}; more=${more//,/ }
    [ -z "$more" ] && echo "warning: $e names variant '$variant' but VARIANT_$variant is empty"
  fi
  if [ "$fmt" = none ]; then
    if [ -n "$variant" ]; then name=bf16-$variant; else name=bf16-repeat; fi
    run_one "$name" none "" "$more"
  else name="$fmt-$recipe${variant:+-$variant}"; run_one "$name" "$fmt" "$recipe" "$more"; fi
  ORDER+=("$name")
done

# The chart: `primus report` over the runs that left metrics, bf16 first. The GPU machine has no
# Cairo: converge_prepare.sh carries one (extra/cairo.tar.xz), used for this command alone.
dirs=()
for n in "${ORDER[@]}"; do [ -e "$RUNS/$n/metrics.jsonl" ] && dirs+=("$RUNS/$n"); done
if [ "${#dirs[@]}" -gt 0 ]; then
  (
    if [ -e "$CARRY/extra/cairo.tar.xz" ]; then
      cd_=/tmp/fp8-conv-cairo
      rm -rf "$cd_" && mkdir -p "$cd_" && tar -C "$cd_" -xJf "$CARRY/extra/cairo.tar.xz"
      printf '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig><dir>%s</dir><cachedir>%s</cachedir></fontconfig>\n' \
        "$cd_/cairo/fonts" "$cd_/fontcache" > "$cd_/fonts.conf"
      export LD_LIBRARY_PATH=$cd_/cairo:$LD_LIBRARY_PATH PRIMUS_CAIRO_LIBRARY=$cd_/cairo/libcairo.so.2 FONTCONFIG_FILE=$cd_/fonts.conf
    fi
    timeout "$(cap 60)" "$BIN/primus" report -o "$OUT/fp8_convergence.png" --json "$OUT/fp8_convergence.json" "${dirs[@]}" > "$C/report.log" 2>&1
    echo "report: rc=$? $(tail -1 "$C/report.log")"
  )
fi

# The table (printed last) and the rows.
python3 - "$OUT" "$DEVICE" "$DATE" "$COMMIT" "$STEPS" "$MB" "$SEQ" "$GB" "$CASE" "$EXTRA" "${ORDER[@]}" <<'PY' | tee "$OUT/summary.txt"
import csv, json, math, os, sys
out, device, date, commit = sys.argv[1:5]
steps, mb, seq, gb = (int(x) for x in sys.argv[5:9])
case, extra = sys.argv[9:11]
order = sys.argv[11:]
cdir = os.path.join(out, "converge")
TOL = 0.01
status = {r["name"]: r for r in csv.DictReader(open(os.path.join(cdir, "status.tsv")), delimiter="\t")}

def read(name):
    """step -> val_loss (a step logged twice keeps its last record), step -> train loss, tokens/s."""
    val, train, tps = {}, {}, []
    try:
        lines = open(os.path.join(cdir, name + ".metrics.jsonl"))
    except OSError:
        return None
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        s = r.get("step")
        if not isinstance(s, int):
            continue
        if "val_loss" in r:
            val[s] = r["val_loss"]
        if "loss" in r:
            train[s] = r["loss"]
        if r.get("tokens_per_s"):
            tps.append(r["tokens_per_s"])
    tps = sorted(tps[1:] or tps)
    return {"val": val, "train": train, "tok_s": tps[len(tps) // 2] if tps else None}

def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)

def fmt(x, f="{:.4f}"):
    return f.format(x) if finite(x) else "-"

runs = {n: read(n) for n in order}
base = runs.get("bf16")
bval = base["val"] if base else {}
bsteps = sorted(s for s, v in bval.items() if finite(v))
bfinal_step = bsteps[-1] if bsteps else None
bfinal = bval[bfinal_step] if bsteps else None
base_ok = base is not None and bfinal_step == steps and status.get("bf16", {}).get("rc") == "0"

rows, table = [], []
for n in order:
    st = status.get(n, {})
    r = runs[n]
    secs = st.get("seconds", "-")
    tok_s = f"{r['tok_s']:,.0f}" if r and r["tok_s"] else "-"
    if r is None or not r["val"]:
        table.append((n, "-", fmt(bfinal), "-", "-", "-", tok_s, secs, "FAILED", st.get("reason") or f"rc={st.get('rc')}, no validation loss"))
        continue
    val = r["val"]
    vsteps = sorted(val)
    final_step = vsteps[-1]
    final = val[final_step]
    if n == "bf16":
        verdict = "anchor" if base_ok else "FAILED"
        note = "" if base_ok else (st.get("reason") or f"rc={st.get('rc')}, last evaluation at step {final_step}")
        table.append((n, fmt(final), fmt(bfinal), "", "", "", tok_s, secs, verdict, note))
        continue
    common = [s for s in bsteps if s in val]
    rel = {s: (val[s] - bval[s]) / bval[s] if finite(val[s]) else math.inf for s in common}
    max_step = max(rel, key=lambda s: abs(rel[s])) if rel else None
    max_rel = abs(rel[max_step]) if rel else math.inf
    final_rel = rel.get(bfinal_step, math.inf) if bsteps else math.inf
    complete = bool(bsteps) and len(common) == len(bsteps) and st.get("rc") == "0"
    passed = base_ok and complete and max_rel <= TOL
    if not base_ok:
        verdict, note = "NO ANCHOR", "the bf16 run did not finish"
    elif not complete:
        verdict = "FAILED"
        note = st.get("reason") or f"rc={st.get('rc')}"
        note += f"; {len(common)} of {len(bsteps)} evaluations"
    else:
        verdict, note = ("PASS" if passed else "FAIL"), ""
    shown = fmt(final) if final_step == steps else f"{fmt(final)}@{final_step}"
    table.append((n, shown, fmt(bfinal), fmt(100 * max_rel, "{:.2f}%"),
                  str(max_step) if max_step is not None else "-", fmt(100 * final_rel, "{:+.2f}%"),
                  tok_s, secs, verdict, note))
    if base_ok and complete and finite(final) and final_step == steps:
        rows.append({"bench": "fp8_convergence", "case": f"{case}/shakespeare/{mb}x{seq}/{steps}/{n}",
                     "device": device, "date": date, "commit": commit, "metric": "val_loss",
                     "ours": round(final, 5), "anchor": round(bfinal, 5), "anchor_name": "primus bf16, same call",
                     "ratio": round(bfinal / final, 5), "max_rel_diff": round(max_rel, 5),
                     "max_rel_diff_step": max_step, "final_rel_diff": round(final_rel, 5),
                     "eval_steps": len(common), "within_1pct": passed,
                     "note": f"global batch {gb}, same seed; ratio bf16 / ours (a loss: higher is better, as DESIGN.md asks); "
                             "max_rel_diff: largest |val - bf16| / bf16 over the evaluations"
                             + (f"; every run's overrides: {extra}" if extra.strip() else "")
                             + (f"; this run's overrides: {st['overrides']}" if st.get("overrides") else "")})

with open(os.path.join(out, "converge.jsonl"), "a") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")

print(f"\n{case}, tinyshakespeare (GPT-2 tokenizer), {mb} x {seq} (global {gb}), {steps} steps, {device}, commit {commit}")
print(f"validation loss against bf16 at the same {len(bsteps)} evaluation steps; PASS: every one within {TOL:.0%}")
head = ("run", "final val", "bf16 final", "max |rel|", "at step", "final rel", "tok/s", "s", "verdict", "")
w = [max(len(str(t[i])) for t in table + [head]) for i in range(len(head))]
for t in [head] + table:
    print("  ".join(str(x).ljust(w[i]) if i in (0, 8, 9) else str(x).rjust(w[i]) for i, x in enumerate(t)).rstrip())
PY

# The device returns at most 8 files: the metrics and logs travel as one archive.
(cd "$OUT" && tar czf converge.tar.gz converge && rm -rf converge)
