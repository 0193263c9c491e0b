"""The LoRA settings of the actor (``model.lora`` in the run config), checked before any process group exists.

``rank = 0`` (the default) means no adapters: the whole model trains. With ``rank > 0`` every targeted Megatron
linear layer gets a low-rank update ``scale * B @ A`` (``scale = alpha / rank``, as in Hugging Face ``peft``) and the
base weights are frozen. Targets are Megatron's module names (the ``local`` and ``transformer_engine`` specs name them
alike); an MoE model's experts carry the same names and are adapted with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Every projection of a transformer layer (attention in/out, MLP in/out; experts included)."""

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
"""Column-parallel layers: the output dimension is split over tensor-parallel ranks."""
ROW_TARGETS = ("linear_proj", "linear_fc2")
"""Row-parallel layers: the input dimension is split over tensor-parallel ranks."""

HF_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""The Hugging Face module names of each target (fused Megatron layers are several HF projections)."""


class LoRAConfigError(ValueError):
    """A ``model.lora`` value that cannot work (the message names the field and the fix)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the actor's linear layers; the base model is frozen."""

    rank: int = 0
    """Adapter rank r (0 = off: full fine-tuning). Typical values: 8-128."""
    alpha: float = 32.0
    """Scaling numerator: the update is (alpha / rank) * B @ A, as in Hugging Face peft's `lora_alpha`."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 keeps old log-probs and training forwards identical)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Megatron linear layers to adapt: any of linear_qkv, linear_proj, linear_fc1, linear_fc2 (an MoE model's
    experts are adapted through linear_fc1 / linear_fc2)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 0:
            raise LoRAConfigError(f"model.lora.rank={self.rank} must be >= 0 (0 = no adapters).")
        if not self.enabled:
            return
        if not self.alpha > 0:
            raise LoRAConfigError(f"model.lora.alpha={self.alpha} must be > 0 (the update is alpha / rank * B @ A; "
                                  f"{2 * self.rank} = 2 x rank is a common choice).")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAConfigError(f"model.lora.dropout={self.dropout} must be in [0, 1).")
        if not self.target_modules:
            raise LoRAConfigError("model.lora.target_modules is empty; name some of "
                                  f"{', '.join(DEFAULT_TARGETS)}, or set model.lora.rank=0.")
        bad = [t for t in self.target_modules if t not in DEFAULT_TARGETS]
        if bad:
            hint = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
            named = "; ".join(f"{t} is {hint[t]}" for t in bad if t in hint)
            raise LoRAConfigError(f"model.lora.target_modules has {', '.join(map(repr, bad))}: use Megatron's names "
                                  f"{', '.join(DEFAULT_TARGETS)}{' (' + named + ')' if named else ''}.")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise LoRAConfigError(f"model.lora.target_modules={self.target_modules} names a layer twice.")
