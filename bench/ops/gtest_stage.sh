# Sourced by the bench/ops device scripts: gtest_stage BIN OUT [SECONDS] runs, when GTEST is set
# (<test binary>:<gtest filter>), those tests of $BIN/<test binary> under a time limit (default
# 300 s), logs to $OUT/tests.log and prints the verdict lines.
gtest_stage() {
  [ -n "${GTEST:-}" ] || return 0
  timeout "${3:-300}" "$1/${GTEST%%:*}" --gtest_brief=1 --gtest_filter="${GTEST#*:}" > "$2/tests.log" 2>&1
  echo "tests (${GTEST}) rc=$?" | tee -a "$2/tests.log"
  grep -E "FAILED|PASSED|turbo gemm" "$2/tests.log" | tail -12
}
