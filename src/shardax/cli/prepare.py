"""``shardax prepare``: tokenize text, JSON lines and Parquet files into token shards for training."""

from __future__ import annotations

import argparse
from typing import Any


def add_prepare_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "prepare", help="tokenize a corpus into token shards on disk (once; train then reads them lazily)",
        description="Tokenize text files (one document each), JSON lines and Parquet files (one document per "
                    "line or row) into token shards with an index, in parallel. Documents are held out for "
                    "validation by a hash of their text. Running it again on unchanged inputs does nothing. "
                    "JSON lines or Parquet of conversations ('messages', or 'prompt' and 'completion') are "
                    "rendered with a chat template and stored with a mask of the tokens to learn (the "
                    "assistant's), for supervised fine-tuning; python-chats names a built-in set of them.")
    add = parser.add_argument
    add("inputs", nargs="+", help="text, .jsonl or .parquet files, or folders of them")
    add("--out", required=True, help="directory for the shards (created; train with --data DIR)")
    add("--tokenizer", default="bytes",
        help="bytes (default), bpe (trained on the corpus) or a tokenizer.json file")
    add("--vocab-size", type=int, help="with --tokenizer bpe: vocabulary size (default 4096)")
    add("--field", default="text", help="the text field of .jsonl and .parquet inputs (default text)")
    add("--format", default="auto",
        help="documents, conversations or preferences, or MODULE:CLASS, a data format of your own (default: "
             "told by each file's first record)")
    add("--chat-template", help="conversations: a checkpoint's folder or a .jinja file to render them with "
                                "(default: the one beside --tokenizer, else shardax's built-in template)")
    add("--validation-fraction", type=float, default=0.05, help="share of documents held out (default 0.05)")
    add("--workers", type=int, help="processes that tokenize (default: one per core)")
    add("--overwrite", action="store_true", help="replace shards made with another tokenizer")
    return parser


def prepare_command(args: argparse.Namespace) -> int:
    from shardax.data.prepare import prepare
    from shardax.data.registry import prepared_format

    if args.workers is not None and args.workers < 1:
        from shardax.errors import UsageError

        raise UsageError(f"--workers {args.workers} must be at least 1")
    done = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   field=args.field, validation_fraction=args.validation_fraction, workers=args.workers,
                   overwrite=args.overwrite, data_format=args.format, template=args.chat_template)
    splits = done.index["splits"]
    if not done.built:
        print(f"{done.root}: {done.reason}; nothing to do")
        return 0
    kind = prepared_format(done.index.get("kind"), done.root)
    for split in ("train", "validation"):
        counts = splits[split]
        learned = f" ({counts['trained']:,} to learn)" if "trained" in counts else ""
        examples = counts["documents"] // kind.sequences_per_example
        print(f"{split}: {examples:,} {kind.what}, {counts['tokens']:,} tokens{learned}, "
              f"{counts['bytes']:,} bytes in {len(counts['shards'])} shards")
    if kind.examples:
        print(f"rendered with {done.index['chat_template']}")
    skipped = done.index.get("skipped") or []
    print(f"{done.root}: {done.index['tokenizer_name']} tokens ({done.reason})"
          + (f"; skipped {len(skipped)} empty files" if skipped else ""))
    return 0
