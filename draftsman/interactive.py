"""`draftsman chat --config chat.yaml`: talk to an instruct target in the terminal, as Medusa's and
EAGLE's demos do, with any drafter. Each reply streams as rounds accept tokens and is followed by
its stats (tau, tokens/s), so a drafter's effect on a real conversation is visible turn by turn.

One line is one user message. The conversation so far goes through the target's chat template
every turn; the replies join it as assistant messages (under --reasoning-parser a reply's thought
is printed apart, and joins as the message's reasoning_content, which thinking models' templates
read or drop as they were trained to). Commands: /reset (or /clear) forgets the conversation
(the system message stays), /exit (or /quit, or end of input) quits, /help lists them; another
"/word" line is named as unknown, not sent (a path such as /usr/bin/env is a message). Ctrl-C
stops the reply being written, which the conversation then leaves out; at the prompt it quits.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from typing import TYPE_CHECKING

from .chat import require_chat_template
from .config import merge
from .replies import DeltaPrinter, ReplyStream, opened_thoughts, reply_message, use_parsers

if TYPE_CHECKING:  # torch and transformers load with the model, not with `draftsman chat --help`
    from .api import Decoder

PROMPT = ">>> "
COMMANDS = "/reset (forget the conversation), /exit (or Ctrl-D), /help; Ctrl-C stops a reply"
EXIT, RESET, HELP = ("/exit", "/quit", "/bye"), ("/reset", "/clear"), ("/help", "/?")
# The generation flags and the config keys they stand in for.
FLAG_KEYS = {"max_new_tokens": ("generation", "max_new_tokens"), "temperature": ("sampling", "temperature")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import add_reply_parser_args, add_run_config_args

    add_run_config_args(p)
    add_reply_parser_args(p, tool_calls=False)
    p.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", type=int, help="longest reply; default: generation.max_new_tokens")
    p.add_argument("--temperature", type=float, help="0 = greedy; default: sampling.temperature")
    p.add_argument("--no-stats", action="store_true", help="no stats line after each reply")


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .api import Decoder
    from .cli import build_config, drafter_memory_kept, lossy_warning

    cfg = with_flags(build_config(args.config, args.drafter, args.overrides, args.target), args)
    lossy_warning(cfg["sampling"])
    hf_logging.disable_progress_bar()
    decoder = Decoder(cfg)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    require_chat_template(decoder.tokenizer, cfg["target"]["path"])  # refused before any input is read
    use_parsers(decoder, None, args.reasoning_parser)
    print(f"chatting with {cfg['target']['path']} (drafter {cfg['drafter']['name']}); {COMMANDS}", file=sys.stderr)
    with drafter_memory_kept(decoder):
        converse(decoder, sys.stdin, system, args.max_new_tokens, args.temperature, show_stats=not args.no_stats,
                 reasoning_parser=args.reasoning_parser)
    return 0


def with_flags(cfg: dict, args: argparse.Namespace) -> dict:
    """The config with the generation flags given set in it, each checked as the config's own value
    is (config.merge). Every turn runs with them, so a value no reply could be made with is refused
    before the model loads, rather than failing every message."""
    for name, (section, key) in FLAG_KEYS.items():
        value = getattr(args, name)
        if value is None:
            continue
        raw = copy.deepcopy(cfg)
        raw[section][key] = value
        try:
            cfg = merge(raw)
        except ValueError as e:  # the config's own words, with the flag that set the value
            raise ValueError(f"--{name.replace('_', '-')} {value}: {e}") from None
    return cfg


def converse(decoder: Decoder, lines, system: list[dict], max_new_tokens: int | None = None,
             temperature: float | None = None, show_stats: bool = True,
             reasoning_parser: str | None = None) -> list[dict]:
    """The loop, on any iterable of lines; returns the conversation as it stands at the end.
    reasoning_parser: each reply's thought printed under "[reasoning]", its answer under "[answer]"."""
    from .api import GenerationStats

    messages = list(system)
    interactive = hasattr(lines, "isatty") and lines.isatty()
    while True:
        if interactive:
            print(PROMPT, end="", flush=True)
        try:
            line = lines.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: quit, as end of input does
            print(file=sys.stderr)
            break
        if not line:  # end of input
            break
        text = line.rstrip("\n")
        command = text.strip().lower()
        if not command:
            continue
        if command in EXIT:
            break
        if command in RESET:
            messages = list(system)
            print("(conversation reset)", file=sys.stderr)
            continue
        if re.fullmatch(r"/[a-z?]+", command):  # a command; "/usr/bin/env" or "/usr is ..." is a message
            known = "" if command in HELP else f"unknown command {text.strip()}; "
            print(f"({known}commands: {COMMANDS})", file=sys.stderr)
            continue
        asked = messages + [{"role": "user", "content": text}]
        stats = GenerationStats()
        reply = ""
        try:
            ids = decoder.encode_chat(asked)[0]
            opened = opened_thoughts(decoder.tokenizer, [ids], 1, reasoning_parser)[0]
            parts, printer = ReplyStream(reasoning_parser=reasoning_parser, opened=opened), DeltaPrinter()
            for piece in decoder.stream(input_ids=ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                        stats=stats):
                printer.write(parts.feed(piece))
                reply += piece
        except ValueError as e:  # e.g. the conversation outgrew the context: keep it as it was
            print(f"error: {e} (/reset starts over)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # stop this reply, not the chat; a half reply would steer the next ones
            print("\n(reply stopped; the conversation leaves it out)", file=sys.stderr)
            continue
        printer.write(parts.feed("", final=True))
        printer.end()
        messages = asked + [reply_message(reply, "stop", reasoning_parser=reasoning_parser, opened=opened)[0]]
        if show_stats:
            lossy = " LOSSY" if stats.lossy else ""
            print(f"[tau {stats.tau:.2f}, {stats.tokens_per_second:.1f} tokens/s, {stats.new_tokens} tokens, "
                  f"{stats.finish_reasons[0]}{lossy}]", file=sys.stderr)
    return messages
