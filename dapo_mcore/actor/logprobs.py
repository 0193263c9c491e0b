"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. Logits are divided by the
sampling temperature first, so the numbers match what the rollout engine sampled from. The columns that only pad
the vocabulary (Megatron pads it to a multiple of ``make_vocab_size_divisible_by * TP``) cost nothing where the
kernel can skip them: entropy, and log-probs at TP=1, work on a view of the real columns (a vocabulary of 32
padded to 128 is 4x less work). Log-probs at TP>1 use Megatron's ``vocab_parallel_cross_entropy`` (a max, a sum
of exponentials and the target logit all-reduced over the TP group: three scalars per token, never the
vocabulary), which needs equal slices, so there the padding columns are masked to a finite -1e30 instead.
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


def real_columns(local_vocab: int, true_vocab_size: int, tp_rank: int) -> int:
    """How many of a TP rank's ``local_vocab`` logit columns are real tokens (the rest pad the vocabulary)."""
    return max(0, min(local_vocab, true_vocab_size - tp_rank * local_vocab))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def scaled_logits(vocab_parallel_logits: torch.Tensor, temperature: float, true_vocab_size: int) -> torch.Tensor:
    """fp32 logits / temperature of this rank's real columns. [..., V_local] -> [..., n_real] (n_real may be 0)."""
    _, tp_rank, _ = _tp_group_info()
    n_real = real_columns(vocab_parallel_logits.shape[-1], true_vocab_size, tp_rank)
    return _scaled(vocab_parallel_logits[..., :n_real], temperature)


def _masked_full_width(vocab_parallel_logits: torch.Tensor, temperature: float, true_vocab_size: int) -> torch.Tensor:
    """fp32 logits / temperature at full local width, padding columns masked (for kernels that need equal slices)."""
    _, tp_rank, _ = _tp_group_info()
    v_local = vocab_parallel_logits.shape[-1]
    logits = _scaled(vocab_parallel_logits, temperature)
    n_real = real_columns(v_local, true_vocab_size, tp_rank)
    if n_real < v_local:
        pad = torch.arange(v_local, device=logits.device) >= n_real
        logits = logits.masked_fill(pad, _MASKED_LOGIT)
    return logits


def token_logprobs(vocab_parallel_logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   true_vocab_size: int) -> torch.Tensor:
    """log p(target) under softmax(logits / T) over the full vocabulary. logits [B, S, V_local], targets [B, S] -> [B, S].

    Differentiable (gradients flow to every TP rank's logits slice).
    """
    from megatron.core import tensor_parallel

    group, _, tp_size = _tp_group_info()
    if group is None or tp_size == 1:
        # logsumexp keeps no [B, S, V] output alive for backward (log_softmax would), and at T=1 in fp32 the
        # logits view itself is all it saves.
        logits = scaled_logits(vocab_parallel_logits, temperature, true_vocab_size)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    # Megatron's kernel wants [S, B, V]; it subtracts the max in place, so it gets its own tensor.
    logits = _masked_full_width(vocab_parallel_logits, temperature, true_vocab_size)
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


@torch.no_grad()
def token_entropy(vocab_parallel_logits: torch.Tensor, temperature: float, true_vocab_size: int) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, reduced over the TP group. [B, S, V_local] -> [B, S]."""
    logits = scaled_logits(vocab_parallel_logits, temperature, true_vocab_size)
    group, _, tp_size = _tp_group_info()
    if logits.shape[-1]:
        local_max = logits.amax(dim=-1)
    else:  # a rank that holds only padding columns
        local_max = logits.new_full(logits.shape[:-1], _MASKED_LOGIT)
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
