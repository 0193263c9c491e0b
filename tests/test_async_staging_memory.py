"""Bounded staleness keeps received versions in the engine ranks' host memory until their batch starts: at most D - 1
per engine rank (D = the engines' lead), each only the rank's vLLM tensor-parallel shard. ``config`` and ``plan``
count what one engine node then holds and refuse a node it does not fit, in one line naming the key."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

ASYNC_32B = "examples/qwen2.5-32b-fp8-async.yaml"
SHAPE = ["model.hf_path=null", "model.preset=qwen2.5-32b"]


def _cfg(*overrides: str):
    from dapo_mcore.config import load_config

    return load_config(ASYNC_32B, [*SHAPE, *overrides])


def test_staged_bytes_are_d_minus_one_shards_per_engine_rank():
    from dapo_mcore.config.rules import staged_host_bytes

    assert staged_host_bytes(10, 2, lead=1, ranks_on_node=8) == 0  # one-step-off stages nothing
    assert staged_host_bytes(10, 2, lead=2, ranks_on_node=8) == 160
    assert staged_host_bytes(10, 2, lead=4, ranks_on_node=8) == 480
    assert staged_host_bytes(12, 2, lead=2, ranks_on_node=8, engine_tp=4) == 48  # 1/4 of the model a rank
    assert staged_host_bytes(10, 2, lead=2, ranks_on_node=1, engine_tp=4) == 6  # 3 of 10 (rounded up) x 2 bytes


def test_config_refuses_a_staleness_whose_staged_versions_a_node_cannot_hold():
    """32B in bf16 is ~61 GiB, an engine's shard at vLLM TP=4 ~15 GiB: K = 4 stages 3 shards per rank, 8 ranks a
    node = ~366 GiB (it was ~1.4 TiB with the whole model staged); at 256 GiB it is refused."""
    from dapo_mcore.config.rules import validate_rollout
    from dapo_mcore.config.tree import ConfigError

    validate_rollout(_cfg("rollout.pipeline.max_staleness=2"))  # 1 staged shard: ~122 GiB a node, fits
    validate_rollout(_cfg("rollout.pipeline.max_staleness=4", "rollout.pipeline.node_host_memory_gib=1024"))
    with pytest.raises(ConfigError) as err:
        validate_rollout(_cfg("rollout.pipeline.max_staleness=4", "rollout.pipeline.node_host_memory_gib=256"))
    text = str(err.value)
    assert "\n" not in text and "rollout.pipeline.max_staleness=4" in text and "node_host_memory_gib=256" in text
    assert "3 received version(s) of 15.3 GiB" in text and "tensor_parallel=4" in text
    assert "8 engine ranks per node: 366 GiB" in text
    # fewer engine ranks on a node share its memory among fewer copies; a wider engine TP stages smaller shards
    validate_rollout(_cfg("rollout.pipeline.max_staleness=4", "rollout.pipeline.node_host_memory_gib=256",
                          "rollout.pipeline.engine_ranks_per_node=4"))
    validate_rollout(_cfg("rollout.pipeline.max_staleness=4", "rollout.pipeline.node_host_memory_gib=256",
                          "rollout.vllm.tensor_parallel=8"))


def test_plan_counts_the_engine_nodes_host_memory_and_refuses_in_one_line(capsys):
    from dapo_mcore.commands.plan import main, plan_input_from_config
    from dapo_mcore.plan.planner import GIB, estimate_host

    args = [ASYNC_32B, *SHAPE, "--nodes", "16", "rollout.pipeline.max_staleness=4"]
    assert main([*args, "--host-memory-gib", "256"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("does not fit: the engine ranks keep 3 received version(s) each")
    assert "366 GiB per engine node > 256 GiB" in out[0] and "rollout.pipeline.max_staleness" in out[0]
    staged = estimate_host(plan_input_from_config(_cfg("rollout.pipeline.max_staleness=2"), 128)).staging_host_bytes
    assert 120 < staged / GIB < 125  # one bf16 32B shard at vLLM TP=4 (15 GiB) on each of the node's 8 engine ranks
    assert estimate_host(plan_input_from_config(_cfg(), 128)).staging_host_bytes == 0  # one-step-off


def test_a_config_the_node_cannot_hold_is_one_line_from_the_cli(capsys):
    from dapo_mcore import cli

    rc = cli.main(["plan", ASYNC_32B, *SHAPE, "--nodes", "16", "rollout.pipeline.max_staleness=4",
                   "rollout.pipeline.node_host_memory_gib=256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "node_host_memory_gib=256" in err[0], err
