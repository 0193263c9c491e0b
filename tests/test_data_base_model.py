"""Tiny base model: cache keying, cache hits, loadability, the corpus encoding."""

import json
import threading
import time

import pytest
import torch
from transformers import Qwen2ForCausalLM

import dapo_mcore.data.base_model as bm
from dapo_mcore.data.tasks import task_records
from dapo_mcore.data.tokenizer import build_tiny_tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

FAST = bm.TinyBaseSettings(steps=6, batch_size=8)


def test_cache_key_depends_on_every_setting():
    keys = {FAST.cache_key(), bm.TinyBaseSettings(steps=7, batch_size=8).cache_key(),
            bm.TinyBaseSettings(steps=6, batch_size=8, correct_weight=0.3).cache_key(),
            bm.TinyBaseSettings(steps=6, batch_size=8, task="min4").cache_key(),
            bm.TinyBaseSettings(steps=6, batch_size=8, preset="tiny-hd32").cache_key()}
    assert len(keys) == 5
    # The preset field came later: the default shape keeps its key (existing caches and traces stay valid).
    assert bm.TinyBaseSettings().cache_key() == "1941c59719fe"


def test_tiny_hd32_preset_has_head_dim_32():
    model = bm.build_tiny_model(seed=0, preset="tiny-hd32")
    c, default = model.config, bm.build_tiny_model(seed=0).config
    assert c.hidden_size // c.num_attention_heads == 32 and c.num_key_value_heads == 2
    assert c.vocab_size == default.vocab_size
    n_default = sum(p.numel() for p in bm.build_tiny_model(seed=0).parameters())
    # K and V grow from 2x16 to 2x32 output features (weights and biases) in each of the 2 layers
    assert sum(p.numel() for p in model.parameters()) == n_default + 2 * 2 * (32 * 64 + 32)


def test_ensure_base_model_builds_then_hits_the_cache(tmp_path, monkeypatch):
    path = bm.ensure_base_model(tmp_path, FAST)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    log = [json.loads(x) for x in (path / "pretrain_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == FAST.steps
    model = Qwen2ForCausalLM.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.float32 and model.config.vocab_size == 32
    tok = load_tokenizer(path)
    assert tok.decode(tok("Answer: 9", add_special_tokens=False).input_ids) == "Answer: 9"

    def no_training(*args, **kwargs):
        raise AssertionError("a second call must be a cache hit")

    monkeypatch.setattr(bm, "pretrain", no_training)
    assert bm.ensure_base_model(tmp_path, FAST) == path


def test_processes_that_miss_the_same_base_at_once_pre_train_it_once(tmp_path, monkeypatch):
    """Two builders of one base at once (two jobs, two test workers): the second waits on the first's lock and reads
    its result instead of pre-training the same base again."""
    calls = []
    real = bm.pretrain

    def slow_pretrain(model, tokenizer, settings, log_path=None):
        calls.append(threading.get_ident())
        time.sleep(1.0)  # the other builder arrives while this one trains
        return real(model, tokenizer, settings, log_path=log_path)

    monkeypatch.setattr(bm, "pretrain", slow_pretrain)
    results = []
    threads = [threading.Thread(target=lambda: results.append(bm.ensure_base_model(tmp_path, FAST)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 2 and results[0] == results[1] and (results[0] / "DONE").is_file()
    assert len(calls) == 1, f"the same base was pre-trained {len(calls)} times"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_settings_validate():
    with pytest.raises(ValueError, match="correct_weight"):
        bm.TinyBaseSettings(correct_weight=1.0).validate()
    with pytest.raises(ValueError, match="unknown task"):
        bm.TinyBaseSettings(task="nope").validate()
    with pytest.raises(ValueError, match="tiny-hd32"):
        bm.TinyBaseSettings(preset="qwen2.5-7b").validate()


def test_encode_examples_masks_all_but_the_response():
    tok = build_tiny_tokenizer()
    ids, labels = bm.encode_examples(tok, ["max(1,2,3,4)", "max(5,2,3,4)"], ["4", "10"])
    assert ids.shape == labels.shape and ids.shape[1] == 13 + 4 + 1
    resp = labels[1][labels[1] != -100].tolist()
    assert tok.decode(resp) == "Answer: 10<eos>"
    assert ids[0, -1].item() == tok.pad_token_id and labels[0, -1].item() == -100


def test_correct_response_prob_matches_naive_chain_rule():
    tok = build_tiny_tokenizer()
    model = bm.build_tiny_model(seed=0).eval()
    rec = task_records("max4", "heldout")[:1]
    p = bm.correct_response_prob(model, tok, rec)
    ids, labels = bm.encode_examples(tok, [rec[0].prompt], [rec[0].ground_truth])
    naive = 1.0
    with torch.no_grad():
        for t in range(ids.shape[1] - 1):
            if labels[0, t + 1] != -100:
                probs = torch.softmax(model(input_ids=ids[:, : t + 1]).logits[0, -1], -1)
                naive *= probs[ids[0, t + 1]].item()
    assert p.item() == pytest.approx(naive, rel=1e-4)
