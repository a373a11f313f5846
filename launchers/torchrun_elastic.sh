#!/bin/bash
# torchrun's elastic agent around the pretraining job: when a rank dies (or a node drops out),
# the agent stops the others and starts the whole group again, up to MAX_RESTARTS times; each
# start runs with --resume auto, so it continues from the latest complete checkpoint (and the
# first start begins the run). Keep --run_dir fixed. Run it on every node:
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 JOB_ID=my_run \
#       launchers/torchrun_elastic.sh --ds_config zero3 --config configs/my_run.yaml --run_dir runs/my_run
# Exit status: 0 done, 75 stopped by SIGTERM/SIGUSR1 with a checkpoint, else the last failure's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# The agent's shared TCP store keeps the last round's keys: a restarted group then read its
# peers' old addresses and failed to connect (pytorch/pytorch#135712, seen here too); with the
# store per round, rank 0 of each round hosts a fresh one.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec torchrun --nnodes "${NNODES:-1}" --nproc_per_node "${NPROC_PER_NODE:-gpu}" \
    --max-restarts "${MAX_RESTARTS:-3}" --rdzv-backend c10d \
    --rdzv-endpoint "${RDZV_ENDPOINT:-127.0.0.1:29400}" --rdzv-id "${JOB_ID:-dr_scale}" \
    "$here/pretrain.py" "$@" --resume auto
