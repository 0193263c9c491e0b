"""The actor at PP=2 with and without virtual pipeline stages (VPP=2), from the same HF weights: log-probs of
variable-length responses, one DAPO update, the weights after it; written to OUT/rank<R>.pt for pytest.

usage: torchrun --nproc_per_node 2 vpp_actor.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

HF = dict(model_type="qwen2", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
          rope_theta=10000.0, tie_word_embeddings=False)


def _samples():
    from dapo_mcore.actor.megatron_actor import TrainSample

    g = torch.Generator().manual_seed(0)
    return [TrainSample(torch.randint(3, 32, (4 + i % 3,), generator=g).tolist(),
                        torch.randint(3, 32, (2 + 3 * i,), generator=g).tolist(),
                        advantage=1.0 if i % 2 else -1.0) for i in range(5)]


def run(hf_dir: Path, vpp: int | None) -> dict:
    from dapo_mcore.actor.megatron_actor import ActorSettings, MegatronActor
    from dapo_mcore.actor.parallel import init_model_parallel
    from dapo_mcore.algo.config import AlgoConfig

    init_model_parallel(1, 2, vpp, seed=1)
    settings = ActorSettings(hf_config=HF, pipeline_parallel=2, virtual_pipeline=vpp, make_vocab_size_divisible_by=16,
                             micro_batch_tokens=24, lr=1e-3, algo=AlgoConfig(), layout="rows")
    actor = MegatronActor(settings)
    actor.load_hf(str(hf_dir))
    samples = _samples()
    out: dict = {"micro_batches": len(actor._my_micro_batches(samples)),
                 "overlap_p2p_comm": actor.tconfig.overlap_p2p_comm}
    out["logp"], _ = actor.compute_logprobs(samples)
    for s, lp in zip(samples, out["logp"], strict=True):
        s.old_logprobs = lp
    out["metrics"] = actor.train_mini_batch(samples, lr=1e-3)
    out["weights"] = c.export(actor)
    return out


def main() -> None:
    import torch.distributed as dist

    from dapo_mcore.actor.parallel import shutdown
    from dapo_mcore.model import cpu_compat

    out_dir = Path(sys.argv[1])
    cpu_compat.apply()
    env = c.start()
    hf_dir = out_dir / "hf"
    if env.rank == 0:
        import transformers

        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(**HF)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir, safe_serialization=True)
    dist.barrier()
    res = {"pp2": run(hf_dir, None), "pp2_vpp2": run(hf_dir, 2)}
    torch.save(res, out_dir / f"rank{env.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
