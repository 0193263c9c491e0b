"""Run NVIDIA Megatron-Bridge's own checkpoint conversion on a CPU, with gloo, without touching its installed files.

Megatron-Bridge (AutoBridge) is what cluster users of Megatron normally use to move checkpoints between Hugging Face
and Megatron; the project's Bridge tests call it through this script, in its own virtualenv (.venv-bridge, see
.ci/tiers/50-bridge.sh). Bridge 0.6.2 with megatron-core 0.19.2 assumes Python
3.12, Transformer Engine and CUDA; `apply_cpu_workarounds()` makes it run here, at import time of this script only:

- `typing.override` (Python >= 3.12) is imported by megatron-core 0.19.2's `megatron/training/models/{gpt,hybrid}.py`:
  it gets `typing_extensions.override`, which is the same decorator.
- `megatron/bridge/peft/lora_layers.py` imports Transformer Engine unguarded (reached from `import megatron.bridge`).
  That one module, and only it, is imported against a stand-in `transformer_engine.pytorch` whose every class raises
  when used; the stand-in is removed from `sys.modules` right after, so every guarded `import transformer_engine`
  elsewhere still finds no Transformer Engine, and a check fails loudly if the stand-in leaked into another module.
- `torch.cuda.set_device` / `synchronize` are no-ops, `current_device()` is the CPU device and `get_rng_state()` the
  CPU generator's state: Bridge's provider calls set_device before it would start NCCL (we start gloo first), saving
  calls get_rng_state even with save_rng=False, megatron-core's writer synchronizes and puts its failure flag on
  `current_device()`, and Bridge's TP broadcast of replicated weights moves them to `current_device()`.
- Bridge's GPT provider defaults to Transformer Engine's layer spec. While a model is built, a provider whose layer
  spec is that default gets megatron-core's local spec instead (same parameters; its sharded state dict uses TE's key
  names); the provider's field is put back afterwards, so the run_config.yaml Bridge writes names the default spec, as
  on a GPU cluster.

    python tests/bridge/bridge_cpu.py versions
    torchrun --nproc-per-node N tests/bridge/bridge_cpu.py import --hf HF_DIR --out SAVE_DIR --tp N [--dtype bf16]
    python tests/bridge/bridge_cpu.py export --mcore SAVE_DIR --out HF_OUT [--hf HF_DIR]
    python tests/bridge/bridge_cpu.py resolve --mcore SAVE_DIR

`import` is `AutoBridge.import_ckpt` (with the provider's tensor_model_parallel_size set to N); `export` is
`AutoBridge.export_ckpt` (one process: Bridge gathers TP shards itself), its bridge `AutoBridge.from_hf_pretrained` of
--hf or, without it, of the HF directory Bridge recorded in the checkpoint (run_config.yaml model.hf_model_id).
`resolve` is the first half of Bridge's training-side load (a fine-tune from checkpoint.pretrained_checkpoint):
which iteration it picks (latest_train_state.pt, else the tracker, whose "0" it rejects) and the (TP, PP) it reads. Each prints one line `bridge_cpu: megatron-bridge X megatron-core Y torch Z transformers W`.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import torch

_STUB_NAMES = ("transformer_engine", "transformer_engine.pytorch")
_UNGUARDED_TE_IMPORTER = "megatron.bridge.peft.lora_layers"
# What lora_layers imports from Bridge itself.
_UNGUARDED_TE_IMPORTS = ("megatron.bridge.peft.utils", "megatron.bridge.peft.adapter_wrapper",
                         "megatron.bridge.peft.lora_merge")


class _AbsentMeta(type):
    """Any attribute of the stand-in is the stand-in itself; calling it says Transformer Engine is not here."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args, **kwargs):
        raise RuntimeError("Transformer Engine is not installed (bridge_cpu.py stands in for its import only)")


class _Absent(metaclass=_AbsentMeta):
    pass


def _stub_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__getattr__ = lambda attr: _Absent  # type: ignore[attr-defined]
    mod.__path__ = []  # a package, so that `import transformer_engine.pytorch` resolves
    return mod


