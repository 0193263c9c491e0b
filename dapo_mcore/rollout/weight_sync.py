"""Engine side of a weight sync: which Hugging Face names an engine expects, and strict bookkeeping of a sync.

The trainer exports its weights as buckets of ``(HF name, full tensor)`` pairs
(``dapo_mcore.weights.export.iter_hf_weights``). An engine must receive every parameter exactly once per
full sync, with the right shape, and nothing else: :class:`SyncTracker` checks each bucket before it is
loaded and reports what is missing at the end. Names follow Hugging Face's ``Qwen2ForCausalLM`` state dict,
which is also what vLLM's ``Qwen2ForCausalLM.load_weights`` consumes (it fuses q/k/v and gate/up itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dapo_mcore.rollout.protocol import EngineError, WeightBucket

__all__ = ["SyncTracker", "qwen2_param_shapes"]

_TIED_HEAD = "lm_head.weight"


def qwen2_param_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Qwen2 causal LM described by its ``config.json`` dict.

    With ``tie_word_embeddings`` the output head is the embedding, so ``lm_head.weight`` is not listed
    (vLLM's Qwen2 loader skips it; :class:`SyncTracker` accepts it as an alias of the embedding).
    """
    if hf_config["model_type"] != "qwen2":
        raise EngineError(f"model_type={hf_config['model_type']!r}: the rollout weight sync knows qwen2 only.")
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config["num_key_value_heads"])
    head_dim = int(hf_config["head_dim"]) if "head_dim" in hf_config else hidden // heads
    inter = int(hf_config["intermediate_size"])
    vocab = int(hf_config["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(int(hf_config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.q_proj.bias": (heads * head_dim,),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not hf_config["tie_word_embeddings"]:
        shapes[_TIED_HEAD] = (vocab, hidden)
    return shapes


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
