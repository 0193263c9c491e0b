"""dapo-mcore: DAPO reinforcement learning on Megatron-Core."""

__version__ = "0.1.0"

import os as _os

if _os.environ.get("DAPO_MCORE_STRICT_DEVICE") == "1":  # NCCL on CPU (tests, rehearse): actor.strict_collectives
    from dapo_mcore.actor.strict_collectives import install as _install

    _install()
