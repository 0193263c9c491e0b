"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. Log-probs use Megatron's
``vocab_parallel_cross_entropy`` (a max, a sum of exponentials and the target logit all-reduced over the TP
group: three scalars per token, never the vocabulary); entropy uses the same reductions. Logits are divided by
the sampling temperature first, so the numbers match what the rollout engine sampled from, and the rows that pad
the vocabulary for TP are masked out so they carry no probability.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Finite stand-in for -inf: exp() underflows to exactly 0 in fp32 without inf arithmetic in backward.
_MASKED_LOGIT = -1.0e30


def _tp_group_info() -> tuple[object | None, int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 0, 1
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def scaled_logits(vocab_parallel_logits: torch.Tensor, temperature: float, true_vocab_size: int) -> torch.Tensor:
    """fp32 logits / temperature with padded-vocab entries masked. Shape [..., V_local] -> same shape."""
    _, tp_rank, _ = _tp_group_info()
    v_local = vocab_parallel_logits.shape[-1]
    start = tp_rank * v_local
    logits = vocab_parallel_logits.float() / temperature
    if start + v_local > true_vocab_size:
        global_ids = torch.arange(start, start + v_local, device=logits.device)
        logits = logits.masked_fill(global_ids >= true_vocab_size, _MASKED_LOGIT)
    return logits


def token_logprobs(vocab_parallel_logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   true_vocab_size: int) -> torch.Tensor:
    """log p(target) under softmax(logits / T) over the full vocabulary. logits [B, S, V_local], targets [B, S] -> [B, S].

    Differentiable (gradients flow to every TP rank's logits slice).
    """
    from megatron.core import tensor_parallel

    logits = scaled_logits(vocab_parallel_logits, temperature, true_vocab_size)
    group, _, tp_size = _tp_group_info()
    if group is None or tp_size == 1:
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Megatron's kernel wants [S, B, V]; it subtracts the max in place, so it gets its own tensor.
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


@torch.no_grad()
def token_entropy(vocab_parallel_logits: torch.Tensor, temperature: float, true_vocab_size: int) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, reduced over the TP group. [B, S, V_local] -> [B, S]."""
    logits = scaled_logits(vocab_parallel_logits, temperature, true_vocab_size)
    group, _, tp_size = _tp_group_info()
    local_max = logits.max(dim=-1).values
    if group is not None and tp_size > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    sum_exp_x = (exp * shifted).sum(dim=-1)
    if group is not None and tp_size > 1:
        stacked = torch.stack([sum_exp, sum_exp_x])
        dist.all_reduce(stacked, group=group)
        sum_exp, sum_exp_x = stacked[0], stacked[1]
    # H = log Z - E[x] with x shifted by the max: log(sum_exp) - sum(exp * x) / sum_exp.
    return torch.log(sum_exp) - sum_exp_x / sum_exp
