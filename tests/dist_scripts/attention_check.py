"""The SDPA core attention against Megatron's local DotProductAttention and against Hugging Face's eager Qwen2.

usage: python attention_check.py OUT.pt   (a world of one, gloo, CPU compatibility layer applied)

Records max absolute differences (outputs and input gradients, or logits and parameter gradients) for:
  module_*     SDPAttention vs DotProductAttention on the same q/k/v: causal mask, no mask, block-diagonal mask,
               a non-causal type with a general mask, MHA and GQA
  thd_*        SDPAttention on THD (cu_seqlens, with and without padded cu_seqlens) vs DotProductAttention with the
               equivalent block-diagonal mask
  model_*      GPTModel with the SDPA core attention vs HF Qwen2 (eager attention): logits and every parameter's
               gradient, mapped to HF names by the weight exporter
  actor_*      the actor with sdpa vs megatron_local: log-probs in the rows / packed / thd layouts and one DAPO update
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402


def _max_diff(a, b) -> float:
    """Largest |a - b| over paired tensors (shapes must match; empty ones count as equal)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def _attend(module, q, k, v, mask, weights, **kw):
    """Output and input gradients of sum(out * weights)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask, **kw)
    (out * weights).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _block_causal(lengths: list[int]) -> torch.Tensor:
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    s = seg.numel()
    return (~((seg[:, None] == seg[None, :]) & torch.ones(s, s, dtype=torch.bool).tril())).view(1, 1, s, s)


def module_checks(res: dict) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from conversion.synthetic import tiny_hf_config
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.model.attention import SDPAttention
    from dapo_mcore.model.qwen import transformer_config

    init_model_parallel(1, 1, seed=1)
    gen = torch.Generator().manual_seed(0)
    s, b, d = 13, 3, 16
    for heads, groups in ((4, 2), (4, 4)):
        tc = transformer_config(tiny_hf_config(num_attention_heads=heads, num_key_value_heads=groups))
        for kind in (AttnMaskType.causal, AttnMaskType.padding):
            kw = dict(config=tc, layer_number=2, attn_mask_type=kind, attention_type="self")
            ref, new = DotProductAttention(**kw), SDPAttention(**kw)
            q = torch.randn(s, b, heads, d, generator=gen)
            k, v = (torch.randn(s, b, groups, d, generator=gen) for _ in range(2))
            w = torch.randn(s, b, heads * d, generator=gen)
            tag = f"h{heads}g{groups}_{kind.name}"
            if kind == AttnMaskType.causal:
                causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
                want = _attend(ref, q, k, v, causal, w)
                res[f"module_causal_mask_{tag}"] = _max_diff(_attend(new, q, k, v, causal, w), want)
                res[f"module_no_mask_{tag}"] = _max_diff(_attend(new, q, k, v, None, w), want)
                block = _block_causal([5, 1, 7])
                res[f"module_block_mask_{tag}"] = _max_diff(_attend(new, q, k, v, block, w),
                                                            _attend(ref, q, k, v, block, w))
            else:  # a general per-row mask (key padding, not causal); every query keeps a key
                mask = torch.rand(b, 1, s, s, generator=gen) < 0.4
                mask[..., 0] = False
                res[f"module_general_mask_{tag}"] = _max_diff(_attend(new, q, k, v, mask, w),
                                                              _attend(ref, q, k, v, mask, w))
        # THD: [t, h, d] with cu_seqlens vs the local module on [t, 1, h, d] with the block-diagonal mask.
        kw = dict(config=tc, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        ref, new = DotProductAttention(**kw), SDPAttention(**kw)
        lengths = [4, 1, 6, 3]
        t = sum(lengths)
        q = torch.randn(t, heads, d, generator=gen)
        k, v = (torch.randn(t, groups, d, generator=gen) for _ in range(2))
        w = torch.randn(t, heads * d, generator=gen)
        cu = torch.tensor([0, 4, 5, 11, 14], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
        got = _attend(new, q, k, v, None, w, packed_seq_params=params)
        want = _attend(ref, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), _block_causal(lengths), w.unsqueeze(1))
        res[f"thd_h{heads}g{groups}"] = _max_diff(got, [want[0].squeeze(1)] + [g.squeeze(1) for g in want[1:]])
        # Padded THD: each sequence sits at the start of a slot of a multiple of 4 tokens; pad rows give zeros.
        slots = [4, 4, 8, 4]
        pcu = torch.tensor([0, 4, 8, 16, 20], dtype=torch.int32)
        idx = torch.cat([torch.arange(n) + int(pcu[i]) for i, n in enumerate(lengths)])
        qp, kp, vp = (torch.zeros(sum(slots), *x.shape[1:]).index_copy(0, idx, x) for x in (q, k, v))
        wp = torch.zeros(sum(slots), heads * d).index_copy(0, idx, w)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=pcu,
                                 cu_seqlens_kv_padded=pcu, max_seqlen_q=8, max_seqlen_kv=8)
        got = _attend(new, qp, kp, vp, None, wp, packed_seq_params=params)
        pad_rows = torch.ones(sum(slots), dtype=torch.bool).index_fill(0, idx, False)
        res[f"thd_padded_h{heads}g{groups}"] = _max_diff([x[idx] for x in got], [want[0].squeeze(1)] +
                                                         [g.squeeze(1) for g in want[1:]])
        res[f"thd_padded_pad_rows_abs_h{heads}g{groups}"] = got[0][pad_rows].abs().max().item()


def model_checks(res: dict, ws: Path) -> None:
    """GPTModel (SDPA) vs HF eager: logits and all parameter gradients of a weighted log-prob loss, without and
    with selective recompute (the core attention re-run in backward)."""
    import json

    import transformers

    from conversion.synthetic import save_tiny_hf_model
    from conversion.verify import causal_mask
    from dapo_mcore.actor.logprobs import token_logprobs
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config
    from dapo_mcore.weights.export import iter_hf_weights
    from dapo_mcore.weights.live import load_hf_into_model

    save_tiny_hf_model(ws / "hf", seed=3, vocab_size=37)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ws / "hf", dtype=torch.float32,
                                                           attn_implementation="eager")
    hf_config = json.loads((ws / "hf" / "config.json").read_text())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 37, (2, 11), generator=gen)
    targets = torch.randint(0, 37, (2, 11), generator=gen)
    w = torch.randn(2, 11, generator=gen)
    pos = torch.arange(11).unsqueeze(0).expand(2, -1)
    hf_logits = hf(ids).logits
    hf_logp = torch.log_softmax(hf_logits.double() / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (hf_logp * w).sum().backward()
    want = dict(hf.named_parameters())
    for recompute in ("none", "selective"):
        init_model_parallel(1, 1, seed=1)
        tconfig = transformer_config(hf_config, recompute=recompute)
        (chunk,) = build_gpt_model(hf_config, tconfig, attention="sdpa", make_vocab_size_divisible_by=16)
        load_hf_into_model([chunk], ws / "hf", "local", 16)
        chunk.train()
        logits = chunk(ids, pos, causal_mask(11))
        (token_logprobs(logits, targets, 0.7, 37) * w).sum().backward()
        res[f"model_logits_{recompute}"] = (logits[..., :37].detach() - hf_logits.detach()).abs().max().item()
        with torch.no_grad():  # export the gradients as if they were weights: HF names, QKV split, padding stripped
            for p in chunk.parameters():
                p.copy_(p.grad)
        grads = {n: t for bucket in iter_hf_weights([chunk], hf_config) for n, t in bucket}
        res[f"model_grad_names_equal_{recompute}"] = sorted(grads) == sorted(n for n in want if n != "lm_head.weight")
        res[f"model_grads_{recompute}"] = max((grads[n] - want[n].grad).abs().max().item() for n in grads)
    res["model_grad_scale"] = max(want[n].grad.abs().max().item() for n in want if n != "lm_head.weight")


def actor_checks(res: dict, ws: Path) -> None:
    """The actor built with each core attention from the same HF weights: log-probs, entropy, one DAPO update."""
    import json

    from safetensors.torch import load_file

    spec = {"seed": 5, "vocab_div": 16, "micro_batch_tokens": 24, "temperature": 0.7, "lr": 1e-3, "adam_eps": 1e-4,
            "weight_decay": 0.1, "grad_clip": 1.0, "algo": {"clip_low": 0.2, "clip_high": 0.28}, "samples": []}
    gen = torch.Generator().manual_seed(2)
    for i in range(9):
        p, r = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        spec["samples"].append({"prompt": torch.randint(3, 37, (p,), generator=gen).tolist(),
                                "response": torch.randint(3, 37, (r if i != 3 else 0,), generator=gen).tolist(),
                                "advantage": float(torch.randn(1, generator=gen))})
    hf_config = json.loads((ws / "hf" / "config.json").read_text())
    batch = c.samples(spec)
    out: dict[str, dict] = {}
    for attention, layout, logp_layouts in (("megatron_local", "rows", ("rows", "packed")),
                                            ("sdpa", "rows", ("rows", "packed")), ("sdpa", "thd", ("thd",))):
        actor = c.make_actor(ws, spec, 1, 1, hf_config=hf_config, attention=attention)
        r: dict = {}
        for lay in logp_layouts:
            actor.layout = lay
            r[f"logp_{lay}"], r[f"ent_{lay}"] = actor.compute_logprobs(batch, with_entropy=True)
        if batch[0].old_logprobs is None:  # the first variant fixes the old log-probs for every update
            noise = torch.Generator().manual_seed(4)
            for s, lp in zip(batch, r["logp_rows"], strict=True):
                s.old_logprobs = lp + 0.3 * torch.randn(lp.shape, generator=noise)
        actor.layout = layout
        r["metrics"] = actor.train_mini_batch(batch, spec["lr"])
        r["weights"] = c.export(actor)
        out[f"{attention}_{layout}"] = r
    old = out["megatron_local_rows"]
    for name in ("sdpa_rows", "sdpa_thd"):
        new = out[name]
        for lay in ("rows", "packed", "thd"):
            if f"logp_{lay}" in new:
                res[f"actor_logp_{name}_{lay}"] = _max_diff(new[f"logp_{lay}"], old["logp_rows"])
                res[f"actor_entropy_{name}_{lay}"] = _max_diff(new[f"ent_{lay}"], old["ent_rows"])
        res[f"actor_update_metrics_{name}"] = max(abs(new["metrics"][k] - old["metrics"][k])
                                                  for k in ("loss", "grad_norm", "entropy", "clipfrac"))
        res[f"actor_update_weights_{name}"] = max((new["weights"][k] - old["weights"][k]).abs().max().item()
                                                  for k in old["weights"])
        res[f"actor_update_ok_{name}"] = new["metrics"]["update_ok"]
    res["actor_logp_old_packed_vs_rows"] = _max_diff(old["logp_packed"], old["logp_rows"])
    start = load_file(str(ws / "hf" / "model.safetensors"))
    res["actor_update_min_move"] = min((old["weights"][k] - v).abs().max().item() for k, v in start.items())
    res["actor_update_clipfrac"] = old["metrics"]["clipfrac"]
    res["actor_update_grad_norm"] = old["metrics"]["grad_norm"]


def main() -> None:
    out = Path(sys.argv[1])
    c.start()
    res: dict = {}
    module_checks(res)
    model_checks(res, out.parent)
    actor_checks(res, out.parent)
    c.save(res, out)


if __name__ == "__main__":
    main()
