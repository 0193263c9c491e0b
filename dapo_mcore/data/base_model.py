"""Build, pre-train and cache the tiny base model of the embedded CPU default.

The model is a Hugging Face ``Qwen2ForCausalLM`` of the ``tiny`` preset (or ``tiny-hd32``, see ``preset``). Its "pre-training" corpus is
drawn from a synthetic task (``data/tasks.py``) as a mixture of rules: for each sampled training
prompt the target answer comes from the correct rule with probability ``correct_weight`` and from one
of the task's distractor rules otherwise. A corpus with one fixed answer per prompt gets memorised
(deterministic model, no mixed DAPO groups); a mixture yields a model that is uncertain on every prompt,
held-out ones included, whose mixture weight RL can then shift globally.

Outputs go to ``cache_dir/<task>-<hash of settings>/``: ``save_pretrained`` safetensors + the tiny
tokenizer + ``settings.json`` + ``pretrain_log.jsonl``. A second call with equal settings is a cache hit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from dapo_mcore.data.prompts import render_prompt_ids
from dapo_mcore.data.records import PromptRecord
from dapo_mcore.data.tasks import get_task, split_problems, task_records
from dapo_mcore.data.tiny_base_settings import TOOL_PRESETS, TinyBaseSettings
from dapo_mcore.data.tokenizer import build_tiny_tokenizer
from dapo_mcore.model.presets import preset_config

logger = logging.getLogger(__name__)

_DONE_MARKER = "DONE"


def build_tiny_model(seed: int, preset: str = "tiny") -> Qwen2ForCausalLM:
    """A randomly initialised float32 ``Qwen2ForCausalLM`` of a tiny preset (pad id 0)."""
    torch.manual_seed(seed)
    config = Qwen2Config(**preset_config(preset, pad_token_id=0, dtype="float32"))
    return Qwen2ForCausalLM(config)


def response_text(answer: str) -> str:
    """The assistant's text for an answer, in the form the math verifier extracts."""
    return f"Answer: {answer}"


def encode_examples(tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                    answers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, T]`` of prompt + ``Answer: <answer>`` + eos (right-padded), labels masking all but the response."""
    return encode_responses(tokenizer, prompts, [response_text(a) for a in answers])


def encode_responses(tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                     responses: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, T]`` of prompt + response text + eos (right-padded) and labels masking all but the response."""
    rows, labels = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        p_ids = render_prompt_ids(tokenizer, prompt)
        r_ids = tokenizer(response, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(p_ids + r_ids)
        labels.append([-100] * len(p_ids) + r_ids)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, l_) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(l_)] = torch.tensor(l_)
    return ids, lab


@torch.no_grad()
def correct_response_prob(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase,
                          records: list[PromptRecord], responses: list[str] | None = None) -> torch.Tensor:
    """Per record, the exact probability that temperature-1 sampling emits the canonical correct response + eos.

    The canonical response is ``Answer: <truth>`` unless ``responses`` gives it (tasks with a worked chain).
    Its mean is the expected accuracy at temperature 1 (avg@k as k grows), counting only the canonical
    response; ``1 - p**G - (1-p)**G`` is the chance that a group of G samples is usable.
    """
    model.eval()
    if responses is None:
        responses = [response_text(r.ground_truth) for r in records]
    ids, labels = encode_responses(tokenizer, [r.prompt for r in records], responses)
    logits = model(input_ids=ids).logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != -100
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.exp((logp * mask).sum(-1))


