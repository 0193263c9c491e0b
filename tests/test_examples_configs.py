"""The production example configs: they load, carry the paper's recipe, and validate at their sbatch's world size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapo_mcore.config import ConfigError, load_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# example config -> (model preset standing in for model.hf_path, the sbatch script that launches it)
EXAMPLES = {
    "qwen2.5-32b-fp8.yaml": ("qwen2.5-32b", "dapo_qwen2.5_32b_fp8.sbatch"),
    "qwen2.5-7b.yaml": ("qwen2.5-7b", "dapo_qwen2.5_7b.sbatch"),
    "qwen2.5-32b-fp8-async.yaml": ("qwen2.5-32b", "dapo_qwen2.5_32b_fp8_async.sbatch"),
    "qwen3-32b-fp8.yaml": ("qwen3-32b", "dapo_qwen3_32b_fp8.sbatch"),
    "qwen3-30b-a3b.yaml": ("qwen3-30b-a3b", "dapo_qwen3_30b_a3b.sbatch"),
}


def sbatch_world_size(script: str) -> tuple[int, str]:
    """(nodes x tasks per node, the default CONFIG) of a GPU sbatch script."""
    text = (ROOT / "slurm" / script).read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", text, re.M).group(1))
    config = re.search(r"config=\$\{CONFIG:-([^}]+)\}", text).group(1)
    return nodes * per_node, config


def cpu_checkable(name: str, tmp_path: Path, *extra: str):
    """The example with a preset for the absent checkpoint and stand-in dataset files (validate() wants them)."""
    for f in ("train.parquet", "eval.parquet"):
        (tmp_path / f).touch()
    preset, _ = EXAMPLES[name]
    return load_config(ROOT / "examples" / name, ["model.hf_path=null", f"model.preset={preset}",
                                                  f"data.train={tmp_path / 'train.parquet'}",
                                                  f"data.eval={tmp_path / 'eval.parquet'}", *extra])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_loads_as_written(name):
    cfg = load_config(ROOT / "examples" / name)
    assert cfg.model.hf_path.startswith("/models/") and cfg.model.preset is None
    assert cfg.rollout.engine == "vllm" and cfg.parallel.backend == "nccl"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_validates_at_its_sbatch_world_size(name, tmp_path):
    world, config = sbatch_world_size(EXAMPLES[name][1])
    assert config == f"examples/{name}", "the sbatch script launches this config by default"
    cpu_checkable(name, tmp_path).validate(world)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_paper_hyperparameters(name):
    c = load_config(ROOT / "examples" / name)
    assert (c.train.prompts_per_step, c.rollout.n, c.train.mini_batch_prompts, c.train.epochs) == (512, 16, 32, 1)
    assert (c.optim.lr, c.optim.betas, c.optim.weight_decay, c.optim.grad_clip) == (1e-6, (0.9, 0.999), 0.1, 1.0)
    assert c.optim.warmup_steps == 20
    assert (c.algo.clip_low, c.algo.clip_high, c.algo.loss_agg) == (0.2, 0.28, "token-mean")
    assert (c.algo.kl_coef, c.algo.entropy_coef) == (0.0, 0.0)
    assert (c.algo.overlong_shaping, c.algo.overlong_max_len, c.algo.overlong_cache_len) == (True, 20480, 4096)
    assert c.rollout.max_new_tokens == 20480 and (c.rollout.temperature, c.rollout.top_p) == (1.0, 1.0)
    assert (c.algo.dynamic_sampling, c.rollout.gen_batch_prompts, c.algo.max_gen_batches) == (True, 1536, 10)
    assert (c.data.max_prompt_len, c.data.truncation) == (2048, "left")
    assert (c.eval.k, c.eval.temperature, c.eval.top_p) == (32, 1.0, 0.7)
    assert c.reward.name == "math_dapo"


def test_32b_layout_is_the_fp8_recipe():
    c = load_config(ROOT / "examples" / "qwen2.5-32b-fp8.yaml")
    assert (c.model.layer_spec, c.model.params_dtype, c.model.recompute) == ("transformer_engine", "bfloat16", "selective")
    assert c.model.fp8.enabled and not c.model.fp8.fp8_params
    p = c.parallel
    assert (p.tensor_parallel, p.pipeline_parallel, p.sequence_parallel, p.distributed_optimizer) == (8, 2, True, True)
    assert (c.rollout.vllm.tensor_parallel, c.rollout.vllm.gpu_memory_utilization) == (4, 0.5)
    assert c.train.micro_batch_tokens == c.data.max_prompt_len + c.rollout.max_new_tokens


def test_32b_layout_refuses_a_world_it_cannot_split(tmp_path):
    cfg = cpu_checkable("qwen2.5-32b-fp8.yaml", tmp_path)
    with pytest.raises(ConfigError, match="multiple of 16"):
        cfg.validate(120)
    # 128 GPUs at TP=8 PP=2 is DP=8; a mini-batch of 32 x 16 = 512 responses does not split over DP=24.
    with pytest.raises(ConfigError, match="data-parallel ranks cannot share"):
        cpu_checkable("qwen2.5-32b-fp8.yaml", tmp_path).validate(16 * 24)


@pytest.mark.parametrize("name", ["qwen2.5-32b-fp8.yaml", "qwen3-32b-fp8.yaml"])
def test_dense_32b_recipes_ship_partial_completion_one_key_from_the_paper_loop(name, tmp_path):
    # The schedule the chain study kept within the paper loop's seed spread and the step model ranks fastest at
    # these shapes (docs/rollout.md, "Which schedule the recipes ship").
    shipped = cpu_checkable(name, tmp_path)
    s = shipped.rollout.schedule
    assert (s.preset, s.streaming, s.partial, s.order) == ("partial_completion", True, True, "completion")
    assert (shipped.rollout.pipeline.mode, shipped.algo.tis_cap) == ("sync", 2.0)  # partial rollouts need the cap
    paper = cpu_checkable(name, tmp_path, "rollout.schedule.preset=paper")
    paper.validate(sbatch_world_size(EXAMPLES[name][1])[0])
    p = paper.rollout.schedule
    assert not p.enabled and not p.partial and p.order == "prompt"


@pytest.mark.parametrize("name", ["qwen2.5-32b-fp8-async.yaml", "qwen3-30b-a3b.yaml"])
def test_async_and_moe_recipes_keep_batch_and_filter(name):
    # No async schedule beyond one-step-off batch and filter stayed within the seed spread; the step model cannot rank
    # the MoE recipe (docs/rollout.md, "Which schedule the recipes ship").
    s = load_config(ROOT / "examples" / name).rollout.schedule
    assert not s.enabled and not s.partial and s.preset is None
