"""HFEngine against Hugging Face's own model: greedy parity, log-prob parity on left-padded batches, seeds,
finish reasons, prompt checks, and strict weight updates."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_mcore.model.presets import preset_config
from dapo_mcore.rollout import Engine, EngineError, HFEngine, SamplingParams, filter_prompts

pytestmark = pytest.mark.unit

EOS = 2
# Different lengths so the batch is left-padded (the longest row has no padding).
PROMPTS = [[1, 7, 9, 12], [1, 3], [1, 4, 4, 4, 8, 9, 10, 11, 30], [1, 20, 21], [5]]


def random_qwen2(seed: int) -> Qwen2ForCausalLM:
    """Tiny Qwen2 with every weight random (biases and norm gains included), fp32."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**preset_config("tiny"))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return random_qwen2(0)


@pytest.fixture()
def engine(model) -> HFEngine:
    return HFEngine(model, eos_token_ids=EOS, pad_token_id=0)


def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Plain full-sequence forward on the unpadded sequence, log_softmax(logits / T) of each response token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    rows = logp[len(prompt) - 1: len(prompt) - 1 + len(response)]
    return rows.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("greedy", [dict(temperature=0.0), dict(temperature=0.8, top_k=1)])
def test_greedy_matches_hf_generate_on_left_padded_batch(model, greedy):
    engine = HFEngine(model, eos_token_ids=EOS, pad_token_id=0, max_batch_rows=6)  # 2 padded chunks of 3 + 2 prompts
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12, **greedy))
    finish = set()
    for prompt, group in zip(PROMPTS, out, strict=True):
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
        want = ref[0, len(prompt):].tolist()
        assert len(group) == 2
        for r in group:
            assert r.token_ids == want
            assert r.finish_reason == ("stop" if want[-1] == EOS else "length")
            finish.add(r.finish_reason)


def test_sampled_logprobs_equal_full_forward(model, engine):
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=10, seed=3)
    out = engine.generate(PROMPTS, params)
    worst = 0.0
    for prompt, group in zip(PROMPTS, out, strict=True):
        for r in group:
            assert len(r.logprobs) == r.length > 0
            ref = reference_logprobs(model, prompt, r.token_ids, 0.7)
            worst = max(worst, (ref - torch.tensor(r.logprobs)).abs().max().item())
    assert worst <= 1e-5


def test_processed_logprobs_ignore_truncation_and_raw_ignore_temperature(model, engine):
    truncated = engine.generate(PROMPTS[:3], SamplingParams(n=3, temperature=0.7, top_p=0.8, top_k=5,
                                                            max_new_tokens=6, seed=1))
    raw = engine.generate(PROMPTS[:3], SamplingParams(n=3, temperature=0.7, max_new_tokens=6, seed=1, logprobs="raw"))
    for prompt, g_trunc, g_raw in zip(PROMPTS, truncated, raw, strict=False):
        for r in g_trunc:  # full-vocabulary log_softmax(logits / T), not renormalised over the top-k/top-p set
            assert torch.allclose(torch.tensor(r.logprobs), reference_logprobs(model, prompt, r.token_ids, 0.7),
                                  atol=1e-5)
        for r in g_raw:
            assert torch.allclose(torch.tensor(r.logprobs), reference_logprobs(model, prompt, r.token_ids, 1.0),
                                  atol=1e-5)
    none = engine.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=4, seed=1, logprobs="none"))
    assert all(r.logprobs == [] for r in none[0])


def test_top_k_limits_sampled_tokens(model, engine):
    prompt = [1, 7, 9]
    out = engine.generate([prompt], SamplingParams(n=64, temperature=1.0, top_k=2, max_new_tokens=1, seed=0))
    with torch.no_grad():
        top2 = set(torch.topk(model(torch.tensor([prompt])).logits[0, -1], 2).indices.tolist())
    sampled = {r.token_ids[0] for r in out[0]}
    assert sampled <= top2 and len(sampled) == 2


def test_seeds_reproduce_and_differ(engine):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    c = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=12))
    assert a == b
    assert [r.token_ids for g in a for r in g] != [r.token_ids for g in c for r in g]


def test_finish_reasons_eos_and_length(engine):
    out = engine.generate(PROMPTS, SamplingParams(n=16, temperature=1.0, max_new_tokens=6, seed=0))
    reasons = set()
    for group in out:
        for r in group:
            if r.finish_reason == "stop":
                assert r.token_ids[-1] == EOS and EOS not in r.token_ids[:-1]
            else:
                assert r.length == 6 and EOS not in r.token_ids
            reasons.add(r.finish_reason)
    assert reasons == {"stop", "length"}  # both occur with this seed: the test exercises both branches


