"""Megatron-Core distributed checkpoints as Megatron-LM and Megatron-Bridge lay them out, on any megatron-core.

Where a checkpoint is (`find`): a save dir with Megatron-LM's tracker (``latest_checkpointed_iteration.txt``:
``release`` or an iteration), a save dir with ``iter_NNNNNNN/`` dirs and no tracker (Megatron-Bridge's export picks
the newest the same way), one ``iter_*``/``release`` dir, or a bare ``dist_checkpointing.save`` dir. A
Megatron-Bridge checkpoint carries ``run_config.yaml`` in its iteration dir; `hf_config_from_run_config` turns its
``model:`` section (the model provider's fields) into the Hugging Face config this project builds models from.

What each megatron-core version can read (`load`): megatron-core 0.17 and newer keep the common (non-tensor)
state inside the ``.distcp`` files, where 0.16 and older wrote ``common.pt``; 0.16.1 fails on such a checkpoint
(``'str' object has no attribute 'iterdir'``). Converting needs only the tensors, so `load` hands
`dist_checkpointing.load` a common-state strategy that reads ``common.pt`` where there is one and nothing where
there is none: the same load on 0.16.1 and 0.19. Formats no installed version reads (``fsdp_dtensor``, the
legacy per-rank ``torch`` format) are refused in one line that says what reads them.

Damage (`check_intact`, before any tensor is read): the checkpoints dapo-mcore writes carry ``CHECKSUMS`` (size and
checksum of every file of the iteration dir: XXH3-64, or CRC-32 in those of earlier versions), so a flipped byte
is one line (a load checks the files it reads, by the ``.metadata`` index of its keys, not every file), and
``MARK`` in their common state, so one whose table was deleted is refused; Megatron-LM's and Megatron-Bridge's
carry none and are read with a warning, but every ``.distcp`` is checked against the byte ranges its ``.metadata``
lists, so a truncated file is named too. A ``.metadata``/``common.pt`` that does not unpickle is one line as well.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_mcore.model.hf_config import MEGATRON_LLAMA3_FIXED
from dapo_mcore.weights.errors import InputFileError, InputMissingError

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
EMBEDDING_KEY = "embedding.word_embeddings.weight"
CHECKSUMS = "dapo_mcore_checksums.json"
"""Beside the ``.distcp`` files of a checkpoint dapo-mcore wrote: {"files": {relative path: {size, xxh3}}}
(``crc32`` in the tables of earlier versions; any of ``weights.checksums.HASHES`` verifies)."""
MARK = "dapo_mcore_checksums"
"""A key of the common state of the checkpoints dapo-mcore writes: they carry CHECKSUMS, so one without is damaged."""
_FIX = "restore the checkpoint from a good copy, or write it again from its source (dapo-mcore convert)"


@dataclass(frozen=True)
class DistCheckpoint:
    """One Megatron-Core distributed checkpoint on disk."""

    path: Path
    """The dir holding ``metadata.json`` and the ``.distcp`` files."""
    origin: str
    """``megatron-bridge`` (a run_config.yaml beside the tensors), ``megatron-lm`` (a tracker or iter dir), ``bare``."""
    run_config: dict | None
    """Megatron-Bridge's run_config.yaml, parsed (None for other origins)."""


