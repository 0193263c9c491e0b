"""A prompt's scored rollouts: the payload the rollout side hands the trainer, one per prompt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dapo_mcore.algo.dynamic_sampling import Group
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.rollout.protocol import Response

__all__ = ["GroupData", "as_group"]


@dataclass
class GroupData:
    """One prompt's G rollouts and their scores (the payload of a dynamic-sampling Group)."""

    record: PromptRecord
    prompt_ids: list[int]
    responses: list[Response]
    scores: list[float]
    """The verifier's scores (+1 / -1 for the built-in one)."""
    acc: list[bool]
    rewards: list[float]
    """The scores after overlong shaping: what advantages are computed from."""
    gen_batch: int
    """The generation call of the step (slot) that produced the group."""
    preds: list[str | None] = field(default_factory=list)
    kept: bool = False

    def joined(self, rest: GroupData) -> GroupData:
        """This group's responses followed by ``rest``'s (a staged group's first stage and its completion)."""
        return dataclasses.replace(self, responses=self.responses + rest.responses, scores=self.scores + rest.scores,
                                   acc=self.acc + rest.acc, rewards=self.rewards + rest.rewards,
                                   preds=self.preds + rest.preds)


def as_group(g: GroupData) -> Group:
    """The view dynamic sampling decides on: outcomes, lengths and stale tokens, with ``g`` as the payload."""
    return Group(acc=g.acc, payload=g, response_lengths=[r.length for r in g.responses],
                 stale_tokens=sum(r.stale_tokens for r in g.responses))
