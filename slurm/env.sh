#!/usr/bin/env bash
# shellcheck shell=bash
# One environment file for every dapo-mcore job script: sourced by launch.sh in the batch shell,
# inherited by every srun task (srun exports the batch environment by default).
# Values already set by the caller win (every line uses ${VAR:-default}), so a test or a user can
# override anything from the submitting shell.

# --- Software: pick one of these hooks for your site (left commented on purpose) -----------------
# module load cuda/12.8 nccl/2.26 gcc/12
# source /path/to/venv/bin/activate                      # or: export PATH=/path/to/venv/bin:$PATH
# Containers (enroot/pyxis): DAPO_SRUN_ARGS="--container-image=/shared/img.sqsh --container-mounts=/shared:/shared"
# (split as a shell splits words: quote an argument holding a space); docs/cluster.md step 5.
if [[ -n "${DAPO_VENV:-}" ]]; then
    # shellcheck disable=SC1091
    source "$DAPO_VENV/bin/activate"
fi

# --- Python --------------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1          # log lines reach the Slurm output file as they happen
export PYTHONFAULTHANDLER=1        # stack traces of every thread on a hard crash or SIGABRT

# --- Caches and the network: nodes of a cluster often have no internet, and 128 ranks must not race on ~/.cache
# Every cache under one directory on the shared file system (default: .cache/dapo-mcore in the repo the job was
# submitted from, git-ignored); set DAPO_CACHE_ROOT, or any one variable, to put it elsewhere (a node-local disk
# for Triton, say). Hugging Face offline by default: model.hf_path / tokenizer paths are local directories; set
# HF_HUB_OFFLINE=0 where nodes may download.
export DAPO_CACHE_ROOT=${DAPO_CACHE_ROOT:-${DAPO_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}/.cache/dapo-mcore}
export HF_HOME=${HF_HOME:-$DAPO_CACHE_ROOT/huggingface}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$DAPO_CACHE_ROOT/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$DAPO_CACHE_ROOT/torchinductor}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$DAPO_CACHE_ROOT/vllm}

# --- Megatron / Transformer Engine -----------------------------------------------------------------
# One hardware work queue per device, so TP communication kernels are issued in program order and
# overlap with compute as Megatron plans (required by sequence parallelism + comm overlap).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# Fused attention back-ends (cuDNN fused attention / flash attention) are allowed; TE picks one.
export NVTE_FLASH_ATTN=${NVTE_FLASH_ATTN:-1}
export NVTE_FUSED_ATTN=${NVTE_FUSED_ATTN:-1}
# Deterministic-ish TE kernels are slower; leave off for production, set 0 to debug numerics.
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=${NVTE_ALLOW_NONDETERMINISTIC_ALGO:-1}
# vLLM colocated with Megatron: expandable segments limit fragmentation when vLLM sleeps and wakes. Needs vLLM
# >= 0.20.1 (before its PR #40812 sleep mode asserts against it); dapo_mcore/model/gpu_stack.py refuses older vLLM.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# --- NCCL ------------------------------------------------------------------------------------------
# Turn a hung collective into an error instead of a silent stall: PyTorch's watchdog aborts the
# process (SIGABRT) after the process-group timeout (parallel.timeout_minutes); the job ends FAILED,
# not requeued (gloo's timeout exits 75 and is: docs/cluster.md "A rank hangs").
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-0}
# Weight sync and checkpoints can keep ranks apart for minutes: heartbeat timeout above that.
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-1800}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# InfiniBand: retry budget for flaky links (timeout is 4.096 us * 2^NCCL_IB_TIMEOUT). The retry
# count is a 3-bit field of the queue pair (ibv_qp_attr.retry_cnt, 0..7): 7 is the most it holds.
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}
# Network interface for the socket traffic of NCCL (bootstrap) and gloo (CPU collectives, vLLM's
# data-parallel coordination), set in one place: DAPO_SOCKET_IFNAME=ib0 (or eth0, ...) sets both
# unless NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME are set themselves. Unset: both pick an interface.
if [[ -n "${DAPO_SOCKET_IFNAME:-}" ]]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$DAPO_SOCKET_IFNAME}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$DAPO_SOCKET_IFNAME}
fi
# Site specific, set when needed: which InfiniBand HCAs NCCL may use.
# export NCCL_IB_HCA=mlx5

# --- Rendezvous ------------------------------------------------------------------------------------
# launch.sh derives MASTER_ADDR from the node list; the port is per job unless set here.
export DAPO_MASTER_PORT_BASE=${DAPO_MASTER_PORT_BASE:-20000}
# Exit code the trainer uses after checkpointing on SIGUSR1/SIGTERM: requeue me (EX_TEMPFAIL).
export DAPO_REQUEUE_EXIT_CODE=${DAPO_REQUEUE_EXIT_CODE:-75}
# Upper bound on requeues of one job (SLURM_RESTART_COUNT), a guard against a crash loop.
export DAPO_MAX_REQUEUES=${DAPO_MAX_REQUEUES:-20}
