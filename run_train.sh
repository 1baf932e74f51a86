#!/usr/bin/env bash
# Train with torchrun. Env: CONFIG_FILE (default configs/llama3_debug.toml), NGPU (processes per
# node; default: number of GPUs, else 2 CPU processes), NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT (multi-node), SIMPLESHARDED_PYTHON (an interpreter with torch to use as it is,
# instead of .venv: scripts/bootstrap.sh). Every argument is passed to the trainer:
# --section.key value (--help lists every key). Config errors are reported here, once, before
# torchrun starts.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
CONFIG_FILE="${CONFIG_FILE:-configs/llama3_debug.toml}"
for arg in "$@"; do  # help once from this process, not from every rank
    if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
        exec "$PY" -m simplesharded.trainer "$@"
    fi
done
if [ -n "${NGPU:-}" ] && ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPU='$NGPU' must be a positive integer" >&2
    exit 2
fi
NNODES="${NNODES:-1}"
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NNODES='$NNODES' must be a positive integer" >&2
    exit 2
fi
if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    rdzv=(--standalone)
else
    rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}"
          --master_addr="${MASTER_ADDR:?set MASTER_ADDR for multi-node}"
          --master_port="${MASTER_PORT:-29500}")
fi
# One Python start (simplesharded/trainer/launch.py): NGPU's default and the ranks'
# environment (a variable already set wins), the preflight against NGPU x NNODES (a config or
# degree error is one line and exit 2, before any rank starts), then torchrun in-process.
exec "$PY" -m simplesharded.trainer.launch "${rdzv[@]}" ${TORCHRUN_ARGS:-} -- \
    --job.config_file "$CONFIG_FILE" "$@"
