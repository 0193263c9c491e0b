"""The rollout simulator's generation model lives in the package (``dapo_mcore/rollout_model.py``), so that
``dapo-mcore plan`` prices a step with the same code as ``benchmarks/rollout_sim.py``; these are its names."""

from dapo_mcore.rollout_model import (  # noqa: F401
    Carried,
    EngineModel,
    EngineSim,
    LengthModel,
    PromptPool,
    Recipe,
    Stage,
    StepResult,
    adaptive_round,
    batch_and_filter_step,
    spread,
    streaming_step,
)