def test_no_eos_generation_ends_with_length(model):
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)
    probe = HFEngine(model, eos_token_ids=EOS).generate(PROMPTS, greedy)
    # an EOS id the greedy continuations never emit -> every response must run to max_new_tokens
    emitted = {t for g in probe for r in g for t in r.token_ids}
    unused = next(t for t in range(6, 32) if t not in emitted)
    engine = HFEngine(model, eos_token_ids=unused, pad_token_id=0)
    out = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
    assert all(r.finish_reason == "length" and r.length == 10 for g in out for r in g)
    stop = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=10,
                                                   stop_token_ids=(probe[0][0].token_ids[1],)))
    assert stop[0][0].finish_reason == "stop" and stop[0][0].token_ids == probe[0][0].token_ids[:2]


def test_prompt_checks(engine):
    res = filter_prompts([[1, 2], [], [1] * 200, [1, 99], [3]], max_prompt_len=128, vocab_size=32)
    assert res.kept == [0, 4]
    assert res.rejected == {1: "empty", 2: "too_long", 3: "out_of_vocab"}
    assert res.counts == {"empty": 1, "too_long": 1, "out_of_vocab": 1}
    with pytest.raises(EngineError, match="empty=1"):
        engine.generate([[1, 2], []], SamplingParams())
    with pytest.raises(EngineError, match="max_position_embeddings"):
        engine.generate([[1] * 100], SamplingParams(max_new_tokens=64))
    with pytest.raises(EngineError, match="max_position_embeddings"):  # stream and resume share the checks
        engine.stream([[1] * 100], SamplingParams(max_new_tokens=64))
    with pytest.raises(EngineError, match="max_position_embeddings"):
        engine.resume([[1] * 100], [[3]], SamplingParams(max_new_tokens=64))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1, 2]], SamplingParams(top_p=0.0))


def buckets_of(state_dict: dict[str, torch.Tensor], size: int):
    items = list(state_dict.items())
    return [items[i:i + size] for i in range(0, len(items), size)]


def test_update_weights_makes_outputs_equal_the_other_model(model):
    engine = HFEngine(random_qwen2(1), eos_token_ids=EOS, pad_token_id=0)
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=8, seed=5)
    before = engine.generate(PROMPTS, params)
    weight_ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    engine.update_weights(buckets_of(model.state_dict(), 5))  # includes the tied lm_head.weight alias
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == weight_ptrs  # copied in place
    after = engine.generate(PROMPTS, params)
    want = HFEngine(model, eos_token_ids=EOS, pad_token_id=0).generate(PROMPTS, params)
    assert after == want and after != before


def test_update_weights_errors_name_the_tensor(model):
    engine = HFEngine(random_qwen2(1), eos_token_ids=EOS)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(EngineError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([[("model.layers.9.mlp.up_proj.weight", torch.zeros(176, 64))]])
    bad = dict(sd, **{"model.layers.1.self_attn.k_proj.bias": torch.zeros(7)})
    with pytest.raises(EngineError, match=r"model.layers.1.self_attn.k_proj.bias.*\(7,\)"):
        engine.update_weights(buckets_of(bad, 4))
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(EngineError, match="never sent: model.norm.weight"):
        engine.update_weights(buckets_of(missing, 4))
    twice = list(sd.items()) + [("model.norm.weight", sd["model.norm.weight"])]
    with pytest.raises(EngineError, match="sent twice"):
        engine.update_weights([twice])
    engine.update_weights(buckets_of(sd, 3))  # a clean full sync still works after failed ones


def test_from_pretrained_roundtrip(model, tmp_path):
    model.generation_config.pad_token_id = 0
    model.save_pretrained(tmp_path)
    loaded = HFEngine.from_pretrained(tmp_path)
    assert isinstance(loaded, Engine)
    assert loaded.eos_token_ids == (EOS,) and loaded.pad_token_id == 0
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    assert loaded.generate(PROMPTS, params) == HFEngine(model, eos_token_ids=EOS).generate(PROMPTS, params)
    loaded.sleep()
    loaded.wake()
    loaded.close()
    with pytest.raises(EngineError, match="closed"):
        loaded.generate(PROMPTS, params)


def test_stream_yields_generates_groups_and_abort_counts_tokens(model):
    from dapo_mcore.rollout import StreamingEngine

    engine = HFEngine(model, eos_token_ids=2, max_batch_rows=12)  # 3 prompts x 4 samples per chunk
    assert isinstance(engine, StreamingEngine)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 3, 4], [1, 8], [1, 10, 11], [1, 12]]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    want = engine.generate(prompts, params)
    got = dict(engine.stream(prompts, params))
    assert sorted(got) == list(range(len(prompts)))
    assert all(got[i] == want[i] for i in range(len(prompts)))
    stream = engine.stream(prompts, params)
    it = iter(stream)
    first_index, _ = next(it)
    assert first_index < 3  # the first chunk's groups come first
    aborted = stream.abort()
    unfinished = [i for i in range(3) if i != first_index]
    assert 0 < aborted <= sum(r.length for i in unfinished for r in want[i])
    assert stream.abort() == 0


