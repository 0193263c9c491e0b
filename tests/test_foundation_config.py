"""Foundation: config validation with fix-it messages, the CLI's user-error path, GPU-only refusals on CPU,
and rank/rendezvous discovery from torchrun and Slurm environments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.actor.parallel import _first_slurm_host, read_launch_env
from dapo_mcore.config import ConfigError, FP8Config, load_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny_cpu.yaml"


def _error(overrides: list[str], world_size: int = 1, path: Path | None = TINY) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides).validate(world_size)
    return str(info.value)


# ------------------------------------------------------------------------------------------ layout and batches
def test_the_tiny_default_is_valid_at_one_and_two_ranks():
    cfg = load_config(TINY, [])
    cfg.validate(1)
    cfg.validate(2)  # DP=2
    load_config(TINY, ["parallel.tensor_parallel=2"]).validate(2)
    load_config(TINY, ["parallel.pipeline_parallel=2"]).validate(2)


def test_tp_not_dividing_heads_names_the_valid_sizes():
    msg = _error(["parallel.tensor_parallel=3"], world_size=3)
    assert "parallel.tensor_parallel=3" in msg and "num_attention_heads=4" in msg
    # Only sizes that divide both the 4 heads and the 2 KV heads are offered.
    assert msg.endswith("both 4 heads and 2 KV heads: 1, 2.")


def test_tp_not_dividing_kv_heads_names_the_valid_sizes():
    # tiny: 4 heads, 2 KV heads. TP=4 divides the heads but not the KV heads.
    msg = _error(["parallel.tensor_parallel=4"], world_size=4)
    assert "num_key_value_heads=2" in msg and msg.endswith(": 1, 2.")


def test_pp_not_dividing_layers_names_the_valid_sizes():
    msg = _error(["parallel.pipeline_parallel=3"], world_size=3)
    assert "pipeline_parallel=3" in msg and "num_hidden_layers=2" in msg and "1, 2" in msg
    msg = _error(["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"], world_size=2)
    assert "virtual_pipeline=2" in msg and "num_hidden_layers=2" in msg


def test_world_size_must_be_a_multiple_of_the_model_parallel_size():
    msg = _error(["parallel.tensor_parallel=2"], world_size=3)
    assert "world size 3" in msg and "multiple of 2" in msg


def test_mini_batch_not_dividing_prompts_per_step():
    msg = _error(["train.prompts_per_step=16", "train.mini_batch_prompts=5"])
    assert "train.mini_batch_prompts=5" in msg and "train.prompts_per_step=16" in msg
    assert "1, 2, 4, 8, 16" in msg


def test_responses_not_dividing_over_data_parallel_ranks():
    # 4 prompts x 8 responses = 32 responses per mini-batch; 3 DP ranks cannot share them.
    msg = _error(["train.mini_batch_prompts=4", "rollout.n=8"], world_size=3)
    assert "32 responses" in msg and "3 data-parallel ranks" in msg and "multiple of 3" in msg
    load_config(TINY, ["train.mini_batch_prompts=4", "rollout.n=8"]).validate(4)  # 32 % 4 == 0


def test_virtual_pipeline_stages_need_pipeline_parallel_responses_per_rank():
    """Megatron's interleaved schedule runs micro-batches in groups of PP: fewer responses per rank than PP could
    never form them (a traceback at the first update before)."""
    from dapo_mcore.config.rules import validate_batches

    vpp = ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"]  # (the rule alone: the tiny base has 2 layers)
    with pytest.raises(ConfigError) as info:  # 2 responses over DP 2
        validate_batches(load_config(TINY, [*vpp, "train.mini_batch_prompts=1", "rollout.n=2"]), world_size=4)
    msg = str(info.value)
    assert "1 responses" in msg and "pipeline_parallel=2" in msg and "at least 4" in msg
    validate_batches(load_config(TINY, [*vpp, "train.mini_batch_prompts=1", "rollout.n=4"]), world_size=4)
    validate_batches(load_config(TINY, ["parallel.pipeline_parallel=2", "train.mini_batch_prompts=1",
                                        "rollout.n=2"]), world_size=4)  # no virtual stages: one micro-batch will do


# ------------------------------------------------------------------------------------------ keys and types
@pytest.mark.parametrize("override, key, suggestion", [
    ("algo.clip_hihg=0.3", "algo.clip_hihg", "clip_high"),
    ("optimm.lr=1e-3", "optimm", "optim"),
    ("train.mini_batch_prompt=4", "train.mini_batch_prompt", "mini_batch_prompts"),
])
def test_unknown_keys_suggest_the_closest_name(override, key, suggestion):
    msg = _error([override])
    assert f"unknown config key {key!r}" in msg and f"Did you mean {suggestion!r}" in msg
    assert "Valid keys here:" in msg


@pytest.mark.parametrize("override, expected", [
    ("train.steps=ten", "train.steps='ten': expected int"),
    ("parallel.sequence_parallel=3", "expected true or false"),
    ("train.prompts_per_step=true", "expected a number, not a boolean"),
    ("rollout.engine=trt", "choose one of 'hf' | 'vllm'"),
    ("optim.betas=0.9", "expected a list"),
    ("model=7", "expected a mapping of ModelConfig fields"),
])
def test_wrong_types_are_refused_with_the_expected_type(override, expected):
    assert expected in _error([override])


def test_numeric_strings_widen_to_float_but_nothing_else_converts(tmp_path):
    cfg = load_config(TINY, ["optim.lr=5e-4"])  # YAML 1.1 reads 5e-4 as a string
    assert cfg.optim.lr == 5e-4 and isinstance(cfg.optim.lr, float)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: '12'\n")
    assert "expected int, got str" in _error([], path=bad)


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model:\n  tiny_base: true\n   parallel: [1, 2\n")
    msg = _error([], path=bad)
    assert "is not valid YAML" in msg and "at line 3, column" in msg and "\n" not in msg, msg
    bad.write_bytes(b"model:\n  tiny_base: \xff\n")
    assert "is not UTF-8 text" in _error([], path=bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    assert "must hold a mapping of sections" in _error([], path=listing)
    msg = _error([], path=tmp_path / "nope.yaml")
    assert "does not exist" in msg and "nope.yaml" in msg
    assert "section.key=value" in _error(["parallel.tensor_parallel"])


def test_missing_model_directory_is_a_config_error(tmp_path):
    msg = _error(["model.tiny_base=false", f"model.hf_path={tmp_path / 'nowhere'}"])
    assert "model.hf_path" in msg and "config.json" in msg


# ------------------------------------------------------------------------------------------ GPU-only features
def test_fp8_on_cpu_is_refused_before_anything_starts():
    from dapo_mcore.model.fp8 import MissingGPUExtra, check_fp8
    from dapo_mcore.run.runtime import check_hardware

    if _has_cuda():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MissingGPUExtra, match="model.fp8.enabled=true .* no CUDA.*layer_spec=local"):
        check_fp8(FP8Config(enabled=True))
    check_fp8(FP8Config(enabled=False))  # off: nothing to check
    cfg = load_config(TINY, ["model.layer_spec=transformer_engine", "model.fp8.enabled=true"])
    cfg.validate(1)  # hardware-independent: a cluster config validates on a laptop ...
    with pytest.raises(MissingGPUExtra, match="no CUDA"):
        check_hardware(cfg)  # ... and is refused where it would run
    # FP8 with the local spec is refused whatever the machine: it has no FP8 kernels.
    assert "needs model.layer_spec=transformer_engine" in _error(["model.fp8.enabled=true"])


def test_transformer_engine_spec_on_cpu_is_refused():
    from dapo_mcore.model.fp8 import MissingGPUExtra
    from dapo_mcore.model.qwen import layer_spec, transformer_config
    from dapo_mcore.run.runtime import check_hardware

    if _has_cuda():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MissingGPUExtra, match="model.layer_spec=transformer_engine needs a CUDA GPU"):
        check_hardware(load_config(TINY, ["model.layer_spec=transformer_engine"]))
    with pytest.raises(MissingGPUExtra, match="transformer_engine layer spec"):
        layer_spec("transformer_engine")
    with pytest.raises(MissingGPUExtra, match="FP8"):
        transformer_config(load_config(TINY, []).model.hf_config(), fp8=FP8Config(enabled=True))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------ the CLI
def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "dapo_mcore.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_cli_help_lists_the_commands():
    out = _cli("--help")
    assert out.returncode == 0, out.stderr
    for command in ("train", "eval", "convert", "plan", "profile", "report", "rollouts", "audit-reward"):
        assert command in out.stdout, command


def test_cli_bad_config_exits_2_with_one_paragraph_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("  tensor_parallel: 1", "  tensor_parallel: 3"))
    run_dir = tmp_path / "run"
    out = _cli("train", str(bad), f"run.dir={run_dir}")
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.strip()
    assert err.startswith("dapo-mcore: configuration error:") and "\n" not in err, err
    assert "parallel.tensor_parallel=3" in err and err.endswith(": 1, 2.")
    assert "Traceback" not in out.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("case", ["unknown_key", "wrong_type", "malformed", "missing", "batches", "fp8", "te"])
def test_cli_main_user_errors(case, tmp_path, capsys):
    """The same path in-process (cli.main), for each kind of user error: exit 2, the key named, nothing written."""
    from dapo_mcore import cli

    if case in ("fp8", "te") and _has_cuda():
        pytest.skip("this machine has CUDA")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TINY.read_text())
    overrides, key = {
        "unknown_key": (["algo.clip_hihg=0.3"], "clip_high"),
        "wrong_type": (["train.steps=ten"], "train.steps"),
        "malformed": ([], "not valid YAML"),
        "missing": ([], "does not exist"),
        "batches": (["train.mini_batch_prompts=5"], "train.mini_batch_prompts=5"),
        "fp8": (["model.layer_spec=transformer_engine", "model.fp8.enabled=true"], "no CUDA"),
        "te": (["model.layer_spec=transformer_engine"], "model.layer_spec=transformer_engine"),
    }[case]
    if case == "malformed":
        cfg.write_text("model: [unclosed\n")
    if case == "missing":
        cfg = tmp_path / "absent.yaml"
    run_dir = tmp_path / "run"
    rc = cli.main(["train", str(cfg), f"run.dir={run_dir}", *overrides])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("dapo-mcore: ") and "\n" not in err and key in err, err
    if case not in ("fp8", "te"):
        assert err.startswith("dapo-mcore: configuration error:"), err
    assert not run_dir.exists()


# ------------------------------------------------------------------------------------------ launch environment
def test_torchrun_environment():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
                           "MASTER_PORT": "29511", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        3, 4, 1, "10.0.0.2", 29511, "torchrun")  # torchrun's variables win over Slurm's


def test_slurm_environment_takes_the_first_node_as_master():
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "node[003-005,007]"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        5, 8, 1, "node003", 29500, "slurm")
    explicit = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[003-005]",
                                "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (explicit.master_addr, explicit.master_port) == ("head", 1234)


@pytest.mark.parametrize("nodelist, first", [
    ("node[003-005,007]", "node003"),
    ("node[007,003-005]", "node007"),
    ("gpu-a[12,15],gpu-b7", "gpu-a12"),
    ("login1,node[1-4]", "login1"),
    ("solo", "solo"),
])
def test_slurm_nodelist_first_host(nodelist, first):
    assert _first_slurm_host(nodelist) == first


def test_single_process_and_broken_environments():
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.source, env.master_addr) == (0, 1, "single", "127.0.0.1")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="outside world size"):
        read_launch_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "x"})
