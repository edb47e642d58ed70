#!/usr/bin/env bash
# Session 25, one device call: (1) the cross-entropy and norm GPU tests of the new build, (2) the new
# binary against the one before it, alternating processes, ROUNDS rounds: `primus benchmark loss` (the
# fold's padding check as a branch, not a select per element) and `primus benchmark norm` (the forward's
# 64-thread blocks), (3) SASS instruction counts of the cross-entropy kernels where the machine has cuobjdump.
# NAMES lists the binaries to alternate (default "primus_old primus"). Carry .carry-ce25: primus_old, primus,
# test_turbo_gpu (.gz or .xz: xz fits three or four binaries in one call), libgomp.so.1, primus_old.commit / primus.commit.
#   run(command="OUT=$OUT bash bench/ops/runs/2026-11-28-h200-s25-ce/ab.sh", carry=[".carry-ce25"])
set -u
OUT=${OUT:-/tmp/ce-ab}
C=${CARRY:-.carry-ce25}
B=/tmp/ceab; mkdir -p "$B" "$OUT"
for f in "$C"/*.gz "$C"/*.xz; do
  [ -e "$f" ] || continue
  n=$(basename "${f%.*}"); case "$f" in *.xz) xz -dc "$f" > "$B/$n" ;; *) gunzip -c "$f" > "$B/$n" ;; esac; chmod +x "$B/$n"
done
cp "$C"/libgomp.so.1 "$B"/
# shellcheck disable=SC1091
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/env.txt"
if [ -x "$B/test_turbo_gpu" ]; then
  "$B/test_turbo_gpu" --gtest_brief=1 --gtest_filter="${GTEST:-*CrossEntropy*:*Loss*:*Norm*}" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | tail -6
fi
for r in $(seq "${ROUNDS:-3}"); do
  for n in ${NAMES:-primus_old primus}; do
    for fam in ${FAMILIES:-loss norm}; do
      extra=""; [ "$fam" = loss ] && extra="--shapes 16384x128256,16384x50304"
      # shellcheck disable=SC2086
      $B/$n benchmark "$fam" $extra --json "$OUT/${n}_${fam}_r$r.jsonl" \
        --commit "$(cat "$C/$n.commit" 2>/dev/null || echo "$n")" > "$OUT/${n}_${fam}_r$r.log" 2>&1
      echo "== $n $fam round $r rc=$?"; grep -E '^  (cross_entropy|layernorm_fwd|add_layernorm_fwd|rmsnorm_fwd|add_rmsnorm_fwd)[^ ]* .* ms ' "$OUT/${n}_${fam}_r$r.log"
    done
  done
done
if [ "${SASS:-1}" = 1 ] && { command -v cuobjdump > /dev/null || [ -x /usr/local/cuda/bin/cuobjdump ]; }; then
  CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  for n in ${NAMES:-primus_old primus}; do
    "$CUOBJ" -sass "$B/$n" | awk '/Function : /{p = ($0 ~ /cross_entropy/)} p' > "$OUT/${n}_ce.sass"
    echo "$n SASS lines (cross_entropy kernels): $(wc -l < "$OUT/${n}_ce.sass")"
  done
fi
# At most 8 files come back from a call: everything in one archive.
tar czf /tmp/ab_all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/ab_all.tgz "$OUT/all.tgz"
