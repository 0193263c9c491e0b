"""How a step's batch reaches the trainer: the ``RolloutSource`` interface the trainer asks (``source``), its
synchronous implementation on the trainer's own ranks (``colocated``: engine groups, scoring, dynamic sampling), and
the async one, where engines on ranks of their own generate ahead of the trainer (``async_source`` on the trainer
side, ``async_engines`` and ``async_channels`` on the engine side: the sending and receiving threads), joined by the
bridge between the two worlds (``bridge``) and the compact form a message travels in (``wire``). It drives the
engines through the engine protocol and decides with ``rollout/scheduling``; it builds no engine and computes no
log-prob or reward itself."""
