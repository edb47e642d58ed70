#!/usr/bin/env bash
# The body of the sbatch scripts beside it (train-1node.sbatch, train-multinode.sbatch): starts a
# Primus training job on the nodes of the current Slurm allocation. It runs as the batch shell
# (the sbatch scripts `exec` it, so Slurm's signals for the batch shell reach it), and is usable
# from `salloc` too. Walkthrough: docs/launch.md, "Slurm".
#
# Everything is set through the environment (sbatch exports the submitting shell's by default);
# the script's arguments are extra key=value overrides, appended last:
#   CONFIG               experiment YAML (default: examples/cuda/gpt2-124M-shakespeare.yaml of the
#                        checkout, or of the image's /opt/primus when a container is used)
#   PRIMUS_OVERRIDES     key=value overrides, split on spaces, before the script's arguments
#   PRIMUS_HOME          the Primus checkout (default: $SLURM_SUBMIT_DIR, where sbatch was run)
#   PRIMUS_BIN           the primus binary as the tasks see it (default: `primus` on the PATH when a
#                        container is used, else $PRIMUS_HOME/build/bin/primus if it exists, else `primus`)
#   PRIMUS_LAUNCH_MODE   launcher: one `primus launch` per node starts that node's ranks (default);
#                        srun: Slurm starts every rank itself, one task per GPU
#   NPROC_PER_NODE       ranks per node (default: SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE, else 1)
#   MASTER_ADDR          rendezvous host (default: the allocation's first node)
#   MASTER_PORT          rendezvous port (default: 20000 + SLURM_JOB_ID mod 10000, as primus derives it)
#   PRIMUS_LOG_ROOT      per-job logs go to $PRIMUS_LOG_ROOT/<job name>-<job id>/attempt-<restart count>/
#                        (default: $SLURM_SUBMIT_DIR/logs)
#   PRIMUS_SRUN_ARGS     extra srun options, e.g. "--container-image=... --container-mounts=..." (pyxis)
#   PRIMUS_WRAP          a command each task runs primus under, e.g. "apptainer exec --nv primus.sif"
#   PRIMUS_LAUNCH_ARGS   extra `primus launch` options (launcher mode), e.g. "--timeout 600"
#   PRIMUS_REQUEUE       1 (default): after a SIGUSR1 (the time-limit warning) stopped the run with a
#                        checkpoint, requeue the job so it resumes; 0: just end
#   PRIMUS_DRY_RUN       1: print the srun command instead of running it
set -uo pipefail
# -e is left off on purpose: srun's exit status is collected by hand (see the wait loop below).

log() { echo "primus-slurm: $*" >&2; }
die() { log "error: $*"; exit 2; }

[ -n "${SLURM_JOB_ID:-}" ] || die "SLURM_JOB_ID is not set: run this inside a Slurm allocation (sbatch or salloc)"
PRIMUS_HOME=${PRIMUS_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
# In a container (pyxis's --container-image, or a PRIMUS_WRAP such as apptainer exec) the tasks
# run the image's primus and see its examples in /opt/primus (examples/container), not this
# checkout's build.
if [[ "${PRIMUS_SRUN_ARGS:-}" == *--container-image* || -n "${PRIMUS_WRAP:-}" ]]; then
  CONFIG=${CONFIG:-/opt/primus/examples/cuda/gpt2-124M-shakespeare.yaml}
  PRIMUS_BIN=${PRIMUS_BIN:-primus}
fi
CONFIG=${CONFIG:-$PRIMUS_HOME/examples/cuda/gpt2-124M-shakespeare.yaml}
if [ -z "${PRIMUS_BIN:-}" ]; then
  if [ -x "$PRIMUS_HOME/build/bin/primus" ]; then PRIMUS_BIN=$PRIMUS_HOME/build/bin/primus; else PRIMUS_BIN=primus; fi
fi
mode=${PRIMUS_LAUNCH_MODE:-launcher}
case "$mode" in launcher|srun) ;; *) die "PRIMUS_LAUNCH_MODE=$mode: expected launcher or srun" ;; esac

nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# SLURM_GPUS_PER_NODE may carry a type ("h100:8"); SLURM_GPUS_ON_NODE is the plain count.
nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}}
case "$nproc" in ''|*[!0-9]*|0) die "ranks per node '$nproc' is not a positive number: set NPROC_PER_NODE" ;; esac

