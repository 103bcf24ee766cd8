"""``shardax prepare``: tokenize text, JSON lines and Parquet files into token shards for training."""

from __future__ import annotations

import argparse
from typing import Any


def add_prepare_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "prepare", help="tokenize a corpus into token shards on disk (once; train then reads them lazily)",
        description="Tokenize text files (one document each), JSON lines and Parquet files (one document per "
                    "line or row) into token shards with an index, in parallel. Documents are held out for "
                    "validation by a hash of their text. Running it again on unchanged inputs does nothing.")
    add = parser.add_argument
    add("inputs", nargs="+", help="text, .jsonl or .parquet files, or folders of them")
    add("--out", required=True, help="directory for the shards (created; train with --data DIR)")
    add("--tokenizer", default="bytes", help="bytes (default), bpe (trained on the corpus) or a tokenizer.json file")
    add("--vocab-size", type=int, help="with --tokenizer bpe: vocabulary size (default 4096)")
    add("--field", default="text", help="the text field of .jsonl and .parquet inputs (default text)")
    add("--validation-fraction", type=float, default=0.05, help="share of documents held out (default 0.05)")
    add("--workers", type=int, help="processes that tokenize (default: one per core)")
    add("--overwrite", action="store_true", help="replace shards made with another tokenizer")
    return parser


def prepare_command(args: argparse.Namespace) -> int:
    from shardax.data.prepare import prepare

    if args.workers is not None and args.workers < 1:
        from shardax.errors import UsageError

        raise UsageError(f"--workers {args.workers} must be at least 1")
    done = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size, field=args.field,
                   validation_fraction=args.validation_fraction, workers=args.workers, overwrite=args.overwrite)
    splits = done.index["splits"]
    if not done.built:
        print(f"{done.root}: {done.reason}; nothing to do")
        return 0
    for split in ("train", "validation"):
        counts = splits[split]
        print(f"{split}: {counts['documents']:,} documents, {counts['tokens']:,} tokens, {counts['bytes']:,} bytes "
              f"in {len(counts['shards'])} shards")
    skipped = done.index.get("skipped") or []
    print(f"{done.root}: {done.index['tokenizer_name']} tokens ({done.reason})"
          + (f"; skipped {len(skipped)} empty files" if skipped else ""))
    return 0
