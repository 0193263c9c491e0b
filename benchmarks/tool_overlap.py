"""Tool calls overlapping generation: a multi-turn rollout's wall time with real tool calls over the same rollout with
zero-time tools.

One random Qwen2 (``--hidden``, ``--layers``; the tiny tool vocabulary), prompts of the tiny tool task, sampled at a
temperature where the model writes ``</code>`` now and then, so responses call the tool at scattered points. The
real run hands each call's code to the ``python`` tool in the sandbox (``--sandbox``: bwrap, the default, or none);
each call runs one fixed line of Python in a fresh sandboxed interpreter (what a ReTool call costs at the least); the
baseline answers every call instantly with the same output, so both runs sample the same tokens (asserted) and differ
only in the time tools take. The multi-turn loop starts a call as soon as its
response's turn ends and keeps decoding the others (``MultiTurnEngine``), so the ratio shows how much of the tools'
time generation hides. ``--repeats`` pairs, each a real run and its zero-time run back to back (so a pair shares the
machine's load of the moment), the real run first in even pairs and second in odd ones (a load that rises or falls
through a pair counts against each side as often); the headline is the median over the pairs of real / zero-time.

The difference between the two walls has two parts, reported apart: the seconds the rollout stood waiting for calls
after its decoding had run out of work (``ToolCounters.waited``: tool time the overlap did not hide), and the rest,
decoding slowed down by the calls' own CPU work (interpreter start-up, the code) on the cores it shares with them.

``--engine vllm`` runs the same on vLLM (its CPU build in its own virtualenv on a CPU machine; ``VLLMEngine``, one
process): each turn's requests are stepped and a response is handed out (and its call started) as it ends.

From the repository root:  python benchmarks/tool_overlap.py
Last line: ``tool_over_zero_time: X`` (median over pairs of real wall / zero-time wall). ``--smoke``: 2 prompts x 2,
32 tokens, a 1-layer hidden-32 model, one pair, bwrap (run in CI).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_mcore.data.prompts import render_prompt_ids  # noqa: E402
from dapo_mcore.data.tasks import get_task  # noqa: E402
from dapo_mcore.data.tokenizer import build_tiny_tokenizer  # noqa: E402
from dapo_mcore.model.presets import preset_config  # noqa: E402
from dapo_mcore.rollout import HFEngine, SamplingParams  # noqa: E402
from dapo_mcore.rollout.multiturn import MultiTurnEngine, ToolCodec, ToolPool  # noqa: E402
from dapo_mcore.tools.registry import ToolOutput, get_tool  # noqa: E402
from dapo_mcore.tools.sandbox import Sandbox  # noqa: E402


def random_model(hidden: int, layers: int, seed: int = 0) -> tuple[Qwen2ForCausalLM, dict]:
    cfg = preset_config("tiny-tools", pad_token_id=0, hidden_size=hidden, intermediate_size=hidden * 3,
                        num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64), num_key_value_heads=2,
                        max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
    return model, cfg


def build_engine(kind: str, model: Qwen2ForCausalLM, cfg: dict, tokenizer, model_dir: Path, max_len: int):
    """The transformers engine on ``model``, or vLLM on ``model`` saved to ``model_dir`` (float32, eager)."""
    if kind == "hf":
        return HFEngine(model, eos_token_ids=2, pad_token_id=0, max_batch_rows=512)
    from dapo_mcore.rollout import VLLMEngine, VLLMEngineOptions

    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    options = VLLMEngineOptions(model_path=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=max_len,
                                max_prompt_len=max_len // 2, seed=1, stop_token_ids=(2,))
    return VLLMEngine(options, cfg)


class TurnCodec(ToolCodec):
    """Every ``</code>`` is a call (a random model rarely opens with ``<code>``): the call's text is its turn."""

    def call_text(self, turn):
        return self.decode(list(turn))


