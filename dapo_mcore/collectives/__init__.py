"""Where a collective's tensors live, and the CPU check that refuses what NCCL refuses: ``device`` (the collective
device of a group: CUDA under NCCL, the CPU under gloo, a marked CPU stand-in under the check), ``strict`` (the
check on torch.distributed's collectives called from this package) and ``packed`` (an all-gather of variable-length
flat tensors). Imports nothing of the project's, so every floor may use it."""
