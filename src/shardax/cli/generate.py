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

With ``--chat`` each prompt is a user's message: rendered with the model's chat template (the
Hugging Face directory's, or the one a run's conversations were rendered with; ``--chat-template``
gives another) and its generation prompt, and the reply ends where the template ends a turn.

    shardax generate --checkpoint runs/chat --chat --prompt "What does json.dumps do?"
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
        description="Continue prompts with a model trained by shardax train or a Hugging Face checkpoint of "
                    "the Llama or Gemma family, decoding from a key/value cache.")
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a shardax train run directory, or its --checkpoint-dir")
    source.add_argument("--hf", metavar="DIR",
                        help="a Hugging Face model directory (config.json, safetensors, "
                             "tokenizer.json)")
    add("--step", type=int, help="with --checkpoint: which step (default: the latest good one)")
    add("--ema", action="store_true",
        help="with --checkpoint: generate with the moving average of the weights that "
             "a run trained with --ema DECAY kept")
    add("--prompt", action="append", help="text to continue (give it more than once for a batch)")
    add("--prompt-file", metavar="FILE", help="prompts, one per line")
    add("--max-new-tokens", type=int, default=64, help="tokens to add to each prompt (default 64)")
    add("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8; 0: greedy)")
    add("--top-k", type=int, default=40, help="draw from the k most likely tokens (default 40; 0: all)")
    add("--top-p", type=float, default=1.0,
        help="draw from the smallest set of tokens holding this much of the "
             "probability (default 1: all)")
    add("--seed", type=int, default=0, help="seed of the draws (default 0)")
    add("--chat", action="store_true", help="each prompt is a user's message: rendered with the model's chat "
                                            "template, the reply ending at the template's end of turn")
    add("--system", help="with --chat: a system message before each prompt")
    add("--chat-template",
        help="with --chat: a checkpoint's folder or a .jinja file (default: the model's own)")
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
        raise UsageError("give the text to continue: --prompt TEXT (or --prompt-file FILE, one prompt per "
                         "line)")
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
    """The model to generate with (from --hf or a run's checkpoint), its tokenizer, and where its
    chat template would be found (the folder of its tokenizer.json)."""
    if args.hf:
        from shardax import hf
        from shardax.data.tokenizer import load_tokenizer

        if not (Path(args.hf) / "tokenizer.json").is_file():
            raise UsageError(f"--hf {args.hf} has no tokenizer.json; generation needs the model's tokenizer")
        tokenizer = Path(args.hf) / "tokenizer.json"
        # the weights as they are stored: generation never changes them
        model = hf.load(args.hf, "data=-1", "fsdp", param_dtype=hf.stored_dtype(Path(args.hf))).model()
        return model, load_tokenizer(tokenizer), tokenizer
    from shardax.cli.export import restore_run, tokenizer_of

    _, run, _, parallel, state = restore_run(args.checkpoint, args.step, ema=args.ema)
    return parallel.merge(state), _run_tokenizer(args.checkpoint, run), tokenizer_of(args.checkpoint, run)


def _chat(args: argparse.Namespace, prompts: list[str], tokenizer: Any,
          tokenizer_file: Path | None) -> tuple[list[list[int]], list[Any], str]:
    """``--chat``: each prompt as a user's turn rendered with the template and its generation
    prompt (as token ids), where a reply stops (the end-of-document token, the end of a turn) and
    the end of a turn as text."""
    from shardax.data.chat import BUILT_IN, chat_template

    template = chat_template(args.chat_template, tokenizer_file)
    if template is BUILT_IN:
        print(f"--chat: no chat template beside {tokenizer_file or 'the model'}; rendering with "
              f"{template.where}",
              file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    texts = [template.render([*system, {"role": "user", "content": text}], add_generation_prompt=True)
             for text in prompts]
    ends = template.end_of_turn()
    stops = [tokenizer.eod_id] + ([[int(t) for t in tokenizer.encode_offsets(ends)[0]]] if ends else [])
    return [[int(t) for t in tokenizer.encode_offsets(text)[0]] for text in texts], stops, ends


def _reply(tokenizer: Any, tokens: list[int], end: str) -> str:
    """Generated tokens as text, less the chat template's end of turn that stopped them."""
    text = tokenizer.decode(tokens)
    return text[: -len(end)] if end and text.endswith(end) else text


class _Stream:
    """One prompt's new text printed as it comes (process 0); a chat's end of turn is held back
    until it is known not to be one, and left out."""

    def __init__(self, tokenizer: Any, end: str, writing: bool) -> None:
        self.tokenizer, self.end, self.writing = tokenizer, end, writing
        self.tokens: list[int] = []
        self.shown = 0

    def __call__(self, _: int, tokens: list[int]) -> None:
        self.tokens.append(tokens[0])
        self._write(self.tokenizer.decode(self.tokens), len(self.end))

    def close(self) -> None:
        self._write(_reply(self.tokenizer, self.tokens, self.end), 0)
        if self.writing:
            print()

    def _write(self, text: str, held: int) -> None:
        upto = max(len(text) - held, self.shown)
        if self.writing and upto > self.shown:
            sys.stdout.write(text[self.shown: upto])
            sys.stdout.flush()
            self.shown = upto


def generate_command(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    if args.ema and args.hf:
        raise UsageError("--ema reads the moving average a shardax train run kept; give --checkpoint DIR "
                         "with it, not --hf")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    if (args.system or args.chat_template) and not args.chat:
        raise UsageError("--system and --chat-template render a conversation; add --chat")
    configure_jax(args.devices, start=True)
    import jax

    from shardax.generation import check_request, generate

    model, tokenizer, tokenizer_file = _model_and_tokenizer(args)
    if args.chat:
        ids, stop, end = _chat(args, prompts, tokenizer, tokenizer_file)
    else:
        ids, stop, end = ([[int(t) for t in tokenizer.encode_batch([text])[0]] for text in prompts],
                          tokenizer.eod_id, "")
    # before any output
    check_request(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    writing = jax.process_index() == 0
    stream = _Stream(tokenizer, end, writing) if len(prompts) == 1 else None
    if stream is not None and writing:
        sys.stdout.write("" if args.chat else prompts[0])  # a chat prints the reply alone
    out = generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=stop, vocab=tokenizer.vocab_size,
                   on_token=stream)
    if stream is not None:
        stream.close()
    elif writing:
        for text, tokens in zip(prompts, out):
            reply = _reply(tokenizer, tokens, end)
            print(f"user: {text}\nassistant: {reply}\n" if args.chat else text + reply + "\n")
    if writing:
        print(out.stats.describe(), file=sys.stderr)  # beside the text, not in it
    return 0
