"""Actor peak memory with LoRA against full fine-tuning, measured on CPU, beside the planner's estimate.

Each mode runs in a fresh process (a world of one, gloo): a bf16 Megatron actor of a Qwen2.5-0.5B-shaped model
cut to 4 layers and a 4k vocabulary is built, loaded and trained for two DAPO updates; the peak of live tensor
bytes (every CPU tensor storage any op creates, from before the model is built to after the second update: weights,
gradient buffers, fp32 main copies, Adam states, activations) is what is compared. The planner's per-GPU terms for
the same shape and micro-batch (weights + grads + optimizer, and the training peak) are printed beside it.

    python benchmarks/lora_memory.py [--rank 16] [--layers 4]

Last line: ``lora_over_full_peak: X`` (measured peak, LoRA / full). ``--smoke``: 1 layer, 256 tokens, rank 4 (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live CPU tensor storages created by any op while active, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._live: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self._live:
                    self._live.add(key)
                    self.current += size
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self._live.discard(key)
        self.current -= size


def model_config(layers: int) -> dict:
    from dapo_mcore.model.presets import preset_config

    return preset_config("qwen2.5-0.5b", num_hidden_layers=layers, vocab_size=4096, tie_word_embeddings=False)


def measure(mode: str, rank: int, layers: int, tokens: int) -> dict:
    """One mode's peak (run in its own process)."""
    import torch.distributed as dist

    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor, TrainSample
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.model import cpu_compat
    from dapo_mcore.model.lora.config import LoRAConfig

    cpu_compat.apply()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(3, 4096, (tokens // 8 - 16,), generator=gen).tolist(),
                           torch.randint(3, 4096, (16,), generator=gen).tolist(), advantage=(-1.0) ** i,
                           old_logprobs=torch.full((16,), -8.0)) for i in range(8)]
    meter = LiveTensorBytes()
    with meter:
        actor = MegatronActor(ActorSettings(
            hf_config=model_config(layers), params_dtype=torch.bfloat16, algo=AlgoConfig(), layout="rows",
            micro_batch_tokens=tokens, lora=LoRAConfig(rank=rank if mode == "lora" else 0, alpha=2.0 * rank)))
        for _ in range(2):
            metrics = actor.train_mini_batch(samples, lr=1e-4)
    trainable = sum(p.numel() for c in actor.chunks for p in c.parameters() if p.requires_grad)
    dist.destroy_process_group()
    return {"peak": meter.peak, "trainable": trainable, "update_ok": metrics.get("update_ok")}


def planner(rank: int, layers: int, tokens: int) -> dict:
    from dapo_mcore.plan.planner import PlanInput, estimate_memory

    out = {}
    for mode, r in (("full", 0), ("lora", rank)):
        est = estimate_memory(PlanInput(model=model_config(layers), precision="bf16", distributed_optimizer=False,
                                        micro_batch_tokens=tokens, colocate_vllm=False, overhead_gib=0.0, vllm_tensor_parallel=1,
                                        lora_rank=r))
        out[mode] = {"static": est.weights + est.grads + est.optimizer, "train_peak": est.train_peak}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="1 layer, 256 tokens, rank 4 (both fresh processes; run in CI)")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.tokens, args.rank = 1, 256, 4
    if args.child:
        print(json.dumps(measure(args.child, args.rank, args.layers, args.tokens)))
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONWARNINGS="ignore")
    res = {}
    for mode in ("full", "lora"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--rank", str(args.rank), "--layers",
                              str(args.layers), "--tokens", str(args.tokens)], env=env, capture_output=True,
                             text=True, check=True).stdout
        res[mode] = json.loads(out.strip().splitlines()[-1])
    plan = planner(args.rank, args.layers, args.tokens)
    gib = 2**30
    for mode in ("full", "lora"):
        print(f"{mode:5s} measured peak {res[mode]['peak'] / gib:.3f} GiB, trainable {res[mode]['trainable']:,} "
              f"params; planner: weights+grads+optimizer {plan[mode]['static'] / gib:.3f} GiB, training peak "
              f"{plan[mode]['train_peak'] / gib:.3f} GiB")
    print(f"planner lora_over_full (static): {plan['lora']['static'] / plan['full']['static']:.3f}; "
          f"(training peak): {plan['lora']['train_peak'] / plan['full']['train_peak']:.3f}")
    print(f"lora_over_full_peak: {res['lora']['peak'] / res['full']['peak']:.3f}")


if __name__ == "__main__":
    main()
