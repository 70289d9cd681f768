"""Char-level, byte-level and byte-level BPE tokenizers, all saved as HF `tokenizers` JSON.

One file format for every tokenizer kind (and for BPE later) means the trainer, the evaluator
and the served model all load it the same way, with `Tokenizer.from_file`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_DOCUMENT = "<|endoftext|>"
UNKNOWN = "<unk>"

TokenizerKind = Literal["char", "byte", "bpe"]


def char_tokenizer(documents: Iterable[str]) -> Tokenizer:
    """One token per character seen in the corpus; characters never seen map to <unk>."""
    seen: set[str] = set()
    for doc in documents:
        seen.update(doc)
    chars = sorted(seen)
    vocab = {END_OF_DOCUMENT: 0, UNKNOWN: 1}
    for char in chars:
        vocab[char] = len(vocab)
    # BPE without merges is exactly a character vocabulary; Fuse joins tokens back with no
    # separator (the default decoder would put spaces between characters).
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNKNOWN))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([END_OF_DOCUMENT, UNKNOWN])
    return tokenizer


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens plus end-of-document: every input is representable, nothing is unknown."""
    vocab = {END_OF_DOCUMENT: 0}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_DOCUMENT])
    return tokenizer


def bpe_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2's pre-tokenization) trained on `documents`, end-of-document id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_DOCUMENT],
        # Every byte is in the vocabulary, so no input is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def build_tokenizer(
    kind: TokenizerKind, documents: Iterable[str], vocab_size: int = 8192
) -> Tokenizer:
    if kind == "char":
        return char_tokenizer(documents)
    if kind == "bpe":
        return bpe_tokenizer(documents, vocab_size)
    return byte_tokenizer()


def end_of_document_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(END_OF_DOCUMENT)
    if token_id is None:
        raise ValueError(f"tokenizer has no {END_OF_DOCUMENT} token")
    return token_id
