#!/usr/bin/env bash
# One device call for issue #40's GPU checks: runs each bench/hf/gpu_<part>.sh (PARTS, default all
# of them) with BIN (the unpacked binaries, on PATH), OUT (its own subfolder of $OUT) and DATA (the
# carried tinyshakespeare) set, each under PART_TIMEOUT seconds (default 240), and prints every
# part's last table, then one line per part. From the repository root, with .carry-hf
# (bench/hf/prepare_carry.sh):
#   run(command="bash bench/hf/run_on_gpu.sh", carry=[".carry-hf"])
#   run(command="PARTS='import generate' bash bench/hf/run_on_gpu.sh", carry=[".carry-hf"])
# The parts write under /tmp/hf-work; they come back as $OUT/hf-out.tgz (the device returns a few
# files only).
set -u
CARRY=${CARRY:-.carry-hf}
OUT_ROOT=${OUT:-/tmp/hf-out}
WORK=/tmp/hf-work
BIN=/tmp/hf-bin
rm -rf "$WORK"; mkdir -p "$OUT_ROOT" "$WORK/parts" "$BIN"
# shellcheck source=scripts/gpu_carry.sh
source scripts/gpu_carry.sh
export PATH=$BIN:$PATH BIN
export DATA=$PWD/$CARRY/tinyshakespeare.txt
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
export COMMIT DATE_UTC
DATE_UTC=$(date -u +%Y-%m-%d)
{ date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
  echo "commit $COMMIT"; } | tee "$WORK/parts/env.txt"
PARTS=${PARTS:-$(for f in bench/hf/gpu_*.sh; do n=$(basename "$f" .sh); echo "${n#gpu_}"; done)}
summary=""
for p in $PARTS; do
  export OUT=$WORK/parts/$p
  mkdir -p "$OUT"
  start=$(date +%s)
  timeout "${PART_TIMEOUT:-240}" bash "bench/hf/gpu_$p.sh" > "$OUT/log.txt" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  echo "===== $p (rc=$rc, ${secs}s) ====="
  tail -n "${TAIL:-25}" "$OUT/log.txt"
  summary+="$(printf '%-10s rc=%-4s %4ss' "$p" "$rc" "$secs")"$'\n'
done
tar -C "$WORK" -czf "$OUT_ROOT/hf-out.tgz" parts
echo "===== parts ====="
printf '%s' "$summary"
