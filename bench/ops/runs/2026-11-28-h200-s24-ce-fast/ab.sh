#!/usr/bin/env bash
# Session 24: the cross-entropy kernels' per-vector fast paths (bounds and target checks once per 16-byte vector
# instead of per element) against the binary before them, alternating processes, ROUNDS rounds, one call.
# Carry .carry-ce: primus_old.gz (2e5fc76, unity CI build), primus.gz (the change), libgomp.so.1, and optionally
# primus_old.commit / primus.commit naming what each binary was built from (the JSON's commit field; without them
# the side's name, since `primus benchmark` would otherwise record the device copy's git HEAD, not the binary's).
#   run(command="OUT=$OUT bash bench/ops/runs/2026-11-28-h200-s24-ce-fast/ab.sh", carry=[".carry-ce"])
set -u
OUT=${OUT:-/tmp/ce-ab}
B=/tmp/ceab; mkdir -p "$B" "$OUT"
for n in primus primus_old; do gunzip -c .carry-ce/$n.gz > $B/$n; chmod +x $B/$n; done
cp .carry-ce/libgomp.so.1 $B/
# shellcheck disable=SC1091
source scripts/gpu_env.sh
export LD_LIBRARY_PATH=$B:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/env.txt"
for r in $(seq "${ROUNDS:-3}"); do
  for n in primus_old primus; do
    $B/$n benchmark loss --shapes 16384x128256,16384x50304 --json "$OUT/${n}_r$r.jsonl" \
      --commit "$(cat .carry-ce/$n.commit 2>/dev/null || echo "$n")" > "$OUT/${n}_r$r.log" 2>&1
    echo "== $n round $r rc=$?"; grep -E '^  cross_entropy.* ms ' "$OUT/${n}_r$r.log"
  done
done
