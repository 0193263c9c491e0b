"""FP8 parameters (model.fp8.fp8_params) leave the model as plain bf16: weight export (the rollout sync) and the
model checkpoint dequantize a quantized parameter type instead of handing it on. Transformer Engine's
``QuantizedTensor`` is stood in for by a fake quantized type that refuses every plain tensor operation."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from dapo_mcore.weights.live import plain_tensor


class FakeFP8(torch.Tensor):
    """int8 codes and one scale behind a bf16 face, like TE's Float8Tensor; it has no plain storage, so any torch
    operation on it (detach, copy, all-gather, save) fails: only ``dequantize`` reads it."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: float):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.bfloat16, device=codes.device)

    def __init__(self, codes: torch.Tensor, scale: float):
        self._codes, self._scale = codes, scale

    @classmethod
    def quantize(cls, t: torch.Tensor) -> FakeFP8:
        scale = float(t.abs().max()) / 127 or 1.0
        return cls(torch.round(t.float() / scale).to(torch.int8), scale)

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self._codes.float() * self._scale).to(dtype or self.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"FakeFP8 has no plain storage ({func}): dequantize it first")


@pytest.mark.unit
def test_plain_tensor_dequantizes_quantized_and_passes_plain_through():
    w = torch.randn(6, 4)
    q = FakeFP8.quantize(w)
    with pytest.raises(TypeError, match="no plain storage"):
        q.detach()
    d = plain_tensor(q)
    assert type(d) is torch.Tensor and d.dtype == torch.bfloat16 and torch.equal(d, q.dequantize())
    assert (d.float() - w).abs().max() < 0.02 * w.abs().max()
    p = torch.nn.Parameter(w)
    assert plain_tensor(p) is p


def _worker(port: int, out_dir: str, queue) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.model import cpu_compat
    from dapo_mcore.model.presets import preset_config
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config
    from dapo_mcore.weights.checkpoint import rank_file
    from dapo_mcore.weights.export import iter_hf_weights
    from dapo_mcore.weights.live import save_megatron_checkpoint, unwrap

    cpu_compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=3)
    hf = preset_config("tiny")
    chunks = build_gpt_model(hf, transformer_config(hf, params_dtype=torch.bfloat16))
    model = unwrap(chunks[0]).to(torch.bfloat16)
    quantized = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            w = module._parameters.get("weight")
            if w is not None and w.dim() == 2 and "embedding" not in name:
                q = FakeFP8.quantize(w)
                w.copy_(q.dequantize())  # the reference: a plain bf16 model holding the dequantized values
                quantized[name] = (module, q)
    ref = {n: t.clone() for b in iter_hf_weights(chunks, hf) for n, t in b}
    for module, q in quantized.values():
        module._parameters["weight"] = q  # now the model holds FP8 parameters, as TE does with fp8_params
    got = {n: t for b in iter_hf_weights(chunks, hf) for n, t in b}
    save_megatron_checkpoint(chunks, f"{out_dir}/ckpt", hf, make_vocab_size_divisible_by=128)
    saved = load_file(str(rank_file(f"{out_dir}/ckpt", 0, 0)))
    plain = {f"{name}.weight": q.dequantize() for name, (_, q) in quantized.items()}
    queue.put(dict(
        n_quantized=len(quantized),
        export_equal=sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref),
        export_dtypes={str(t.dtype) for t in got.values()},
        export_plain=all(type(t) is torch.Tensor for t in got.values()),
        ckpt_equal=all(torch.equal(saved[k], v) for k, v in plain.items()),
    ))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_export_and_checkpoint_of_fp8_params_are_plain_bf16(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(port, str(tmp_path), queue))
    proc.start()
    res = queue.get(timeout=240)
    proc.join(timeout=60)
    assert res["n_quantized"] >= 8  # qkv, proj, fc1, fc2 of every layer
    assert res["export_equal"] and res["export_plain"] and res["export_dtypes"] == {"torch.bfloat16"}
    assert res["ckpt_equal"]
