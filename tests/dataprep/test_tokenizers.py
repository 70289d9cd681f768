from dataprep.normalize import normalize
from dataprep.tokenizer import bpe_tokenizer, byte_tokenizer, char_tokenizer, end_of_document_id
from tests.conftest import SHAKESPEARE


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


def test_bpe_learns_merges_and_round_trips_unseen_text() -> None:
    speeches = SHAKESPEARE.read_text()[:300_000].split("\n\n")
    tokenizer = bpe_tokenizer(speeches, vocab_size=1000)
    assert tokenizer.get_vocab_size() == 1000
    assert end_of_document_id(tokenizer) == 0
    sample = speeches[5]
    # Merges compress: far fewer tokens than bytes on text like the training data.
    assert len(tokenizer.encode(sample).ids) < 0.5 * len(sample.encode())
    unseen = "naïve — 東京 🚀 ROMEO"  # bytes never seen in training still round-trip
    assert tokenizer.decode(tokenizer.encode(unseen).ids) == unseen


def test_normalize_folds_case_forms_and_whitespace() -> None:
    assert normalize("  Ａ\tB \n C ") == "a b c"  # full-width A folds to ASCII
    assert normalize("To  BE,\nor not") == normalize("to be, or not")
