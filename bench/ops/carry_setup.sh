# Sourced by the bench/ops device scripts that run binaries from a carried folder (env_ab.sh,
# gemm_env_ab.sh): unpacks $CARRY/*.gz into $BIN (executable), copies the carry's shared libraries
# beside them, puts $BIN first on LD_LIBRARY_PATH, sets COMMIT from $CARRY/commit.txt, and writes
# the GPU's name, clocks and power limit to $OUT/env.txt. Needs CARRY, BIN and OUT.
mkdir -p "$OUT" "$BIN"
for f in "$CARRY"/*.gz; do gunzip -c "$f" > "$BIN/$(basename "$f" .gz)" && chmod +x "$BIN/$(basename "$f" .gz)"; done
cp "$CARRY"/lib*.so* "$BIN/" 2>/dev/null
export LD_LIBRARY_PATH=$BIN:${LD_LIBRARY_PATH:-}
COMMIT=$(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/env.txt"
