"""HF <-> live Megatron at TP in {1,2} x PP in {1,2} (+ VPP): logit parity, export, checkpoint save/load.

One torchrun launch of 4 gloo processes runs this file as a script (the worker below); it initialises model
parallel once per layout, checks everything there for both tied and untied embeddings, and writes one json of
results per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2), (4, 1, 1)]  # (tp, pp, vpp); TP4 > 2 KV heads
NPROC = 4


# ----------------------------------------------------------------------------------------------- worker
def _check_layout(ws: Path, tie: bool, tp: int, pp: int, vpp: int, results: list[dict]) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from safetensors.torch import load_file

    from conversion.verify import compare_logits, megatron_logits
    from dapo_mcore.model.qwen import build_gpt_model, transformer_config
    from dapo_mcore.weights.checkpoint import CheckpointError, read_megatron_rank
    from dapo_mcore.weights.export import iter_hf_weights
    from dapo_mcore.weights.live import (
        load_hf_into_model,
        load_megatron_checkpoint_into_model,
        save_megatron_checkpoint,
        unwrap,
    )

    hf_dir = ws / f"hf_tie{int(tie)}"
    hf_config = json.loads((hf_dir / "config.json").read_text())
    ref = load_file(os.fspath(hf_dir / "model.safetensors"))
    ref_logits = torch.load(ws / f"logits_tie{int(tie)}.pt")
    ids = torch.load(ws / "ids.pt")
    tag = f"tie{int(tie)}_tp{tp}_pp{pp}_vpp{vpp}"

    def record(check, value):
        results.append({"layout": tag, "check": check, "value": value})

    def build():
        # The layout's groups exist already (_worker); only Megatron's RNG restarts, as a fresh init would.
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        tc = transformer_config(hf_config, tensor_parallel=tp, pipeline_parallel=pp,
                                virtual_pipeline=vpp if vpp > 1 else None)
        return build_gpt_model(hf_config, tc)

    chunks = build()
    load_hf_into_model(chunks, hf_dir, "local", 128)
    record("hf_logits", compare_logits(ref_logits, megatron_logits(chunks, ids, hf_config["vocab_size"])))
    pad_nonzero = 0.0
    for c in chunks:
        for name, p in unwrap(c).named_parameters():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows = torch.arange(p.shape[0]) + ps.get_tensor_model_parallel_rank() * p.shape[0]
                pad_nonzero = max(pad_nonzero, p[rows >= hf_config["vocab_size"]].abs().max().item()
                                  if (rows >= hf_config["vocab_size"]).any() else 0.0)
    record("padding_rows_abs_max", pad_nonzero)

    exported = {}
    bounded = True
    for bucket in iter_hf_weights(chunks, hf_config, bucket_bytes=40_000):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        bounded = bounded and (size <= 40_000 or len(bucket) == 1)  # only a lone tensor may exceed a bucket
        for name, t in bucket:
            exported[name] = t
    record("export_names_equal", sorted(exported) == sorted(ref))
    record("export_bitwise_equal", all(torch.equal(exported[k], ref[k]) for k in ref if k in exported))
    record("export_buckets_bounded", bounded)
    # a consumer that stops after one bucket: the transfers already issued complete, the next export is whole
    early = iter_hf_weights(chunks, hf_config, bucket_bytes=40_000)
    next(early)
    early.close()
    again = {n: t for bucket in iter_hf_weights(chunks, hf_config) for n, t in bucket}
    record("export_after_early_stop_equal", sorted(again) == sorted(exported)
           and all(torch.equal(again[k], exported[k]) for k in exported))
    if tp > 1:  # the NCCL path (all_gather_into_tensor + merge_gathered), forced here on gloo: same tensors
        from dapo_mcore.weights import export as export_mod

        plain_init = export_mod._Exporter.__init__

        def gather_init(self, *args, **kwargs):
            plain_init(self, *args, **kwargs)
            self.by_plan = False

        export_mod._Exporter.__init__ = gather_init
        try:
            gathered = {n: t for bucket in iter_hf_weights(chunks, hf_config) for n, t in bucket}
        finally:
            export_mod._Exporter.__init__ = plain_init
        record("export_allgather_path_equal", sorted(gathered) == sorted(exported)
               and all(torch.equal(gathered[k], exported[k]) for k in exported))

    # live save == offline conversion, and offline conversion loads back with the same logits
    saved = ws / f"saved_{tag}"
    save_megatron_checkpoint(chunks, saved, hf_config, make_vocab_size_divisible_by=128)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    mine = read_megatron_rank(saved, tp_rank, pp_rank)
    offline = read_megatron_rank(ws / f"mcore_{tag}", tp_rank, pp_rank)
    record("live_save_equals_offline", sorted(mine) == sorted(offline)
           and all(torch.equal(mine[k], offline[k]) for k in mine))
    fresh = build()
    load_megatron_checkpoint_into_model(fresh, ws / f"mcore_{tag}")
    record("mcore_logits", compare_logits(ref_logits, megatron_logits(fresh, ids, hf_config["vocab_size"])))

    # a checkpoint of another layout is refused before any parameter changes
    other = ws / f"mcore_tie{int(tie)}_tp1_pp1_vpp1"
    if (tp, pp, vpp) != (1, 1, 1):
        before = [p.detach().clone() for c in fresh for p in unwrap(c).parameters()]
        try:
            load_megatron_checkpoint_into_model(fresh, other)
            record("mismatch_error", "no error")
        except CheckpointError as err:
            record("mismatch_error", str(err))
        after = [p.detach() for c in fresh for p in unwrap(c).parameters()]
        record("mismatch_untouched", all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    dist.barrier()


def _worker(ws: Path) -> None:
    from dapo_mcore.actor.parallel import init_distributed, init_model_parallel, read_launch_env, shutdown

    env = read_launch_env()
    init_distributed(env, "gloo")
    results: list[dict] = []
    try:
        for tp, pp, vpp in LAYOUTS:
            # Megatron's groups once per layout (~1 s each of gloo set-up on 4 ranks), both embeddings in them
            init_model_parallel(tp, pp, vpp if vpp > 1 else None, seed=7)
            for tie in (True, False):
                _check_layout(ws, tie, tp, pp, vpp, results)
    finally:
        (ws / f"results_{env.rank}.json").write_text(json.dumps(results))
        shutdown()


# ----------------------------------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    from conversion.hf_to_mcore import convert_hf_to_mcore
    from conversion.synthetic import save_tiny_hf_model
    from dapo_mcore.weights import ParallelLayout

    ws = tmp_path_factory.mktemp("weights_dist")
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.save(ids, ws / "ids.pt")
    for tie in (True, False):
        model = save_tiny_hf_model(ws / f"hf_tie{int(tie)}", seed=11 + tie, tie_word_embeddings=tie,
                                   num_hidden_layers=4)
        with torch.no_grad():
            torch.save(model(ids).logits, ws / f"logits_tie{int(tie)}.pt")
        for tp, pp, vpp in LAYOUTS:
            convert_hf_to_mcore(ws / f"hf_tie{int(tie)}", ws / f"mcore_tie{int(tie)}_tp{tp}_pp{pp}_vpp{vpp}",
                                ParallelLayout(tp=tp, pp=pp, vpp=vpp))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(NPROC), "--master_port", "29537",
           __file__, str(ws)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [r for rank in range(NPROC) for r in json.loads((ws / f"results_{rank}.json").read_text())]


def _values(results, check):
    vals = [(r["layout"], r["value"]) for r in results if r["check"] == check]
    assert vals, f"no results for {check}"
    return vals


def test_every_layout_was_checked_on_every_rank(dist_results):
    layouts = {r["layout"] for r in dist_results}
    assert len(layouts) == 2 * len(LAYOUTS)
    assert len(_values(dist_results, "hf_logits")) == 2 * len(LAYOUTS) * NPROC


@pytest.mark.parametrize("check", ["hf_logits", "mcore_logits"])
def test_megatron_logits_match_hf(dist_results, check):
    for layout, stats in _values(dist_results, check):
        assert stats["max_abs_diff"] <= 1e-4, (layout, stats)
        assert stats["top1_agreement"] == 1.0, (layout, stats)


def test_vocab_padding_rows_are_zero(dist_results):
    for layout, value in _values(dist_results, "padding_rows_abs_max"):
        assert value == 0.0, layout


def test_export_yields_exactly_the_hf_state_dict(dist_results):
    for check in ("export_names_equal", "export_bitwise_equal", "export_buckets_bounded",
                  "export_after_early_stop_equal", "live_save_equals_offline"):
        for layout, ok in _values(dist_results, check):
            assert ok is True, (check, layout)


def test_allgather_export_path_equals_the_copy_plan(dist_results):
    values = _values(dist_results, "export_allgather_path_equal")
    assert len({layout for layout, _ in values}) == 2 * sum(tp > 1 for tp, _, _ in LAYOUTS)
    for layout, ok in values:
        assert ok is True, layout


def test_layout_mismatch_refused_before_writing(dist_results):
    errors = _values(dist_results, "mismatch_error")
    assert errors
    for layout, msg in errors:
        assert "does not fit the live model" in msg and ("tp:" in msg or "pp:" in msg), (layout, msg)
    for layout, ok in _values(dist_results, "mismatch_untouched"):
        assert ok is True, layout


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