def test_resume_continues_a_greedy_response_exactly(model):
    """Partial rollouts: resume(prompt, R[:k]) of a greedy response R gives R[k:] with R's log-probs, on a batch
    whose prompt + prefix rows have different lengths (left padding) and different token budgets."""
    from dapo_mcore.rollout import ResumingEngine

    engine = HFEngine(model, eos_token_ids=99, pad_token_id=0, max_batch_rows=3)  # no EOS: every R is 12 long
    assert isinstance(engine, ResumingEngine)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    whole = [g[0] for g in engine.generate(PROMPTS, params)]
    cuts = [1, 5, 11, 3, 7]
    tails = engine.resume(PROMPTS, [r.token_ids[:k] for r, k in zip(whole, cuts, strict=True)], params)
    for r, k, tail in zip(whole, cuts, tails, strict=True):
        assert tail.token_ids == r.token_ids[k:] and tail.finish_reason == "length" == r.finish_reason
        torch.testing.assert_close(torch.tensor(tail.logprobs), torch.tensor(r.logprobs[k:]), atol=2e-5, rtol=0)


def test_resume_stops_at_eos_and_refuses_bad_requests(model, engine):
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    whole = [g[0] for g in engine.generate(PROMPTS, params)]
    stopped = [(p, r) for p, r in zip(PROMPTS, whole, strict=True) if r.finish_reason == "stop" and r.length > 1]
    if stopped:
        p, r = stopped[0]
        (tail,) = engine.resume([p], [r.token_ids[:1]], params)
        assert tail.token_ids == r.token_ids[1:] and tail.finish_reason == "stop"
    with pytest.raises(EngineError, match="n=1"):
        engine.resume([PROMPTS[0]], [[3]], SamplingParams(n=2, max_new_tokens=12))
    with pytest.raises(EngineError, match="prefix 0 has 12 tokens"):
        engine.resume([PROMPTS[0]], [[3] * 12], params)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.resume([PROMPTS[0]], [[engine.vocab_size]], params)
    (plain,) = engine.resume([PROMPTS[0]], [[]], params)  # an empty prefix is a plain generation
    assert plain.token_ids == whole[0].token_ids


def test_stream_abort_keeps_partial_groups_as_prefixes_of_generate(model):
    """abort(keep_partial=True): the in-flight groups come back as they stood, each response a prefix of what
    generate samples with the same seed (ended ones whole), and abort counts none of their tokens."""
    from dapo_mcore.rollout import PartialGroupStream

    # Ten stop ids end responses early and at different steps, so groups finish one by one.
    engine = HFEngine(model, eos_token_ids=list(range(2, 12)), max_batch_rows=12)  # 3 prompts x 4 samples a chunk
    prompts = [[1, 5, 6], [1, 7], [1, 9, 3, 4], [1, 8], [1, 10, 11], [1, 12]]
    cut_total = 0
    for seed in range(8):
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=seed)
        want = engine.generate(prompts, params)
        stream = engine.stream(prompts, params)
        assert isinstance(stream, PartialGroupStream)
        first_index, _ = next(iter(stream))
        assert stream.abort(keep_partial=True) == 0
        partials = stream.partials()
        assert [p.index for p in partials] == [i for i in range(3) if i != first_index]
        for p in partials:
            for r, done, w in zip(p.responses, p.done, want[p.index], strict=True):
                assert r.token_ids == w.token_ids[:r.length] and r.logprobs == w.logprobs[:r.length]
                assert done == (r.length == w.length) and (not done or r.finish_reason == w.finish_reason)
                cut_total += w.length - r.length
        again = engine.stream(prompts, params)
        next(iter(again))
        assert again.abort() == sum(p.num_tokens() for p in partials)  # the same groups, dropped instead
    assert cut_total > 0  # some response was really cut mid-way
