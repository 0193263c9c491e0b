"""Byte sizes the actor's kernels work in, without torch: the planner reads them (``plan`` imports no torch)."""

ENTROPY_CHUNK_BYTES = 32 << 20
"""fp32 bytes of one chunk of positions in ``actor.logprobs.token_entropy``; its temporaries are a few such chunks,
however many positions and vocabulary columns the micro-batch has (the planner counts them)."""
