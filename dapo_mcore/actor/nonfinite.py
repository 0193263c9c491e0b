"""NaN and infinity in training: an update whose loss or gradients are not finite is never applied.

``optim.skip_nonfinite_updates`` decides what follows (``NonFiniteGuard``): 0 (the default) stops the run at the
first such update with one line naming the fix, before anything of that step is logged or checkpointed, so the
last checkpoint stays the one to resume from; N > 0 skips up to N such updates in a row (weights and Adam's state
untouched, a warning each) and stops at the next. Stopping is the default because an update that went non-finite
usually follows one that was finite but far too large (a learning rate of 1e6): the weights are already broken,
and skipping alone would carry them into sampling. A checkpoint is never written from non-finite weights
(``nonfinite_tensors`` before every save).

Every check is collective and ends in the same answer on every rank, so all ranks take the same branch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from dapo_mcore.errors import NonFiniteError

log = logging.getLogger(__name__)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank (collective over the default group, if there is one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    from dapo_mcore.collectives.device import collective_device

    device = collective_device()
    t = device.to(torch.tensor([1 if flag else 0], dtype=torch.int32))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(device.host(t).item())


def grads_finite(chunks: Iterable[torch.nn.Module]) -> bool:
    """Collective: whether every rank's reduced gradients (Megatron's ``main_grad``, else ``grad``) are finite.

    One sum per tensor (no temporary of the gradient's size): a sum is finite exactly when no element is NaN or
    infinite, short of fp32 overflow, which is itself a gradient no update should take."""
    total = torch.zeros((), dtype=torch.float32, device=_device())
    for chunk in chunks:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                total += g.sum(dtype=torch.float32)
    return not any_rank(not bool(torch.isfinite(total)))


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity (this rank's; floating-point tensors only)."""
    bad = []
    for name, t in named:
        if t.is_floating_point() and not bool(torch.isfinite(t.detach().sum(dtype=torch.float32))):
            if not bool(torch.isfinite(t.detach()).all()):  # the sum alone may overflow on finite values
                bad.append(name)
    return bad


class NonFiniteGuard:
    """Decides, update by update, whether a non-finite one is skipped or stops the run (module docstring)."""

    def __init__(self, skip_limit: int, lr: float, grad_clip: float) -> None:
        self.skip_limit, self.lr, self.grad_clip = skip_limit, lr, grad_clip
        self.in_a_row = 0

    def check(self, loss: float, grads_ok: bool, update_lr: float) -> bool:
        """True: skip this update. Raises NonFiniteError when the update must stop the run."""
        if grads_ok and math.isfinite(loss):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        what = f"loss {loss:g}" + ("" if grads_ok else " and non-finite gradients")
        fix = f"lower optim.lr (now {self.lr:g}, this update {update_lr:g})"
        if self.grad_clip == 0:
            fix += " or turn gradient clipping on (optim.grad_clip=1.0; now 0 = off)"
        if self.in_a_row > self.skip_limit:
            allowed = (f"{self.in_a_row} non-finite updates in a row, more than optim.skip_nonfinite_updates="
                       f"{self.skip_limit}" if self.skip_limit else "optim.skip_nonfinite_updates=0")
            raise NonFiniteError(
                f"a non-finite update ({what}) was not applied and stops the run ({allowed}); nothing of this step "
                f"is logged or checkpointed, so the run resumes from its last checkpoint. {fix[0].upper()}{fix[1:]}, "
                "or set optim.skip_nonfinite_updates=N to skip up to N such updates in a row")
        log.warning("non-finite update (%s) skipped: weights and optimizer state unchanged (%d in a row, "
                    "optim.skip_nonfinite_updates=%d); %s", what, self.in_a_row, self.skip_limit, fix)
        return True
