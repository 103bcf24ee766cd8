"""``shardax generate``: text from a ``shardax train`` checkpoint or a Hugging Face model.

    shardax generate --checkpoint runs/tiny --prompt "def main(" --max-new-tokens 80
    shardax generate --hf tiny-llama --prompt "import json" --temperature 0 --max-new-tokens 40

The model is laid out FSDP over the local devices (a checkpoint's step restored into it, or a
Hugging Face checkpoint read into shards) and decoded with ``shardax.generate``'s key/value
cache. With one prompt the text is printed as it comes; with several (``--prompt`` given more
than once, or ``--prompt-file`` with one prompt per line) each is printed whole, in order. The
tokenizer is the run's (its ``tokenizer.json``, the one ``shardax prepare`` trained, or bytes)
or the Hugging Face directory's ``tokenizer.json``; generation ends at its end-of-document token.
How fast it went (time to the first token, tokens a second while decoding) is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shardax.cli.devices import configure_jax
from shardax.cli.errors import UsageError


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "generate", help="generate text from a checkpoint or a Hugging Face model",
        description="Continue prompts with a model trained by shardax train or a Hugging Face checkpoint of the "
                    "Llama or Gemma family, decoding from a key/value cache.")
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a shardax train run directory, or its --checkpoint-dir")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (config.json, safetensors, "
                                                    "tokenizer.json)")
    add("--step", type=int, help="with --checkpoint: which step (default: the latest good one)")
    add("--ema", action="store_true", help="with --checkpoint: generate with the moving average of the weights that "
                                           "a run trained with --ema DECAY kept")
    add("--prompt", action="append", help="text to continue (give it more than once for a batch)")
    add("--prompt-file", metavar="FILE", help="prompts, one per line")
    add("--max-new-tokens", type=int, default=64, help="tokens to add to each prompt (default 64)")
    add("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8; 0: greedy)")
    add("--top-k", type=int, default=40, help="draw from the k most likely tokens (default 40; 0: all)")
    add("--top-p", type=float, default=1.0, help="draw from the smallest set of tokens holding this much of the "
                                                 "probability (default 1: all)")
    add("--seed", type=int, default=0, help="seed of the draws (default 0)")
    add("--devices", type=int, default=8, help="simulated CPU devices when running on CPU (default 8)")
    return parser


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        try:
            prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        except OSError as error:
            raise UsageError(f"--prompt-file {args.prompt_file}: cannot read it ({error.strerror})") from None
    if not prompts:
        raise UsageError("give the text to continue: --prompt TEXT (or --prompt-file FILE, one prompt per line)")
    return prompts


def _run_tokenizer(checkpoint: str, run: dict) -> Any:
    """The tokenizer a ``shardax train`` run was trained with: its run directory's, else the one
    its settings name."""
    from shardax.cli.export import tokenizer_of
    from shardax.data.tokenizer import ByteTokenizer, load_tokenizer

    kept = tokenizer_of(checkpoint, run)
    if kept is not None:
        return load_tokenizer(kept)
    name = run.get("tokenizer")
    if name in (None, "bytes"):
        return ByteTokenizer()
    if Path(name).is_file():
        return load_tokenizer(name)
    from shardax.lm.data import open_data  # a tokenizer shardax prepare trained: it lives with the data

    return open_data(run.get("data"), name, run.get("vocab_size"), run.get("field"), 16).tokenizer


def _model_and_tokenizer(args: argparse.Namespace):
    """The model to generate with (from --hf or a run's checkpoint) and its tokenizer."""
    if args.hf:
        from shardax import hf
        from shardax.data.tokenizer import load_tokenizer

        if not (Path(args.hf) / "tokenizer.json").is_file():
            raise UsageError(f"--hf {args.hf} has no tokenizer.json; generation needs the model's tokenizer")
        return hf.load(args.hf, "data=-1", "fsdp").model(), load_tokenizer(Path(args.hf) / "tokenizer.json")
    from shardax.cli.export import restore_run

    _, run, _, parallel, state = restore_run(args.checkpoint, args.step, ema=args.ema)
    return parallel.merge(state), _run_tokenizer(args.checkpoint, run)


def generate_command(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    if args.ema and args.hf:
        raise UsageError("--ema reads the moving average a shardax train run kept; give --checkpoint DIR with it, "
                         "not --hf")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    configure_jax(args.devices, start=True)
    import jax

    from shardax.generation import check_request, generate

    model, tokenizer = _model_and_tokenizer(args)
    ids = [[int(t) for t in tokenizer.encode_batch([text])[0]] for text in prompts]
    check_request(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p)  # before any output
    writing = jax.process_index() == 0
    shown: list[str] = []

    def stream(_: int, tokens: list[int]) -> None:  # one prompt: its text as it comes
        so_far.append(tokens[0])
        text = tokenizer.decode(so_far)
        if writing and len(text) > len(shown[0]):
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    so_far: list[int] = []
    if writing and len(prompts) == 1:
        sys.stdout.write(prompts[0])
        shown.append("")
    out = generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=tokenizer.eod_id, vocab=tokenizer.vocab_size,
                   on_token=stream if len(prompts) == 1 else None)
    if writing:
        if len(prompts) == 1:
            print()
        else:
            for text, tokens in zip(prompts, out):
                print(text + tokenizer.decode(tokens))
                print()
        print(out.stats.describe(), file=sys.stderr)  # beside the text, not in it
    return 0
