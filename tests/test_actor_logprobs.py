"""Token log-probs and entropy from (padded) vocabulary logits against a naive per-token reference (TP=1).

The columns that pad the vocabulary are filled with NaN and huge values: a kernel that read them would return
NaN or a wrong softmax, so passing proves they are skipped. TP>1 is covered by tests/test_actor_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.actor.logprobs import real_columns, scaled_logits, token_entropy, token_logprobs

pytestmark = pytest.mark.unit

TRUE_VOCAB, PADDED = 37, 128


def _padded_logits(seed: int, b: int = 3, s: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, PADDED, generator=gen) * 3
    logits[..., TRUE_VOCAB:] = float("nan")
    logits[..., TRUE_VOCAB::2] = 1e4
    return logits


def _naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Loop over tokens in float64: log p(target) and entropy over the real vocabulary only."""
    b, s, _ = logits.shape
    logp, ent = torch.zeros(b, s, dtype=torch.float64), torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            row = torch.log_softmax(logits[i, j, :TRUE_VOCAB].double() / temperature, dim=-1)
            logp[i, j] = row[targets[i, j]]
            ent[i, j] = -(row.exp() * row).sum()
    return logp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_ignore_padding_columns(temperature):
    logits = _padded_logits(0)
    targets = torch.randint(0, TRUE_VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    want_logp, want_ent = _naive(logits, targets, temperature)
    got_logp = token_logprobs(logits, targets, temperature, TRUE_VOCAB)
    got_ent = token_entropy(logits, temperature, TRUE_VOCAB)
    assert torch.isfinite(got_logp).all() and torch.isfinite(got_ent).all()
    assert (got_logp.double() - want_logp).abs().max() < 1e-5
    assert (got_ent.double() - want_ent).abs().max() < 1e-5
    assert want_ent.std() > 0.1 and want_logp.std() > 0.1  # not a degenerate distribution


def test_logprob_gradient_equals_naive_and_is_zero_on_padding():
    logits = _padded_logits(2)
    targets = torch.randint(0, TRUE_VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(4))
    got = logits.clone().requires_grad_(True)
    (token_logprobs(got, targets, 0.7, TRUE_VOCAB) * weights).sum().backward()
    ref = logits[..., :TRUE_VOCAB].double().requires_grad_(True)
    (torch.log_softmax(ref / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * weights).sum().backward()
    assert (got.grad[..., :TRUE_VOCAB].double() - ref.grad).abs().max() < 1e-5
    assert got.grad[..., TRUE_VOCAB:].eq(0).all()
    assert ref.grad.abs().max() > 0.1


def test_scaled_logits_is_a_view_of_the_real_columns_at_temperature_one():
    logits = _padded_logits(5)
    view = scaled_logits(logits, 1.0, TRUE_VOCAB)
    assert view.shape[-1] == TRUE_VOCAB and view.data_ptr() == logits.data_ptr()  # no copy of the vocabulary


@pytest.mark.parametrize(("local", "true", "rank", "want"), [
    (128, 37, 0, 37), (128, 128, 0, 128), (32, 37, 0, 32), (32, 37, 1, 5), (32, 37, 2, 0), (32, 37, 3, 0)])
def test_real_columns_per_tensor_parallel_rank(local, true, rank, want):
    assert real_columns(local, true, rank) == want
