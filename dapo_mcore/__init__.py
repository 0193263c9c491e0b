"""dapo-mcore: DAPO reinforcement learning on Megatron-Core."""

__version__ = "0.1.0"

import os as _os

from dapo_mcore.model.megatron_import import install as _fast_megatron_import

_fast_megatron_import()  # Megatron-Core's import without the two costs no run uses (model/megatron_import.py)

if _os.environ.get("DAPO_MCORE_STRICT_DEVICE") == "1":  # NCCL on CPU (tests, rehearse): collectives.strict
    from dapo_mcore.collectives.hook import install_when_torch_distributed_loads as _install

    _install()