def _patch_typing_override() -> None:
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _import_lora_layers_with_te_stub() -> None:
    """Import megatron.bridge.peft.lora_layers (and only it) against a Transformer Engine stand-in."""
    import importlib

    # lora_layers' one megatron-core import, loaded first without the stand-in (its own guards must see the truth).
    importlib.import_module("megatron.core.transformer.moe.moe_utils")
    assert not any(n in sys.modules for n in _STUB_NAMES), "a real Transformer Engine is imported; no stand-in needed"
    # Empty shells for the parent packages, so that their __init__ (which imports all of Bridge) does not run inside
    # the window; the real packages replace them right after.
    site = Path(importlib.util.find_spec("megatron.bridge").origin).parent
    shells = {"megatron.bridge": site, "megatron.bridge.peft": site / "peft", "megatron.bridge.utils": site / "utils"}
    for name, path in shells.items():
        shell = types.ModuleType(name)
        shell.__path__ = [str(path)]
        sys.modules[name] = shell
    stubs = {name: _stub_module(name) for name in _STUB_NAMES}
    stubs["transformer_engine"].pytorch = stubs["transformer_engine.pytorch"]
    try:
        # lora_layers' own Bridge imports, first without the stand-in (peft/utils.py probes Transformer Engine too).
        for name in _UNGUARDED_TE_IMPORTS:
            importlib.import_module(name)
        before = set(sys.modules)
        sys.modules.update(stubs)
        importlib.import_module(_UNGUARDED_TE_IMPORTER)
        window = set(sys.modules) - before - set(_STUB_NAMES)
    finally:
        for name in (*_STUB_NAMES, *shells):
            sys.modules.pop(name, None)
        if getattr(sys.modules["megatron"], "bridge", None) is shells["megatron.bridge"]:
            del sys.modules["megatron"].bridge
    if window != {_UNGUARDED_TE_IMPORTER}:
        raise RuntimeError(f"more than {_UNGUARDED_TE_IMPORTER} was imported against the Transformer Engine stand-in: "
                           f"{sorted(window)}; import those first, without it")
    # lora_layers and its imports stay imported (their parents' __init__ finds them in sys.modules); the real parent
    # packages are imported now.
    import megatron.bridge  # noqa: F401


def _patch_cuda_for_cpu() -> None:
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()


def _use_local_spec_while_building() -> None:
    from megatron.bridge.models import gpt_provider

    provide = gpt_provider.GPTModelProvider.provide

    def provide_on_cpu(self, *args, **kwargs):
        if self.transformer_layer_spec is not gpt_provider.default_layer_spec:
            return provide(self, *args, **kwargs)
        self.transformer_layer_spec = gpt_provider.local_layer_spec
        try:
            return provide(self, *args, **kwargs)
        finally:
            self.transformer_layer_spec = gpt_provider.default_layer_spec

    gpt_provider.GPTModelProvider.provide = provide_on_cpu


def apply_cpu_workarounds() -> None:
    """Everything Bridge needs to run on this CPU (see the module docstring); idempotent."""
    if getattr(apply_cpu_workarounds, "done", False):
        return
    _patch_typing_override()
    _patch_cuda_for_cpu()
    _import_lora_layers_with_te_stub()
    _use_local_spec_while_building()
    apply_cpu_workarounds.done = True


def versions() -> str:
    from importlib.metadata import version

    return (f"bridge_cpu: megatron-bridge {version('megatron-bridge')} megatron-core {version('megatron-core')} "
            f"torch {torch.__version__} transformers {version('transformers')}")


