"""Tokenizers for the LM: bytes (no training, vocabulary 256 + end-of-document) or BPE.

BPE goes through the Hugging Face ``tokenizers`` library: trained on the corpus (byte-level,
so every text encodes and nothing is unknown) or loaded from a ``tokenizer.json``. Every
tokenizer has an end-of-document token, knows how many bytes of text each token stands for
(for bits per byte), and is saved beside the shards as ``tokenizer.json`` so that training,
sampling and resume read the very same one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from shardax.errors import UsageError

END_OF_DOCUMENT = "<|endoftext|>"
BYTES_SPEC = {"kind": "bytes"}


def padded_vocab(size: int, multiple: int = 64) -> int:
    """The model's vocabulary: the tokenizer's, rounded up so that tensor parallelism can split it."""
    return -(-size // multiple) * multiple


class ByteTokenizer:
    """Every UTF-8 byte is a token (0-255); 256 ends a document."""

    name = "bytes"
    end_of_document = END_OF_DOCUMENT
    vocab_size = 257
    eod_id = 256

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text``'s ids as written (nothing added) and each token's ``[start, end)`` characters."""
        ids = self.encode_batch([text])[0]
        widths = [len(character.encode("utf-8")) for character in text]
        starts = np.repeat(np.arange(len(text)), widths)
        return ids, np.stack([starts, starts + 1], axis=-1).reshape(-1, 2)

    def token_bytes(self) -> np.ndarray:
        """Bytes of text per token id (the end-of-document token counts as one, like a separator)."""
        return np.ones(self.vocab_size, np.int32)

    def to_json(self) -> str:
        return json.dumps(BYTES_SPEC)

    def to_hf_json(self) -> str:
        """The same tokenizer as a Hugging Face ``tokenizer.json`` (a byte-level BPE with no merges:
        each byte its own id, then the end-of-document token), for exported checkpoints."""
        tokenizers = _hf()
        vocab = {character: byte for byte, character in enumerate(_byte_characters())}
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        tokenizer.add_special_tokens([tokenizers.AddedToken(END_OF_DOCUMENT, special=True)])
        return tokenizer.to_str()

    @property
    def fingerprint(self) -> str:
        return "bytes"


def _byte_characters() -> list[str]:
    """The printable character byte-level BPE writes for each byte (byte ``b`` is entry ``b``):
    printable Latin-1 bytes stand for themselves, the others for code points from 256 on."""
    kept = [*range(ord("!"), ord("~") + 1),
            *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
            *range(ord("\N{REGISTERED SIGN}"), 256)]
    characters, spare = {}, 256
    for byte in range(256):
        if byte in kept:
            characters[byte] = chr(byte)
        else:
            characters[byte], spare = chr(spare), spare + 1
    return [characters[byte] for byte in range(256)]


class BPETokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with an end-of-document token."""

    def __init__(self, tokenizer, source: str, end_of_document: str = END_OF_DOCUMENT) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.name = (f"bpe ({source})" if "vocabulary" in source
                     else f"bpe (vocabulary {self.vocab_size}, {source})")
        self.end_of_document = end_of_document
        eod = tokenizer.token_to_id(end_of_document)
        if eod is None:
            raise UsageError(f"tokenizer {source} has no {end_of_document!r} token to end documents; add it "
                             "as a special token, or let shardax train one (--tokenizer bpe --vocab-size N)")
        self.eod_id = eod

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        return [np.asarray(encoding.ids, dtype) for encoding in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids if i != self.eod_id])

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text``'s ids as written (no special tokens added: a chat template writes its own) and
        each token's ``[start, end)`` characters."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        return np.asarray(encoding.ids, dtype), np.asarray(encoding.offsets, np.int64).reshape(-1, 2)

    def token_bytes(self) -> np.ndarray:
        """Bytes of text per token id: exact for byte-level BPE (one character per byte), from the
        decoded text otherwise; special tokens count as one."""
        from tokenizers import decoders

        byte_level = isinstance(self.tokenizer.decoder, decoders.ByteLevel)
        lengths = np.ones(self.vocab_size, np.int32)
        special = {token.content for token in self.tokenizer.get_added_tokens_decoder().values()
                   if token.special}
        for token, index in self.tokenizer.get_vocab().items():
            if token in special:
                continue
            length = len(token) if byte_level else len(self.tokenizer.decode([index]).encode("utf-8"))
            lengths[index] = max(length, 1)
        return lengths

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def to_hf_json(self) -> str:
        return self.to_json()

    @property
    def fingerprint(self) -> str:
        return "bpe-" + hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


Tokenizer = ByteTokenizer | BPETokenizer


def _hf():
    try:
        import tokenizers
    except ImportError:
        raise UsageError("BPE needs the Hugging Face tokenizers library; pip install "
                         "'tokenizers>=0.19'") from None
    return tokenizers


def check_bpe_vocab(vocab_size: int) -> None:
    if not 257 + 1 <= vocab_size <= 2**20:
        raise UsageError(f"--vocab-size {vocab_size}: a byte-level BPE needs more than the 256 bytes and the "
                         f"end-of-document token (at least 258) and at most {2**20}; e.g. 4096")


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens learned from ``texts``."""
    check_bpe_vocab(vocab_size)
    tokenizers = _hf()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_DOCUMENT], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tokenizer, f"trained, vocabulary {tokenizer.get_vocab_size()}")


def _end_of_document(source: str) -> str:
    """The token that ends a document: a Hugging Face model's ``eos_token`` (its
    ``tokenizer_config.json`` beside the ``tokenizer.json``), else ``<|endoftext|>``."""
    beside = Path(source).parent / "tokenizer_config.json"
    try:
        eos = json.loads(beside.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return END_OF_DOCUMENT
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and eos else END_OF_DOCUMENT


def from_json(text: str, source: str, end_of_document: str | None = None) -> Tokenizer:
    """A tokenizer saved by ``to_json`` (or any Hugging Face ``tokenizer.json``, whose documents
    end with its model's ``eos_token`` when a ``tokenizer_config.json`` is beside it)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"tokenizer {source} is not JSON ({error.msg} at line {error.lineno}); give a "
                         "Hugging Face tokenizer.json") from None
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    try:
        tokenizer = _hf().Tokenizer.from_str(text)
    except Exception as error:  # the Rust side raises plain Exceptions with its own message
        raise UsageError(f"tokenizer {source} is not a Hugging Face tokenizer.json "
                         f"({str(error)[:120]})") from None
    return BPETokenizer(tokenizer, Path(source).name, end_of_document or _end_of_document(source))


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise UsageError(f"--tokenizer {path}: cannot read it ({error.strerror}); give a tokenizer.json "
                         "file, 'bytes' or 'bpe'") from None
    return from_json(text, str(path))
