"""Telemetry: metric names (keys), TensorBoard + jsonl metrics, phase timers, the cost ledger,
the zarr rollout store, run reports (figures) and the profile summary. See docs/observability.md."""