def _start_gloo() -> None:
    """Start the default group with gloo (torchrun's env, or a one-process world) before Bridge would start NCCL."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.distributed.init_process_group("gloo")


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def import_ckpt(hf_dir: str, out: str, tp: int, dtype: str | None) -> None:
    """AutoBridge.import_ckpt(hf_dir, out) at tensor parallel `tp` (the world size must be tp)."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion import auto_bridge

    _start_gloo()
    world = torch.distributed.get_world_size()
    if world != tp:
        raise SystemExit(f"bridge_cpu import: --tp {tp} needs {tp} processes; run it under "
                         f"`torchrun --nproc-per-node {tp}` (got {world})")
    # import_ckpt builds its provider inside; it takes the parallel sizes from the provider, so set them there.
    to_provider = auto_bridge.AutoBridge.to_megatron_provider

    def to_provider_at_tp(self, *args, **kwargs):
        provider = to_provider(self, *args, **kwargs)
        provider.tensor_model_parallel_size = tp
        provider.pipeline_model_parallel_size = 1
        return provider

    auto_bridge.AutoBridge.to_megatron_provider = to_provider_at_tp
    kwargs = {"torch_dtype": _DTYPES[dtype]} if dtype else {}
    AutoBridge.import_ckpt(hf_dir, out, **kwargs)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def export_ckpt(mcore: str, out: str, hf_dir: str | None) -> None:
    """AutoBridge.export_ckpt(mcore, out), the bridge from the HF model directory (default: the one Bridge recorded
    in the checkpoint's run_config.yaml, model.hf_model_id)."""
    from megatron.bridge import AutoBridge

    if hf_dir is None:
        hf_dir = AutoBridge.get_hf_model_id_from_checkpoint(mcore)
        if hf_dir is None or not Path(hf_dir).is_dir():
            raise SystemExit(f"bridge_cpu export: {mcore} names no HF model directory that exists here "
                             f"(run_config.yaml model.hf_model_id: {hf_dir!r}); pass --hf HF_DIR")
    AutoBridge.from_hf_pretrained(hf_dir).export_ckpt(mcore, out, show_progress=False)


def resolve(mcore: str) -> dict:
    """What Bridge's training-side loader (checkpoint.pretrained_checkpoint / checkpoint.load = mcore) resolves before
    it loads any tensor: whether it sees a checkpoint, which iteration directory, and the (TP, PP) it compares with the
    run's (read from run_config.yaml's model section, a KeyError when absent)."""
    from megatron.bridge.training.checkpointing import _resolve_checkpoint_iteration, read_run_config
    from megatron.bridge.training.utils.checkpoint_utils import (
        checkpoint_exists,
        get_checkpoint_name,
        get_checkpoint_run_config_filename,
    )

    exists = checkpoint_exists(mcore)
    iteration, release = _resolve_checkpoint_iteration(mcore, None)
    name = get_checkpoint_name(mcore, iteration, release)
    model = read_run_config(get_checkpoint_run_config_filename(name))["model"]
    return {"exists": exists, "iteration": iteration, "release": release, "dir": Path(name).name,
            "tp_pp": [model["tensor_model_parallel_size"], model["pipeline_model_parallel_size"]]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("versions")
    imp = sub.add_parser("import", help="AutoBridge.import_ckpt, under torchrun with --tp processes")
    imp.add_argument("--hf", required=True)
    imp.add_argument("--out", required=True)
    imp.add_argument("--tp", type=int, default=1)
    imp.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="torch_dtype for from_hf_pretrained")
    exp = sub.add_parser("export", help="AutoBridge.export_ckpt, one process")
    exp.add_argument("--mcore", required=True)
    exp.add_argument("--out", required=True)
    exp.add_argument("--hf", default=None)
    res = sub.add_parser("resolve", help="what Bridge's training-side loader resolves in a save dir (one json line)")
    res.add_argument("--mcore", required=True)
    args = parser.parse_args(argv)

    apply_cpu_workarounds()
    if int(os.environ.get("RANK", "0")) == 0:
        print(versions(), flush=True)
    if args.cmd == "import":
        import_ckpt(args.hf, args.out, args.tp, args.dtype)
    elif args.cmd == "export":
        export_ckpt(args.mcore, args.out, args.hf)
    elif args.cmd == "resolve":
        import json

        print("bridge_cpu resolve: " + json.dumps(resolve(args.mcore)), flush=True)


if __name__ == "__main__":
    main()
