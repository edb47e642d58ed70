#!/usr/bin/env bash
# Session 25: SASS of the cross-entropy kernels (the machine has cuobjdump; this one does not), and an
# in-process A/B of the LayerNorm forward's one-chain statistics under the 64-thread default.
#   run(command="OUT=$OUT bash bench/ops/runs/2026-11-28-h200-s25-ce/sass.sh", carry=[".carry-ce25"])
set -u
OUT=${OUT:-/tmp/ce-sass}
C=${CARRY:-.carry-ce25}
B=/tmp/ceab; mkdir -p "$B" "$OUT"
for f in "$C"/*.xz; do n=$(basename "${f%.*}"); xz -dc "$f" > "$B/$n"; chmod +x "$B/$n"; done
cp "$C"/libgomp.so.1 "$B"/
# shellcheck disable=SC1091
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
"$CUOBJ" -sass "$B/primus" | awk '/Function : /{p = ($0 ~ /cross_entropy/)} p' > "$OUT/ce.sass"
grep 'Function :' "$OUT/ce.sass"; wc -l < "$OUT/ce.sass"
"$B/primus" benchmark norm --ab PRIMUS_TURBO_NORM_FWD_STATS=twopass,chan --ab-rounds "${AB_ROUNDS:-7}" > "$OUT/ab_chan.log" 2>&1
echo "ab rc=$?"; grep -E '^  (layernorm_fwd|add_layernorm_fwd)[^ ]* .* ms ' "$OUT/ab_chan.log"
tar czf /tmp/sass_all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/sass_all.tgz "$OUT/all.tgz"
