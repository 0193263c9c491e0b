"""A LoRA run's checkpoint additions: the adapters, their optimizer state, and the identity of the frozen base.

Beside the usual ``model/`` (the frozen base, unchanged since it was loaded) a LoRA checkpoint holds::

  lora/base.json                      the base's identity (where it was loaded from, a hash of its weight files),
                                      the adapter settings, the optimizer step and which states follow
  lora/adapter_config.json            peft's adapter config (HF target names)
  lora/<state>/pp<P>_ep<E>.safetensors  adapter values (``adapter``), Adam's ``exp_avg`` / ``exp_avg_sq`` and the
                                      fp32 ``main_param`` of a bf16 model: each pipeline stage's (and
                                      expert-parallel rank's) layers, by peft name, whole along TP

Everything is in the layout-independent peft form (``weights.lora``), so a LoRA run resumes at any TP/PP/DP layout;
Adam's states are elementwise and split exactly like their parameters, so they go through the same transforms
(the shared A of a fused layer is saved under each of its projections' names and read back from the first).
A resume whose base differs from the checkpoint's (another path, or other bytes at the path) is refused in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.weights import checkpoint as wckpt
from dapo_mcore.weights.checkpoint import CheckpointError
from dapo_mcore.weights.checksums import DEFAULT_HASH, HASHES, new_hasher
from dapo_mcore.weights.lora import gather_adapters, load_adapters

log = logging.getLogger(__name__)

LORA_DIR = "lora"
BASE_FILE = "base.json"
ADAPTER = "adapter"
MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN_PARAM = "main_param"


def base_identity(source: str | Path | None, algo: str = DEFAULT_HASH) -> dict[str, Any]:
    """Where the base was loaded from and an `algo` hash over its weight files' digests (names, sizes, `algo`
    digests): the same bytes give the same identity wherever they are; None-path bases (random weights) have no
    digest. Earlier versions wrote the CRC-32 form (``algo="crc32"``, no "hash" key), which this reproduces."""
    if source is None:
        return {"path": None, "digest": None}
    root = Path(source)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".distcp", ".pt")
                   and "optim" not in p.relative_to(root).parts)
    hasher = new_hasher(algo)
    for f in files:
        d = wckpt.file_digest(f, algo)
        hasher.update(f"{f.relative_to(root).as_posix()}:{d['size']}:{d[algo]}\n".encode())
    return {"path": str(root.resolve()), "digest": hasher.hexdigest(), "files": len(files), "hash": algo}


def _shared_identity(actor, algo: str = DEFAULT_HASH) -> dict[str, Any]:
    """The actor's base identity by `algo`, computed once by global rank 0 and known on every rank (a collective)."""
    if getattr(actor, "_base_identity", None) is None:
        actor._base_identity = {}
    if algo not in actor._base_identity:
        box = [base_identity(actor.base_source, algo) if _rank() == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        actor._base_identity[algo] = box[0]
    return actor._base_identity[algo]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _inner(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _optim_target(actor):
    """param -> (the tensor Adam updates for it: its fp32 main copy in a bf16 model, else itself; its optimizer)."""
    owner = {id(p): opt for opt in _inner(actor.optimizer) for g in opt.param_groups for p in g["params"]}

    def target(param):
        main = getattr(param, "main_param", None)
        t = main if main is not None and id(main) in owner else param
        return t, owner[id(t)]
    return target


def _states(actor) -> list[str]:
    target = _optim_target(actor)
    from dapo_mcore.model.lora.attach import adapted_layers

    layers = adapted_layers(actor.chunks)
    bf16 = bool(layers) and target(layers[0].adapter.a)[0] is not layers[0].adapter.a
    return [ADAPTER, *MOMENTS] + ([MAIN_PARAM] if bf16 else [])


def _getter(actor, state: str):
    target = _optim_target(actor)
    if state == ADAPTER:
        return None
    if state == MAIN_PARAM:
        return lambda p: target(p)[0]

    def moment(p):
        t, opt = target(p)
        return opt.state.get(t, {}).get(state, torch.zeros_like(t))  # before the first step: zeros
    return moment


def _writer() -> bool:
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() != 0:
        return False
    if ps.get_expert_model_parallel_world_size() > 1:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0


def _file_name() -> str:
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_rank() if ps.get_expert_model_parallel_world_size() > 1 else 0
    return f"pp{ps.get_pipeline_model_parallel_rank():03d}_ep{ep:03d}.safetensors"


def save_lora(actor, partial: Path, step_of_optimizer: int) -> None:
    """Collective: write the adapters, their optimizer states and the base identity under ``partial/lora``."""
    from dapo_mcore.weights.lora import adapter_config

    root = partial / LORA_DIR
    identity = _shared_identity(actor)
    states = _states(actor)
    for state in states:
        tensors = gather_adapters(actor.chunks, actor.s.hf_config, actor.s.layer_spec, get=_getter(actor, state))
        if _writer():
            (root / state).mkdir(parents=True, exist_ok=True)
            wckpt.save_safetensors({k: v.contiguous() for k, v in tensors.items()}, root / state / _file_name(),
                                   {"format": "pt"})
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        lora = actor.lora
        body = {"base": identity, "rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                "target_modules": list(lora.target_modules), "step": step_of_optimizer, "states": states,
                "hf_config": actor.s.hf_config}
        (root / BASE_FILE).write_text(json.dumps(body, indent=1) + "\n")
        (root / "adapter_config.json").write_text(json.dumps(adapter_config(lora, identity["path"],
                                                                            actor.s.hf_config), indent=1) + "\n")


def read_lora_meta(ckpt: Path) -> dict[str, Any] | None:
    path = Path(ckpt) / LORA_DIR / BASE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def check_lora(ckpt: Path, actor) -> dict[str, Any]:
    """Refuse (one line) a checkpoint that is not this LoRA run's: no adapters, other adapter settings, another base."""
    meta = read_lora_meta(ckpt)
    lora = actor.lora
    if meta is None:
        raise CheckpointError(f"checkpoint {ckpt} holds no LoRA adapters (a full fine-tuning run's) but "
                              f"model.lora.rank={lora.rank}; resume it with model.lora.rank=0, or start a new run.")
    saved = (meta["rank"], sorted(meta["target_modules"]))
    if saved != (lora.rank, sorted(lora.target_modules)):
        raise CheckpointError(f"checkpoint {ckpt} holds adapters of rank {meta['rank']} on {meta['target_modules']}, "
                              f"not model.lora.rank={lora.rank} on {list(lora.target_modules)}; resume with its "
                              "settings, or start a new run.")
    theirs = meta["base"]
    algo = theirs.get("hash", "crc32")  # base.json of earlier versions holds a CRC-32 identity and no "hash"
    if algo not in HASHES:
        raise CheckpointError(f"{ckpt / LORA_DIR / BASE_FILE} names an unknown hash {algo!r} (one of "
                              f"{', '.join(HASHES)} expected): the file is damaged; resume from another checkpoint.")
    mine = _shared_identity(actor, algo)
    if (mine["path"], mine["digest"]) != (theirs["path"], theirs["digest"]):
        raise CheckpointError(f"checkpoint {ckpt} trained adapters on the base {theirs['path']} (weights {algo} "
                              f"{theirs['digest']}), but this run loaded {mine['path']} ({algo} {mine['digest']}); "
                              "point model.hf_path / model.mcore_path at the base it was trained on, or start a new run.")
    return meta


def _read_state(root: Path, state: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted((root / state).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_lora(ckpt: Path, actor, *, weights_only: bool) -> int:
    """Set the adapters (and, unless ``weights_only``, their optimizer state) from a checkpoint of any layout;
    returns the optimizer step. Every state is read and checked before any is set."""
    meta = check_lora(ckpt, actor)
    root = Path(ckpt) / LORA_DIR
    states = [ADAPTER] if weights_only else _states(actor)
    if not weights_only and set(states) != set(meta["states"]):
        raise CheckpointError(f"checkpoint {ckpt}: its adapters' optimizer states {meta['states']} do not fit this "
                              f"run's {states} (another model.params_dtype); resume with the dtype it was saved with, "
                              "or set run.resume_weights_only=true.")
    values = {state: _read_state(root, state) for state in states}
    target = _optim_target(actor)
    hf, spec = actor.s.hf_config, actor.s.layer_spec
    load_adapters(actor.chunks, hf, values[ADAPTER], spec, put=lambda p, v: None)  # a dry run: every check first
    for state in states:
        if state == ADAPTER:
            load_adapters(actor.chunks, hf, values[state], spec)
        elif state == MAIN_PARAM:
            load_adapters(actor.chunks, hf, values[state], spec, put=lambda p, v: target(p)[0].copy_(v))
        else:
            def put(p, v, state=state):
                t, opt = target(p)
                opt.state[t][state] = v.to(t.device, t.dtype).clone()
            load_adapters(actor.chunks, hf, values[state], spec, put=put)
    if weights_only:
        actor.refresh_main_params()
        return 0
    step = int(meta["step"])
    for p in (q for layer in _layers(actor) for q in (layer.adapter.a, layer.adapter.b)):
        t, opt = target(p)
        if isinstance(opt, torch.optim.Adam):  # torch counts per parameter (as actor.optim_state restores it)
            on_device = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
            opt.state[t]["step"] = torch.tensor(float(step), dtype=torch.float32,
                                                device=t.device if on_device else "cpu")
    for opt in _inner(actor.optimizer):
        if not isinstance(opt, torch.optim.Adam):
            for group in opt.param_groups:
                group["step"] = step
    if MAIN_PARAM not in states:
        actor.refresh_main_params()
    return step


def _layers(actor):
    from dapo_mcore.model.lora.attach import adapted_layers

    return adapted_layers(actor.chunks)


def optimizer_step(actor) -> int:
    """Adam's step count of the adapters (0 before the first update)."""
    target = _optim_target(actor)
    for layer in _layers(actor):
        t, opt = target(layer.adapter.a)
        if "step" in opt.state.get(t, {}):
            return int(opt.state[t]["step"])
        for group in opt.param_groups:
            if "step" in group:
                return int(group["step"])
    return 0
