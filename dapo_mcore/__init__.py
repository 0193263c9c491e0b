"""dapo-mcore: DAPO reinforcement learning on Megatron-Core."""

__version__ = "0.1.0"
