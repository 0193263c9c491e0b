"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. Logits are divided by the
sampling temperature first, so the numbers match what the rollout engine sampled from. The columns that only pad
the vocabulary (``model.vocab_padding``: as far as TP needs, or Megatron-LM's multiple of
``make_vocab_size_divisible_by * TP``) cost nothing where the
kernel can skip them: entropy, and log-probs at TP=1, work on a view of the real columns (a vocabulary of 32
padded to 128 is 4x less work). Log-probs at TP>1 use Megatron's ``vocab_parallel_cross_entropy`` (a max, a sum
of exponentials and the target logit all-reduced over the TP group: three scalars per token, never the
vocabulary), which needs equal slices, so there the padding columns are masked to a finite -1e30 instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dapo_mcore.actor import sizes

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
    # Megatron's kernel wants [S, B, V] and turns it into the softmax in place, so it gets its own tensor: fp32 logits
    # at T=1 on a rank without padding columns in a one-row micro-batch (THD) are neither scaled, masked nor moved by
    # the transpose, and the kernel would overwrite the caller's logits (which the entropy metric reads next).
    logits = _masked_full_width(vocab_parallel_logits, temperature, true_vocab_size).transpose(0, 1).contiguous()
    if logits.data_ptr() == vocab_parallel_logits.data_ptr():
        logits = logits.clone()
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits, targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


@torch.no_grad()
def token_entropy(vocab_parallel_logits: torch.Tensor, temperature: float, true_vocab_size: int,
                  chunk_bytes: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, reduced over the TP group. [B, S, V_local] -> [B, S].

    A metric, not a loss term: no graph, and computed over chunks of positions, so the fp32 temporaries (the scaled
    logits, their shift by the max, its exponential and their product) hold ``chunk_bytes`` each instead of four
    [B*S, V_local] copies beside the logits the backward still needs. The max (exact in the logits' own dtype, and
    dividing by T > 0 keeps the order) is taken on the logits as they are; the TP group reduces the max and the two
    sums once each, as before. ``chunk_bytes`` defaults to ``actor.sizes.ENTROPY_CHUNK_BYTES``.
    """
    group, tp_rank, tp_size = _tp_group_info()
    n_real = real_columns(vocab_parallel_logits.shape[-1], true_vocab_size, tp_rank)
    rows = vocab_parallel_logits[..., :n_real].flatten(0, -2)  # a view for Megatron's contiguous [B, S, V] output
    if n_real:
        local_max = _scaled(rows.amax(dim=-1), temperature)
    else:  # a rank that holds only padding columns
        local_max = rows.new_full(rows.shape[:-1], _MASKED_LOGIT, dtype=torch.float32)
    reduced = group is not None and tp_size > 1
    if reduced:  # the logits' own device on a GPU (a no-op move); marked under NCCL-on-CPU (collectives.strict)
        from dapo_mcore.collectives.device import collective_device

        device = collective_device(group)
        local_max = device.to(local_max)
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    sums = torch.zeros(2, rows.shape[0], dtype=torch.float32, device=rows.device)  # sum exp, sum exp * x
    step = max(1, (chunk_bytes or sizes.ENTROPY_CHUNK_BYTES) // (4 * max(n_real, 1)))
    for start in range(0, rows.shape[0], step):
        shifted = _scaled(rows[start:start + step], temperature) - local_max[start:start + step].unsqueeze(-1)
        exp = shifted.exp()
        sums[0, start:start + step] = exp.sum(dim=-1)
        sums[1, start:start + step] = (exp * shifted).sum(dim=-1)
        del shifted, exp
    if reduced:
        sums = device.to(sums)
        dist.all_reduce(sums, group=group)
    # H = log Z - E[x] with x shifted by the max: log(sum_exp) - sum(exp * x) / sum_exp.
    return (torch.log(sums[0]) - sums[1] / sums[0]).view(vocab_parallel_logits.shape[:-1])
