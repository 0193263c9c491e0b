"""Which prompts a step generates, on which engine, and what becomes of the groups: the rollout scheduler
(``scheduler``: streaming, adaptive rounds, the partial-rollout buffer's freshness), streaming over several engine
groups (``engine_groups``), the buffer of partial rollouts carried from one step into the next (``partial``),
spreading prompts over the engines and gathering their groups back (``gather``), and the scored group a step is made
of (``groups``). It works on the engine protocol's types (``rollout/protocol.py``) and never builds an engine or
moves a batch between processes; ``rollout/pipeline`` drives it."""
