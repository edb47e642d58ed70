#!/usr/bin/env bash
# Runs the sbatch scripts of examples/slurm as Slurm would, on this machine: the script is started
# with bash and the batch shell's SLURM_* variables, and fake `srun` / `scontrol` (fake-slurm/)
# start the job step's tasks locally with each task's own variables, so "2 nodes" are two groups
# of local processes. The reference backend trains a tiny GPT-2 on 2 ranks; the checks read the
# per-rank logs and metrics.jsonl.
# Usage: sbatch_test.sh CASE PRIMUS_BINARY
#   launcher-2nodes       train-multinode.sbatch, 2 nodes x 1 rank, one `primus launch` per node
#   srun-1node            train-1node.sbatch, 1 node x 2 ranks started by srun (SLURM_PROCID, ...)
#   rank-failure          rank 1 is killed mid-run: the job must fail, soon, naming it
#   preempt-requeue       SIGUSR1 to the batch shell: checkpoint, exit 0, requeue; the requeued
#                         attempt resumes from that checkpoint and finishes
#   pyxis-2nodes          as launcher-2nodes in a "container": --container-image in PRIMUS_SRUN_ARGS
#                         (the fake srun ignores it) and the image's `primus` on the tasks' PATH
#   apptainer-srun        as srun-1node with every rank under PRIMUS_WRAP="apptainer exec --nv IMAGE"
#                         (a fake apptainer that runs the command here)
#   broken-script-caught  a copy of the runner that starts one rank instead of two still exits 0;
#                         the checks the cases above use must reject its run
#   lint                  bash -n, shellcheck (when installed), #SBATCH lines before any command,
#                         the runner's refusals (no allocation, unknown mode)
set -uo pipefail

