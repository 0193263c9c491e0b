"""Micro-batch padding for sequence parallel and FP8: the rule for every (fp8 recipe, SP, TP) case, and padding
that never reaches the loss or the token counts."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dapo_mcore.actor.batch import build_micro_batch
from dapo_mcore.actor.megatron_actor import ActorSettings
from dapo_mcore.config import FP8Config

pytestmark = pytest.mark.unit

RECIPES = [None, "delayed", "tensorwise", "blockwise", "mxfp8"]


def _te_ok(tokens_per_rank: int, recipe: str | None) -> bool:
    """Transformer Engine's requirement on a GEMM input's token dimension, restated from its sources: leading dims
    % 8 (utils.assert_dim_for_fp8_exec) and % 16 as the weight-gradient GEMM's reduction dim; MXFP8 % 32."""
    if recipe is None:
        return True
    return tokens_per_rank % (32 if recipe == "mxfp8" else 16) == 0


def _settings(tp: int, sp: bool, recipe: str | None) -> ActorSettings:
    fp8 = FP8Config(enabled=recipe is not None, recipe=recipe or "tensorwise")
    return ActorSettings(hf_config={}, tensor_parallel=tp, sequence_parallel=sp, fp8=fp8)


def _random_batch(rng: random.Random, n: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [[rng.randint(1, 99) for _ in range(rng.randint(1, 13))] for _ in range(n)]
    responses = [[rng.randint(1, 99) for _ in range(rng.randint(0, 17))] for _ in range(n)]
    return prompts, responses


@pytest.mark.parametrize(("recipe", "sp", "tp"), list(itertools.product(RECIPES, [False, True], [1, 2, 4, 8])))
def test_every_rank_slice_satisfies_sequence_parallel_and_te_fp8(recipe, sp, tp):
    multiple = _settings(tp, sp, recipe).seq_pad_multiple
    rng = random.Random(hash((recipe, sp, tp)) % 1000)
    for layout in ("thd", "packed", "rows"):
        for _ in range(20):
            prompts, responses = _random_batch(rng, rng.randint(1, 6))
            mb = build_micro_batch(prompts, responses, layout=layout, pad_to_multiple=multiple)
            rows, seq = mb.tokens.shape
            if sp:
                assert seq % tp == 0, (layout, seq, tp)
            per_rank = rows * (seq // tp if sp else seq)
            assert _te_ok(per_rank, recipe), (layout, recipe, sp, tp, seq)


@pytest.mark.parametrize(("recipe", "sp", "tp"), [(None, False, 1), (None, True, 4), ("tensorwise", True, 8),
                                                  ("mxfp8", False, 2)])
def test_the_rule_is_the_smallest_that_works(recipe, sp, tp):
    """No more padding than needed: 16 (32 for MXFP8) per rank slice with FP8, TP with SP, 1 otherwise."""
    align = 1 if recipe is None else (32 if recipe == "mxfp8" else 16)
    assert _settings(tp, sp, recipe).seq_pad_multiple == align * (tp if sp else 1)


@pytest.mark.parametrize("layout", ["thd", "packed", "rows"])
def test_padding_stays_out_of_the_loss_inputs_and_the_token_count(layout):
    rng = random.Random(7)
    for _ in range(20):
        prompts, responses = _random_batch(rng, rng.randint(1, 5))
        plain = build_micro_batch(prompts, responses, layout=layout)
        padded = build_micro_batch(prompts, responses, layout=layout, pad_to_multiple=128)
        assert padded.tokens.shape[1] % 128 == 0
        assert padded.num_tokens == plain.num_tokens == sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        # Response tokens are read from the same positions, with the same mask: padded positions are never read.
        assert torch.equal(padded.resp_row, plain.resp_row) and torch.equal(padded.resp_col, plain.resp_col)
        assert torch.equal(padded.resp_mask, plain.resp_mask)
        s = plain.tokens.shape[1]
        assert torch.equal(padded.tokens[:, :s], plain.tokens) and torch.equal(padded.position_ids[:, :s],
                                                                              plain.position_ids)
        if layout == "thd":
            cu_plain, cu_pad = plain.packed_seq_params.cu_seqlens_q, padded.packed_seq_params.cu_seqlens_q
            # Real sequences keep their boundaries; the padding is one trailing segment of its own.
            assert torch.equal(cu_pad[: len(cu_plain)], cu_plain) and int(cu_pad[-1]) == padded.tokens.shape[1]
        else:
            # No real token attends to a padded position (True = masked).
            mask = padded.attention_mask.expand(padded.tokens.shape[0], 1, -1, -1)
            assert bool(mask[:, :, :s, s:].all())


@pytest.mark.parametrize("layout", ["thd", "packed", "rows"])
def test_one_shape_for_every_micro_batch_under_virtual_pipeline_stages(layout):
    """With virtual pipeline stages the actor pads every micro-batch to the largest one's shape (Megatron's interleaved
    schedule deadlocked with the per-micro-batch shape handshake); the padding rows and columns are never read."""
    rng = random.Random(3)
    for _ in range(20):
        prompts, responses = _random_batch(rng, rng.randint(1, 5))
        plain = build_micro_batch(prompts, responses, layout=layout)
        rows, length = plain.tokens.shape[0] + 2, plain.tokens.shape[1] + 5
        padded = build_micro_batch(prompts, responses, layout=layout, min_rows=rows, min_len=length)
        assert padded.tokens.shape == ((rows if layout == "rows" else 1), length)
        assert padded.num_tokens == plain.num_tokens
        assert torch.equal(padded.resp_row, plain.resp_row) and torch.equal(padded.resp_col, plain.resp_col)
        assert torch.equal(padded.resp_mask, plain.resp_mask)
        r, s = plain.tokens.shape
        assert torch.equal(padded.tokens[:r, :s], plain.tokens)
        if layout != "thd":
            mask = padded.attention_mask.expand(padded.tokens.shape[0], 1, -1, -1)
            assert bool(mask[:r, :, :s, s:].all())  # no real token attends to the padding
        # already as large: nothing added
        same = build_micro_batch(prompts, responses, layout=layout, min_rows=r, min_len=s)
        assert same.tokens.shape == plain.tokens.shape


def test_padding_forms_segments_no_longer_than_the_longest_sequence():
    """Under virtual pipeline stages a small micro-batch is padded to the largest one's length. The padding was one
    trailing THD segment (attention quadratic in its length, and ``max_seqlen`` raised to it); now segments of at
    most the longest real sequence, so the pad costs no more per token than the real sequences."""
    from dapo_mcore.actor.batch import pad_segments

    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14]]  # lengths 7 and 3
    for layout in ("thd", "packed"):
        mb = build_micro_batch(prompts, responses, layout=layout, min_len=40)
        assert mb.tokens.shape == (1, 40) and mb.num_tokens == 10
        if layout == "thd":
            p = mb.packed_seq_params
            seg = (p.cu_seqlens_q[1:] - p.cu_seqlens_q[:-1]).tolist()
            assert seg == [7, 3, 7, 7, 7, 7, 2] and p.max_seqlen_q == p.max_seqlen_kv == 7
        else:  # the CPU mask: each pad token sees only its own segment, causally
            visible = (~mb.attention_mask[0, 0]).sum(dim=1).tolist()
            assert visible[10:] == [*range(1, 8)] * 4 + [1, 2]
        assert mb.position_ids[0, 10:].tolist() == [*range(7)] * 4 + [0, 1]
    assert pad_segments(0, 5) == [] and pad_segments(12, 5) == [5, 5, 2] and sum(pad_segments(1000, 7)) == 1000
