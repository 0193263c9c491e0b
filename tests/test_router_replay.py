"""Rollout routing replay (R3): the transformers engine records the experts of every token it samples;
with ``algo.router_replay=rollout`` the Megatron actor routes with them.

The case is constructed so that engine and trainer route differently from numerics alone: one model, the same
fp32 weights on both sides, a top-1 Qwen3-MoE whose router rows come in pairs 1e-6 apart. The engine decodes with
a KV cache, the trainer runs the whole sequence at once; their hidden states differ by rounding, which is enough to
flip a near-tie, so some tokens pick the other expert of their pair (measured: 5.6% of token-layer pairs, log-probs
up to 0.25 apart). With replay the trainer uses the engine's experts and takes the gate from its own router on them
(a softmax probability, near-equal on both sides), and its log-probs equal the engine's to fp32 rounding.
The worker runs in its own process (a gloo process group of one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def _worker(out: Path) -> None:
    from conversion.synthetic_moe import build_tiny_moe_model, tiny_moe_config
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor, TrainSample
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env, shutdown
    from dapo_mcore.algo.config import AlgoConfig
    from dapo_mcore.rollout.engines.hf_engine import HFEngine
    from dapo_mcore.rollout.protocol import SamplingParams

    cfg = tiny_moe_config(num_experts_per_tok=1, norm_topk_prob=False)
    model = build_tiny_moe_model(cfg, seed=3, tie_gap=float(os.environ.get("DAPO_R3_GAP", "1e-6")))
    model.save_pretrained(out / "hf")
    engine = HFEngine(model, eos_token_ids=[2])
    prompts = [[1 + (7 * i + j) % 90 for j in range(5 + i % 4)] for i in range(6)]
    groups = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, seed=5))
    init_distributed(read_launch_env(), "gloo")
    init_model_parallel(1, 1, seed=1)
    actor = MegatronActor(ActorSettings(hf_config=json.loads((out / "hf" / "config.json").read_text()),
                                        router_replay=True, make_vocab_size_divisible_by=16, algo=AlgoConfig()))
    actor.load_hf(str(out / "hf"))
    samples = [TrainSample(p, r.token_ids, extra={"routed_experts": r.routed_experts})
               for p, g in zip(prompts, groups, strict=True) for r in g]
    engine_lp = [torch.tensor(r.logprobs) for g in groups for r in g]
    result = {}
    for mode, replay in (("none", False), ("rollout", True)):
        actor.replay.replay = replay
        logps, _ = actor.compute_logprobs(samples)
        diffs = torch.cat([(a - e).abs() for a, e in zip(logps, engine_lp, strict=True)])
        result[mode] = {"max_abs_diff": float(diffs.max()), "tokens_over_1e-4": int((diffs > 1e-4).sum()),
                        "routing_mismatch_frac": actor.routing_mismatch, "tokens": int(diffs.numel())}
    (out / "result.json").write_text(json.dumps(result))
    shutdown()


@pytest.fixture(scope="module")
def replay_result(tmp_path_factory, cli_env) -> dict:
    out = tmp_path_factory.mktemp("r3")
    env = {**cli_env, "DAPO_R3_OUT": str(out)}
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_without_replay_some_tokens_route_differently(replay_result):
    off = replay_result["none"]
    assert off["routing_mismatch_frac"] > 0.005
    assert off["max_abs_diff"] > 1e-3 and off["tokens_over_1e-4"] > 0


def test_with_replay_the_trainer_matches_the_engine_to_fp32(replay_result):
    on = replay_result["rollout"]
    assert on["routing_mismatch_frac"] == 0.0
    assert on["max_abs_diff"] < 1e-5 and on["tokens_over_1e-4"] == 0


if __name__ == "__main__":
    _worker(Path(os.environ["DAPO_R3_OUT"]))


def _records(frac: float, n: int = 6) -> list[dict]:
    return [{"step": s, "train/loss": 0.1, "train/lr": 1e-6, "moe/routing_mismatch_frac": frac,
             "mismatch/logp_abs_diff_mean": 0.02 if frac else 1e-7, "moe/load_max_over_mean": 1.5,
             "moe/aux_loss": 1.1} for s in range(1, n + 1)]


def test_diagnose_names_routing_mismatch_and_report_draws_it(tmp_path):
    from dapo_mcore.telemetry.diagnose import Run, diagnose
    from dapo_mcore.telemetry.report import moe_figure

    found = diagnose(Run(_records(0.05))).findings
    assert [f.rule for f in found if f.rule == "routing-mismatch"] == ["routing-mismatch"]
    assert "algo.router_replay=rollout" in next(f.advice for f in found if f.rule == "routing-mismatch")
    replayed = diagnose(Run(_records(0.0)))
    assert "routing-mismatch" in replayed.ok and not any(f.rule == "routing-mismatch" for f in replayed.findings)
    dense = diagnose(Run([{k: v for k, v in r.items() if not k.startswith("moe/")} for r in _records(0.0)]))
    assert "routing-mismatch" not in dense.skipped  # a dense run is not told an MoE rule was skipped
    assert moe_figure(_records(0.05), tmp_path, 1).name == "moe.png"
    assert moe_figure([{"step": 1, "train/loss": 0.1}], tmp_path, 1) is None


def test_vllm_routed_experts_become_the_engine_neutral_table():
    """vLLM's [tokens, layers, k] numpy array (vLLM 0.32 ``CompletionOutput.routed_experts``) padded with -1 to the
    prompt + response positions; and the LLM kwarg is only set when replay asks for it."""
    import numpy as np

    from dapo_mcore.rollout.correction.routes import routes_from_vllm
    from dapo_mcore.rollout.engines.vllm_engine import VLLMEngineOptions

    table = routes_from_vllm(np.arange(24).reshape(4, 3, 2), 5)
    assert table.shape == (5, 3, 2) and table.dtype == torch.int16
    assert table[:4].flatten().tolist() == list(range(24)) and (table[4] == -1).all()
    assert "enable_return_routed_experts" not in VLLMEngineOptions(model_path="m").llm_kwargs(1)
    assert VLLMEngineOptions(model_path="m", return_routed_experts=True).llm_kwargs(1)["enable_return_routed_experts"]
