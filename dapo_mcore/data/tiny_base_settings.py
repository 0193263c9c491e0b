"""Settings of the embedded tiny base model, apart from the code that builds it.

Kept free of torch and transformers so that ``dapo_mcore.config`` (and every config error) loads without them;
``dapo_mcore.data.base_model`` builds and caches the model from these settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from dapo_mcore.data.tasks import get_task

_CACHE_FORMAT_VERSION = 1
TINY_PRESETS = ("tiny", "tiny-hd32", "tiny-tools")
"""Presets a tiny base can take (dapo_mcore.model.presets): the tiny vocabulary, shapes that pre-train in seconds;
``tiny-tools`` has the tool task's vocabulary (the tiny one plus ReTool's markers)."""
TOOL_PRESETS = ("tiny-tools",)
"""The presets whose tokenizer holds the tool-call markers (``data.tokenizer.TINY_TOOL_VOCAB``)."""


@dataclass(frozen=True)
class TinyBaseSettings:
    """Everything that determines the cached base model (all fields enter the cache key)."""

    task: str = "max4"
    """Registered synthetic task whose training split makes the corpus."""
    split_seed: int = 0
    """Seed of the task's train/held-out permutation (must match the one used for RL and eval)."""
    heldout_fraction: float = 0.2
    """Share of the task's problems held out (never seen in pre-training or RL)."""
    correct_weight: float = 0.25
    """Probability that a corpus answer comes from the correct rule; the distractors share the rest equally."""
    steps: int = 600
    """Optimizer steps of pre-training."""
    batch_size: int = 64
    """Sequences per pre-training step (each a fresh draw of prompt and rule)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up over 5% of the steps, cosine decay to 10%)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the initial weights and of the corpus draws."""
    preset: str = "tiny"
    """Model shape (dapo_mcore.model.presets): "tiny", "tiny-hd32" (head_dim 32, which vLLM's CPU kernels need), or
    "tiny-tools" (the tool task's vocabulary: ``<code>``, ``</code>``, ``<interpreter>``, ``</interpreter>``, ``print``)."""

    def validate(self) -> None:
        get_task(self.task)
        if self.preset not in TINY_PRESETS:
            raise ValueError(f"preset={self.preset!r}: the tiny base uses the tiny vocabulary; choose one of "
                             f"{', '.join(TINY_PRESETS)}")
        if not 0.0 < self.correct_weight < 1.0:
            raise ValueError(f"correct_weight={self.correct_weight} must lie in (0, 1), e.g. 0.25, "
                             "so that the base model is uncertain")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps={self.steps} and batch_size={self.batch_size} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0, e.g. 3e-3")

    def cache_key(self) -> str:
        """A short hash of the settings, the vocabulary and the cache format."""
        from dapo_mcore.data.tokenizer import tiny_vocab  # imports transformers: only when a base is built

        fields = dataclasses.asdict(self)
        if fields["preset"] == "tiny":
            del fields["preset"]  # the default shape keeps the key it had before the field existed
        vocab = list(tiny_vocab(self.preset in TOOL_PRESETS))
        payload = json.dumps([fields, vocab, _CACHE_FORMAT_VERSION], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]
