"""Training-inference mismatch and what corrects it: the metrics that compare the trainer's log-probs with the
engine's and the truncated importance weights built from them (``mismatch``), and the MoE routes an engine records
while it samples so the trainer can replay them (``routes``). It imports nothing of the rollout side (only ``algo``
and ``actor`` below it); the engines import it to record routes, the trainer to weigh the loss, and nothing here
knows how responses are generated, scheduled or carried."""
