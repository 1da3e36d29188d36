"""The `draftsman` command line.

    draftsman generate --config cfg.yaml --prompt "def f(" [--drafter ngram] [--set drafter.k=6] [--json]
    draftsman generate --target DIR --prompt "def f(" [--drafter ngram]   # no config file: target.path = DIR
    draftsman generate --config cfg.yaml --chat "Write a haiku" [--system TEXT]   # or --messages FILE.json
    draftsman drafters                 # registered drafters, their options and defaults
    draftsman demo [...]               # the bundled demo (draftsman/demo.py, when built)

    draftsman compare [--config bench.yaml] [--quick]   # drafters side by side (draftsman/bench/)
    draftsman audit --config cfg.yaml [--prompts FILE] [--json]   # is the drafter lossless? (exit 1 if not)

    draftsman train medusa|eagle|eagle3|mtp|mlp_speculator --config training/configs/<kind>.yaml   # a frozen target
    draftsman regenerate --target DIR --data-file IN.jsonl --out OUT.jsonl   # replies by the target itself
    draftsman export eagle|medusa --heads DIR --target DIR --engine vllm --out DIR   # for serving engines

Every subcommand is one row of SUBCOMMANDS: (help, add_arguments, run). User errors (bad config, missing folder, bad prompt) print
`error: <message>` and exit 2; tracebacks are kept for bugs.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import re
import sys
import textwrap
from typing import TYPE_CHECKING, Callable

import yaml

from . import __version__
from .chat import TOOL_SHAPE, check_conversations, check_template_kwargs, check_tools
from .config import DEFAULTS, apply_overrides, load_config, merge, parse_yaml, read_text
from .drafter_catalog import describe_drafters
from .json_lines import json_lines
from .reasoning import PARSERS as REASONING_PARSERS
from .replies import (PARSER_FLAGS, DeltaPrinter, ReplyStream, grammar_after_thought, message_deltas, opened_thoughts,
                      reply_messages, use_parsers, with_default_grammar)
from .tool_calls import PARSERS as TOOL_CALL_PARSERS
from .verifier.structured import StructuredOutput

if TYPE_CHECKING:  # torch and transformers load with the first model, not with `draftsman --help`
    from .api import Decoder, GenerationStats

EXIT_USAGE = 2  # same status argparse uses for bad arguments


class UserError(ValueError):
    """A problem in what the user asked for, reported without a traceback."""


def add_target_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", metavar="DIR", help="the target model folder (sets target.path: no config file "
                                                   "needed, or over the config's)")


def add_run_config_args(p: argparse.ArgumentParser) -> None:
    """--config / --target / --drafter / --set, for the commands that build one Decoder and keep it
    (serve, chat)."""
    p.add_argument("--config", help="YAML or JSON run config (sections: target, drafter, sampling, generation)")
    add_target_arg(p)
    p.add_argument("--drafter", metavar="NAME", help="use this drafter instead of the config's (its options are "
                                                     "dropped; add new ones with --set)")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE",
                   help="override one config value, parsed as YAML (drafter.k=6, sampling.temperature=0.7)")


# --------------------------------------------------------------------------- generate

def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or JSON run config (sections: target, drafter, sampling, generation)")
    add_target_arg(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt; repeat for a batch")
    p.add_argument("--input-ids", action="append", default=[], metavar="IDS",
                   help='a prompt as token ids, e.g. "1,2,3"; repeat for a batch (instead of --prompt)')
    p.add_argument("--chat", action="append", default=[], metavar="TEXT",
                   help="a user message, sent through the target's chat template with the assistant's turn "
                        "opened (an instruct model's prompt); repeat for a batch of one-message conversations")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each user message")
    p.add_argument("--chat-template-kwarg", action="append", default=[], type=parse_template_kwarg,
                   dest="chat_template_kwargs", metavar="NAME=VALUE",
                   help="with --chat / --messages: a variable for the chat template, VALUE parsed as YAML "
                        "(repeatable; vLLM's chat_template_kwargs), e.g. enable_thinking=false")
    p.add_argument("--messages", metavar="FILE",
                   help='a JSON file of one conversation, [{"role": "user", "content": "..."}, ...], or a list '
                        'of them, or a .jsonl file of one conversation a line (a list, or {"messages": [...]}), '
                        "sent through the target's chat template")
    p.add_argument("--tools", metavar="FILE",
                   help="with --chat / --messages: a JSON file of tool definitions (a list of OpenAI-style "
                        "function schemas) for a tool-calling model's chat template")
    add_reply_parser_args(p, "with --chat / --messages: ")
    p.add_argument("--drafter", metavar="NAME",
                   help="use this drafter; if it differs from the config's, the config's drafter options "
                        "are dropped (they belong to the other drafter) - add new ones with --set")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE",
                   help="override one config value, parsed as YAML (drafter.k=6, sampling.top_k=null); "
                        "applied after --config and --drafter")
    p.add_argument("--max-new-tokens", type=int, help="default: generation.max_new_tokens")
    p.add_argument("--min-new-tokens", type=int,
                   help="EOS cannot end a row before this many new tokens; default: generation.min_new_tokens")
    p.add_argument("--temperature", type=float, help="0 = greedy; default: sampling.temperature")
    p.add_argument("--top-k", type=int, help="default: sampling.top_k")
    p.add_argument("--top-p", type=float, help="default: sampling.top_p")
    p.add_argument("--min-p", type=float, help="default: sampling.min_p")
    add_truncation_args(p)
    p.add_argument("--repetition-penalty", type=float,
                   help="Hugging Face's, e.g. 1.2; default: sampling.repetition_penalty")
    add_ngram_ban_arg(p)
    p.add_argument("--structured-output", type=parse_structured_output, metavar="JSON",
                   help='the output held to a grammar, as JSON: {"json": SCHEMA}, {"json_object": true}, '
                        '{"regex": "..."}, {"choice": [...]} or {"grammar": LARK} (vLLM\'s structured_outputs; '
                        "exact: plain decoding under the grammar); default: sampling.structured_output")
    p.add_argument("--presence-penalty", type=float, help="vLLM / OpenAI's; default: sampling.presence_penalty")
    p.add_argument("--frequency-penalty", type=float, help="vLLM / OpenAI's; default: sampling.frequency_penalty")
    add_logit_bias_arg(p)
    add_lossy_typical_arg(p)
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="end a row when it generates TEXT (repeatable; the output ends before it); "
                        "default: generation.stop. In bash, --stop $'\\n\\n' is two newlines")
    p.add_argument("--stop-token-id", type=int, action="append", dest="stop_token_ids", metavar="ID",
                   help="end a row when it generates token ID, as EOS does (repeatable); "
                        "default: generation.stop_token_ids")
    p.add_argument("--ignore-eos", action="store_true", default=None,
                   help="EOS ends no row (vLLM's ignore_eos): rows run to --max-new-tokens or a stop; "
                        "default: generation.ignore_eos")
    p.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                   help="N samples of each prompt (needs --temperature > 0), printed prompt by prompt")
    p.add_argument("--seed", type=int, help="default: generation.seed")
    p.add_argument("--json", action="store_true", help="print one JSON object: texts, token_ids, stats, config")
    p.add_argument("--logprobs", nargs="?", const="raw", choices=["raw", "processed"],
                   help="with --json: add logprobs, the target's log-probability of each new token; raw (the "
                        "default): the model's distribution; processed: the one each token is drawn from")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="with --json --logprobs: add top_logprobs, the N most likely tokens at each position "
                        "as [token id, log-probability] pairs")


def parse_input_ids(text: str) -> list[int]:
    """'1,2,3', '1, 2, 3' or '1 2 3' -> [1, 2, 3]. An empty place between commas ('1,,3', '1,2,') is
    refused: an id lost in a paste, not a shorter prompt to run."""
    parts = re.split(r"\s*,\s*|\s+", text.strip())
    if "" in parts and parts != [""]:
        raise UserError(f"--input-ids '{text}': an id is missing between commas (or before or after them)")
    try:
        ids = [int(x) for x in parts if x]
    except ValueError:
        raise UserError(f"--input-ids '{text}': expected integers separated by commas, e.g. \"1,2,3\"") from None
    if not ids:  # (a text prompt may be "": its tokenizer may add a BOS token)
        raise UserError(f"--input-ids '{text}': no token ids: give at least one (e.g. the BOS token's)")
    return ids


def build_config(config_path: str | None, drafter: str | None, overrides: list[str], target: str | None = None) -> dict:
    """The run config from a file (or the defaults), then --drafter, then --set overrides, then
    --target (the folder as typed: a --set value would be parsed as YAML)."""
    cfg = load_config(config_path) if config_path else load_config({})
    if drafter is not None and drafter != cfg["drafter"].get("name"):
        # Options such as `path` or `k` were written for the other drafter; carrying them over
        # would either be rejected or silently mean something else.
        cfg["drafter"] = {"name": drafter}
    cfg = apply_overrides(cfg, overrides)
    if target is not None:
        cfg["target"]["path"] = target
    return cfg


# Config keys whose flag is not the key dashed (max_new_tokens -> --max-new-tokens): one item a flag.
_FLAG_NAMES = {"stop_token_ids": "--stop-token-id", "bad_words_ids": "--bad-word"}


def with_generate_flags(cfg: dict, args: argparse.Namespace) -> dict:
    """The config the run uses: cfg with the sampling and generation flags given over it, checked as any
    config is (config.merge). So a bad flag value is refused before a model loads, and --json's "config"
    holds what the run used (rerunning from it repeats the run)."""
    given = {("sampling", key): value for key, value in sampling_flags(args).items() if value is not None}
    given.update({("generation", key): getattr(args, key) for key in DEFAULTS["generation"]
                  if getattr(args, key, None) is not None})
    raw = copy.deepcopy(cfg)
    for (section, key), value in given.items():
        raw[section][key] = value
    try:
        return merge(raw)
    except ValueError as e:
        # The message names the config key (generation.max_new_tokens); say which flag set it.
        flags = [_FLAG_NAMES.get(key, "--" + key.replace("_", "-")) for section, key in given
                 if re.search(rf"\b{section}\.{key}\b", str(e))]
        raise UserError(f"{', '.join(flags)}: {e}" if flags else str(e)) from None


def _run_generate(args: argparse.Namespace) -> int:
    # Check the prompts before loading any model: a typo should not cost a model load.
    if sum(map(bool, (args.prompt, args.input_ids, args.chat, args.messages))) != 1:
        raise UserError("give the prompts one way: --prompt TEXT, --input-ids 1,2,3 or --chat TEXT (repeat "
                        "any of them for a batch), or --messages FILE; not several, not none")
    if args.system is not None and not args.chat:
        raise UserError("--system goes with --chat (put a system message in the --messages file instead)")
    if args.chat_template_kwargs and not (args.chat or args.messages):
        raise UserError("--chat-template-kwarg goes with --chat or --messages: plain prompts use no template")
    if args.tools and not (args.chat or args.messages):
        raise UserError("--tools goes with --chat or --messages: plain prompts use no template")
    for flag, given in zip(PARSER_FLAGS, (args.tool_call_parser, args.reasoning_parser)):
        if given and not (args.chat or args.messages):
            raise UserError(f"{flag} parses chat replies: it goes with --chat or --messages")
    template_kwargs = check_template_kwargs(dict(args.chat_template_kwargs))
    conversations = chat_conversations(args)
    tools = read_tools(args.tools)
    if args.logprobs and not args.json:
        raise UserError("--logprobs adds a field to the JSON output: add --json")
    if args.top_logprobs and not args.logprobs:
        raise UserError("--top-logprobs needs --logprobs (and --json): add them")
    input_ids = [parse_input_ids(s) for s in args.input_ids] or None
    cfg = with_generate_flags(build_config(args.config, args.drafter, args.overrides, args.target), args)
    lossy_warning(cfg["sampling"])

    from transformers.utils import logging as hf_logging

    from .api import Decoder, _check_samples
    from .verifier.sampling import SamplingParams

    try:  # the rule generate applies, before the model loads rather than after
        _check_samples(args.num_return_sequences, SamplingParams(**cfg["sampling"]))
    except ValueError as e:
        raise UserError(f"--num-return-sequences: {e}") from None

    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the output on stderr
    decoder = Decoder(cfg)
    with drafter_memory_kept(decoder):
        return _generate_with(decoder, args, cfg, conversations, input_ids, template_kwargs, tools)


def _generate_with(decoder: Decoder, args: argparse.Namespace, cfg: dict, conversations, input_ids, template_kwargs,
                   tools) -> int:
    parsers = (args.tool_call_parser, args.reasoning_parser)
    use_parsers(decoder, *parsers)
    if conversations is not None:
        input_ids = decoder.encode_chat(conversations, chat_template_kwargs=template_kwargs, tools=tools)
    sampling = sampling_flags(args)
    if conversations is not None and args.reasoning_parser:  # the grammar holds the answer, after the thought
        grammars = with_default_grammar(sampling["structured_output"], decoder.config["sampling"]["structured_output"])
        try:
            sampling["structured_output"] = grammar_after_thought(decoder.tokenizer, input_ids, grammars,
                                                                  args.reasoning_parser)
        except ValueError as e:
            raise UserError(str(e)) from None
    one_prompt = len(args.prompt) == 1 or (conversations is not None and len(input_ids) == 1)
    if not args.json and one_prompt and args.num_return_sequences == 1 and decoder.tokenizer is not None:
        opened = opened_thoughts(decoder.tokenizer, input_ids or [], 1, args.reasoning_parser,
                                 sampling["structured_output"])[0]
        return _stream_one(decoder, args, input_ids[0] if input_ids else None, parsers, tools, opened, sampling)
    out = decoder.generate(args.prompt or None, input_ids=input_ids, max_new_tokens=args.max_new_tokens,
                           min_new_tokens=args.min_new_tokens, seed=args.seed, stop=args.stop,
                           stop_token_ids=args.stop_token_ids, num_return_sequences=args.num_return_sequences,
                           ignore_eos=args.ignore_eos,
                           logprobs=args.logprobs or False, top_logprobs=args.top_logprobs, **sampling)
    opened = opened_thoughts(decoder.tokenizer, input_ids or [], len(out.texts), args.reasoning_parser,
                             sampling["structured_output"])
    if args.json:
        logprobs = {"logprobs": out.logprobs} if args.logprobs else {}
        if args.top_logprobs:
            logprobs["top_logprobs"] = out.top_logprobs
        # A chat's replies also as OpenAI's assistant messages, parsed as Decoder.chat parses them.
        messages = {"messages": reply_messages(out.texts, *parsers, tools, opened)} if conversations is not None else {}
        print(json.dumps({"texts": out.texts, "token_ids": out.token_ids, **logprobs, **messages,
                          "stats": out.stats.as_dict(), "config": cfg}))
        return 0
    many = len(out.token_ids) > 1
    for i, (text, ids) in enumerate(zip(out.texts, out.token_ids)):
        if many:
            print(f"--- [{i}] ---")
        if any(parsers):
            printer = DeltaPrinter()
            printer.write(message_deltas(reply_messages([text], *parsers, tools, opened[i:i + 1])[0]))
            printer.end()
            continue
        # Without a tokenizer there is no text: show the ids rather than an empty line.
        print(text if decoder.tokenizer is not None else " ".join(map(str, ids)))
    _print_stats(decoder.drafter.name, out.stats)
    return 0


@contextlib.contextmanager
def drafter_memory_kept(decoder: Decoder):
    """Saves the drafter's memory (Decoder.save_drafter_memory) when the block ends, however it
    ends: what a run taught the drafter outlives it."""
    try:
        yield decoder
    finally:
        for path in decoder.save_drafter_memory():
            print(f"drafter memory saved to {path}", file=sys.stderr)


def add_reply_parser_args(p: argparse.ArgumentParser, prefix: str = "", tool_calls: bool = True) -> None:
    """--reasoning-parser and --tool-call-parser (vLLM's flags and format names; draftsman/replies.py)."""
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, metavar="FORMAT",
                   help=f"{prefix}a reply's thinking (<think>...</think>, Magistral's [THINK]...[/THINK]) comes "
                        "apart from the answer, as vLLM's "
                        f"reasoning_content (formats: {', '.join(REASONING_PARSERS)})")
    if tool_calls:
        p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, metavar="FORMAT",
                       help=f"{prefix}the tool calls a reply writes in this format come apart, as OpenAI's "
                            f"tool_calls (formats: {', '.join(TOOL_CALL_PARSERS)}: hermes's <tool_call>{{json}}"
                            "</tool_call>, as Hermes and Qwen write them; qwen3_coder's <tool_call><function=NAME>"
                            "<parameter=KEY>..., as Qwen3-Coder writes them, the values typed by the tool schema; "
                            "llama3_json's {\"name\": ..., \"parameters\": ...}, as Llama 3.1 / 3.2 write them; "
                            "pythonic's [name(key=value), ...], as Llama 3.2 / 4 write them; mistral's "
                            "[TOOL_CALLS] calls, as Mistral's models write them, the marker kept in the text)")


