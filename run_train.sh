#!/usr/bin/env bash
# Train with torchrun. Env: CONFIG_FILE (default configs/llama3_debug.toml), NGPU (processes per
# node; default: number of GPUs, else 2 CPU processes), NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT (multi-node). Every argument is passed to the trainer: --section.key value
# (--help lists every key). Config errors are reported here, once, before torchrun starts.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
CONFIG_FILE="${CONFIG_FILE:-configs/llama3_debug.toml}"
for arg in "$@"; do  # help once from this process, not from every rank
    if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
        exec python -m simplesharded.train "$@"
    fi
done
if [ -z "${NGPU:-}" ]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 2)" 2>/dev/null)
fi
NNODES="${NNODES:-1}"
for var in NGPU NNODES; do
    if ! [[ "${!var}" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: $var='${!var}' must be a positive integer" >&2
        exit 2
    fi
done
# Preflight: a config or degree error is one line and exit 2 here, before torchrun starts any
# rank (each rank would print it again, then torchrun its ChildFailedError traceback). The
# ranks repeat these checks for direct torchrun users.
WORLD_SIZE=$((NGPU * NNODES)) python -m simplesharded.train --check-only \
    --job.config_file "$CONFIG_FILE" "$@" || exit
# torchrun --max-restarts: restarted gloo ranks must not reuse the dead workers' store
# (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# On CPU each rank gets an equal share of the cores; on GPU one thread is enough.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}"
# CPU ranks reuse freed memory instead of page-faulting it in again every step
# (simplesharded/host_malloc.py); a variable already set wins. Nothing on GPU nodes.
eval "$(python -m simplesharded.host_malloc)"
if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    rdzv=(--standalone)
else
    rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}"
          --master_addr="${MASTER_ADDR:?set MASTER_ADDR for multi-node}"
          --master_port="${MASTER_PORT:-29500}")
fi
exec torchrun "${rdzv[@]}" --nproc_per_node="$NGPU" ${TORCHRUN_ARGS:-} \
    -m simplesharded.train --job.config_file "$CONFIG_FILE" "$@"
