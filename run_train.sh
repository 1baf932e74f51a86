#!/usr/bin/env bash
# Train with torchrun. Env: CONFIG_FILE (default configs/llama3_debug.toml), NGPU (processes per
# node; default: number of GPUs, else 2 CPU processes), NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT (multi-node). Every argument is passed to the trainer: --section.key value.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
CONFIG_FILE="${CONFIG_FILE:-configs/llama3_debug.toml}"
if [ -z "${NGPU:-}" ]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 2)" 2>/dev/null)
fi
NNODES="${NNODES:-1}"
# torchrun --max-restarts: restarted gloo ranks must not reuse the dead workers' store
# (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# On CPU each rank gets an equal share of the cores; on GPU one thread is enough.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"
if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    rdzv=(--standalone)
else
    rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}"
          --master_addr="${MASTER_ADDR:?set MASTER_ADDR for multi-node}"
          --master_port="${MASTER_PORT:-29500}")
fi
exec torchrun "${rdzv[@]}" --nproc_per_node="$NGPU" ${TORCHRUN_ARGS:-} \
    -m simplesharded.train --job.config_file "$CONFIG_FILE" "$@"
