"""Adam's state in the canonical checkpoint format, so that it reshards like the weights (elastic resume).

Adam's state is per parameter and elementwise: ``exp_avg`` and ``exp_avg_sq`` have their parameter's shape and
are split across TP ranks exactly like it, and so are the fp32 main parameters of a bf16 model. Each is stored as
its own canonical checkpoint directory (``weights.checkpoint``: same keys, rank files and metadata as ``model/``)
and read back through ``weights.reshard``, which moves elements only: resharded optimizer state is bit-identical
to the saved one. The step count, the same for every parameter, goes to ``optimizer.json``.

    optim/exp_avg/ optim/exp_avg_sq/   Adam's moments (fp32)
    optim/main_params/                 fp32 main parameters (bf16 models only)
    optim/optimizer.json               {"step": n}

Megatron's distributed optimizer keeps its state in flat buffers sharded over DP ranks; it is saved in its own
format (``optim/*_dist.pt``) and resumes at the same layout only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from dapo_mcore.weights import checkpoint as wckpt
from dapo_mcore.weights.live import live_ep_rank, live_layout, live_tensors
from dapo_mcore.weights.safetensors_io import dtype_name

MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN_PARAMS = "main_params"
STEP_FILE = "optimizer.json"


def _inner(optimizer) -> list:
    """The torch optimizers inside Megatron's wrapper(s)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _targets(actor) -> tuple[dict[str, tuple[torch.Tensor, torch.optim.Optimizer]], object, int, int]:
    """Checkpoint key -> (the tensor the optimizer updates for that parameter, its torch optimizer); that tensor
    is the parameter itself, or its fp32 main copy (``param.main_param``) in a bf16 model."""
    layout, tp_rank, pp_rank = live_layout(actor.chunks, actor.s.layer_spec, actor.s.make_vocab_size_divisible_by,
                                           actor.s.vocab_padding)
    owner = {id(p): opt for opt in _inner(actor.optimizer) for g in opt.param_groups for p in g["params"]}
    out = {}
    for key, param in live_tensors(actor.chunks, layout).items():
        main = getattr(param, "main_param", None)
        target = main if main is not None and id(main) in owner else param
        assert id(target) in owner, f"{key} is not updated by the optimizer"
        out[key] = (target, owner[id(target)])
    return out, layout, tp_rank, pp_rank


def _step_of(targets) -> int:
    steps = set()
    for target, opt in targets.values():
        state = opt.state.get(target, {})
        if "step" in state:
            steps.add(int(state["step"]))
    for opt in {id(o): o for _, o in targets.values()}.values():
        steps.update(int(g["step"]) for g in opt.param_groups if "step" in g)
    assert len(steps) <= 1, f"parameters are at different optimizer steps: {sorted(steps)}"
    return steps.pop() if steps else 0


def save_optimizer(actor, directory: Path, *, write: bool, write_meta: bool) -> None:
    """Write this rank's Adam state under `directory` (= ``<checkpoint>/optim``); the directory exists.

    `write`: this rank writes its (tp, pp) files (DP rank 0); `write_meta`: it writes the metadata (global rank 0).
    With expert parallelism each expert-parallel rank holds other experts' moments: the first replica of each
    (expert-data-parallel rank 0) writes its (tp, pp, ep) files instead, as the model's files are written.
    """
    targets, layout, tp_rank, pp_rank = _targets(actor)
    ep_rank = live_ep_rank(layout)
    if ep_rank is not None:
        from megatron.core import parallel_state as ps

        write = ps.get_expert_data_parallel_rank() == 0
    kinds = list(MOMENTS) + ([MAIN_PARAMS] if _has_main_params(actor, targets, layout) else [])
    if write:
        for kind in kinds:
            tensors = {}
            for key, (target, opt) in targets.items():
                if kind == MAIN_PARAMS:
                    value = target
                else:  # before the first step Adam has no state: its moments are zeros
                    value = opt.state.get(target, {}).get(kind, torch.zeros_like(target))
                tensors[key] = value.detach().to("cpu", torch.float32).contiguous()
            path = wckpt.rank_file(directory / kind, tp_rank, pp_rank, ep_rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            wckpt.save_safetensors(tensors, path, {"format": "pt"})
    if write_meta:
        model_meta = wckpt.read_meta(directory.parent / "model")
        meta = wckpt.CheckpointMeta(model_meta.hf_config, model_meta.layout, model_meta.padded_vocab_size,
                                    dtype_name(torch.float32))
        for kind in kinds:
            (directory / kind).mkdir(parents=True, exist_ok=True)
            wckpt.write_meta(directory / kind, meta)
        wckpt.write_bytes(directory / STEP_FILE,
                          (json.dumps({"step": _step_of(targets), "states": kinds}) + "\n").encode())


def has_canonical_state(directory: Path) -> bool:
    return (directory / STEP_FILE).is_file()


def read_optimizer(actor, directory: Path) -> Callable[[], int]:
    """Read and check this rank's Adam state from `directory` (= ``<checkpoint>/optim``), resharded to the live
    layout; returns a function that sets it (and returns the restored step count). Nothing changes before that."""
    from dapo_mcore.weights.live import check_tensors_match
    from dapo_mcore.weights.reshard import read_rank_resharded

    info = json.loads((directory / STEP_FILE).read_text())
    targets, layout, tp_rank, pp_rank = _targets(actor)
    ep_rank = live_ep_rank(layout)
    values = {kind: read_rank_resharded(directory / kind, layout, tp_rank, pp_rank, ep_rank)
              for kind in info["states"]}
    if (MAIN_PARAMS in values) != _has_main_params(actor, targets, layout):
        raise wckpt.CheckpointError(f"{directory}: the optimizer state was saved for another params_dtype "
                                    "(fp32 main parameters present in one and not the other); resume with the "
                                    "model.params_dtype it was saved with, or run.resume_weights_only=true.")
    for kind, state in values.items():
        check_tensors_match({k: tuple(t.shape) for k, t in state.items()},
                            {k: tuple(t.shape) for k, (t, _) in targets.items()},
                            f"optimizer state {kind} in {directory}", "the live model")
    return partial(_apply, targets, values, int(info["step"]))


def _apply(targets, values: dict[str, dict[str, torch.Tensor]], step: int) -> int:
    with torch.no_grad():
        for key, (target, opt) in targets.items():
            state = opt.state[target]
            for kind in MOMENTS:
                state[kind] = values[kind][key].to(target.device, target.dtype).clone()
            if MAIN_PARAMS in values:
                target.copy_(values[MAIN_PARAMS][key])
            if isinstance(opt, torch.optim.Adam):  # torch counts per parameter (AdamW is an Adam)
                on_device = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
                state["step"] = torch.tensor(float(step), dtype=_scalar_dtype(),
                                             device=target.device if on_device else "cpu")
        for opt in {id(o): o for _, o in targets.values()}.values():
            if not isinstance(opt, torch.optim.Adam):  # apex / Transformer Engine FusedAdam count per group
                for group in opt.param_groups:
                    group["step"] = step
    return step


def _has_main_params(actor, targets, layout) -> bool:
    params = live_tensors(actor.chunks, layout)
    return any(target is not params[key] for key, (target, _) in targets.items())


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
