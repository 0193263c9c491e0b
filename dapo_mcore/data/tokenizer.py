"""The tiny character-level tokenizer of the embedded CPU default.

Built locally with the ``tokenizers`` library (no download): special tokens, the ten digits, a few
arithmetic symbols, and the word ``Answer:`` as ONE token so that a response decodes to
``"Answer: 7"``, which the math verifier's ``Answer\\s*:\\s*(.*)`` pattern reads. Everything else
is one character per token; decoding concatenates tokens without inserted spaces.

The chat template renders ``<bos><user>{content}<assistant>`` for one user turn plus the generation
prompt, and ``{content}<eos>`` for an assistant turn (used to render pre-training targets).
Token ids match the ``tiny`` model preset: pad 0, bos 1, eos 2; the vocabulary fits in its 32 rows.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
USER, ASSISTANT = "<user>", "<assistant>"
ANSWER = "Answer:"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, USER, ASSISTANT)
# Order fixes the ids: specials 0..5, digits 6..15, then the word and the symbols.
_PLAIN_TOKENS: tuple[str, ...] = (
    *"0123456789", ANSWER, " ", "\n", "+", "-", "*", "=", ",", "?", "(", ")", "max", "min", "mod",
)
TINY_VOCAB: tuple[str, ...] = SPECIAL_TOKENS + _PLAIN_TOKENS
TINY_VOCAB_SIZE_LIMIT = 32
TOOL_TOKENS: tuple[str, ...] = ("<code>", "</code>", "<interpreter>", "</interpreter>", "print")
"""The tool task's words (ReTool's markers and ``print``), each one token, after the tiny vocabulary (ids 30..34)."""
TINY_TOOL_VOCAB: tuple[str, ...] = TINY_VOCAB + TOOL_TOKENS
TINY_TOOL_VOCAB_SIZE_LIMIT = 48

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<assistant>{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('tiny chat template supports roles user and assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_vocab(tools: bool = False) -> tuple[str, ...]:
    """The tiny vocabulary, or with ``tools`` the tool task's (the tiny one plus :data:`TOOL_TOKENS`)."""
    return TINY_TOOL_VOCAB if tools else TINY_VOCAB


def _split_pattern(plain: tuple[str, ...]) -> Regex:
    """Isolate the multi-character words, then every remaining single character (newline included)."""
    words = sorted((t for t in plain if len(t) > 1), key=len, reverse=True)
    escaped = [re.escape(w) for w in words]
    return Regex("|".join(escaped) + r"|[\s\S]")


def build_tiny_tokenizer(tools: bool = False) -> PreTrainedTokenizerFast:
    """Build the tiny tokenizer in memory (deterministic; ids as in ``TINY_VOCAB``, or with ``tools`` as in
    ``TINY_TOOL_VOCAB``: the same ids plus the tool task's words)."""
    words = tiny_vocab(tools)
    assert len(words) <= (TINY_TOOL_VOCAB_SIZE_LIMIT if tools else TINY_VOCAB_SIZE_LIMIT), len(words)
    assert len(set(words)) == len(words), "duplicate token in the tiny vocabulary"
    vocab = {tok: i for i, tok in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    plain = _PLAIN_TOKENS + (TOOL_TOKENS if tools else ())
    backend.pre_tokenizer = pre_tokenizers.Split(_split_pattern(plain), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )
    tok.chat_template = CHAT_TEMPLATE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    return tok


def save_tiny_tokenizer(directory: Path) -> Path:
    """Build the tiny tokenizer and ``save_pretrained`` it into ``directory``; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(directory)
    logger.info("saved tiny tokenizer (%d tokens) to %s", len(TINY_VOCAB), directory)
    return directory


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer directory (the tiny one or any HF ``tokenizer.json``) faithfully.

    Use this, not ``AutoTokenizer``: transformers 5 maps ``model_type: qwen2`` in a ``config.json``
    next to the tokenizer to ``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the vocabulary
    and silently drops the tiny tokenizer's words (``Answer:``, ``max``, the space). Loading the
    ``tokenizer.json`` through ``PreTrainedTokenizerFast`` keeps its exact pipeline, for Qwen2.5 too.
    """
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} holds no tokenizer.json; build the tiny one with save_tiny_tokenizer({path!s})")
    return PreTrainedTokenizerFast.from_pretrained(path)