def _iteration_dir(save_dir: Path) -> Path:
    tracker = save_dir / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return save_dir / "release"
        if not text.isdigit():
            raise InputFileError(f"{tracker} holds {text!r}; Megatron-LM and Megatron-Bridge write an iteration "
                                 "number or 'release' there; fix the file or pass one iter_* dir.")
        return save_dir / f"iter_{int(text):07d}"
    iters = sorted((p for p in save_dir.glob("iter_*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    if iters:
        if len(iters) > 1:
            log.info("%s has no %s; reading the newest of its %d iteration dirs, %s", save_dir, TRACKER, len(iters),
                     iters[-1].name)
        return iters[-1]
    return save_dir


def _refuse_other_formats(path: Path) -> None:
    if (path / "mp_rank_00").is_dir() or (path / "mp_rank_00_000").is_dir():
        raise InputFileError(f"{path} is in Megatron-LM's legacy per-rank 'torch' format (mp_rank_*/"
                             "model_optim_rng.pt), not a distributed checkpoint; resave it with Megatron-LM "
                             "(--ckpt-format torch_dist, or tools/checkpoint/convert.py --saver mcore) and pass that.")
    raise InputMissingError(f"{path} is not a Megatron-Core distributed checkpoint (no metadata.json); pass a "
                            f"Megatron-LM or Megatron-Bridge save dir (with {TRACKER} or iter_* dirs) or one of its "
                            "iter_* dirs.")


def find(path: str | Path) -> DistCheckpoint:
    """Locate the distributed checkpoint under `path` (see the module doc); one-line errors otherwise."""
    path = Path(path)
    if not path.exists():
        raise InputMissingError(f"{path} does not exist; pass a Megatron-LM or Megatron-Bridge checkpoint dir.")
    ckpt_dir = _iteration_dir(path)
    if not ckpt_dir.is_dir():
        raise InputMissingError(f"{path / TRACKER} points at {ckpt_dir.name}, which does not exist; the save was "
                                "interrupted or the dir was moved: pass an existing iter_* dir.")
    meta_file = ckpt_dir / "metadata.json"
    if not meta_file.is_file():
        _refuse_other_formats(ckpt_dir)
    try:
        backend = json.loads(meta_file.read_text()).get("sharded_backend")
    except (OSError, json.JSONDecodeError) as err:
        raise InputFileError(f"{meta_file} cannot be read ({err}); the checkpoint is damaged.") from err
    if backend != "torch_dist":
        hint = ("megatron-core's fsdp_dtensor format: load it with Megatron-LM/Megatron-Bridge and resave with "
                "--ckpt-format torch_dist" if backend == "fsdp_dtensor" else
                "zarr checkpoints are read by megatron-core <= 0.13: resave it as torch_dist there"
                if backend == "zarr" else "resave it with --ckpt-format torch_dist")
        raise InputFileError(f"{ckpt_dir} is a {backend!r} checkpoint; dapo-mcore reads torch_dist ({hint}).")
    run_config = None
    if (ckpt_dir / RUN_CONFIG).is_file():
        run_config = _read_yaml(ckpt_dir / RUN_CONFIG)
    origin = ("megatron-bridge" if run_config is not None else
              "megatron-lm" if ckpt_dir != path or (path / "common.pt").is_file() else "bare")
    return DistCheckpoint(ckpt_dir, origin, run_config)


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise InputFileError(f"{path} cannot be read as YAML ({str(err).splitlines()[0]}); the checkpoint is "
                             "damaged, or pass --hf-config DIR with the model's config.json.") from err
    if not isinstance(data, dict):
        raise InputFileError(f"{path} is not a mapping; pass --hf-config DIR with the model's config.json.")
    return data


def provider_kind(model: dict) -> str:
    """The HF model_type a Megatron-Bridge model provider section describes."""
    target = str(model.get("_target_", ""))
    if model.get("num_moe_experts"):
        return "qwen3_moe"
    if "Qwen3" in target or (model.get("qk_layernorm") and not model.get("add_qkv_bias")):
        return "qwen3"
    if "Llama" in target or not model.get("add_qkv_bias", False):  # Qwen2's provider always sets the QKV bias
        return "llama"
    return "qwen2"


def hf_config_from_run_config(run_config: dict, where: Path) -> dict[str, Any]:
    """An HF config.json dict equivalent to the ``model:`` section of a Megatron-Bridge run_config.yaml."""
    model = run_config.get("model")
    need = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if not isinstance(model, dict) or model.get(k) is None]
    if missing:
        raise InputFileError(f"{where}/{RUN_CONFIG} has no model.{missing[0]}; pass --hf-config DIR with the "
                             "model's config.json (the original Hugging Face dir).")
    kind = provider_kind(model)
    heads = int(model["num_attention_heads"])
    hf: dict[str, Any] = {
        "model_type": kind,
        "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}[kind]],
        "hidden_size": int(model["hidden_size"]),
        "intermediate_size": int(model["ffn_hidden_size"]),
        "num_hidden_layers": int(model["num_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(model.get("num_query_groups") or heads),
        "head_dim": int(model.get("kv_channels") or model["hidden_size"] // heads),
        "vocab_size": int(model["vocab_size"]),
        "max_position_embeddings": int(model.get("seq_length") or model.get("max_position_embeddings") or 32768),
        "rms_norm_eps": float(model.get("layernorm_epsilon", 1e-6)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model.get("rotary_base", 1000000.0))},
        "tie_word_embeddings": bool(model.get("share_embeddings_and_output_weights", False)),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if kind == "qwen2":
        hf["use_sliding_window"] = False
        hf["max_window_layers"] = hf["num_hidden_layers"]
    else:
        hf["attention_bias"] = bool(model.get("add_qkv_bias", False))
    if model.get("rope_scaling"):  # Llama 3.1+: Bridge fixes all but the factor (hf_config.MEGATRON_LLAMA3_FIXED)
        low, high, original = MEGATRON_LLAMA3_FIXED
        hf["rope_parameters"].update(rope_type="llama3", factor=float(model.get("rope_scaling_factor", 8.0)),
                                     low_freq_factor=low, high_freq_factor=high,
                                     original_max_position_embeddings=original)
    if kind == "qwen3_moe":
        hf.update(num_experts=int(model["num_moe_experts"]), num_experts_per_tok=int(model["moe_router_topk"]),
                  moe_intermediate_size=int(model["moe_ffn_hidden_size"]), decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=not model.get("moe_router_pre_softmax", False),
                  router_aux_loss_coef=float(model.get("moe_aux_loss_coeff") or 0.0))
    return hf


def write_checksums(ckpt_dir: Path) -> None:
    """Record size and checksum (``weights.checksums.DEFAULT_HASH``) of every file under `ckpt_dir` (one process,
    once every file is written)."""
    from dapo_mcore.weights import checkpoint as wckpt

    digests = {n: wckpt.file_digest(ckpt_dir / n) for n in wckpt.list_files(ckpt_dir, exclude=(CHECKSUMS,))}
    (ckpt_dir / CHECKSUMS).write_text(json.dumps({"files": digests}, indent=1) + "\n")


_checked: set[tuple] = set()
"""Dirs already checked in this process, with each file's size and mtime: a load reads the files once more, not
twice, unless one of them changed."""


def check_intact(ckpt: DistCheckpoint, reads: set[str] | None = None) -> None:
    """InputFileError naming the first damaged file: one that differs from CHECKSUMS (ours), or a ``.distcp`` shorter
    than the byte ranges the ``.metadata`` lists for it (any writer's). A checkpoint of ours (``MARK`` in its common
    state) whose CHECKSUMS is gone is refused; another writer's, which carries none, is read with a warning.
    `reads`: check only these files (relative names: what this process is about to read); None: every file."""
    table = ckpt.path / CHECKSUMS
    if table.is_file():
        _check_against_table(ckpt, table, reads)
        return
    if _carries_mark(ckpt):
        raise InputFileError(f"{ckpt.path} was written by dapo-mcore but its {CHECKSUMS} is missing, so its bytes "
                             f"cannot be verified; {_FIX}.")
    if os.fspath(ckpt.path.resolve()) not in _warned:
        _warned.add(os.fspath(ckpt.path.resolve()))
        log.warning("%s carries no checksums (written by Megatron-LM or Megatron-Bridge): only truncated files are "
                    "detected, not flipped bytes", ckpt.path)
    needed: dict[str, int] = {}
    for info in _storage_metadata(ckpt).storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = ckpt.path / name
        have = path.stat().st_size if path.is_file() else None
        if have is None or have < size:
            what = "missing" if have is None else f"{have} bytes, its .metadata lists {size} (truncated)"
            raise InputFileError(f"{ckpt.path} is damaged: {path}: {what}; {_FIX}.")


_warned: set[str] = set()


def _check_against_table(ckpt: DistCheckpoint, table: Path, reads: set[str] | None) -> None:
    from dapo_mcore.weights import checkpoint as wckpt

    key = (os.fspath(ckpt.path.resolve()), *((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                              for p in sorted(ckpt.path.rglob("*")) if p.is_file()))
    if key in _checked or (key, frozenset(reads or ())) in _checked:
        return
    try:
        files = json.loads(table.read_text())["files"]
        malformed = wckpt.table_problem(files)
        if malformed is not None:
            raise ValueError(malformed)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputFileError(f"{table} cannot be read ({err}); {_FIX}.") from err
    present = wckpt.list_files(ckpt.path, exclude=(CHECKSUMS,))
    problems = [f"{ckpt.path / n}: not in {CHECKSUMS}" for n in present if n not in files]
    names = None if reads is None else sorted(n for n in files if n in reads)
    problems += wckpt.verify_files(ckpt.path, files, names)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputFileError(f"{ckpt.path} is damaged: {problems[0]}{more}; {_FIX}.")
    _checked.add(key if reads is None else (key, frozenset(reads)))


_ALWAYS_READ = {".metadata", "metadata.json", "common.pt"}
"""The files every load reads whatever its shards: the storage index, the format, the common state."""


def files_read(ckpt: DistCheckpoint, sharded_state_dict: dict) -> set[str] | None:
    """The files of `ckpt` a load of `sharded_state_dict` reads (the ``.distcp`` files holding its keys, by the
    ``.metadata`` index, and the ones every load reads); None (check every file) if a key is not in the index."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    wanted = {v.unique_key if isinstance(v, ShardedObject) else v.key for v in nested_values(sharded_state_dict)
              if isinstance(v, (ShardedObject, ShardedTensor))}
    by_key: dict[str, set[str]] = {}
    for index, info in _storage_metadata(ckpt).storage_data.items():
        by_key.setdefault(index.fqn, set()).add(info.relative_path)
    if not wanted or any(k not in by_key for k in wanted):
        return None
    return {name for k in wanted for name in by_key[k]} | _ALWAYS_READ


def _carries_mark(ckpt: DistCheckpoint) -> bool:
    """Whether the checkpoint's common state holds ``MARK`` (dapo-mcore wrote it). The common state is ``common.pt``
    (megatron-core <= 0.16) or inside the ``.distcp`` files (0.17+, read only where the installed version can)."""
    common = ckpt.path / "common.pt"
    if common.is_file():
        import torch

        with _unreadable_as_damage(ckpt, "common.pt"):
            state = torch.load(common, map_location="cpu", weights_only=False)
        return isinstance(state, dict) and MARK in state
    if _reads_common_pt_only():
        return False
    from megatron.core import dist_checkpointing

    with _unreadable_as_damage(ckpt, "common state"):
        state = dist_checkpointing.load_common_state_dict(os.fspath(ckpt.path))
    return isinstance(state, dict) and MARK in state


def _storage_metadata(ckpt: DistCheckpoint) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    with _unreadable_as_damage(ckpt, ".metadata"):
        return FileSystemReader(os.fspath(ckpt.path)).read_metadata()


class _unreadable_as_damage:  # noqa: N801  (a context manager)
    """A checkpoint file that does not unpickle or unzip (truncated, overwritten) becomes one InputFileError."""

    def __init__(self, ckpt: DistCheckpoint, what: str) -> None:
        self.ckpt, self.what = ckpt, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        import pickle

        from torch.distributed.checkpoint.api import CheckpointException

        damaged = isinstance(err, (EOFError, pickle.UnpicklingError, CheckpointException)) or (
            isinstance(err, RuntimeError) and "PytorchStreamReader" in str(err))
        if not damaged:
            return False
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        detail = f"{type(err).__name__}: {lines[-1] if lines else 'no detail'}"
        raise InputFileError(f"{self.ckpt.path}: its {self.what} cannot be read ({detail[:200]}): a file is "
                             f"truncated or damaged; {_FIX}.") from err


def embedding_rows(ckpt: DistCheckpoint) -> tuple[int, Any]:
    """(rows, dtype) of the checkpoint's word embedding: its padded vocabulary and its weights' dtype."""
    from megatron.core import dist_checkpointing

    check_intact(ckpt, _ALWAYS_READ)  # it reads the index only
    with _unreadable_as_damage(ckpt, ".metadata"):
        meta = dist_checkpointing.load_tensors_metadata(os.fspath(ckpt.path))
    embed = next((t for k, t in meta.items() if k.endswith(EMBEDDING_KEY)), None)
    if embed is None:
        raise InputFileError(f"{ckpt.path} holds no {EMBEDDING_KEY}; is it a GPT model checkpoint?")
    return embed.global_shape[0], embed.dtype


def load(sharded_state_dict: dict, ckpt: DistCheckpoint) -> dict:
    """`dist_checkpointing.load` of `sharded_state_dict`, on checkpoints with or without ``common.pt``."""
    from megatron.core import dist_checkpointing

    check_intact(ckpt, files_read(ckpt, sharded_state_dict))  # what this process reads, not every file
    kwargs = {}
    if not (ckpt.path / "common.pt").is_file() and _reads_common_pt_only():
        kwargs["common_strategy"] = _tolerant_common_strategy()
    with _unreadable_as_damage(ckpt, "files"):
        return dist_checkpointing.load(sharded_state_dict, os.fspath(ckpt.path), **kwargs)


def _reads_common_pt_only() -> bool:
    """megatron-core <= 0.16: `load` reads the common state from common.pt through a LoadCommonStrategy."""
    import inspect

    from megatron.core import dist_checkpointing

    return "common_strategy" in inspect.signature(dist_checkpointing.load).parameters


def _tolerant_common_strategy():
    """megatron-core <= 0.16's common-state strategy, reading nothing from a 0.17+ checkpoint (no common.pt)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class _NoCommonPt(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return {}  # the common state is inside the .distcp; the tensors need none of it

    return _NoCommonPt()


def is_dist_checkpoint(path: str | Path) -> bool:
    """True for what `find` reads (a tracker, iter_* dirs or metadata.json), not for this project's own format."""
    path = Path(path)
    return path.is_dir() and ((path / TRACKER).is_file() or (path / "metadata.json").is_file()
                              or any(p.is_dir() for p in path.glob("iter_*")))


def load_into_model(model_chunks: list, path: str | Path) -> DistCheckpoint:
    """Load a distributed checkpoint into live model chunks (collective; any TP/PP: the format reshards on load).

    The chunks' vocabulary must have the checkpoint's rows (its padding); otherwise one line names both sizes.
    """
    from megatron.core import parallel_state as ps

    found = find(path)
    rows, _ = embedding_rows(found)
    for chunk in model_chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            live = embedding.word_embeddings.weight.shape[0] * ps.get_tensor_model_parallel_world_size()
            if live != rows:
                raise InputFileError(f"{found.path} holds a vocabulary of {rows} rows, the model here has {live}: "
                                     "its vocabulary padding differs; set model.vocab_padding (tp: as Megatron-"
                                     "Bridge writes; megatron: multiples of 128 x TP) to the checkpoint's.")
    sharded = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model_chunks)}
    loaded = load(sharded, found)
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(loaded[f"model{i}"])
    log.info("loaded %s (a %s dist checkpoint, vocabulary %d rows)", found.path, found.origin, rows)
    return found
