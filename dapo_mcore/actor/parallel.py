"""Parallel start-up: rank/world from torchrun or Slurm, the process group, and Megatron's TP/PP/DP groups.

NCCL on GPU, gloo on CPU (where the CPU compatibility layer is applied first). Collective timeouts
(``parallel.timeout_minutes``) turn a dead or hung rank into an error instead of a hang; `rollcall` then names the
rank that stopped answering. `check_shared_dir` refuses a run directory that the nodes do not share.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``node[003-005,007],gpu1`` without calling scontrol."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return prefix + first


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Rank, world size and rendezvous from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or Slurm (SLURM_PROCID/...)."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        source = "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
        source = "slurm"
    else:
        rank, world, local, source = 0, 1, 0, "single"
    addr = env.get("MASTER_ADDR")
    if addr is None and source == "slurm" and env.get("SLURM_JOB_NODELIST"):
        addr = _first_slurm_host(env["SLURM_JOB_NODELIST"])
    if "MASTER_PORT" in env:
        port = int(env["MASTER_PORT"])
    elif source == "single":
        port = _free_port()  # a lone process rendezvouses with itself: never collide with another job's 29500
    else:
        port = 29500
    if world > 1 and addr is None:
        raise RuntimeError("MASTER_ADDR is not set for a multi-process launch; use torchrun or slurm/launch.sh, "
                           "which export it.")
    if not 0 <= rank < world:
        raise RuntimeError(f"rank {rank} is outside world size {world}; check the launcher's environment.")
    return LaunchEnv(rank, world, local, addr or "127.0.0.1", port, source)


def choose_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("parallel.backend=nccl needs CUDA; use parallel.backend=gloo (or auto) on CPU.")
    return requested


def init_distributed(launch: LaunchEnv, backend: str = "auto", timeout_minutes: float = 10) -> str:
    """Create the default process group (if not already there) and start the roll-call responder. Returns the
    backend used."""
    backend = choose_backend(backend)
    if backend == "gloo":
        from dapo_mcore.model import cpu_compat

        cpu_compat.apply()
    elif torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, rank=launch.rank, world_size=launch.world_size,
            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    from dapo_mcore.actor import rollcall

    rollcall.start(launch.master_addr, launch.master_port, launch.rank, launch.world_size,
                   datetime.timedelta(minutes=timeout_minutes))
    log.info("process group ready: rank %d/%d (%s, %s)", launch.rank, launch.world_size, backend, launch.source)
    return backend


def check_shared_dir(path: Path, key: str = "run.dir") -> None:
    """Refuse (UserError, on every rank) a directory that not every rank sees: a node-local path on a cluster.

    Rank 0 writes a token file named by a fresh random id; every rank looks for it. Without this check each node
    would write its own half of every checkpoint and the run could never resume. A collective: call it on every
    rank of the default process group, after the run directory was prepared and before anything is written to it.
    """
    from dapo_mcore.errors import UserError

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, host = dist.get_rank(), socket.gethostname()
    path.mkdir(parents=True, exist_ok=True)
    name = [f".shared-check-{uuid.uuid4().hex}"]
    dist.broadcast_object_list(name, src=0)
    token = path / name[0]
    if rank == 0:
        token.write_text(host)
    dist.barrier()
    seen: list[tuple[bool, str]] = [(False, "")] * dist.get_world_size()
    dist.all_gather_object(seen, (token.is_file(), host))
    dist.barrier()
    if rank == 0:
        token.unlink()
    blind = sorted({h for ok, h in seen if not ok})
    if blind:
        raise UserError(f"{key}={str(path)!r} is not shared between the nodes: {', '.join(blind)} cannot see the "
                        f"file rank 0 wrote there on {seen[0][1]} (a node-local path?); put {key} on a file system "
                        "that every node mounts at the same path (NFS, Lustre, GPFS).")
    log.debug("%s=%s is shared by all %d ranks", key, path, len(seen))


def expert_layout_error(world_size: int, tensor_parallel: int, pipeline_parallel: int,
                        expert_parallel: int, expert_tensor_parallel: int | None = None) -> str | None:
    """Why Megatron cannot lay out `expert_parallel` x `expert_tensor_parallel` on this world (one line with the
    fix), or None.

    world = TP x PP x DP for the dense part and ETP x EP x PP x expert-DP for the experts (Megatron's expert grid,
    ``initialize_model_parallel``): each layer's experts are split over EP ranks and each expert over ETP ranks,
    so ETP x EP must divide world / PP. ETP must divide TP (None: = TP, Megatron's default), so that a rank's
    expert-TP rank is its TP rank modulo ETP (the weights' layout relies on it)."""
    etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    if expert_parallel < 1:
        return f"parallel.expert_parallel={expert_parallel} must be >= 1."
    if etp < 1 or tensor_parallel % etp:
        fits = ", ".join(str(d) for d in range(1, tensor_parallel + 1) if tensor_parallel % d == 0)
        return (f"parallel.expert_tensor_parallel={etp} must divide parallel.tensor_parallel={tensor_parallel}; use "
                f"one of {fits} (1 keeps every expert whole, Megatron's MoE recipes' choice).")
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        return None  # the dense layout's own check names this
    per_stage = world_size // pipeline_parallel
    if per_stage % (etp * expert_parallel):
        fits = ", ".join(str(d) for d in range(1, per_stage // etp + 1) if per_stage % (d * etp) == 0)
        return (f"parallel.expert_parallel={expert_parallel} x expert_tensor_parallel={etp} must divide the "
                f"{per_stage} ranks of a pipeline stage (world {world_size} / pipeline_parallel {pipeline_parallel}): "
                f"Megatron lays the experts out over them; use an expert_parallel among {fits} or launch "
                f"{pipeline_parallel * etp * expert_parallel}*k processes.")
    return None


def init_model_parallel(tensor_parallel: int, pipeline_parallel: int, virtual_pipeline: int | None = None,
                        seed: int = 1234, timeout_minutes: float = 10, expert_parallel: int = 1,
                        expert_tensor_parallel: int | None = None) -> None:
    """Create Megatron's TP/PP/DP (and expert-parallel, expert-TP) groups and seed its RNG tracker
    (``expert_tensor_parallel`` None: = TP, Megatron's default)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as tp

    problem = expert_layout_error(dist.get_world_size() if dist.is_initialized() else 1, tensor_parallel,
                                  pipeline_parallel, expert_parallel, expert_tensor_parallel)
    if problem:
        raise ValueError(problem)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        distributed_timeout_minutes=timeout_minutes,
    )
    tp.model_parallel_cuda_manual_seed(seed)
    log.info("model parallel: TP=%d PP=%d VPP=%s DP=%d EP=%d ETP=%d", tensor_parallel, pipeline_parallel,
             virtual_pipeline, ps.get_data_parallel_world_size(), expert_parallel,
             ps.get_expert_tensor_parallel_world_size())


def shutdown() -> None:
    """Tear down Megatron's groups and the process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    from dapo_mcore.actor import rollcall

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    rollcall.end()
    if dist.is_initialized():
        dist.destroy_process_group()
