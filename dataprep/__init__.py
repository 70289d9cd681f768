"""Data preparation: read, clean, deduplicate, tokenize and shard a corpus into a snapshot."""
