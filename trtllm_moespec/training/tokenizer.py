"""Byte-level BPE tokenizer trained with Hugging Face ``tokenizers``.

Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``)
so that ``AutoTokenizer.from_pretrained(dir)`` returns a ``PreTrainedTokenizerFast``.
A single special token, ``<|endoftext|>``, serves as eos, bos and pad and is the
document separator of the corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT_TOKEN = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; id 0 is ``<|endoftext|>``."""
    if vocab_size < 256 + 2:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_pretrained(tokenizer: Tokenizer, out_dir: Path, model_max_length: int = 2048) -> None:
    """Write the files ``AutoTokenizer.from_pretrained(out_dir)`` needs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": EOT_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "pad_token": EOT_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """The raw ``tokenizers.Tokenizer`` saved in ``tokenizer_dir``."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}")
    return Tokenizer.from_file(str(path))
