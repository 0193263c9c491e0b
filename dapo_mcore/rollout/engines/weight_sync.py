"""Engine side of a weight sync: which Hugging Face names an engine expects, and strict bookkeeping of a sync.

The trainer exports its weights as buckets of ``(HF name, full tensor)`` pairs
(``dapo_mcore.weights.export.iter_hf_weights``). An engine must receive every parameter exactly once per
full sync, with the right shape, and nothing else: :class:`SyncTracker` checks each bucket before it is
loaded and reports what is missing at the end. Names follow Hugging Face's ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` state dict, which is also what vLLM's ``load_weights`` of the same classes consumes (it fuses
q/k/v and gate/up itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dapo_mcore.rollout.protocol import EngineError, WeightBucket

__all__ = ["SyncTracker", "hf_param_shapes"]

_TIED_HEAD = "lm_head.weight"


def hf_param_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a supported causal LM (Qwen2, Qwen3, ...) described by its ``config.json``
    dict: the weight mapping's own table (``dapo_mcore.weights``), so the engine expects what the export sends.

    With ``tie_word_embeddings`` the output head is the embedding, so ``lm_head.weight`` is not listed
    (vLLM's Qwen loaders skip it; :class:`SyncTracker` accepts it as an alias of the embedding).
    """
    from dapo_mcore.weights.errors import WeightsError
    from dapo_mcore.weights.registry import get_mapping

    try:
        return dict(get_mapping(dict(hf_config)).hf_shapes())
    except (WeightsError, ValueError) as exc:
        raise EngineError(f"the rollout weight sync cannot map this model: {exc}") from exc


class SyncTracker:
    """Checks the buckets of one full weight sync against the expected names and shapes.

    Args:
        shapes: expected ``name -> shape`` of every parameter the engine holds.
        aliases: extra accepted names that refer to another expected parameter (e.g. a tied
            ``lm_head.weight`` -> ``model.embed_tokens.weight``); an alias never counts as coverage,
            and is not required.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], aliases: Mapping[str, str] | None = None):
        self.shapes = dict(shapes)
        self.aliases = dict(aliases or {})
        for alias, target in self.aliases.items():
            assert target in self.shapes, f"alias {alias} -> unknown {target}"
        self.seen: set[str] = set()

    def start(self) -> None:
        """Begin a new full sync (forgets what an earlier, possibly failed, sync sent)."""
        self.seen = set()

    def check_bucket(self, bucket: WeightBucket) -> WeightBucket:
        """Validate one bucket (before anything in it is loaded); returns it without the aliases."""
        out: WeightBucket = []
        for name, tensor in bucket:
            target = self.aliases.get(name, name)
            if target not in self.shapes:
                raise EngineError(f"weight sync: unknown tensor {name!r} (shape {tuple(tensor.shape)}); the engine "
                                  f"has no such parameter. Check the HF name mapping of the exporter.")
            want = self.shapes[target]
            if tuple(tensor.shape) != want:
                raise EngineError(f"weight sync: tensor {name!r} has shape {tuple(tensor.shape)}, the engine expects "
                                  f"{want}. (A padded vocabulary must be trimmed to vocab_size before export.)")
            if name in self.aliases:
                continue
            if name in self.seen:
                raise EngineError(f"weight sync: tensor {name!r} sent twice in one sync; send each parameter once.")
            self.seen.add(name)
            out.append((name, tensor))
        return out

    def finish(self) -> None:
        """Raise EngineError listing the parameters that were never sent; then reset for the next sync."""
        missing = sorted(set(self.shapes) - self.seen)
        self.seen = set()
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise EngineError(f"weight sync incomplete: {len(missing)} parameter(s) never sent: {shown}. "
                              f"A full sync must cover every parameter once.")