def add_logit_bias_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--logit-bias", action="append", type=parse_logit_bias, metavar="ID=BIAS",
                   help=f"{prefix}add BIAS (in [-100, 100]) to token ID's logit (repeatable; OpenAI's logit_bias); "
                        "default: sampling.logit_bias")


def add_ngram_ban_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """Hugging Face's no_repeat_ngram_size and bad_words_ids."""
    p.add_argument("--no-repeat-ngram-size", type=int, metavar="N",
                   help=f"{prefix}no N-gram twice in prompt + output (Hugging Face's; exact at any temperature); "
                        "default: sampling.no_repeat_ngram_size")
    p.add_argument("--bad-word", action="append", type=parse_token_ids, dest="bad_words_ids", metavar="IDS",
                   help=f"{prefix}a token sequence never to generate, e.g. 50256 or 1,2 (repeatable; Hugging Face's "
                        "bad_words_ids); default: sampling.bad_words_ids")


def parse_structured_output(text: str) -> dict:
    """'{"regex": "[0-9]+"}' -> {'regex': '[0-9]+'}, checked as generate checks it."""
    try:
        value = json.loads(text)
        StructuredOutput.parse(value)
    except (json.JSONDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"'{text[:80]}': {e}") from None
    return value


def parse_token_ids(text: str) -> list[int]:
    """'1,2' -> [1, 2]."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected token ids separated by commas, e.g. 1,2") from None
    return ids


def add_truncation_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """Hugging Face's typical-p, epsilon, eta and top-H warpers (exact: they shape the target's
    distribution)."""
    p.add_argument("--top-h", type=float,
                   help=f"{prefix}Hugging Face's top-H in (0, 1], e.g. 0.4 (transformers 5); default: sampling.top_h")
    p.add_argument("--typical-p", type=float,
                   help=f"{prefix}locally typical sampling mass, e.g. 0.95 (Hugging Face's typical_p; exact, not "
                        "--lossy-typical-acceptance); default: sampling.typical_p")
    p.add_argument("--epsilon-cutoff", type=float,
                   help=f"{prefix}drop tokens below this probability, e.g. 3e-4; default: sampling.epsilon_cutoff")
    p.add_argument("--eta-cutoff", type=float,
                   help=f"{prefix}drop tokens below min(eta, sqrt(eta) exp(-entropy)), e.g. 1e-3; "
                        "default: sampling.eta_cutoff")


def add_lossy_typical_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--lossy-typical-acceptance", nargs="?", const=True, type=parse_typical, metavar="THRESHOLD,ALPHA",
                   help=f"{prefix}LOSSY: accept drafts by Medusa's typical acceptance at temperature > 0 "
                        "(posterior threshold and alpha; default 0.09,0.3). More drafts are accepted, and the "
                        "output is no longer distributed as the target's; default: sampling.lossy_typical_acceptance")


def parse_typical(text: str) -> dict:
    """'0.09,0.3' -> {'posterior_threshold': 0.09, 'posterior_alpha': 0.3}."""
    try:
        threshold, alpha = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected THRESHOLD,ALPHA, e.g. 0.09,0.3") from None
    return {"posterior_threshold": threshold, "posterior_alpha": alpha}


def lossy_warning(sampling: dict) -> None:
    """Say it on stderr whenever a run is lossy, so no output passes for the target's own."""
    if sampling.get("lossy_typical_acceptance") not in (None, False) and sampling.get("temperature"):
        print("warning: lossy_typical_acceptance is on: drafts are accepted by Medusa's typical acceptance, so "
              "this output is NOT distributed as the target's own samples", file=sys.stderr)


