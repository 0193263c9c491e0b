"""Capacity planning before a job is queued: per-GPU memory and FLOPs (``planner``), the step-time model of a DAPO step
(``step_model``, ``rollout_model``) and the trainer/engine split of a disaggregated layout (``disagg``)."""