case_name=${1:?usage: sbatch_test.sh CASE PRIMUS_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
slurm_dir=$repo/examples/slurm

fail() { echo "FAIL ($case_name): $*" >&2; exit 1; }

if [ "$case_name" = lint ]; then
  files=("$slurm_dir"/*.sbatch "$slurm_dir"/*.sh "$here"/*.sh "$here"/fake-slurm/* "$repo"/examples/container/*.sh)
  for f in "${files[@]}"; do bash -n "$f" || fail "bash -n $f"; done
  if command -v shellcheck >/dev/null; then
    shellcheck -x "${files[@]}" || fail "shellcheck"
  else
    echo "shellcheck is not installed: only bash -n was checked"
  fi
  # sbatch reads #SBATCH lines only up to the first command; one below it is silently ignored.
  for f in "$slurm_dir"/*.sbatch; do
    first_cmd=$(grep -n -v -E '^[[:space:]]*(#|$)' "$f" | head -n 1 | cut -d: -f1)
    last_directive=$(grep -n '^#SBATCH' "$f" | tail -n 1 | cut -d: -f1)
    [ -n "$last_directive" ] || fail "$f has no #SBATCH line"
    [ "$last_directive" -lt "$first_cmd" ] || fail "$f: #SBATCH on line $last_directive comes after the first command (line $first_cmd)"
  done
  # Outside an allocation, or with a mode it does not know, the runner stops with a reason.
  out=$(env -u SLURM_JOB_ID bash "$slurm_dir/primus-slurm.sh" 2>&1); rc=$?
  if [ "$rc" != 2 ] || [[ $out != *"SLURM_JOB_ID is not set"* ]]; then fail "outside an allocation: exit $rc: $out"; fi
  out=$(SLURM_JOB_ID=1 PRIMUS_LAUNCH_MODE=mpirun bash "$slurm_dir/primus-slurm.sh" 2>&1); rc=$?
  if [ "$rc" != 2 ] || [[ $out != *"PRIMUS_LAUNCH_MODE=mpirun"* ]]; then fail "unknown mode: exit $rc: $out"; fi
  echo "PASS ($case_name)"
  exit 0
fi

export PRIMUS_BIN=${2:?usage: sbatch_test.sh CASE PRIMUS_BINARY}
[ -x "$PRIMUS_BIN" ] || fail "no primus binary at $PRIMUS_BIN"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/primus_slurm_test.XXXXXX")
job_pid=""
# A job that outlives the test (it failed midway) is ended with everything it started: every job
# runs in a session of its own, and the launchers take their ranks with them.
# shellcheck disable=SC2329,SC2317  # run by the EXIT trap
cleanup() {
  if [ -n "$job_pid" ]; then kill -KILL -- "-$job_pid" 2>/dev/null; fi
  if [ "${KEEP_TMP:-0}" = 1 ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

# A job id whose derived port (20000 + id mod 10000, what the script and primus use) is free, so
# that concurrent test runs do not meet at one store.
pick_job_id() {
  local id port
  for _ in $(seq 50); do
    id=$((100000 + RANDOM % 10000))
    port=$((20000 + id % 10000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$id"; return; fi
  done
  fail "no free port found for the job's rendezvous"
}

# The batch shell's environment, as sbatch sets it for NODES nodes x PER_NODE tasks. Loopback
# addresses stand for the nodes: 127.0.0.1 and 127.0.0.2 both reach this machine.
slurm_env() {
  local nodes=$1 per_node=$2
  export PATH="$here/fake-slurm:$PATH"
  export SLURM_JOB_ID=${job_id:-$(pick_job_id)} SLURM_JOB_NAME=primus-ci SLURM_SUBMIT_DIR=$tmp
  export SLURM_JOB_NODELIST="127.0.0.[1-$nodes]" SLURM_NODELIST="127.0.0.[1-$nodes]"
  export SLURM_NNODES=$nodes SLURM_JOB_NUM_NODES=$nodes SLURM_NTASKS=$((nodes * per_node))
  export SLURM_NTASKS_PER_NODE=$per_node SLURM_TASKS_PER_NODE="$per_node(x$nodes)"
  export SLURM_CPUS_ON_NODE=$per_node SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0
  export FAKE_SLURM_RECORD=$tmp/slurm-record FAKE_SLURM_STEP_FILE=$tmp/slurm-step
  export PRIMUS_HOME=${home:-$repo} CONFIG=$repo/examples/reference/shakespeare.yaml
  export PRIMUS_DIST_TIMEOUT=30 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT PRIMUS_LAUNCH_MODE NPROC_PER_NODE SLURM_RESTART_COUNT \
        PRIMUS_OVERRIDES PRIMUS_SRUN_ARGS PRIMUS_WRAP PRIMUS_LAUNCH_ARGS PRIMUS_LOG_ROOT PRIMUS_REQUEUE PRIMUS_DRY_RUN
}

# A tiny GPT-2 (18k parameters) on tinyshakespeare bytes; the global batch of 4 splits over 2 ranks.
tiny="num_layers=1 hidden_size=32 num_attention_heads=2 ffn_hidden_size=64 seq_length=32 micro_batch_size=2"
tiny+=" global_batch_size=4 eval_interval=0 log_interval=1 sample_tokens=0 lr_warmup_iters=1 lr_decay_iters=10"
ws=$tmp/workspace
metrics=$ws/local/local/shakespeare/metrics.jsonl
save=$ws/local/local/shakespeare/checkpoints

# Starts an sbatch script as the batch shell (in its own session: its pid is its group's id);
# its output goes to $tmp/job.out.
start_job() {
  local script=$1; shift
  job_t0=$SECONDS
  setsid bash "$script" "$@" >"$tmp/job.out" 2>&1 &
  job_pid=$!
}
# Waits for the job; its status goes to $job_rc, its duration to $job_s.
wait_job() {
  wait "$job_pid"
  job_rc=$?
  job_s=$((SECONDS - job_t0))
  sed 's/^/  | /' "$tmp/job.out"
}
run_job() { start_job "$@"; wait_job; }

log_dir() { echo "$tmp/logs/primus-ci-$SLURM_JOB_ID/attempt-${1:-0}"; }
last_step() { grep -o '"step":[0-9]*' "$metrics" 2>/dev/null | tail -n 1 | cut -d: -f2; }

# What a good training job leaves: exit 0, every step 1..STEPS in metrics.jsonl (once each),
# WORLD ranks that met (rank 0 trained data parallel over WORLD ranks; each rank wrote its log).
check_trained() {
  local steps=$1 world=$2 logs=$3
  [ "$job_rc" = 0 ] || fail "the job exited with $job_rc"
  [ -f "$metrics" ] || fail "no metrics.jsonl at $metrics"
  local got want
  got=$(grep -o '"step":[0-9]*' "$metrics" | cut -d: -f2 | tr '\n' ' ')
  want=$(seq -s ' ' 1 "$steps")' '
  [ "$got" = "$want" ] || fail "metrics.jsonl has steps '$got', expected '$want'"
  grep -q "data parallel over $world ranks" "$logs/rank_0.log" ||
    fail "rank 0 did not train data parallel over $world ranks; it said: $(grep -m 1 ' training ' "$logs/rank_0.log")"
  for ((r = 0; r < world; r++)); do
    [ -s "$logs/rank_$r.log" ] || fail "rank $r left no log in $logs"
  done
  grep -Eq "step +$steps/$steps " "$logs/rank_0.log" || fail "rank 0's log has no step $steps/$steps"
  [ -f "$save/iter_$(printf %07d "$steps")/manifest.json" ] || fail "no checkpoint of step $steps in $save"
}

case "$case_name" in
  launcher-2nodes)
    slurm_env 2 1
    export PRIMUS_OVERRIDES="$tiny train_iters=6 save_interval=3 workspace=$ws"
    run_job "$slurm_dir/train-multinode.sbatch"
    check_trained 6 2 "$(log_dir)"
    # One launcher per node, each starting its own rank with its node's index.
    grep -q "starting 1 rank (0-0 of 2) on node 0 of 2" "$tmp/job.out" || fail "no launcher on node 0"
    grep -q "starting 1 rank (1-1 of 2) on node 1 of 2" "$tmp/job.out" || fail "no launcher on node 1"
    ;;

  srun-1node)
    slurm_env 1 2
    export PRIMUS_LAUNCH_MODE=srun
    # Overrides as the script's arguments this time (PRIMUS_OVERRIDES is the other way in).
    unset PRIMUS_OVERRIDES
    # shellcheck disable=SC2086  # the overrides are words
    run_job "$slurm_dir/train-1node.sbatch" $tiny train_iters=6 save_interval=3 "workspace=$ws"
    check_trained 6 2 "$(log_dir)"
    if grep -q "primus launch:" "$tmp/job.out"; then fail "srun mode ran primus launch"; fi
    ;;

  rank-failure)
    slurm_env 2 1
    # Rank 1 is killed (SIGKILL) after 3 s of a long run, as a crash would end it.
    export PRIMUS_LAUNCH_ARGS="--exec $here/kill_rank1.sh --grace 3"
    export PRIMUS_OVERRIDES="$tiny train_iters=1000000 save_interval=0 workspace=$ws"
    run_job "$slurm_dir/train-multinode.sbatch"
    [ "$job_rc" != 0 ] || fail "the job exited 0 although rank 1 was killed"
    [ "$job_s" -lt 25 ] || fail "the job took $job_s s to fail (should stop soon after the kill, not wait for a timeout)"
    grep -q "FAILED: rank 1 .*signal 9\|FAILED: rank 1 .*exit code 137" "$tmp/job.out" ||
      fail "node 1's launcher did not name rank 1 as failed"
    grep -q "srun exited with status $job_rc" "$tmp/job.out" || fail "the job's status is not srun's"
    ;;

  preempt-requeue)
    slurm_env 2 1
    export PRIMUS_OVERRIDES="$tiny train_iters=1000000 save_interval=0 workspace=$ws"
    start_job "$slurm_dir/train-multinode.sbatch"
    until grep -Eq "step +3/" "$(log_dir)/rank_0.log" 2>/dev/null; do
      kill -0 "$job_pid" 2>/dev/null || { cat "$tmp/job.out"; fail "the job ended before step 3"; }
      [ $((SECONDS - job_t0)) -lt 40 ] || { cat "$tmp/job.out"; fail "no step 3 after 40 s"; }
      sleep 0.1
    done
    # What `#SBATCH --signal=B:USR1@120` does two minutes before the time limit.
    kill -USR1 "$job_pid"
    for _ in $(seq 600); do kill -0 "$job_pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$job_pid" 2>/dev/null && { cat "$tmp/job.out"; fail "the job still runs 60 s after SIGUSR1"; }
    wait_job
    [ "$job_rc" = 0 ] || fail "the preempted job exited with $job_rc, expected 0"
    grep -q "received signal 10" "$(log_dir)/rank_0.log" || fail "rank 0 did not get SIGUSR1"
    grep -qx "requeue $SLURM_JOB_ID" "$tmp/slurm-record" 2>/dev/null || fail "the job did not requeue itself"
    stopped=$(cat "$save/latest_checkpointed_iteration.txt" 2>/dev/null) || fail "no checkpoint after the signal"
    if [ "$stopped" -lt 3 ] || [ "$stopped" -ge 1000000 ]; then
      fail "checkpoint of step $stopped, expected one from the middle of the run"
    fi
    [ "$(last_step)" = "$stopped" ] || fail "metrics end at step $(last_step), the checkpoint is of step $stopped"
    echo "stopped at step $stopped; requeued"

    # The requeued attempt: same job id, Slurm counts the restart. Two more steps this time.
    export SLURM_RESTART_COUNT=1
    export PRIMUS_OVERRIDES="$tiny train_iters=$((stopped + 2)) save_interval=0 workspace=$ws"
    : >"$tmp/slurm-record"
    run_job "$slurm_dir/train-multinode.sbatch"
    check_trained $((stopped + 2)) 2 "$(log_dir 1)"
    grep -q "resumed from .* at step $stopped" "$(log_dir 1)/rank_0.log" || fail "attempt 1 did not resume at step $stopped"
    [ -s "$(log_dir 0)/rank_0.log" ] || fail "attempt 1 overwrote attempt 0's logs"
    [ -s "$tmp/slurm-record" ] && fail "the finished job requeued itself again"
    ;;

  pyxis-2nodes|apptainer-srun)
    # The "image": a folder whose primus is this build's; the script must find it on the PATH.
    mkdir -p "$tmp/image/bin"
    ln -s "$PRIMUS_BIN" "$tmp/image/bin/primus"
    : >"$tmp/primus.sif"
    real_bin=$PRIMUS_BIN
    unset PRIMUS_BIN
    if [ "$case_name" = pyxis-2nodes ]; then
      slurm_env 2 1
      export PATH="$tmp/image/bin:$PATH"
      export PRIMUS_SRUN_ARGS="--container-image=$tmp/primus.sqsh --container-mounts=$tmp:$tmp"
      script=train-multinode.sbatch world=2
    else
      slurm_env 1 2
      export FAKE_IMAGE_BIN=$tmp/image/bin PRIMUS_LAUNCH_MODE=srun
      export PRIMUS_WRAP="apptainer exec --nv --bind $tmp $tmp/primus.sif"
      script=train-1node.sbatch world=2
    fi
    export PRIMUS_OVERRIDES="$tiny train_iters=6 save_interval=3 workspace=$ws"
    run_job "$slurm_dir/$script"
    check_trained 6 "$world" "$(log_dir)"
    # The tasks went into the image, and ran the primus found there (the script was not told
    # where primus is: PRIMUS_BIN is unset, and the checkout has no build/bin/primus in PATH).
    if [ "$case_name" = pyxis-2nodes ]; then
      grep -qx "srun container-image $tmp/primus.sqsh" "$tmp/slurm-record" || fail "srun was not given the image"
    else
      [ "$(grep -cx "apptainer exec $tmp/primus.sif" "$tmp/slurm-record")" = 2 ] || fail "not every rank ran under apptainer"
    fi
    grep -q "binary primus$" "$tmp/job.out" || fail "the script did not default to the image's primus"
    [ "$(command -v primus)" != "$real_bin" ] || fail "the test's PATH already held the build's primus"
    ;;

  broken-script-caught)
    # The runner with a bug that fails nothing by itself: srun mode starts one task per node
    # whatever NPROC_PER_NODE says, so one rank trains alone and the job exits 0.
    home=$tmp/home
    mkdir -p "$home/examples/slurm"
    cp "$slurm_dir"/* "$home/examples/slurm/"
    # shellcheck disable=SC2016  # the pattern is the script's text, not an expansion
    sed -i -e 's/--ntasks=\$((nnodes \* nproc))/--ntasks="$nnodes"/' \
           -e 's/--ntasks-per-node="\$nproc")/--ntasks-per-node=1)/' "$home/examples/slurm/primus-slurm.sh"
    cmp -s "$slurm_dir/primus-slurm.sh" "$home/examples/slurm/primus-slurm.sh" &&
      fail "the mutation did not apply: update this case to the runner's srun line"
    slurm_env 1 2
    export PRIMUS_LAUNCH_MODE=srun PRIMUS_OVERRIDES="$tiny train_iters=6 save_interval=3 workspace=$ws"
    run_job "$home/examples/slurm/train-1node.sbatch"
    [ "$job_rc" = 0 ] || fail "the broken runner's job failed by itself ($job_rc); the case wants one that exits 0"
    if (check_trained 6 2 "$(log_dir)") 2>"$tmp/check.err"; then
      fail "the checks accepted a job in which one rank trained alone"
    fi
    echo "rejected as it should be: $(cat "$tmp/check.err")"
    ;;

  *) fail "unknown case" ;;
esac
echo "PASS ($case_name) in $SECONDS s"
