"""Pytest side of the actor/foundation distributed checks: one workspace, four process launches, cached results.

``run_all()`` (memoized per pytest process, so several test files share one set of launches):
  1. writes a tiny random Qwen2 with Hugging Face (vocab 37: padded to 48 at TP=1 and 64 at TP=2), the samples
     and settings (``spec.json``), and Hugging Face's own reference logits / log-probs / entropies;
  2. launches, two at a time: the TP=PP=DP=1 reference (+ the uninterrupted resume baseline) alongside the run
     that checkpoints and is SIGKILLed mid-save; then the resumed run alongside one 2-process torchrun that
     checks TP=2, PP=2 and DP=2; then the elastic resume (TP=1 checkpoint -> TP=2 -> PP=2, 2 processes);
  3. returns everything the workers wrote.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEMPERATURE = 0.7
MULTI_LAYOUTS = "2x1,1x2,1x1"   # with 2 processes: TP=2, PP=2, DP=2
_CACHE: dict[str, dict] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _random_sample(gen: torch.Generator, vocab: int, min_resp: int) -> dict:
    plen = int(torch.randint(1, 9, (1,), generator=gen))
    rlen = int(torch.randint(min_resp, 8, (1,), generator=gen))
    return {"prompt": torch.randint(3, vocab, (plen,), generator=gen).tolist(),
            "response": torch.randint(3, vocab, (rlen,), generator=gen).tolist(),
            "advantage": float(torch.randn(1, generator=gen))}


@torch.no_grad()
def hf_reference(model, prompt: list[int], response: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive per-token log-prob and full-vocab entropy of each response token from HF's own logits."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0].double() / temperature
    logp, ent = [], []
    for j, token in enumerate(response):
        row = torch.log_softmax(logits[len(prompt) - 1 + j], dim=-1)
        logp.append(row[token])
        ent.append(-(row.exp() * row).sum())
    return torch.tensor(logp, dtype=torch.float64), torch.tensor(ent, dtype=torch.float64)


def _write_workspace(ws: Path, preset: str = "tiny", **overrides) -> dict:
    """``preset``: "tiny" (Qwen2) or "tiny-qwen3" / "tiny-llama" (tests/test_family_actor.py); ``overrides``: HF
    config fields, e.g. num_hidden_layers=4 (tests/test_lora_actor.py: PP=2 x VPP=2 needs 4)."""
    import transformers

    from conversion.synthetic import save_tiny_hf_model

    (ws / "out").mkdir(parents=True)
    vocab = 37
    save_tiny_hf_model(ws / "hf", seed=3, vocab_size=vocab, preset=preset, **overrides)  # tied embeddings, GQA 4/2 heads, 2 layers
    hf = transformers.AutoModelForCausalLM.from_pretrained(ws / "hf", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    spec = {
        "seed": 5, "vocab_size": vocab, "vocab_div": 16, "temperature": TEMPERATURE, "micro_batch_tokens": 24,
        # Adam's eps is raised from 1e-8 so a near-zero gradient's update does not hinge on its rounding noise
        # (g / (|g| + 1e-8) flips sign with it), and so the updated weights depend on the gradient's scale.
        "lr": 1e-3, "adam_eps": 1e-4, "weight_decay": 0.1, "grad_clip": 1.0,
        "algo": {"clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean"},
        "ids": torch.randint(0, vocab, (2, 11), generator=gen).tolist(),
        "samples": [_random_sample(gen, vocab, 0) for _ in range(9)] + [{"prompt": [5], "response": [],
                                                                          "advantage": 1.0}],
        "resume_batch": 8, "resume_steps": 4, "resume_k": 2, "resume_seed": 7,
        "mismatch_shapes": {"ffn": {"intermediate_size": 96}, "layers": {"num_hidden_layers": 4},
                            "vocab": {"vocab_size": 45}},  # 45 pads to the same 48 rows as 37
    }
    for key in ("update1", "update2"):
        batch = [_random_sample(gen, vocab, 1) for _ in range(8)]
        for s in batch:
            logp, _ = hf_reference(hf, s["prompt"], s["response"], TEMPERATURE)
            s["old_logprobs"] = (logp.float() + 0.3 * torch.randn(len(logp), generator=gen)).tolist()
        batch[1]["loss_mask"] = [1.0] * (len(batch[1]["response"]) - 1) + [0.0]
        spec[key] = batch
    (ws / "spec.json").write_text(json.dumps(spec))
    ref = {"logits": hf(torch.tensor(spec["ids"])).logits.float(),
           "samples": [hf_reference(hf, s["prompt"], s["response"], TEMPERATURE) for s in spec["samples"]]}
    torch.save(ref, ws / "hf_reference.pt")
    return spec


def _launch(args: list[str], nproc: int = 1) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", env["MASTER_PORT"], *args]
    else:
        cmd = [sys.executable, *args]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, what: str, expect: int = 0) -> None:
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == expect, f"{what}: exit {proc.returncode}, expected {expect}\n{out[-6000:]}"


def run_all() -> dict:
    """Run everything once per process; the workspace lives in its own temporary directory (not pytest's basetemp,
    which a concurrent pytest session may rotate away mid-run) and is removed at exit."""
    if "results" in _CACHE:
        return _CACHE["results"]
    ws = Path(tempfile.mkdtemp(prefix="dapo_actor_runs_"))
    atexit.register(shutil.rmtree, ws, ignore_errors=True)
    t0 = time.perf_counter()
    spec = _write_workspace(ws)
    layouts, resume = str(HERE / "actor_layouts.py"), str(HERE / "actor_resume.py")
    ref = _launch([layouts, str(ws), "ref", "1x1", "--straight"])
    killed = _launch([resume, str(ws), "killed"])
    _wait(killed, "killed run", expect=-9)
    partial_after_kill = sorted(p.name for p in (ws / "ckpt").iterdir())
    # The 2-process run tries this TP=1 checkpoint at other layouts; the resumed run prunes the original meanwhile.
    shutil.copytree(ws / "ckpt" / f"step_{spec['resume_k']:06d}", ws / "ckpt_tp1")
    resumed = _launch([resume, str(ws), "resume"])
    _wait(ref, "reference run")
    multi = _launch([layouts, str(ws), "multi", MULTI_LAYOUTS], nproc=2)
    _wait(resumed, "resumed run")
    elastic = _launch([resume, str(ws), "elastic"], nproc=2)
    _wait(multi, "2-process layouts")
    _wait(elastic, "elastic resume")
    out = ws / "out"
    results = {
        "ws": ws, "spec": spec, "hf": torch.load(ws / "hf_reference.pt"),
        "ref": torch.load(out / "ref_rank0.pt", weights_only=False)["tp1_pp1_dp1"],
        "multi": [torch.load(out / f"multi_rank{r}.pt", weights_only=False) for r in range(2)],
        "ckpt_entries_after_kill": partial_after_kill,
        "straight_log": json.loads((out / "straight_log.json").read_text()),
        "killed_log": json.loads((out / "killed_log.json").read_text()),
        "resume_log": json.loads((out / "resume_log.json").read_text()),
        "straight_weights": torch.load(out / "straight.pt"),
        "resume": torch.load(out / "resume.pt", weights_only=False),
        "elastic_log": json.loads((out / "elastic_log.json").read_text()),
        "elastic": torch.load(out / "elastic.pt"),
        "wall_s": time.perf_counter() - t0,
    }
    _CACHE["results"] = results
    return results
