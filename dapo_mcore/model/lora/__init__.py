"""LoRA for the Megatron actor: the settings (config), the sharded adapter (adapter) and how it is put on a model
(attach). The adapters' Hugging Face (peft) names, checkpoints and merged export live in ``dapo_mcore.weights.lora``.
"""
