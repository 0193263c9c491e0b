"""What Megatron-Bridge's AutoBridge.export_ckpt needs from a checkpoint directory: delete things from copies of a
committed fixture and see which copies still export bit-exactly to the original HF model.

    .venv-bridge/bin/python tests/bridge/probe_requirements.py [--fixture qwen2_untied_fp32/bridge_tp2]
        [--write-minimal tests/data/bridge/minimal_run_config.yaml]

Prints one line per variant: `ok` (exported, every tensor torch.equal to the HF original) or the failure's last line.
The `model:` section is minimised in two steps: drop every field whose value equals the provider class's own
default (what `instantiate` would give it anyway), then try dropping each remaining field alone; the fields whose
removal breaks the export are the mandatory ones, and the minimal run_config.yaml keeps exactly those (plus
`_target_`). One process: Bridge is imported once (tests/bridge/bridge_cpu.py's workarounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[0] / "data" / "bridge"
sys.path.insert(0, str(HERE))

import bridge_cpu  # noqa: E402

bridge_cpu.apply_cpu_workarounds()

from bridge_tensors import hf_differences  # noqa: E402


def export_ok(bridge, ckpt: Path, hf: Path) -> str:
    with tempfile.TemporaryDirectory() as out:
        try:
            bridge.export_ckpt(str(ckpt), out, show_progress=False)
        except BaseException as exc:  # a SystemExit or assert from deep inside Bridge is a result here, not a crash
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            return f"FAILS: {last[:300]}"
        bad = hf_differences(hf, Path(out))
    return "ok" if not bad else f"NOT bit-exact: {bad[:3]}"


def copy_of(fixture: Path, tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(fixture, dst)
    return dst


def write_model_section(ckpt: Path, model: dict) -> None:
    (ckpt / "iter_0000000" / "run_config.yaml").write_text(yaml.safe_dump({"model": model}, sort_keys=False))


def default_equal_fields(model: dict) -> list[str]:
    """The model fields whose yaml value is what the provider class would set by itself."""
    from megatron.bridge.utils.instantiate_utils import instantiate

    full = instantiate(dict(model))
    cls = type(full)
    out = []
    for f in dataclasses.fields(cls):
        if f.name not in model or f.name == "_target_":
            continue
        trimmed = {k: v for k, v in model.items() if k != f.name}
        try:
            again = instantiate(trimmed)
        except Exception:  # noqa: BLE001 - a field the class cannot do without
            continue
        if _same(getattr(again, f.name), getattr(full, f.name)):
            out.append(f.name)
    return out


def _same(a, b) -> bool:
    if callable(a) and callable(b):
        return getattr(a, "__qualname__", repr(a)) == getattr(b, "__qualname__", repr(b)) and \
            getattr(a, "keywords", None) == getattr(b, "keywords", None)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - tensors, objects without __eq__
        return a is b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", default="qwen2_untied_fp32/bridge_tp2")
    parser.add_argument("--write-minimal", default=None)
    args = parser.parse_args()
    from megatron.bridge import AutoBridge

    fixture = DATA / args.fixture
    hf = fixture.parent / "hf"
    bridge = AutoBridge.from_hf_pretrained(str(hf))
    run_config = yaml.safe_load((fixture / "iter_0000000" / "run_config.yaml").read_text())
    model = run_config["model"]
    results = []

    def probe(name: str, edit) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = copy_of(fixture, Path(tmp), name)
            edit(ckpt)
            verdict = export_ok(bridge, ckpt, hf)
        print(f"probe: {name}: {verdict}", flush=True)
        results.append((name, verdict))
        return verdict

    it = "iter_0000000"
    probe("as written", lambda c: None)
    probe("no train_state.pt, no latest_train_state.pt",
          lambda c: [(c / it / "train_state.pt").unlink(), (c / "latest_train_state.pt").unlink()])
    probe("no tokenizer/", lambda c: shutil.rmtree(c / it / "tokenizer"))
    probe("no latest_checkpointed_iteration.txt", lambda c: (c / "latest_checkpointed_iteration.txt").unlink())
    probe("no metadata.json", lambda c: (c / it / "metadata.json").unlink())
    probe("no run_config.yaml", lambda c: (c / it / "run_config.yaml").unlink())
    probe("iter_0000000 renamed release", lambda c: (c / it).rename(c / "release"))
    probe("run_config.yaml: the model section only", lambda c: write_model_section(c, model))

    dropped = default_equal_fields(model)
    reduced = {k: v for k, v in model.items() if k not in dropped}
    print(f"probe: {len(dropped)} of {len(model) - 1} model fields equal the provider's defaults; "
          f"{len(reduced) - 1} left: {sorted(k for k in reduced if k != '_target_')}", flush=True)
    probe("model section without the default-valued fields", lambda c: write_model_section(c, reduced))

    mandatory = []
    for key in sorted(k for k in reduced if k != "_target_"):
        trimmed = {k: v for k, v in reduced.items() if k != key}
        if probe(f"  ... and without {key}", lambda c, m=trimmed: write_model_section(c, m)) != "ok":
            mandatory.append(key)
    minimal = {"_target_": model["_target_"], **{k: model[k] for k in sorted(mandatory)}}

    def only_essentials(c: Path) -> None:
        write_model_section(c, minimal)
        for path in (c / it / "train_state.pt", c / "latest_train_state.pt", c / "latest_checkpointed_iteration.txt"):
            path.unlink()
        shutil.rmtree(c / it / "tokenizer")

    verdict = probe(f"minimal model section ({len(mandatory)} fields) and no tracker, train_state, tokenizer",
                    only_essentials)
    print("probe: minimal model section:\n" + yaml.safe_dump({"model": minimal}, sort_keys=False), flush=True)
    if args.write_minimal and verdict == "ok":
        Path(args.write_minimal).write_text(yaml.safe_dump({"model": minimal}, sort_keys=False))


if __name__ == "__main__":
    main()
