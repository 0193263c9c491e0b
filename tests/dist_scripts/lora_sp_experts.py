"""LoRA adapters on Megatron's own column/row-parallel linears at TP=2 with sequence parallelism and as experts
(explicit expert communication), against a dense single-matrix reference; results for pytest.

usage: torchrun --nproc_per_node 2 lora_sp_experts.py OUT

Every case builds the layer at TP=2 (its shard of a known whole W), puts an adapter on it with ``attach_lora`` and
sets the adapter to its shards of known whole A, B. It feeds this rank's part of a known input, backpropagates this
rank's part of a known output gradient, and reassembles what the token dispatcher or the sequence-parallel layers
around would: the output, the input gradient, and the gradients of A and B (whole). The reference is
``y = x W^T + s x A^T B^T`` on whole tensors, with autograd.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

S, BATCH, IN, OUT, R, ALPHA = 6, 2, 8, 12, 3, 6.0


def whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(*shape, generator=g) for k, shape in
            (("w", (OUT, IN)), ("a", (R, IN)), ("b", (OUT, R)), ("x", (S, BATCH, IN)), ("dy", (S, BATCH, OUT)))}


def reference(t: dict) -> dict:
    x, a, b = t["x"].clone().requires_grad_(), t["a"].clone().requires_grad_(), t["b"].clone().requires_grad_()
    y = x @ t["w"].t() + ALPHA / R * (x @ a.t()) @ b.t()
    (y * t["dy"]).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "da": a.grad, "db": b.grad}


def build(parallel: str, sp: bool, expert: bool):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dapo_mcore.model.lora.attach import attach_lora
    from dapo_mcore.model.lora.config import LoRAConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=2, tensor_model_parallel_size=2,
                            sequence_parallel=sp, use_cpu_initialization=True, gradient_accumulation_fusion=False,
                            expert_model_parallel_size=1)
    init = torch.nn.init.zeros_
    if parallel == "column":
        layer = ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, bias=False, gather_output=False,
                                     is_expert=expert)
        name = "linear_fc1"
    else:
        layer = RowParallelLinear(IN, OUT, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                  skip_bias_add=True, is_expert=expert)
        name = "linear_fc2"
    holder = torch.nn.Module()
    holder.add_module(name, layer)
    attach_lora([holder], LoRAConfig(rank=R, alpha=ALPHA, target_modules=[name]), sequence_parallel=sp)
    return layer


def run_case(parallel: str, sp: bool, expert: bool, t: dict) -> dict:
    rank = dist.get_rank()
    layer = build(parallel, sp, expert)
    ad = layer.lora
    rows, cols = slice(rank * OUT // 2, (rank + 1) * OUT // 2), slice(rank * IN // 2, (rank + 1) * IN // 2)
    seq = slice(rank * S // 2, (rank + 1) * S // 2)
    with torch.no_grad():
        if parallel == "column":
            layer.weight.copy_(t["w"][rows])
            ad.a.copy_(t["a"])
            ad.b.copy_(t["b"][rows])
        else:
            layer.weight.copy_(t["w"][:, cols])
            ad.a.copy_(t["a"][:, cols])
            ad.b.copy_(t["b"])
    x = t["x"]
    if parallel == "row":
        x = x[..., cols]
    if sp and parallel == "column":
        x = x[seq]
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    dy = t["dy"]
    if parallel == "column":
        dy = dy[..., rows]
    if sp and parallel == "row":
        dy = dy[seq]
    (y * dy).sum().backward()
    return {"explicit": ad.explicit_comm, "sp": ad.sequence_parallel, "y": y.detach(), "dx": x.grad,
            "da": ad.a.grad, "db": ad.b.grad, "base_grad": layer.weight.grad}


def main() -> None:
    out = Path(sys.argv[1])
    env = c.start()
    from dapo_mcore.actor.parallel import init_model_parallel

    init_model_parallel(2, 1, seed=1)
    t = whole()
    results = {"ref": reference(t)}
    for parallel in ("column", "row"):
        for sp, expert in ((True, False), (False, True)):
            results[f"{parallel}_{'sp' if sp else 'expert'}"] = run_case(parallel, sp, expert, t)
    c.save(results, out / f"sp_experts_rank{env.rank}.pt")
    from dapo_mcore.actor.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main()
