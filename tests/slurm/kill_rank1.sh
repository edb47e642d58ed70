#!/usr/bin/env bash
# A rank for the failure case of sbatch_test.sh, run by `primus launch --exec`: rank 1 is killed
# with SIGKILL after 3 s, as a crashed rank would end; every other rank is plain primus.
if [ "${RANK:-}" = 1 ]; then
  exec timeout --signal=KILL 3 "$PRIMUS_BIN" "$@"
fi
exec "$PRIMUS_BIN" "$@"
