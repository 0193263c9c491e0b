"""The tiny tokenizer: ids, round trips, chat template, save/load."""

import pytest

from dapo_mcore.data.prompts import render_prompt_ids, render_prompt_text
from dapo_mcore.data.tokenizer import (
    ANSWER,
    TINY_VOCAB,
    build_tiny_tokenizer,
    load_tokenizer,
    save_tiny_tokenizer,
)
from dapo_mcore.model.presets import preset_config

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_ids_fit_the_tiny_preset(tok):
    cfg = preset_config("tiny")
    assert len(tok) == len(TINY_VOCAB) <= cfg["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"], 0)


@pytest.mark.parametrize("text", ["Answer: 7", "Answer: 10", "max(3,9,1,4)", "07+45", "1 2\n3=4?", "Answer:-1"])
def test_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_answer_is_one_token_and_decodes_for_the_verifier(tok):
    ids = tok("Answer: 7", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == [ANSWER, " ", "7"]
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "Answer: 7"


def test_unknown_characters_map_to_unk(tok):
    assert tok("x", add_special_tokens=False).input_ids == [tok.unk_token_id]


def test_chat_template_renders_one_user_turn_and_generation_prompt(tok):
    assert render_prompt_text(tok, "max(1,2,3,4)") == "<bos><user>max(1,2,3,4)<assistant>"
    ids = render_prompt_ids(tok, "max(1,2,3,4)")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<assistant>")
    full = tok.apply_chat_template([{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "Answer: 3"}],
                                   tokenize=False)
    assert full == "<bos><user>1+2<assistant>Answer: 3<eos>"


def test_save_and_load_keep_the_exact_pipeline(tmp_path, tok):
    save_tiny_tokenizer(tmp_path)
    # A Qwen2 config.json beside it must not change what load_tokenizer returns.
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    loaded = load_tokenizer(tmp_path)
    text = render_prompt_text(loaded, "max(3,9,1,4)") + "Answer: 9"
    assert loaded(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
    assert loaded.chat_template == tok.chat_template and loaded.padding_side == "left"


def test_load_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "nope")
