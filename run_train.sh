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
# NGPU's default, the device and the ranks' environment for it (simplesharded/shims/launch_env.py;
# a variable already set wins).
eval "$("$PY" -m simplesharded.shims.launch_env)"
NNODES="${NNODES:-1}"
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NNODES='$NNODES' must be a positive integer" >&2
    exit 2
fi
# Preflight: a config or degree error is one line and exit 2 here, before torchrun starts any
# rank (each rank would print it again, then torchrun its ChildFailedError traceback). The
# ranks repeat these checks for direct torchrun users.
WORLD_SIZE=$((NGPU * NNODES)) "$PY" -m simplesharded.trainer --check-only \
    --job.config_file "$CONFIG_FILE" "$@" || exit
if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    rdzv=(--standalone)
else
    rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}"
          --master_addr="${MASTER_ADDR:?set MASTER_ADDR for multi-node}"
          --master_port="${MASTER_PORT:-29500}")
fi
# the preflight printed the config's warnings (a deprecated key): the ranks do not again
SIMPLESHARDED_PREFLIGHT_DONE=1 exec "$PY" -m torch.distributed.run "${rdzv[@]}" --nproc_per_node="$NGPU" ${TORCHRUN_ARGS:-} \
    -m simplesharded.trainer --job.config_file "$CONFIG_FILE" "$@"
