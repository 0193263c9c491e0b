"""GPU-only checks of engine-side paths (``pytest -m gpu``; the prepared GPU check's ``pytest`` section runs them):

- the async version receiver on a GPU: its receives run on the engine's device and a side stream of their own, so the
  loop's decode steps (kernels on the default stream, a host sync per step as a sampler's) keep going while a version
  is being received; the same receive run on the default stream (what the receiver did before) is measured beside it;
- an MoE vLLM engine: the kernel backend it chose keeps the checkpoint's expert layout, and one expert's fused
  ``w13`` after a weight sync holds exactly the synced ``[gate; up]`` rows. Needs vLLM (absent from the prepared
  check's image: skipped there, with the reason);
- the async engine's host staging of its shard from CUDA receive buffers (``rollout.pipeline.host_shard``): the
  staged version loads as the whole one.

Nothing here has run on a GPU yet. Skipped without CUDA (streams and vLLM's CUDA kernels have no CPU stand-in).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _decode_steps_during(receive_on_side_stream: bool, seconds: float = 1.0) -> tuple[int, int]:
    """Decode steps (4096^2 matmul + host sync) the main thread completes while a receiver thread copies 1 GiB
    chunks device -> host for ``seconds``; and the copies it made."""
    from dapo_mcore.rollout.pipeline.async_channels import VersionReceiver

    class Stop(Exception):
        pass

    device = torch.cuda.current_device()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    blob = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    window: dict[str, float] = {}
    copies = [0]

    def receive():
        if "end" in window:
            raise Stop
        window["start"] = time.monotonic()
        while time.monotonic() - window["start"] < seconds:
            blob.cpu()  # a staged bucket's copy to the host, on whatever stream is current in this thread
            copies[0] += 1
        window["end"] = time.monotonic()
        return {"version": 0}, [], seconds

    if receive_on_side_stream:
        rx = VersionReceiver(receive, 1, Stop, device=device)
    else:  # the receiver before: a plain thread on the default stream
        rx = VersionReceiver(receive, 1, Stop, device=None)
    steps: list[float] = []
    while "end" not in window:
        (a @ a).sum().item()  # one decode step: kernels, then the sampled token read back
        steps.append(time.monotonic())
    rx.take()
    return sum(window["start"] <= t <= window["end"] for t in steps), copies[0]


def test_the_receiver_leaves_the_default_stream_to_the_engine():
    side, side_copies = _decode_steps_during(True)
    default, default_copies = _decode_steps_during(False)
    print(json.dumps({"receiver_overlap": {"decode_steps_side_stream": side, "decode_steps_default_stream": default,
                                           "copies_side": side_copies, "copies_default": default_copies}}))
    assert side > 0 and side_copies > 0
    assert side >= default  # the side stream never makes the engine's steps slower than the default stream did


def test_moe_vllm_engine_backend_and_one_expert_after_a_sync(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed here (the prepared check carries no vLLM)")
    from conversion.synthetic_moe import save_tiny_moe_model, tiny_moe_config
    from dapo_mcore.rollout.engines.vllm_engine import VLLMEngine, VLLMEngineOptions
    from dapo_mcore.rollout.engines.vllm_moe import chosen_moe_backends
    from dapo_mcore.rollout.engines.weight_sync import hf_param_shapes

    hf = tiny_moe_config(head_dim=32, num_attention_heads=2, num_key_value_heads=1, hidden_size=64,
                         moe_intermediate_size=64)
    save_tiny_moe_model(tmp_path / "m", **{k: v for k, v in hf.items() if k != "model_type"})
    engine = VLLMEngine(VLLMEngineOptions(model_path=str(tmp_path / "m"), dtype="bfloat16", enforce_eager=True,
                                          gpu_memory_utilization=0.3, load_format="dummy"), hf, world_size=1)
    model = engine.backend._model
    chosen = set(chosen_moe_backends(model).values())
    print(json.dumps({"moe_backend": sorted(chosen)}))
    assert chosen <= {"TRITON", "BATCHED_TRITON"}  # the build refuses anything else; this records what it took
    g = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf_param_shapes(hf).items()}
    engine.update_weights([list(weights.items())])
    layer, expert, inter = 1, 2, hf["moe_intermediate_size"]
    w13 = dict(model.named_parameters())[f"model.layers.{layer}.mlp.experts.w13_weight"][expert].float().cpu()
    gate = weights[f"model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight"].float()
    up = weights[f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"].float()
    assert torch.equal(w13[:inter], gate) and torch.equal(w13[inter:], up)
    engine.close()


def test_a_staged_shard_of_cuda_buffers_loads_as_the_whole_version():
    """The async engine's host staging from a CUDA receive buffer (``rollout.pipeline.host_shard``): the recorder
    wraps CUDA tensors, ``stage`` copies each read slice off the device into host memory of its own, and the expanded
    version loads the same weights into CUDA parameters as the whole one (a column- and a row-parallel loader at
    rank 1 of 2, a norm whole)."""
    from dapo_mcore.rollout.pipeline.host_shard import ReadRecorder, expand, stage, staged_bytes

    def load(buckets):
        out = {}
        for bucket in buckets:
            for name, w in bucket:
                if name == "col":
                    out[name] = w.narrow(0, 32, 32).to("cuda", copy=True)
                elif name == "row":
                    out[name] = w.narrow(1, 16, 16).to("cuda", copy=True)
                else:
                    out[name] = torch.empty(w.shape, dtype=w.dtype, device="cuda")
                    out[name].copy_(w)
        return out

    def version(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [[(n, torch.randn(s, generator=g, device="cuda").bfloat16()) for n, s in
                 (("col", (64, 32)), ("row", (32, 32)), ("norm", (32,)))]]

    recorder = ReadRecorder()
    load(recorder.wrap(version(0)))
    staged = [stage(bucket, recorder.regions()) for bucket in version(1)]
    assert all(s.part.device.type == "cpu" for s in staged[0])
    assert staged_bytes(staged) == (2 * (32 * 32 + 32 * 16 + 32), 2 * (64 * 32 + 32 * 32 + 32))
    got, want = load(expand(b) for b in staged), load(version(1))
    for name, t in want.items():
        assert torch.equal(got[name], t), name
