from dataprep.dedup import DedupStats, exact_dedup, normalize
from dataprep.readers import split_documents
from dataprep.tokenizer import byte_tokenizer, char_tokenizer, end_of_document_id


def test_char_tokenizer_round_trips_seen_text() -> None:
    tokenizer = char_tokenizer(["Hello  world\n", "ROMEO: ay!"])
    text = "ROMEO: Hello  world\nay!"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert end_of_document_id(tokenizer) == 0
    assert tokenizer.get_vocab_size() == 2 + len(set("Hello  world\nROMEO: ay!"))


def test_byte_tokenizer_represents_anything() -> None:
    tokenizer = byte_tokenizer()
    text = "naïve — 東京 🚀\n\ttabs"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.get_vocab_size() == 257


def test_exact_dedup_on_normalized_text() -> None:
    stats = DedupStats()
    docs = ["To be, or not", "to  BE, or not", "Something else", "To be, or not"]
    assert list(exact_dedup(docs, stats)) == ["To be, or not", "Something else"]
    assert (stats.seen, stats.removed) == (4, 2)
    assert normalize("  Ａ\tB ") == "a b"  # full-width A folds to ASCII


def test_split_rules() -> None:
    text = "one\ntwo\n\n\nthree\n  \nfour"
    assert list(split_documents(text, "blank-line")) == ["one\ntwo", "three", "four"]
    assert list(split_documents(text, "line")) == ["one", "two", "three", "four"]
    assert list(split_documents(text, "whole-file")) == [text.strip()]
