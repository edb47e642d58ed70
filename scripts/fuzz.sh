#!/usr/bin/env bash
# Builds the libFuzzer targets (clang) and runs each for a fixed time, starting from its seed
# corpus in fuzz/corpus/<target>/. Exits non-zero when a target finds a crash; the input is
# saved in build-fuzz/artifacts/<target>/ (turn it into a regression: docs/hardening.md).
#
# Usage: scripts/fuzz.sh [--seconds N | --runs N [--seed S]] [--targets a,b] [--build-dir DIR]
#                        [--no-build | --no-run] [--jobs N] [--keep-going] [--record FILE] [--update-corpus]
#   --seconds N       per target (default 25); e.g. --seconds 3600 for an hour
#   --runs N          a fixed number of inputs per target instead of a time; with --seed S the run
#                     is reproducible (same binary, corpus and seed: same inputs). The CI smoke run
#                     (scripts/test.sh) uses --runs 10000 --seed 1, so it cannot fail by chance.
#   --targets a,b     a subset (default: every fuzz/*_fuzz.cpp)
#   --jobs N          targets fuzzed at once (default 1; each target is one process, one core)
#   --no-run          build only
#   --keep-going      libFuzzer fork mode that goes on after a crash (long unattended runs)
#   --record FILE     append one JSON line per target (execs, seconds, crashes) to FILE
#   --update-corpus   merge inputs that add coverage back into fuzz/corpus/<target>/
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECONDS_PER_TARGET=25
RUNS=""
SEED=""
TARGETS=""
BUILD_DIR=build-fuzz
BUILD=1
RUN=1
JOBS=1
KEEP_GOING=0
RECORD=""
UPDATE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_PER_TARGET=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --targets) TARGETS=${2//,/ }; shift 2 ;;
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --keep-going) KEEP_GOING=1; shift ;;
    --record) RECORD=$2; shift 2 ;;
    --update-corpus) UPDATE=1; shift ;;
    --jobs) JOBS=$2; shift 2 ;;
    --no-run) RUN=0; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
CXX=${PRIMUS_FUZZ_CXX:-clang++-14}
CC=${PRIMUS_FUZZ_CC:-clang-14}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 2; }
if [ -z "$TARGETS" ]; then
  TARGETS=$(ls fuzz/*_fuzz.cpp | sed 's|fuzz/||; s|_fuzz.cpp||' | tr '\n' ' ')
fi
if [ "$BUILD" = 1 ]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_C_COMPILER="$CC" -DPRIMUS_FUZZ=ON \
    -DPRIMUS_CUDA=OFF -DPRIMUS_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_UNITY_BUILD="${PRIMUS_UNITY_BUILD:-ON}" -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 >/dev/null
  # Under scripts/test.sh the jobs come from its make's shared pool (the jobserver in MAKEFLAGS).
  case " ${MAKEFLAGS:-} " in *jobserver*) jobs=() ;; *) jobs=(-j "$(nproc)") ;; esac
  cmake --build "$BUILD_DIR" "${jobs[@]}" --target $(for t in $TARGETS; do echo "fuzz_$t"; done)
fi
[ "$RUN" = 1 ] || exit 0

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$RUNS" ]; then what="$RUNS runs${SEED:+, seed $SEED}"; else what="${SECONDS_PER_TARGET}s"; fi
for t in $TARGETS; do
  [ -x "$BUILD_DIR/bin/fuzz_$t" ] || { echo "fuzz.sh: $BUILD_DIR/bin/fuzz_$t is missing" >&2; exit 2; }
done

# One target's run; its counts go to logs/<target>.result ("execs seconds crashes exit").
run_target() {
  local t=$1
  local bin=$BUILD_DIR/bin/fuzz_$t
  local work=$BUILD_DIR/corpus/$t     # grows as the fuzzer finds new coverage
  local art=$BUILD_DIR/artifacts/$t
  local log=$BUILD_DIR/logs/$t.log
  mkdir -p "$work" "$art" "$(dirname "$log")"
  local opts=(-timeout=20 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$art/")
  if [ -n "$RUNS" ]; then opts+=(-runs="$RUNS"); else opts+=(-max_total_time="$SECONDS_PER_TARGET"); fi
  [ -n "$SEED" ] && opts+=(-seed="$SEED")
  [ -f "fuzz/dict/$t.dict" ] && opts+=(-dict="fuzz/dict/$t.dict")
  [ "$KEEP_GOING" = 1 ] && opts+=(-fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1)
  local before start rc=0 secs execs crashes
  before=$(ls "$art" | wc -l)
  start=$(date +%s)
  PRIMUS_FUZZ_KNOWN=${PRIMUS_FUZZ_KNOWN:-$ROOT/fuzz/known_findings.txt} ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} "$bin" "${opts[@]}" "$work" "fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  secs=$(( $(date +%s) - start ))
  # Executions: the final stats line, or (fork mode) the last progress line's #N.
  execs=$( (grep -o 'stat::number_of_executed_units: [0-9]*' "$log" || true) | awk '{s+=$2} END {print s+0}')
  if [ "$execs" = 0 ]; then execs=$( (grep -o '^#[0-9]*' "$log" || true) | tail -1 | tr -d '#'); fi
  crashes=$(( $(ls "$art" | wc -l) - before ))
  echo "${execs:-0} $secs $crashes $rc" >"$BUILD_DIR/logs/$t.result"
}

mkdir -p "$BUILD_DIR/logs"
for t in $TARGETS; do
  rm -f "$BUILD_DIR/logs/$t.result"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  run_target "$t" &
done
wait

failed=()
for t in $TARGETS; do
  log=$BUILD_DIR/logs/$t.log
  echo "== fuzz_$t: $what (log: $log)"
  if [ ! -f "$BUILD_DIR/logs/$t.result" ]; then
    echo "   no result (the run did not finish)"; failed+=("$t"); continue
  fi
  read -r execs secs crashes rc <"$BUILD_DIR/logs/$t.result"
  echo "   $execs executions in ${secs}s, $crashes new crash input(s), exit $rc"
  if [ "$rc" != 0 ] || [ "$crashes" != 0 ]; then
    failed+=("$t")
    (grep -E 'ERROR: |primus fuzz finding|SUMMARY|runtime error' "$log" || true) | head -5 | sed 's/^/   /'
  fi
  if [ -n "$RECORD" ]; then
    printf '{"bench":"fuzz","case":"%s","device":"cpu (%s cores)","date":"%s","commit":"%s","metric":"execs","ours":%s,"seconds":%s,"crashes_found":%s,"crashes_fixed":0}\n' \
      "$t" "$(nproc)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$commit" "$execs" "$secs" "$crashes" >>"$RECORD"
  fi
  if [ "$UPDATE" = 1 ]; then
    "$BUILD_DIR/bin/fuzz_$t" -merge=1 "fuzz/corpus/$t" "$BUILD_DIR/corpus/$t" >>"$log" 2>&1 || true
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: findings in: ${failed[*]} (inputs in $BUILD_DIR/artifacts/)" >&2
  exit 1
fi
echo "fuzz.sh: no findings"
