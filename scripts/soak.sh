#!/usr/bin/env bash
# Kill -9 soak of CheckpointManager saves (issue 16): local, mpiexec and torchrun clients, S3, sync and async,
# and clients that disagree on a save or skip one; tiered saves (issue 28: the clients as two simulated nodes,
# a local tier with one replica, every third save persistent; kills of one client or one whole node).
#
#   scripts/soak.sh [--trials 200] [--clients 4] [--saves 4] [--seed S] [--dir D] [--json FILE]
#                   [--configs local-sync,local-async,mpi-sync,mpi-async,torch-sync,torch-async,
#                              mpi-disagree,torch-disagree,mpi-skip,torch-skip,s3-sync,s3-async,
#                              mpi-tiered,torch-tiered]
#                                                                (the default: all; comma-separated, no spaces)
#
# s3-* configs save to a moto S3 server the driver starts (one process per job). The seed is printed
# first; SHARDCKPT_SOAK_SEED=S (or --seed S) replays a run's random moments.
#
# Every trial resumes from latest_checkpoint (checking every restored value on every client),
# saves on, and is SIGKILLed at a random moment (the local process, one random client, or the
# whole job); the driver then proves the latest checkpoint and every kept one whole and exact,
# and that the next committed save removed every leftover. It prints a table of counts per
# config; exit status 0 only when corrupt, missing, uncleaned, hangs and leaked bytes are all 0.
# What each count means: tests/helpers/soak.py. A short run is in the suite (tests/test_soak.py).
set -u
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$here/tests/helpers/soak.py" "$@"
