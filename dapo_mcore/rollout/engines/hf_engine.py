"""HFEngine: a rollout engine on a Hugging Face causal LM, for CPU and small models.

A hand-written sampling loop with a KV cache (not ``model.generate``) so that positions are explicit:
prompts are LEFT-padded and ``position_ids = cumsum(attention_mask) - 1`` (clipped at 0), so the real
tokens of every row get positions ``0..L-1`` exactly as an unpadded forward (and the actor) gives them.
Each decoding step feeds one token per row at position ``prompt_len + t``. Rows that finish (EOS/stop
token) are dropped from the batch and from the KV cache, so the batch shrinks as responses end.

``sleep``/``wake`` are no-ops: on CPU there is no accelerator memory to give back.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from dapo_mcore.rollout.correction.routes import RouteRecorder
from dapo_mcore.rollout.engines.hf_streams import _HFGroupStream, _HFResumeStream
from dapo_mcore.rollout.engines.sampling import sample_next
from dapo_mcore.rollout.engines.weight_sync import SyncTracker
from dapo_mcore.rollout.protocol import (
    EngineError,
    Response,
    SamplingParams,
    WeightBucket,
    check_prompts,
    check_resume,
)
from dapo_mcore.weights.qwen3_moe import per_expert_views

__all__ = ["HFEngine"]

logger = logging.getLogger(__name__)


def _as_ids(ids: int | Sequence[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    return (int(ids),) if isinstance(ids, int) else tuple(int(i) for i in ids)


class HFEngine:
    """Rollout engine on an in-memory ``transformers`` causal LM.

    Args:
        model: the causal LM (e.g. ``Qwen2ForCausalLM``); put in eval mode, weights owned by the engine.
        eos_token_ids: token id(s) that end a response (finish_reason "stop").
        pad_token_id: id written into padding (never attended); defaults to the first EOS id.
        max_prompt_len: longest accepted prompt; defaults to ``max_position_embeddings``.
        max_batch_rows: most (prompt x sample) rows decoded together (at least n); bounds memory.
    """

    stream_ticks = True
    """Streams have ``ticks()`` (protocol.TickingEngine): several engine groups can stream together."""

    def __init__(self, model: PreTrainedModel, *, eos_token_ids: int | Sequence[int],
                 pad_token_id: int | None = None, max_prompt_len: int | None = None,
                 max_batch_rows: int = 512):
        self.model = model.eval()
        self.weights_valid = True  # the model's weights stay in place across sleep/wake
        self.eos_token_ids = _as_ids(eos_token_ids)
        if not self.eos_token_ids:
            raise EngineError("HFEngine needs at least one EOS token id (eos_token_ids=...).")
        self.pad_token_id = self.eos_token_ids[0] if pad_token_id is None else int(pad_token_id)
        self.max_positions = int(model.config.max_position_embeddings)
        self.max_prompt_len = self.max_positions if max_prompt_len is None else int(max_prompt_len)
        if max_batch_rows < 1:
            raise EngineError(f"max_batch_rows={max_batch_rows} must be >= 1.")
        self.max_batch_rows = max_batch_rows
        self.vocab_size = int(model.config.vocab_size)
        self.device = next(model.parameters()).device
        # transformers >= 5.2x renamed the KV-cache argument/output from past_key_values to cache.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._tracker = self._make_tracker()
        self.routes = RouteRecorder(self.model)  # MoE models: the experts each sampled token was routed to (R3)
        self._closed = False

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        **kwargs) -> HFEngine:
        """Load a Hugging Face model directory; EOS/pad ids come from its generation config / config."""
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
        gen_cfg = model.generation_config
        eos = _as_ids(gen_cfg.eos_token_id) or _as_ids(model.config.eos_token_id)
        pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else model.config.pad_token_id
        kwargs.setdefault("pad_token_id", pad)
        return cls(model, eos_token_ids=eos, **kwargs)

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Response]]:
        """Sample ``params.n`` responses per prompt (see ``Engine.generate``)."""
        generator, stop_ids = self._prepare(prompts, params)
        per_chunk = max(1, self.max_batch_rows // params.n)  # prompts per chunk; each becomes n rows
        flat: list[Response] = []
        t0 = time.perf_counter()
        for start in range(0, len(prompts), per_chunk):
            flat.extend(self._generate_rows(prompts[start:start + per_chunk], params, stop_ids, generator))
        logger.debug("HFEngine: %d responses, %d tokens in %.3f s", len(flat), sum(r.length for r in flat),
                     time.perf_counter() - t0)
        return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _prepare(self, prompts: list[list[int]], params: SamplingParams) -> tuple[torch.Generator, Tensor]:
        """The checks every call shares (engine open, params, prompts, prompt + max_new_tokens within the model's
        positions), then the call's sampling RNG (``params.seed``, or a fresh one) and its stop ids."""
        self._check_open()
        params.validate()
        check_prompts(prompts, self.max_prompt_len, self.vocab_size)
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_new_tokens > self.max_positions:
            raise EngineError(f"prompt length {longest} + max_new_tokens {params.max_new_tokens} exceeds the "
                              f"model's max_position_embeddings={self.max_positions}; lower max_new_tokens or "
                              f"the prompt limit.")
        seed = int(torch.randint(0, 2**62, (1,)).item()) if params.seed is None else params.seed
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), device=self.device)
        return generator, stop_ids

    def _left_pad(self, rows: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
        lens = torch.tensor([len(r) for r in rows], device=self.device)
        width = int(lens.max())
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        return input_ids, mask, lens

    def _generate_rows(self, prompts: list[list[int]], params: SamplingParams, stop_ids: Tensor,
                       generator: torch.Generator) -> list[Response]:
        """Prefill each prompt once, fan the KV cache out to n rows, decode until every row stops."""
        tokens, logps, n_gen, stopped, _ = deque(self._decode(prompts, params, stop_ids, generator), maxlen=1)[0]
        return self._to_responses(tokens, logps, n_gen, stopped, params, self._row_routes(prompts, params.n, n_gen))

    def _row_routes(self, prompts: list[list[int]], n: int, n_gen: Tensor, first_row: int = 0) -> list | None:
        """The recorded routes (prompt + response positions) of rows ``first_row..`` of the last decode call."""
        if not self.routes.active:
            return None
        rows = torch.arange(first_row, first_row + n_gen.numel())
        lens = [len(prompts[int(r) // n]) + int(g) for r, g in zip(rows, n_gen.tolist(), strict=True)]
        return self.routes.rows(rows, lens)

    def _decode(self, prompts: list[list[int]], params: SamplingParams, stop_ids: Tensor,
                generator: torch.Generator, budgets: Tensor | None = None, carry: Tensor | None = None,
                ) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor, list[int]]]:
        """The decoding loop; after each token step yields ``(tokens, logps, n_gen, stopped, finished)`` where
        ``finished`` lists the rows (prompt i's sample j is row i*n+j) that ended at this step. ``budgets`` (one per
        row, <= max_new_tokens) ends a row after that many tokens (``resume``); None = max_new_tokens for all.
        ``carry`` (``resume``: each row's last prefix tokens, -1 where it has fewer) lets a stop sequence begin in
        the prefix: a response cut inside ``</code>`` and continued still stops where the whole one would have."""
        input_ids, mask, lens = self._left_pad(prompts)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rec = self.routes if self.routes.active else None
        if rec is not None:
            rec.begin(len(prompts), input_ids.shape[1] + params.max_new_tokens)
            rec.prefill(lens, input_ids.shape[1])
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        if rec is not None:
            rec.expand(params.n, lens)
        cache, logits = getattr(out, self._cache_kw), out.logits[:, -1, :]
        if params.n > 1:
            cache.batch_repeat_interleave(params.n)
            logits, mask, lens = (x.repeat_interleave(params.n, dim=0) for x in (logits, mask, lens))
        n_rows, max_new = len(prompts) * params.n, params.max_new_tokens
        tokens = torch.full((n_rows, max_new), self.pad_token_id, dtype=torch.long, device=self.device)
        logps = torch.zeros((n_rows, max_new), dtype=torch.float32, device=self.device)
        n_gen = torch.zeros(n_rows, dtype=torch.long, device=self.device)
        stopped = torch.zeros(n_rows, dtype=torch.bool, device=self.device)
        active = torch.arange(n_rows, device=self.device)  # original row index of each batch row
        next_pos = lens.clone()
        sequences = [torch.tensor(seq, dtype=torch.long, device=self.device) for seq in params.stop_sequences]
        for t in range(max_new):
            tok, lp = sample_next(logits, params, generator)
            tokens[active, t], logps[active, t], n_gen[active] = tok, lp.to(logps.dtype), t + 1
            hit = torch.isin(tok, stop_ids)
            for seq in sequences:  # a stop sequence ends a row when its newest tokens equal it
                if t + 1 >= len(seq):
                    hit |= (tokens[active, t + 1 - len(seq):t + 1] == seq).all(dim=-1)
                elif carry is not None and carry.shape[1] >= len(seq) - t - 1:
                    window = torch.cat([carry[active, carry.shape[1] - (len(seq) - t - 1):], tokens[active, :t + 1]], 1)
                    hit |= (window == seq).all(dim=-1)
            stopped[active] |= hit
            if budgets is not None:
                hit = hit | (budgets[active] <= t + 1)
            if t == max_new - 1 or bool(hit.all()):
                yield tokens, logps, n_gen, stopped, active.tolist()
                return
            # Every step yields (often nothing ended): a stream's ticks are decode steps, so engine groups that
            # exchange every k ticks stand at the same decode step, and completion order is decode-step order.
            yield tokens, logps, n_gen, stopped, active[hit].tolist()
            if bool(hit.any()):
                keep = (~hit).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, tok, mask, next_pos = active[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            if rec is not None:
                rec.step(active, next_pos)
            out = self.model(input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=next_pos.unsqueeze(-1),
                             use_cache=True, **{self._cache_kw: cache})
            cache, logits = getattr(out, self._cache_kw), out.logits[:, -1, :]
            next_pos = next_pos + 1

    def stream(self, prompts: list[list[int]], params: SamplingParams) -> _HFGroupStream:
        """Like ``generate``, but yields ``(prompt index, responses)`` as each prompt's n samples have all ended
        (see ``protocol.GroupStream``); ``abort()`` stops decoding. Same seed, prompts and params -> the same
        responses as ``generate``."""
        generator, stop_ids = self._prepare(prompts, params)
        return _HFGroupStream(self, prompts, params, generator, stop_ids)

    @torch.inference_mode()
    def resume(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams) -> list[Response]:
        """Continue one response per prompt after its ``prefix`` (see ``protocol.ResumingEngine.resume``): the
        prefix is prefilled with the prompt at the positions it was sampled at; only the new tokens come back. A stop
        sequence may begin in the prefix."""
        generator, stop_ids = self._prepare(prompts, params)
        check_resume(prompts, prefixes, params, self.vocab_size)
        out: list[Response] = []
        for start in range(0, len(prompts), self.max_batch_rows):
            chunk = slice(start, start + self.max_batch_rows)
            rows, budgets, carry, tail = self._resume_rows(prompts[chunk], prefixes[chunk], params)
            tokens, logps, n_gen, stopped, _ = deque(self._decode(rows, tail, stop_ids, generator, budgets, carry),
                                                     maxlen=1)[0]
            out.extend(self._to_responses(tokens, logps, n_gen, stopped, tail))
        return out

    def _resume_rows(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams
                     ) -> tuple[list[list[int]], Tensor, Tensor | None, SamplingParams]:
        """One chunk of a resume: the rows (prompt + prefix), each row's budget, the carried prefix tails (the last
        tokens a stop sequence may begin with; None without stop sequences longer than one token) and the params
        of the chunk's decode (max_new_tokens: its largest budget)."""
        rows = [list(p) + list(q) for p, q in zip(prompts, prefixes, strict=True)]
        budgets = torch.tensor([params.max_new_tokens - len(q) for q in prefixes], device=self.device)
        width = max((len(s) for s in params.stop_sequences), default=1) - 1
        carry = None
        if width > 0:
            carry = torch.full((len(rows), width), -1, dtype=torch.long, device=self.device)
            for i, q in enumerate(prefixes):
                tail = list(q)[-width:]
                if tail:
                    carry[i, width - len(tail):] = torch.tensor(tail, dtype=torch.long)
        return rows, budgets, carry, dataclasses.replace(params, max_new_tokens=int(budgets.max()))

    def resume_stream(self, prompts: list[list[int]], prefixes: list[list[int]], params: SamplingParams
                      ) -> _HFResumeStream:
        """``resume``, each response handed out as soon as it has ended: iterate for ``(index into prompts,
        Response)`` in completion order (a multi-turn rollout starts a response's tool call while the others still
        decode). The same seed, prompts and params give the same responses as ``resume``. Stopped early (``close``),
        ``unfinished()`` gives the responses not yet handed out as far as they got (partial rollouts)."""
        generator, stop_ids = self._prepare(prompts, params)
        check_resume(prompts, prefixes, params, self.vocab_size)
        return _HFResumeStream(self, prompts, prefixes, params, generator, stop_ids)

    @staticmethod
    def _to_responses(tokens: Tensor, logps: Tensor, n_gen: Tensor, stopped: Tensor,
                      params: SamplingParams, routes: list | None = None) -> list[Response]:
        tok_lists, lp_lists = tokens.tolist(), logps.tolist()
        out = []
        for i, (n, stop) in enumerate(zip(n_gen.tolist(), stopped.tolist(), strict=True)):
            lp = lp_lists[i][:n] if params.logprobs != "none" else []
            out.append(Response(token_ids=tok_lists[i][:n], logprobs=lp, finish_reason="stop" if stop else "length",
                                routed_experts=None if routes is None else routes[i]))
        return out

    # ------------------------------------------------------------------ weights
    def _make_tracker(self) -> SyncTracker:
        canonical: dict[int, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        aliases: dict[str, str] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) in canonical:
                aliases[name] = canonical[id(param)]
            else:
                canonical[id(param)] = name
                shapes[name] = tuple(param.shape)
        self._params = dict(self.model.named_parameters())
        experts = per_expert_views(self._params)  # MoE: fused expert tensors, synced under per-expert names
        if experts:
            fused = {n.rsplit(".", 3)[0] + "." + k for n in experts for k in ("gate_up_proj", "down_proj")}
            for name in fused:
                shapes.pop(name, None)
                self._params.pop(name, None)
            shapes.update({n: tuple(v.shape) for n, v in experts.items()})
            self._params.update(experts)
        return SyncTracker(shapes, aliases)

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Copy one full sync of HF-named tensors into the model in place (no reallocation).

        Each bucket is checked (unknown name, wrong shape, duplicate -> EngineError naming the tensor)
        before any of it is copied; parameters never sent are reported at the end. Tied aliases
        (``lm_head.weight`` of a tied model) are accepted and skipped.
        """
        self._check_open()
        t0 = time.perf_counter()
        tracker = self._tracker
        tracker.start()
        n_tensors = n_bytes = 0
        for bucket in buckets:
            for name, tensor in tracker.check_bucket(bucket):
                self._params[name].copy_(tensor)
                n_tensors += 1
                n_bytes += tensor.numel() * tensor.element_size()
        tracker.finish()
        logger.debug("HFEngine: loaded %d tensors (%.1f MB) in %.3f s", n_tensors, n_bytes / 1e6,
                    time.perf_counter() - t0)

    # ------------------------------------------------------------------ life cycle
    def sleep(self) -> None:
        """No-op on CPU (nothing to release); kept so the trainer has one code path."""

    def wake(self) -> None:
        """No-op on CPU (see ``sleep``)."""

    def close(self) -> None:
        """Drop the model; further calls raise EngineError."""
        self._closed = True
        self._params = {}
        del self.model

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("HFEngine is closed; build a new one.")
