# shellcheck shell=bash
# Sourced by bench/hf/gpu_<part>.sh, from the repository root, with PART set: OUT (default
# /tmp/<part>-out), BIN (default build/bin), W (a fresh work folder), $OUT/<part>.jsonl started
# empty, COMMIT (the carried commit when run_on_gpu.sh exports it, else git's), DEVICE, DATE and
# ROWS (the lines of the table each script prints last).
set -u
OUT=${OUT:-/tmp/$PART-out}
BIN=${BIN:-build/bin}
W=$(mktemp -d "/tmp/$PART-work.XXXXXX")
mkdir -p "$OUT"
: > "$OUT/$PART.jsonl"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
DATE=$(date -u +%Y-%m-%d)
declare -a ROWS