def run(engine: HFEngine, tokenizer, tool, prompts, params, workers: int, max_calls: int):
    codec = TurnCodec(lambda t: tokenizer(t, add_special_tokens=False).input_ids, lambda ids: tokenizer.decode(ids))
    pool = ToolPool(tool, workers=workers, deadline_s=30.0)
    mt = MultiTurnEngine(engine, codec, pool, max_calls=max_calls, max_output_tokens=16)
    start = time.perf_counter()
    out = mt.generate(prompts, params)
    wall = time.perf_counter() - start
    counters = pool.take_counters()
    pool.close()
    return wall, out, counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-calls", type=int, default=2)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--smoke", action="store_true",
                    help="2 prompts x 2, 32 tokens, a 1-layer hidden-32 model, one pair (the same loop; run in CI)")
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.n, args.max_new_tokens, args.hidden, args.layers = 2, 2, 32, 32, 1
        args.repeats, args.workers = 1, 1
        if args.engine == "vllm":
            args.hidden = 64  # vLLM's CPU attention needs head_dim >= 32
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer(tools=True)
    task = get_task("mul2tool")
    prompts = [render_prompt_ids(tokenizer, task.render(p)) for p in task.problems()[:args.prompts]]
    model, cfg = random_model(args.hidden, args.layers)
    tmp = tempfile.TemporaryDirectory()
    engine = build_engine(args.engine, model, cfg, tokenizer, Path(tmp.name),
                          2 * max(args.max_new_tokens, max(len(p) for p in prompts)))
    python = get_tool("python", Sandbox(timeout_s=10, memory_mb=512, backend=args.sandbox))
    snippet = "print(sum(i * i for i in range(10000)))"  # each call: a sandboxed interpreter and a line of work
    answer = python(snippet).text

    def real(text: str) -> ToolOutput:
        return python(snippet)

    def zero_time(text: str) -> ToolOutput:
        return ToolOutput(answer)

    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=7)
    run(engine, tokenizer, real, prompts, params, args.workers, args.max_calls)  # warm-up
    walls: dict[str, list[float]] = {"real": [], "zero": []}
    tokens = calls = 0
    tool_s, waited = [], []
    load = os.getloadavg()[0]
    for i in range(args.repeats):
        order = ("real", "zero") if i % 2 == 0 else ("zero", "real")
        outs = {}
        for kind in order:
            wall, outs[kind], c = run(engine, tokenizer, real if kind == "real" else zero_time, prompts, params,
                                      args.workers, args.max_calls)
            walls[kind].append(wall)
            if kind == "real":
                tool_s.append(c.seconds)
                waited.append(c.waited)
                calls = c.calls
        assert outs["real"] == outs["zero"], "the zero-time run sampled other tokens"
        tokens = sum(r.length for g in outs["real"] for r in g)
    real_s, zero_s = statistics.median(walls["real"]), statistics.median(walls["zero"])
    print(f"{args.engine} engine, {len(prompts)} prompts x {args.n}, {tokens} tokens ({calls} tool calls), model "
          f"hidden {args.hidden} x {args.layers} layers, {args.workers} tool workers, sandbox {args.sandbox}, "
          f"{os.cpu_count()} CPUs, load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"wall with tools      {real_s:.3f} s (runs: {', '.join(f'{w:.3f}' for w in walls['real'])})")
    print(f"wall zero-time tools {zero_s:.3f} s (runs: {', '.join(f'{w:.3f}' for w in walls['zero'])})")
    tools_med, waited_med = statistics.median(tool_s), statistics.median(waited)
    print(f"tool seconds (calls summed) {tools_med:.3f} s, {tools_med / max(calls, 1):.3f} s a call; waited on "
          f"after decoding {waited_med:.3f} s (runs: {', '.join(f'{w:.3f}' for w in waited)}): "
          f"{waited_med / max(zero_s, 1e-9):.3f} of the zero-time wall")
    pairs = [r / z for r, z in zip(walls["real"], walls["zero"], strict=True)]
    decode = [(r - w) / z for r, w, z in zip(walls["real"], waited, walls["zero"], strict=True)]
    print(f"per pair real / zero-time: {', '.join(f'{x:.3f}' for x in pairs)}; ratio of the medians "
          f"{real_s / zero_s:.3f}; without the wait (decoding slowed by the calls' CPU work): "
          f"{statistics.median(decode):.3f}")
    if args.engine == "vllm":
        engine.close()
    tmp.cleanup()
    print(f"tool_over_zero_time: {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
