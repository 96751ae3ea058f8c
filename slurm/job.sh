# Sourced by colocated.sbatch and disaggregated.sbatch (after their #SBATCH block): the environment
# every step shares, the per-job log folder, the srun steps and the job's lifecycle.
# Inputs: CONFIG [overrides], SERVE_NODES (hosts that run the serve step; 0 when colocated).

set -uo pipefail  # no -e: the trainer's status must reach the end of the script
CONFIG=${1:?usage: sbatch slurm/<layout>.sbatch CONFIG.yaml [section.key=value ...]}
shift
OVERRIDES=("$@")

# ---- environment: set once here; srun passes the whole environment to every step ------------
export MEGATRON_RL_SGLANG_API_KEY=${MEGATRON_RL_SGLANG_API_KEY:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
export MEGATRON_RL_GPUS_PER_NODE=${MEGATRON_RL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export MEGATRON_RL_MASTER_PORT=${MEGATRON_RL_MASTER_PORT:-29500}
export MEGATRON_RL_ROLLOUT_NODES=$SERVE_NODES
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # TP comm/GEMM overlap, sequence parallel
export NVTE_FP8_BLOCK_SCALING_FP32_SCALES=${NVTE_FP8_BLOCK_SCALING_FP32_SCALES:-1}  # Hopper: FP32 block scales
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead peer ends the step
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_* and NVTE_* set at submission travel the same way.

# ---- logs: one folder per job; srun writes one labelled file per step and host ---------------
LOG_DIR=${MEGATRON_RL_LOG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/logs}/${SLURM_JOB_NAME:-megatron-rl}-${SLURM_JOB_ID}
mkdir -p "$LOG_DIR" || exit 1
export MEGATRON_RL_LOG_DIR=$LOG_DIR  # SGLang server logs: $LOG_DIR/<host>/
echo "logs: $LOG_DIR"

# ---- time limit and requeue: SIGUSR1 (--signal=B:USR1@lead) -> the stop request file -> the trainer
# stops after its current step with a checkpoint and names it in the stop file -> the job requeues
# itself; a requeued job (SLURM_RESTART_COUNT > 0, also after Slurm's own requeue) resumes from the
# latest checkpoint. A file, not a signal through srun: Slurm signals every process of a step
# (torchrun, reward workers and servers too, which SIGUSR1 kills). Needs the log folder shared.
export MEGATRON_RL_STOP_REQUEST=$LOG_DIR/stop-requested MEGATRON_RL_STOP_FILE=$LOG_DIR/stopped-at-step
trap 'echo "SIGUSR1: the trainer stops after its current step"; touch "$MEGATRON_RL_STOP_REQUEST"' USR1
rm -f "$MEGATRON_RL_STOP_REQUEST" "$MEGATRON_RL_STOP_FILE"
if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
  OVERRIDES+=(checkpoint.resume=true)  # what `megatron-rl train --resume` sets
  echo "restart ${SLURM_RESTART_COUNT}: resuming from the latest checkpoint"
fi

# ---- steps -----------------------------------------------------------------------------------
CONTAINER_ARGS=()
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
  CONTAINER_ARGS=(--container-image="$CONTAINER_IMAGE" --container-mounts="${CONTAINER_MOUNTS:-$PWD:$PWD}"
                  --container-workdir="$PWD" --no-container-mount-home)
fi
# --ntasks on every step: srun otherwise takes the job's SLURM_NTASKS (one per node of the whole job)
# and runs several tasks on a step's fewer nodes.
SRUN=(srun "${CONTAINER_ARGS[@]}" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --kill-on-bad-exit=1)
LAUNCH=(python -m megatron_rl.cluster.launch)
ARGS=("$CONFIG" "${OVERRIDES[@]}")
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
SERVE_HOSTS=$(IFS=,; echo "${HOSTS[*]:0:SERVE_NODES}")
TRAIN_HOSTS=$(IFS=,; echo "${HOSTS[*]:SERVE_NODES}")

STEP_PIDS=()
stop_steps() {  # SIGTERM every step still running (srun forwards it to the tasks), then wait for them
  for pid in "${STEP_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${STEP_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
}
trap stop_steps EXIT
trap 'exit 143' TERM INT  # scancel / time limit: the EXIT trap stops the steps

# The plan every step executes; a bad config or layout ends the job here, before anything starts.
"${SRUN[@]}" --nodes=1 --ntasks=1 --open-mode=truncate --output="$LOG_DIR/plan.json" --error="$LOG_DIR/plan.err" \
  "${LAUNCH[@]}" --dry-run "${ARGS[@]}" || { cat "$LOG_DIR/plan.err" >&2; exit 2; }

if (( SERVE_NODES > 0 )); then
  "${SRUN[@]}" --nodes="$SERVE_NODES" --ntasks="$SERVE_NODES" --nodelist="$SERVE_HOSTS" --output="$LOG_DIR/serve-%N.log" \
    "${LAUNCH[@]}" --role serve "${ARGS[@]}" &
  SERVE_PID=$!
  STEP_PIDS+=("$SERVE_PID")
fi
"${SRUN[@]}" --nodes=$(( ${#HOSTS[@]} - SERVE_NODES )) --ntasks=$(( ${#HOSTS[@]} - SERVE_NODES )) \
  --nodelist="$TRAIN_HOSTS" --output="$LOG_DIR/train-%N.log" \
  "${LAUNCH[@]}" --role train "${ARGS[@]}" &
TRAIN_PID=$!
STEP_PIDS+=("$TRAIN_PID")

# ---- lifecycle: the job ends with the trainer, with its status; servers never outlive it -------
while kill -0 "$TRAIN_PID" 2>/dev/null; do
  if [[ -n "${SERVE_PID:-}" ]] && ! kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "the serve step ended before the trainer (see $LOG_DIR/serve-*.log); stopping the trainer" >&2
    kill -TERM "$TRAIN_PID"
    wait "$TRAIN_PID"
    exit 1
  fi
  sleep 2
done
wait "$TRAIN_PID"
RC=$?
while kill -0 "$TRAIN_PID" 2>/dev/null; do wait "$TRAIN_PID"; RC=$?; done  # a trapped signal ends `wait` early
echo "trainer exited with status $RC"
if [[ "$RC" == 0 && -s "$MEGATRON_RL_STOP_FILE" ]]; then
  echo "stopped early with $(cat "$MEGATRON_RL_STOP_FILE") steps done and checkpointed: requeueing the job"
  stop_steps
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
if [[ "$RC" != 0 && -n "${SERVE_PID:-}" ]] && ! kill -0 "$SERVE_PID" 2>/dev/null; then
  # the trainer can notice a dead server (a failed request) before the 2 s poll above does
  echo "the serve step ended before the trainer (see $LOG_DIR/serve-*.log)" >&2
fi
exit "$RC"