def parse_logit_bias(text: str) -> tuple[int, float]:
    """'50256=-100' -> (50256, -100.0)."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected ID=BIAS, e.g. 50256=-100") from None


def sampling_flags(args: argparse.Namespace) -> dict:
    """--temperature, --top-k, ...: one flag per key of the config's sampling section (None = unset;
    a command without a key's flag, as the audit has no --structured-output, leaves it unset)."""
    flags = {key: getattr(args, key, None) for key in DEFAULTS["sampling"]}
    flags["logit_bias"] = dict(flags["logit_bias"]) if flags["logit_bias"] else None  # [(id, bias)] -> {id: bias}
    return flags


def parse_template_kwarg(text: str) -> tuple[str, object]:
    """'enable_thinking=false' -> ('enable_thinking', False)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"'{text}': expected NAME=VALUE, e.g. enable_thinking=false")
    return name.strip(), parse_yaml(value)


def chat_conversations(args: argparse.Namespace) -> list[list[dict]] | None:
    """--chat / --system or --messages as a list of checked conversations; None for other prompts."""
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        return [[*system, {"role": "user", "content": text}] for text in args.chat]
    if not args.messages:
        return None
    text = read_flag_file("--messages", args.messages)
    if args.messages.endswith(".jsonl"):
        messages = _jsonl_conversations(args.messages, text)
    else:
        try:
            messages = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--messages '{args.messages}' is not valid JSON ({e}): expected "
                            '[{"role": "user", "content": "..."}, ...] or a list of such lists (or a .jsonl '
                            "file, one conversation a line)") from None
    try:
        return check_conversations(messages)
    except ValueError as e:
        raise UserError(f"--messages '{args.messages}': {e}") from None


def read_flag_file(flag: str, path: str) -> str:
    """The text of the file a flag names; one that cannot be read is named with the flag and the fix."""
    try:
        return read_text(path, flag)
    except FileNotFoundError:
        raise UserError(f"{flag}: no such file '{path}'") from None
    except ValueError as e:  # a folder, not UTF-8, not readable
        raise UserError(str(e)) from None


def _jsonl_conversations(path: str, text: str) -> list:
    """A .jsonl --messages file: one conversation a line, a list of messages or an object with
    "messages" (OpenAI's batch and fine-tuning files); blank lines skipped."""
    each = ('each line of a .jsonl file is a conversation, [{"role": "user", "content": "..."}, ...] or '
            '{"messages": [...]}')
    conversations = []
    try:
        for number, _, record in json_lines(text, path, each):
            if isinstance(record, dict) and "messages" in record:
                record = record["messages"]
            elif isinstance(record, dict):  # one message a line would be ambiguous: which conversation?
                raise ValueError(f"{path}:{number}: {each}; this one is a single message with keys {sorted(record)}")
            conversations.append(record)
    except ValueError as e:
        raise UserError(f"--messages {e}") from None
    if not conversations:
        raise UserError(f"--messages '{path}' has no conversations (no lines)")
    return conversations


def read_tools(path: str | None) -> list[dict] | None:
    """--tools FILE: its checked list of tool definitions; None without the flag."""
    if not path:
        return None
    text = read_flag_file("--tools", path)
    try:
        return check_tools(json.loads(text))
    except json.JSONDecodeError as e:
        raise UserError(f"--tools '{path}' is not valid JSON ({e}): expected a list like [{TOOL_SHAPE}]") from None
    except ValueError as e:
        raise UserError(f"--tools '{path}': {e}") from None


def _stream_one(decoder: Decoder, args: argparse.Namespace, input_ids: list[int] | None = None,
                parsers: tuple[str | None, str | None] = (None, None), tools: list[dict] | None = None,
                opened: bool = False, sampling: dict | None = None) -> int:
    """One prompt (text, or the ids of a conversation): print the continuation as rounds accept it;
    parsers (tool-call, reasoning): a chat reply's thought and calls printed apart as they come
    (tools: the tool definitions, whose types qwen3_coder's values are read by; opened: the reply
    is read as starting inside the thought, opened_thoughts); sampling: the sampling settings
    (default: sampling_flags(args))."""
    from .api import GenerationStats

    stats = GenerationStats()
    prompt = None if input_ids is not None else args.prompt[0]
    reply, printer = (ReplyStream(*parsers, tools, opened), DeltaPrinter()) if any(parsers) else (None, None)
    for piece in decoder.stream(prompt, input_ids=input_ids, max_new_tokens=args.max_new_tokens,
                                min_new_tokens=args.min_new_tokens, seed=args.seed, stats=stats,
                                stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                                **(sampling_flags(args) if sampling is None else sampling)):
        if reply is None:
            print(piece, end="", flush=True)
        else:
            printer.write(reply.feed(piece))
    if reply is None:
        print()
    else:
        printer.write(reply.feed("", final=True))
        printer.end()
    _print_stats(decoder.drafter.name, stats)
    return 0


def _print_stats(drafter: str, s: GenerationStats) -> None:
    """drafter: the name of the one that ran (decoder.drafter.name: adaptive(ngram) where the config says ngram)."""
    print(f"[stats] drafter {drafter}: tau {s.tau:.2f} tokens/pass, "
          f"{s.tokens_per_second:.1f} tokens/s, {s.rounds} rounds, {s.new_tokens} new tokens, "
          f"{s.total_seconds:.2f} s" + (" (LOSSY: typical acceptance)" if s.lossy else ""))


# --------------------------------------------------------------------------- drafters

def _add_drafters_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the list as JSON")


def _run_drafters(args: argparse.Namespace) -> int:
    drafters = describe_drafters()
    if args.json:
        print(json.dumps(drafters, indent=2))
        return 0
    for d in drafters:
        print(d["name"])
        print(textwrap.fill(d["summary"], width=100, initial_indent="    ", subsequent_indent="    "))
        if not d["options"]:
            print("    options: none")
        for o in d["options"]:
            default = yaml.safe_dump(o["default"], default_flow_style=True).strip().removesuffix("...").strip()
            line = f"    drafter.{o['name']} = {default}  ({o['type']})"
            print(line + (f"  # {o['help']}" if o["help"] else ""))
        print()
    print("Choose one in a config (drafter: {name: ngram, k: 6}) or on the command line "
          "(--drafter ngram --set drafter.k=6).")
    return 0


# --------------------------------------------------------------------------- demo

def _run_demo(argv: list[str]) -> int:
    """Hand the arguments to draftsman/demo.py, which owns its own parser."""
    if importlib.util.find_spec("draftsman.demo") is None:
        print("error: the demo is not available yet: it needs the bundled models zoo/python-target and "
              "zoo/python-draft, which are not built yet (`make zoo` trains them, ~1.5 h on CPU)",
              file=sys.stderr)
        return EXIT_USAGE
    from . import demo

    return demo.main(argv) or 0


# --------------------------------------------------------------------------- compare

def _add_compare_args(p: argparse.ArgumentParser) -> None:
    from .bench import command

    command.add_arguments(p)


def _run_compare(args: argparse.Namespace) -> int:
    from .bench import command

    return command.run(args)


# --------------------------------------------------------------------------- audit

def _add_audit_args(p: argparse.ArgumentParser) -> None:
    from . import audit_flags  # not audit: it imports torch and transformers

    audit_flags.add_arguments(p)


def _run_audit(args: argparse.Namespace) -> int:
    from . import audit

    return audit.run(args)


# --------------------------------------------------------------------------- train

def _run_train(argv: list[str]) -> int:
    from .training import heads_config

    if argv[:1] == ["pard"]:  # its own trainer and flags (training/pard.py)
        args = heads_config.pard_parser().parse_args(argv[1:])  # --help and a typo answer before torch loads
        from .training import pard

        return pard.run(args)
    args = heads_config.train_parser().parse_args(argv)
    from .training import heads

    return heads.run(args)


# --------------------------------------------------------------------------- vocab

def _add_vocab_args(p: argparse.ArgumentParser) -> None:
    from .training import vocab

    vocab.add_arguments(p)


def _run_vocab(args: argparse.Namespace) -> int:
    from .training import vocab

    return vocab.run(args)


# --------------------------------------------------------------------------- regenerate

def _add_regenerate_args(p: argparse.ArgumentParser) -> None:
    from .training import regenerate

    regenerate.add_arguments(p)


def _run_regenerate(args: argparse.Namespace) -> int:
    from .training import regenerate

    return regenerate.run(args)


# --------------------------------------------------------------------------- export

def _add_export_args(p: argparse.ArgumentParser) -> None:
    from . import export_flags  # not export: it imports torch and transformers

    export_flags.add_arguments(p)


def _run_export(args: argparse.Namespace) -> int:
    from . import export

    return export.run(args)


# --------------------------------------------------------------------------- datastore

def _add_datastore_args(p: argparse.ArgumentParser) -> None:
    from . import datastore_build

    datastore_build.add_arguments(p)


def _run_datastore(args: argparse.Namespace) -> int:
    from . import datastore_build

    return datastore_build.run(args)


# --------------------------------------------------------------------------- loadtest

def _add_loadtest_args(p: argparse.ArgumentParser) -> None:
    from . import loadtest

    loadtest.add_arguments(p)


def _run_loadtest(args: argparse.Namespace) -> int:
    from . import loadtest

    return loadtest.run(args)


# --------------------------------------------------------------------------- serve

def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from . import serve_flags  # not serve: the server imports torch and transformers

    serve_flags.add_arguments(p)


def _run_serve(args: argparse.Namespace) -> int:
    from . import serve

    return serve.run(args)


# --------------------------------------------------------------------------- chat

def _add_chat_args(p: argparse.ArgumentParser) -> None:
    from . import interactive

    interactive.add_arguments(p)


def _run_chat(args: argparse.Namespace) -> int:
    from . import interactive

    return interactive.run(args)


# --------------------------------------------------------------------------- dispatch

# name -> (help, add_arguments, run). Commands whose add_arguments is None take their raw argv and
# parse it themselves (run(argv)); the others get an argparse Namespace (run(args)).
SUBCOMMANDS: dict[str, tuple[str, Callable | None, Callable]] = {
    "generate": ("generate text with a target model and a drafter", _add_generate_args, _run_generate),
    "drafters": ("list the registered drafters with their options and defaults", _add_drafters_args,
                 _run_drafters),
    "demo": ("run the bundled demo (models in zoo/); arguments go to the demo", None, _run_demo),
    "compare": ("every drafter on one target side by side, with Hugging Face peers, tables and plots",
                _add_compare_args, _run_compare),
    "audit": ("check that a drafter is lossless on your target: greedy argmax and sampling chi-square; "
              "exit 1 on a failure", _add_audit_args, _run_audit),
    "train": ("train draft heads on a frozen target: draftsman train medusa|eagle|eagle3|mtp|mlp_speculator "
              "--config FILE (pard: adapt a draft model for parallel drafting)", None, _run_train),
    "vocab": ("count the tokens the target picks most, for a draft model's draft_vocab", _add_vocab_args,
              _run_vocab),
    "regenerate": ("write a data_file's assistant replies again with the target itself (self-distilled "
                   "training data for heads)", _add_regenerate_args, _run_regenerate),
    "export": ("write trained heads in the layout vLLM / SGLang (or the Medusa repo) load", _add_export_args,
               _run_export),
    "datastore": ("tokenize a retrieval drafter's datastore once and write it as an index it loads in a moment",
                  _add_datastore_args, _run_datastore),
    "serve": ("serve the OpenAI API (/v1/completions, /v1/chat/completions) with speculative decoding",
              _add_serve_args, _run_serve),
    "loadtest": ("clients at once against an OpenAI-compatible server (ours, vLLM's, ...): throughput, latency, "
                 "TTFT", _add_loadtest_args, _run_loadtest),
    "chat": ("talk to an instruct target in the terminal, each reply streamed with its tau and speed",
             _add_chat_args, _run_chat),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command line, only its command gets its flags. Each command's
    module imports what it runs on (torch, transformers: seconds), so `draftsman --help`, and a
    typo in a command's flags, answer without loading the others."""
    parser = argparse.ArgumentParser(prog="draftsman", description="Exact speculative decoding.")
    parser.add_argument("--version", action="version", version=f"draftsman {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if add_arguments is not None and (argv is None or argv[:1] == [name]):
            add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS and SUBCOMMANDS[argv[0]][1] is None:
            return SUBCOMMANDS[argv[0]][2](argv[1:])
        args = build_parser(argv).parse_args(argv)
        return SUBCOMMANDS[args.command][2](args)
    except BrokenPipeError:  # `draftsman drafters | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is quiet
        return 1
    except (ValueError, OSError, yaml.YAMLError) as e:
        # Bad config, missing model folder, bad prompt: the message says what to fix.
        # (json.JSONDecodeError is a ValueError, FileNotFoundError an OSError.)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