def _lr_at(step: int, settings: TinyBaseSettings) -> float:
    warmup = max(1, settings.steps // 20)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, settings: TinyBaseSettings,
             log_path: Path | None = None) -> list[dict[str, float]]:
    """Next-token training on mixture-of-rules answers; returns (and appends to ``log_path``) progress rows."""
    task = get_task(settings.task)
    problems = split_problems(task, "train", settings.split_seed, settings.heldout_fraction)
    rules = task.corpus_rules()
    n_wrong = len(rules) - 1
    weights = torch.tensor([settings.correct_weight] + [(1 - settings.correct_weight) / n_wrong] * n_wrong)
    heldout = task_records(settings.task, "heldout", settings.split_seed, settings.heldout_fraction)[:256]
    heldout_problems = split_problems(task, "heldout", settings.split_seed, settings.heldout_fraction)[:256]
    canonical = [rules[0](p) for p in heldout_problems]
    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                            betas=(0.9, 0.98))
    log: list[dict[str, float]] = []
    start = time.perf_counter()
    every = max(1, settings.steps // 10)
    for step in range(settings.steps):
        model.train()
        picks = torch.randint(len(problems), (settings.batch_size,), generator=gen).tolist()
        which = torch.multinomial(weights, settings.batch_size, replacement=True, generator=gen).tolist()
        batch = [problems[i] for i in picks]
        ids, labels = encode_responses(tokenizer, [task.render(p) for p in batch],
                                       [rules[r](p) for p, r in zip(batch, which, strict=True)])
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, settings)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % every == 0 or step + 1 == settings.steps:
            p = correct_response_prob(model, tokenizer, heldout, canonical)
            row = {"step": step + 1, "loss": round(loss.item(), 4),
                   "heldout_p_correct": round(p.mean().item(), 4),
                   "heldout_usable_g8": round((1 - p**8 - (1 - p) ** 8).mean().item(), 4),
                   "elapsed_s": round(time.perf_counter() - start, 2)}
            log.append(row)
            logger.info("pretrain %s: %s", settings.task, row)
            if log_path is not None:
                with log_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    model.eval()
    return log


def ensure_base_model(cache_dir: Path, settings: TinyBaseSettings) -> Path:
    """Return the directory of the cached base model for ``settings``, pre-training it on a miss.

    The directory holds a ``from_pretrained``-loadable model and tokenizer. Writing happens in a
    temporary sibling that is renamed when complete, so an interrupted build is never a cache hit.
    Processes that miss the same base at once (the ranks of two jobs on one machine, test sessions) build it once:
    the first holds a lock file beside it while it pre-trains, the others wait and then read its result.
    """
    settings.validate()
    cache_dir = Path(cache_dir)
    final = cache_dir / f"{settings.task}-{settings.cache_key()}"
    if (final / _DONE_MARKER).is_file():
        logger.info("tiny base model cache hit: %s", final)
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache_dir / f".{final.name}.lock"):
        if (final / _DONE_MARKER).is_file():
            logger.info("tiny base model built meanwhile by another process: %s", final)
            return final
        return _build(cache_dir, final, settings)


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` while a base is built (released by the kernel if the holder dies). Where
    the file system has no locks, the build goes on without one: concurrent builds then each pre-train, and the
    first rename wins, as before."""
    with open(path, "a") as f:
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("tiny base model: another process is pre-training the same base; waiting for it (%s)",
                            path)
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # e.g. ENOLCK on a file system without locks
            logger.warning("tiny base model: cannot lock %s (%s); building without the lock", path, e)
        yield  # closing the file releases the lock


def _build(cache_dir: Path, final: Path, settings: TinyBaseSettings) -> Path:
    logger.info("tiny base model cache miss: pre-training %s into %s", settings, final)
    # A private staging folder per process: where the lock is missing, concurrent cache misses must not delete each
    # other's files; the first finished rename wins and the other result is discarded.
    tmp = cache_dir / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    tokenizer = build_tiny_tokenizer(tools=settings.preset in TOOL_PRESETS)
    model = build_tiny_model(settings.seed, settings.preset)
    (tmp / "settings.json").write_text(json.dumps(dataclasses.asdict(settings), indent=2) + "\n")
    # One thread: the cached weights (and so every fixed-seed trace built on them) must not depend on the
    # caller's thread count, which changes the reduction order of the matmuls.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pretrain(model, tokenizer, settings, log_path=tmp / "pretrain_log.jsonl")
    finally:
        torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a one-file "Writing model shards" bar is noise in a run's log
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text("ok\n")
    try:
        tmp.rename(final)
    except OSError:
        if not (final / _DONE_MARKER).is_file():
            raise
        shutil.rmtree(tmp)  # another process finished the same build first
        logger.info("tiny base model was built concurrently by another process; using %s", final)
    logger.info("tiny base model saved to %s", final)
    return final
