"""Byte-level text data: a corpus from files (or Python's own standard library) and its batches."""
