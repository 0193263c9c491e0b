"""The step rules live in the package (``dapo_mcore/step_model.py``): ``dapo-mcore plan`` and
``benchmarks/rollout_sim.py`` price a step with one model; these are its names."""

from dapo_mcore.step_model import Phases, StepTime, async_step, async_steps, mean_step, sync_step  # noqa: F401