# The rendezvous: rank 0 runs on the allocation's first node and hosts the store there. The port
# is derived from the job id, as primus itself does under srun, so two jobs sharing a node differ.
if [ -z "${MASTER_ADDR:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  [ -n "$MASTER_ADDR" ] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' printed no host: set MASTER_ADDR"
fi
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
export MASTER_ADDR MASTER_PORT

# One folder per attempt: a requeued job keeps its id, and its second run must not overwrite the
# logs of the first (which hold the reason it stopped).
log_dir=${PRIMUS_LOG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/logs}/${SLURM_JOB_NAME:-primus}-$SLURM_JOB_ID/attempt-${SLURM_RESTART_COUNT:-0}

# auto_continue_train: every attempt, the first included, resumes from the latest checkpoint in
# `save` when there is one, so a requeued job continues where the last one stopped.
# The list variables are split into words at spaces, tabs and newlines (no quoting inside).
# (read -d '' reads to the end and then returns 1, which is expected here.)
read -r -d '' -a overrides <<<"${PRIMUS_OVERRIDES:-}"
train=(train pretrain --config "$CONFIG" auto_continue_train=true "${overrides[@]}" "$@")
read -r -d '' -a srun_extra <<<"${PRIMUS_SRUN_ARGS:-}"
read -r -d '' -a wrap <<<"${PRIMUS_WRAP:-}"
read -r -d '' -a launch_extra <<<"${PRIMUS_LAUNCH_ARGS:-}"

# --kill-on-bad-exit: one failed task (a launcher whose rank failed, or a rank) ends the step at
# once instead of leaving the others waiting for it until their timeout.
srun_cmd=(srun --kill-on-bad-exit=1 --nodes="$nnodes")
if [ "$mode" = launcher ]; then
  # One task per node holding all of the node's CPUs: the launcher's ranks live in its allocation,
  # and a task gets one CPU unless told otherwise.
  srun_cmd+=(--ntasks="$nnodes" --ntasks-per-node=1)
  [ -n "${SLURM_CPUS_ON_NODE:-}" ] && srun_cmd+=(--cpus-per-task="$SLURM_CPUS_ON_NODE")
  # The launchers' own status lines (start, failure, exit) go to the job's output; each rank
  # writes $log_dir/rank_K.log.
  launcher=("${wrap[@]}" "$PRIMUS_BIN" launch --nproc-per-node "$nproc" --nnodes "$nnodes"
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --log-dir "$log_dir"
            "${launch_extra[@]}")
  # Each task puts its own node index (SLURM_NODEID, known only where it runs) among the
  # launcher's options, before `--` and the ranks' command; $1 counts the launcher's words.
  # shellcheck disable=SC2016
  srun_cmd+=("${srun_extra[@]}"
             bash -c 'n=$1; shift; exec "${@:1:n}" --node-rank "$SLURM_NODEID" "${@:n+1}"' primus-node
             "${#launcher[@]}" "${launcher[@]}" -- "${train[@]}")
else
  # Slurm starts every rank; each reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_NODEID.
  srun_cmd+=(--ntasks=$((nnodes * nproc)) --ntasks-per-node="$nproc")
  # The node's CPUs shared among its ranks (a task gets one CPU unless told otherwise).
  if [ -n "${SLURM_CPUS_ON_NODE:-}" ] && [ "$SLURM_CPUS_ON_NODE" -ge "$nproc" ]; then
    srun_cmd+=(--cpus-per-task=$((SLURM_CPUS_ON_NODE / nproc)))
  fi
  srun_cmd+=(--output="$log_dir/rank_%t.log" "${srun_extra[@]}" "${wrap[@]}" "$PRIMUS_BIN" "${train[@]}")
fi

log "job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}: $nnodes node(s) x $nproc rank(s), mode $mode," \
    "rendezvous $MASTER_ADDR:$MASTER_PORT, logs in $log_dir"
log "config $CONFIG, binary $PRIMUS_BIN"
if [ "${PRIMUS_DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${srun_cmd[@]}"
  echo
  exit 0
fi
mkdir -p "$log_dir" || die "cannot create the log folder $log_dir"

# Preemption. `#SBATCH --signal=B:USR1@120` sends SIGUSR1 to this shell alone two minutes before
# the time limit; srun forwards the signals it receives to its tasks, and from there `primus
# launch` to the ranks, which finish the step, checkpoint and exit 0. SIGTERM (scancel,
# preemption) is not forwarded: Slurm sends it to every process of the job itself, and a rank
# that gets a second SIGTERM leaves at once without saving. The trap keeps this shell alive so
# that the job lasts until the ranks have written their checkpoint.
stop_signal=""
srun_pid=""
# shellcheck disable=SC2317  # called by the traps below, which shellcheck does not follow
on_signal() {
  stop_signal=$1
  log "received SIG$1 at $(date -u +%H:%M:%S)"
  if [ "$1" = USR1 ] && [ -n "$srun_pid" ]; then
    log "asking the ranks to checkpoint and stop"
    kill -USR1 "$srun_pid" 2>/dev/null
  fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

start=$(date +%s)
"${srun_cmd[@]}" &
srun_pid=$!
# A trapped signal interrupts `wait` (status > 128) while srun runs on; wait again until srun
# itself has ended, and keep its status.
while :; do
  wait "$srun_pid"
  rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done
log "srun exited with status $rc after $(( $(date +%s) - start )) s"

if [ "$stop_signal" = USR1 ] && [ "$rc" = 0 ] && [ "${PRIMUS_REQUEUE:-1}" = 1 ]; then
  # The ranks stopped early with a checkpoint; the requeued job starts this script again and
  # auto_continue_train resumes from it. Needs `#SBATCH --requeue` (or the cluster's default).
  log "requeueing job $SLURM_JOB_ID to resume from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID" || { log "scontrol requeue failed"; exit 1; }
fi
exit "$rc"
