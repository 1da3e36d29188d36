"""The public entry points: `draftsman.load(config)` -> Decoder, `Decoder.generate(...)`."""
from __future__ import annotations

import numbers
import operator
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Container, Iterable, NamedTuple

from .chat import chat_ids, check_conversations, check_unicode
from .replies import (check_parsers, grammar_after_thought, kept_in_text, opened_thoughts, reply_messages,
                      with_default_grammar)
from .tool_calls import arguments_as_objects
from .config import check_drafter_named, load_config
from .models import check_model_folder, eos_ids, load_causal_lm, load_tokenizer, resolve_device, verified_context
from .drafters import TargetInfo, build_drafter, check_drafter_config
from .detokenize import IncrementalText
from .stop import StopStrings, check_stop_strings
from .verifier.engine import GenerationStats, SpeculativeEngine, per_row  # noqa: F401 (re-exported)
from .forced_calls import check_tool_choice, forced_calls
from .verifier.grammar import GrammarCompiler
from .verifier.joining import JoiningRow, as_named
from .verifier.logprobs import MODES as LOGPROBS_MODES
from .verifier.logprobs import TokenLogprobs, prompt_logprobs
from .verifier.sampling import ROW_FIELDS, SamplingParams


@dataclass
class GenerationOutput:
    texts: list[str]  # new text only, cut before a stop string ("" when the target folder has no tokenizer)
    token_ids: list[list[int]]  # new tokens only, with the EOS or stop string that ended the row
    stats: GenerationStats
    # generate(logprobs=True): per row, the target's log-probability of each token of token_ids
    # (its raw distribution, before sampling settings; "processed": after them; verifier/logprobs.py).
    logprobs: list[list[float]] | None = None
    # generate(top_logprobs=N): per row and token, the target's N most likely tokens at that
    # position as (token id, log-probability), most likely first; else None.
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # chat() only: per row, the reply as OpenAI's assistant message ({"role": "assistant", "content"},
    # with "reasoning_content" / "tool_calls" under chat's parsers), ready to append to the conversation.
    messages: list[dict] | None = None


@dataclass
class StreamChunk:
    """What one round of stream_chunks() adds: newly visible text, new token ids, and their scores
    when asked for (as GenerationOutput's logprobs / top_logprobs, for these tokens only). A row's
    last chunk carries its finish_reason (eos | stop | length | context, or abort: stream_batch's
    `aborted`) and no new tokens."""
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None


class JoiningPrompt(NamedTuple):
    """A prompt that joins stream_batch's running batch (its `joining`); a plain tuple in this
    order works too. None: the batch's one value, else the config's."""
    input_ids: Iterable[int]
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: list[str] | None = None  # [] : no stop strings
    stop_token_ids: list[int] | None = None  # [] : none (EOS still ends the row, unless ignore_eos)
    # Its own ROW_FIELDS (warpers, penalties, bias, bans), e.g. {"temperature": 0.7}; a key given as
    # None: the config's value (left out: the batch's one value)
    warpers: dict | None = None
    ignore_eos: bool | None = None
    keep_in_text: list[str] | None = None  # special tokens its text keeps (generate's keep_in_text); [] : none
    include_stop_str_in_output: bool | None = None  # its text keeps the stop string that ended it

    @classmethod
    def of(cls, given) -> "JoiningPrompt":
        return as_named(cls, given, 1, "a joining prompt")


def _check_samples(n, sampling: SamplingParams | list[SamplingParams]) -> None:
    """num_return_sequences: a whole number >= 1, and more than 1 only for prompts that sample
    (greedy samples would be identical rows); sampling is one setting, or one per prompt."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_return_sequences must be a whole number >= 1, got {n!r}")
    per_prompt = isinstance(sampling, list)
    greedy = next((i for i, params in enumerate(sampling if per_prompt else [sampling]) if params.greedy), None)
    if n > 1 and greedy is not None:
        which = f" (prompt {greedy})" if per_prompt else ""
        raise ValueError(f"num_return_sequences={n} at temperature 0{which} would give identical rows: sample "
                         "(temperature > 0) or leave it at 1")


def _token_rows(input_ids, what: str = "input_ids") -> list[list[int]]:
    """Prompts as token ids: a list of rows of whole numbers (a 2-D tensor or array too). The usual
    slip, one prompt's flat ids, failed as "'int' object is not iterable"."""
    rows = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
    if isinstance(rows, (list, tuple)):  # rows may be 1-D tensors or arrays
        rows = [row.tolist() if hasattr(row, "tolist") else row for row in rows]
    if isinstance(rows, str) or isinstance(rows, (list, tuple)) and any(isinstance(row, str) for row in rows):
        raise ValueError(f"{what} takes token ids, not text, got {_shown(input_ids)}: encode it first, "
                         "decoder.encode(texts), or give text to generate / stream as prompts")
    if not isinstance(rows, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in rows):
        raise ValueError(f"{what} is a list of prompts, each a list of token ids: [[5, 6, 7]] for one prompt, "
                         f"got {_shown(input_ids)}")
    return [_token_ids(row, what, i) for i, row in enumerate(rows)]


def _token_ids(row, what: str, i: int = 0) -> list[int]:
    bad = [t for t in row if isinstance(t, bool) or not (isinstance(t, numbers.Integral)
                                                          or isinstance(t, float) and t.is_integer())]
    if bad:
        raise ValueError(f"{what}: prompt {i} has {bad[:3]}, not token ids (whole numbers)")
    return [int(t) for t in row]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _samples_of(ids: list[list[int]], n, args: dict) -> list[list[int]]:
    """n rows of each prompt, prompt by prompt (num_return_sequences); a max_new_tokens,
    min_new_tokens, stop, stop_token_ids, ignore_eos or sampling setting given per prompt in
    `args` becomes one per row."""
    _check_samples(n, args["sampling"])
    for key in (*PER_PROMPT_SETTINGS, "sampling"):
        per_prompt = args[key]
        if isinstance(per_prompt, list):  # _run_args gives a setting per prompt as a list, and only then
            if len(per_prompt) != len(ids):
                one = "one list" if key.startswith("stop") else "one flag" if key == "ignore_eos" else "one number"
                name = key if key != "sampling" else "per-prompt sampling settings (temperature, top_p, ...)"
                raise ValueError(f"{name} has {len(per_prompt)} values for {len(ids)} prompts: give {one}, "
                                 "or one per prompt")
            args[key] = [m for m in per_prompt for _ in range(n)]
    return [row for row in ids for _ in range(n)]


# Settings generate and stream_batch take for all prompts or one per prompt (a number each for the
# limits; a list each for the stops, e.g. stop=[["\n"], ["END", "##"]], stop_token_ids=[[2], []];
# a flag each for ignore_eos). The warpers, penalties, logit_bias and bans too (verifier/sampling.py's
# ROW_FIELDS: temperature=[0.0, 0.8], top_p=[None, 0.9], presence_penalty=[0.5, None],
# logit_bias=[{5: -100}, None], bad_words_ids=[[[7, 8]], None], no_repeat_ngram_size=[3, None],
# ...; None: the config's), which the engine takes as one SamplingParams per row.
PER_PROMPT_SETTINGS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos")


def _per_prompt(key: str, value) -> bool:
    """Whether a ROW_FIELDS value comes one per prompt: a list. logit_bias is one value as a dict
    or a list of (id, bias) pairs, and bad_words_ids one value as a list of words (token-id
    lists), so one per prompt is a list of those (or None)."""
    if key not in ROW_FIELDS or not isinstance(value, (list, tuple)):
        return False
    if key not in ("logit_bias", "bad_words_ids"):
        return True
    lists = lambda v: isinstance(v, (list, tuple)) and all(isinstance(item, (list, tuple)) for item in v)  # noqa: E731
    one = (lambda v: v is None or isinstance(v, dict) or lists(v)) if key == "logit_bias" else \
        (lambda v: v is None or lists(v))
    empty = [isinstance(v, (list, tuple)) and not v for v in value]  # [[]]: one malformed value, not "none"
    return bool(value) and all(one(v) for v in value) and not all(empty)


def _scores(recorder: TokenLogprobs | None, row: int, start: int, count: int) -> tuple:
    """The recorder's values for tokens [start, start + count) of `row`, or (None, None)."""
    if recorder is None:
        return None, None
    top = recorder.top_tokens[row][start:start + count] if recorder.top_tokens is not None else None
    return recorder.values[row][start:start + count], top


# generate's sampling keywords, as _run_args takes them in one dict.
_SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty", "logit_bias", "lossy_typical_acceptance", "typical_p", "epsilon_cutoff",
                      "eta_cutoff", "no_repeat_ngram_size", "bad_words_ids", "top_h", "structured_output")


class Decoder:
    """A target model, a drafter and the shared verifier, ready to generate."""

    def __init__(self, config: dict):
        self.config = config
        t = config["target"]
        if not t.get("path"):
            raise ValueError("target.path is required: the local folder of the target model (in a config, "
                             "target: {path: DIR}; on the command line, --target DIR)")
        check_model_folder(t["path"], "target.path")
        check_drafter_config(config["drafter"])  # a drafter mistake is named before the target loads
        self.device = resolve_device(t["device"])
        self.target = load_causal_lm(t["path"], t["dtype"], self.device, what="target.path")
        if t.get("attn_implementation"):
            self.target.set_attn_implementation(t["attn_implementation"])
        self.tokenizer = load_tokenizer(t["path"])
        self.kept_in_text: dict[int, str] = {}  # special tokens decoded text keeps (keep_in_text)
        vocab = self.target.get_output_embeddings().weight.shape[0]
        info = TargetInfo(self.target, str(t["path"]), self.tokenizer, vocab, self.device, self.target.dtype)
        self.drafter = build_drafter(config["drafter"], info)
        context, context_note = verified_context(self.target.config)
        if context_note:
            warnings.warn(f"target {t['path']}: {context_note}", stacklevel=2)
        self.engine = SpeculativeEngine(self.target, self.drafter, eos_ids(self.target, self.tokenizer), context,
                                        context_note)
        self.engine.recurrent_branches = t["recurrent_branches"]
        if self.tokenizer is not None:  # built when a request first asks for structured_output
            self.engine.grammars = GrammarCompiler(self.tokenizer, vocab, self.engine.eos_token_ids)

    def with_drafter(self, drafter: dict | str) -> "Decoder":
        """Another Decoder on the same loaded target and tokenizer, with a different drafter
        (how `demo` and `compare` put several drafters side by side without reloading): a
        drafter config, or a drafter's name for its defaults ("ngram" = {"name": "ngram"})."""
        if isinstance(drafter, str):
            drafter = {"name": drafter}
        if not isinstance(drafter, dict):
            raise ValueError(f"with_drafter takes a drafter config, e.g. {{'name': 'ngram', 'k': 4}}, or a drafter's "
                             f"name, got {_shown(drafter)}")
        check_drafter_named(drafter)
        other = object.__new__(Decoder)
        other.config = {**self.config, "drafter": dict(drafter)}
        other.device, other.target, other.tokenizer = self.device, self.target, self.tokenizer
        other.kept_in_text = dict(self.kept_in_text)
        info = TargetInfo(self.target, str(self.config["target"]["path"]), self.tokenizer,
                          self.engine.vocab_size, self.device, self.target.dtype)
        other.drafter = build_drafter(other.config["drafter"], info)
        other.engine = SpeculativeEngine(self.target, other.drafter, self.engine.eos_token_ids,
                                         self.engine.max_context, self.engine.context_note)
        other.engine.grammars = self.engine.grammars  # one compiler per tokenizer
        other.engine.recurrent_branches = self.engine.recurrent_branches
        return other

    def save_drafter_memory(self) -> list[str]:
        """Write what the drafter learnt from earlier requests (the `suffix` drafter's cache of
        outputs, the `recycling` drafter's candidate matrix) to its `memory_file`, so the next
        process that loads it starts warm; the paths written ([] when no drafter has one). Call it
        between generate calls; the CLI's generate, chat and serve call it when they end, serve
        also every --save-memory-every seconds."""
        return self.drafter.save_memory()

    def encode(self, prompts: list[str] | str) -> list[list[int]]:
        """Token ids of each prompt (one string: one prompt, as generate takes it)."""
        if isinstance(prompts, str):  # (iterated, it was one prompt per character)
            prompts = [prompts]
        if self.tokenizer is None:
            raise ValueError(f"target folder '{self.config['target']['path']}' has no tokenizer: "
                             "pass input_ids=[[...], ...] instead of text prompts")
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_unicode(prompt, f"prompt {i}")
        # verbose=False: the tokenizer's "longer than the specified maximum" warning would come before
        # check_prompts' own error, which names the context and the fix.
        return [self.tokenizer(p, verbose=False)["input_ids"] for p in prompts]

    def encode_chat(self, conversations, *, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> list[list[int]]:
        """The prompt ids of one conversation ([{"role": ..., "content": ...}, ...]) or a list of
        them, rendered by the target tokenizer's chat template (draftsman/chat.py); tools: tool
        definitions every conversation offers, for a tool-calling template. Earlier tool calls'
        arguments given as JSON strings (OpenAI's form, and chat(tool_call_parser=)'s messages)
        reach the template as the objects templates expect. add_generation_prompt False: no
        assistant's turn is opened after the last message (vLLM's request field)."""
        return [chat_ids(self.tokenizer, arguments_as_objects(c), self.config["target"]["path"], continue_final_message,
                         chat_template_kwargs, tools, add_generation_prompt)
                for c in check_conversations(conversations)]

    def chat(self, conversations, *, continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = True,
             **generate_args) -> GenerationOutput:
        """generate() for chat messages: one conversation or a list of them, each rendered by the
        target tokenizer's chat template with the assistant's turn opened (vLLM's LLM.chat). Takes
        generate's keyword arguments. continue_final_message: the last message is the assistant's
        and the model continues it; chat_template_kwargs: extra template variables (vLLM's), e.g.
        {"enable_thinking": False}; tools: tool definitions (OpenAI's JSON schemas, vLLM's tools=) for a
        tool-calling template.
        Each reply also comes back as OpenAI's assistant message (`messages`), parsed as `draftsman
        serve` parses it: tool_call_parser ("hermes", "qwen3_coder", "llama3_json", "pythonic", "mistral") puts
        the calls the model wrote in "tool_calls" (qwen3_coder types their values by `tools`),
        reasoning_parser ("qwen3", "deepseek_r1", "mistral") its thought in "reasoning_content"
        (draftsman/replies.py). The texts stay the model's own.
        tool_choice (OpenAI's): "auto" (None) and "none" leave the output free; "required" or
        {"type": "function", "function": {"name": NAME}} hold it by a grammar to calls of `tools`
        (structured_output, draftsman/forced_calls.py), read back into "tool_calls" with no parser.
        parallel_tool_calls (OpenAI's) False keeps each reply's first call only, as vLLM does, and
        holds "required" to one call.
        To stream a reply: stream(input_ids=decoder.encode_chat(conv)[0]), through replies.ReplyStream."""
        if "prompts" in generate_args or "input_ids" in generate_args:
            raise ValueError("chat() takes its prompts as messages: drop prompts= / input_ids=, or use generate()")
        check_parsers(self.tokenizer, tool_call_parser, reasoning_parser)  # before any model runs
        if not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls must be True or False, got {parallel_tool_calls!r}")
        forced = forced_calls(tool_choice, tools, parallel_tool_calls)  # checks tool_choice and the tools it forces
        if forced is not None:
            if generate_args.get("structured_output") is not None:
                raise ValueError("tool_choice holds the reply to tool calls and structured_output would constrain it "
                                 "too: pass one of them")
            generate_args["structured_output"], tool_call_parser = forced.structured_output, forced
        elif check_tool_choice(tool_choice)[0] == "none":
            tool_call_parser = None
        ids = self.encode_chat(conversations, continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs, tools=tools)
        if reasoning_parser is not None:  # each grammar, the config's too, holds the answer, after the thought
            grammars = with_default_grammar(generate_args.get("structured_output"),
                                            self.config["sampling"]["structured_output"])
            generate_args["structured_output"] = grammar_after_thought(self.tokenizer, ids, grammars, reasoning_parser,
                                                                       forced_call=forced is not None)
        markers = kept_in_text(tool_call_parser, reasoning_parser)
        if markers:  # kept in these replies' text only (per call: the decoder's own setting is left as it is)
            generate_args["keep_in_text"] = self._with_markers(generate_args.get("keep_in_text"), markers)
        out = self.generate(input_ids=ids, **generate_args)
        opened = opened_thoughts(self.tokenizer, ids, len(out.texts), reasoning_parser,
                                 generate_args.get("structured_output"))
        out.messages = reply_messages(out.texts, tool_call_parser, reasoning_parser, tools, opened,
                                      one_call=not parallel_tool_calls)
        return out

    def generate(self, prompts: list[str] | str | None = None, *, input_ids: list[list[int]] | None = None,
                 max_new_tokens: int | list[int] | None = None, temperature: float | list | None = None,
                 top_k: int | list | None = None, top_p: float | list | None = None, seed: int | None = None,
                 min_p: float | list | None = None, stop: list[str] | list[list[str]] | None = None,
                 repetition_penalty: float | list | None = None, presence_penalty: float | list | None = None,
                 frequency_penalty: float | list | None = None, min_new_tokens: int | list[int] | None = None,
                 logprobs: bool | str = False, top_logprobs: int = 0,
                 stop_token_ids: list[int] | list[list[int]] | None = None, num_return_sequences: int = 1,
                 logit_bias: dict[int, float] | list | None = None,
                 lossy_typical_acceptance: bool | dict | None = None, typical_p: float | list | None = None,
                 epsilon_cutoff: float | list | None = None, eta_cutoff: float | list | None = None,
                 no_repeat_ngram_size: int | list | None = None,
                 bad_words_ids: list[list[int]] | list | None = None, top_h: float | list | None = None,
                 ignore_eos: bool | list[bool] | None = None,
                 structured_output: dict | list | None = None,
                 keep_in_text: list[str] | list[list[str]] | None = None,
                 include_stop_str_in_output: bool | list[bool] = False) -> GenerationOutput:
        """Generate for a batch of text prompts or token-id lists (ragged allowed). Arguments left
        as None take the config's values. max_new_tokens: one number, or one per prompt. stop:
        strings that end a row (draftsman/stop.py), one list for all prompts or one per prompt
        ([["\n"], ["END"]]; stop_token_ids likewise);
        min_new_tokens: EOS cannot end a row before it has that many new tokens, one number or one
        per prompt; logprobs: also
        return the target's log-probability of each new token (out.logprobs), True or "raw" for the
        model's own distribution, "processed" for the one the token was drawn from
        (verifier/logprobs.py); top_logprobs: with logprobs, also the N likeliest tokens at each
        position (out.top_logprobs); stop_token_ids: tokens that end a row as EOS does (vLLM's);
        num_return_sequences: n samples of each prompt (Hugging Face's; vLLM's n), as rows prompt by
        prompt: [p0 s0, p0 s1, ..., p1 s0, ...]; the prompt is prefilled once for all n;
        logit_bias: {token id: bias} added to the target's logits (OpenAI's), or a list of one per
        prompt ([{5: -100}, None]); typical_p,
        epsilon_cutoff, eta_cutoff, top_h: Hugging Face's truncation warpers (exact, as top_p is);
        no_repeat_ngram_size: Hugging Face's, no n-gram of that size twice in prompt + output;
        bad_words_ids: Hugging Face's, token sequences never generated ([[5], [7, 8]]);
        lossy_typical_acceptance: LOSSY, True or {"posterior_threshold": 0.09, "posterior_alpha": 0.3}:
        at temperature > 0 drafts are accepted by Medusa's typical acceptance, so the output is no
        longer distributed as the target's (out.stats.lossy says so; verifier/typical.py); False
        turns a config's setting off; ignore_eos: vLLM's, EOS ends no row (it is drawn as any
        token, so the distribution is the target's), rows run to their stops or max_new_tokens;
        one flag, or one per prompt; structured_output: the output held to a grammar, as vLLM's
        structured_outputs: {"json": SCHEMA}, {"json_object": True}, {"regex": "..."}, {"choice":
        [...]} or {"grammar": LARK} (verifier/structured.py; exact: the target's distribution
        restricted to what the grammar allows, as plain decoding under it), or one per prompt;
        keep_in_text: special tokens the texts keep where decoded text drops the others (a format's
        markers, e.g. ["[TOOL_CALLS]"]; as keep_in_text() sets for all calls, which None takes; []:
        none), one list for all prompts or one per prompt; stop strings then search that text;
        include_stop_str_in_output: vLLM's, a text ended by a stop string keeps it (the token ids
        are the same either way), one flag or one per prompt.
        The warpers (temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff,
        top_h), the penalties (repetition_penalty, presence_penalty, frequency_penalty),
        logit_bias, the bans (no_repeat_ngram_size, bad_words_ids) and structured_output take one value, or a list of
        one per prompt (None in it: the config's): the rows generate as
        one batch, each exact under its own settings (docs/verifier.md, "Batches")."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass either prompts (text) or input_ids (token ids), not both or neither")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts = isinstance(prompts, (list, tuple)) and all(isinstance(p, str) for p in prompts)
        if prompts is not None and not texts:
            raise ValueError(f"prompts is a string or a list of strings (token ids go in input_ids=[[...]]), "
                             f"got {_shown(prompts)}")
        ids = self.encode(prompts) if prompts is not None else _token_rows(input_ids)
        args = self._run_args(max_new_tokens, seed, stop, dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias,
            lossy_typical_acceptance=lossy_typical_acceptance, typical_p=typical_p, epsilon_cutoff=epsilon_cutoff,
            eta_cutoff=eta_cutoff, no_repeat_ngram_size=no_repeat_ngram_size, bad_words_ids=bad_words_ids,
            top_h=top_h, structured_output=structured_output),
            min_new_tokens, stop_token_ids, ignore_eos)
        prompt_count = len(ids)
        ids = _samples_of(ids, num_return_sequences, args)
        decodes = self._row_texts(keep_in_text, include_stop_str_in_output, prompt_count, num_return_sequences, args)
        recorder = self._logprobs_recorder(len(ids), logprobs, top_logprobs)
        tokens, stats = self.engine.generate(ids, **args, logprobs=recorder)
        stops = _row_values(args["stop"], len(tokens))
        texts = [stop.cut(decode(t)) if stop else decode(t) for stop, decode, t in zip(stops, decodes, tokens)]
        if recorder is None:
            return GenerationOutput(texts, tokens, stats)
        return GenerationOutput(texts, tokens, stats, recorder.values, recorder.top_tokens)

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, stats: GenerationStats | None = None,
               min_p: float | None = None, stop: list[str] | None = None,
               repetition_penalty: float | None = None, presence_penalty: float | None = None,
               frequency_penalty: float | None = None, min_new_tokens: int | None = None,
               stop_token_ids: list[int] | None = None, logit_bias: dict[int, float] | None = None,
               lossy_typical_acceptance: bool | dict | None = None, typical_p: float | None = None,
               epsilon_cutoff: float | None = None, eta_cutoff: float | None = None,
               no_repeat_ngram_size: int | None = None, bad_words_ids: list[list[int]] | None = None,
               top_h: float | None = None, ignore_eos: bool | None = None,
               structured_output: dict | None = None, keep_in_text: list[str] | None = None,
               include_stop_str_in_output: bool = False):
        """Yield the new text of one prompt piece by piece, as rounds accept tokens (several per
        round). The pieces join to exactly `generate(...).texts[0]`; pass `stats` to read the run's
        statistics afterwards. lossy_typical_acceptance: LOSSY, as generate's. For the tokens and
        their log-probabilities as well, use stream_chunks()."""
        for chunk in self.stream_chunks(
                prompt, input_ids=input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                top_p=top_p, seed=seed, stats=stats, min_p=min_p, stop=stop, repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, min_new_tokens=min_new_tokens,
                stop_token_ids=stop_token_ids, logit_bias=logit_bias,
                lossy_typical_acceptance=lossy_typical_acceptance, typical_p=typical_p,
                epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff, no_repeat_ngram_size=no_repeat_ngram_size,
                bad_words_ids=bad_words_ids, top_h=top_h, ignore_eos=ignore_eos,
                structured_output=structured_output, keep_in_text=keep_in_text,
                include_stop_str_in_output=include_stop_str_in_output):
            if chunk.text:
                yield chunk.text

    def stream_chunks(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                      max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
                      top_p: float | None = None, seed: int | None = None, stats: GenerationStats | None = None,
                      min_p: float | None = None, stop: list[str] | None = None,
                      repetition_penalty: float | None = None, presence_penalty: float | None = None,
                      frequency_penalty: float | None = None, min_new_tokens: int | None = None,
                      stop_token_ids: list[int] | None = None, logit_bias: dict[int, float] | None = None,
                      lossy_typical_acceptance: bool | dict | None = None, logprobs: bool | str = False,
                      top_logprobs: int = 0, typical_p: float | None = None, epsilon_cutoff: float | None = None,
                      eta_cutoff: float | None = None, no_repeat_ngram_size: int | None = None,
                      bad_words_ids: list[list[int]] | None = None, top_h: float | None = None,
                      ignore_eos: bool | None = None, structured_output: dict | None = None,
                      keep_in_text: list[str] | None = None, include_stop_str_in_output: bool = False):
        """stream() with the tokens: one StreamChunk per round that commits tokens, holding the
        text that became visible (may be "" while a stop string might still complete), the new
        token ids and, with logprobs= / top_logprobs= (as generate's), their scores. The texts
        join to generate's text, the token ids to its token_ids."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass either a prompt (text) or input_ids (token ids), not both or neither")
        if self.tokenizer is None:
            raise ValueError("stream() yields text and the target folder has no tokenizer; use generate(input_ids=...)")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"stream takes one prompt, as text, got {_shown(prompt)}: for several, call it once per "
                             "prompt, or use generate() or stream_batch()")
        flat = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
        if flat is not None and not isinstance(flat, (list, tuple)):  # e.g. one id, input_ids=5
            raise ValueError(f"stream's input_ids are one prompt's token ids, e.g. input_ids=[5, 6, 7], got "
                             f"{_shown(input_ids)}")
        if flat is not None and any(isinstance(t, (list, tuple)) for t in flat):
            raise ValueError(f"stream takes one prompt: input_ids=[5, 6, 7], got {_shown(input_ids)}; for several, "
                             "use stream_batch(input_ids=[[...], ...]) or generate()")
        ids = self.encode([prompt]) if prompt is not None else [_token_ids(flat, "input_ids")]
        args = self._run_args(max_new_tokens, seed, stop, dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias,
            lossy_typical_acceptance=lossy_typical_acceptance, typical_p=typical_p, epsilon_cutoff=epsilon_cutoff,
            eta_cutoff=eta_cutoff, no_repeat_ngram_size=no_repeat_ngram_size, bad_words_ids=bad_words_ids,
            top_h=top_h, structured_output=structured_output),
            min_new_tokens, stop_token_ids, ignore_eos)
        decodes = self._row_texts(keep_in_text, include_stop_str_in_output, 1, 1, args)
        for _, chunk in self._row_chunks(ids, args, decodes, self._logprobs_recorder(1, logprobs, top_logprobs),
                                         stats):
            yield chunk

    def stream_batch(self, input_ids: list[list[int]], *, stats: GenerationStats | None = None,
                     aborted: Container[int] = (), joining=None, **settings):
        """stream_chunks() for several prompts generated as one batch (how `draftsman serve`
        streams requests that arrive together): yields (row, StreamChunk), rows interleaved as
        rounds commit their tokens; each row's chunks join to generate's output for that prompt.
        settings: stream_chunks' keywords (max_new_tokens and min_new_tokens, one number or one per
        prompt; stop, stop_token_ids and keep_in_text, one list or one per prompt;
        include_stop_str_in_output, one flag or one per prompt; temperature, ..., logprobs,
        top_logprobs), and num_return_sequences (rows then go prompt
        by prompt, n samples each, as generate's). A row's last chunk, with its finish_reason,
        comes as soon as that row ends.
        aborted: rows to end early, e.g. a set the caller adds a row to when its reader goes away:
        the row ends after the round it is in, its last chunk saying finish_reason "abort", and
        the others go on as they would have.
        joining: continuous batching. joining() is asked before every round and returns prompts
        that join the running batch now, as JoiningPrompt(input_ids, max_new_tokens, min_new_tokens,
        stop, stop_token_ids, warpers, ignore_eos, keep_in_text, include_stop_str_in_output) or
        tuples in that order, [] for none (a value left out or None: the batch's one value, else
        the config's; stop strings as a list;
        warpers a dict of ROW_FIELDS, e.g. {"temperature": 0.7,
        "presence_penalty": 0.5}: a key left out takes the batch's one value, else the config's;
        a key given as None the config's). Their rows (n samples each) are
        numbered after the rows before them and generate with the batch's other settings, each as
        it would alone (the same tokens at temperature 0, the same distribution when sampling).
        The batch runs until no row is left and joining() returns nothing. Needs a drafter that
        can add rows (`can_join`)."""
        if self.tokenizer is None:
            raise ValueError("stream_batch() yields text and the target folder has no tokenizer; use generate()")
        ids = _token_rows(input_ids)
        logprobs, top_logprobs = settings.pop("logprobs", False), settings.pop("top_logprobs", 0)
        n = settings.pop("num_return_sequences", 1)
        known = {"max_new_tokens", "seed", "stop", "min_new_tokens", "stop_token_ids", "ignore_eos", "keep_in_text",
                 "include_stop_str_in_output", *_SAMPLING_SETTINGS}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"stream_batch() got unknown settings {unknown}; valid: {sorted(known)}")
        sampling = {k: settings.get(k) for k in _SAMPLING_SETTINGS}
        args = self._run_args(settings.get("max_new_tokens"), settings.get("seed"), settings.get("stop"), sampling,
                              settings.get("min_new_tokens"), settings.get("stop_token_ids"), settings.get("ignore_eos"))
        g = self.config["generation"]
        limit, least, stop, stop_ids, ignore = (args[key] for key in PER_PROMPT_SETTINGS)
        default_limit = limit if isinstance(limit, int) else g["max_new_tokens"]
        default_least = least if isinstance(least, int) else g["min_new_tokens"]
        default_stop = self._stop_check(g["stop"]) if isinstance(stop, list) else stop
        default_stop_ids = (g["stop_token_ids"] or ()) if per_row(stop_ids) else stop_ids
        default_ignore = ignore if isinstance(ignore, bool) else g["ignore_eos"]
        # A joining row's sampling: its own warpers, else the batch's one value, else the config's.
        batch_sampling = {k: None if _per_prompt(k, v) else v for k, v in sampling.items()}
        keep, include = settings.get("keep_in_text"), settings.get("include_stop_str_in_output", False)
        batch_keep = None if per_row(keep) else keep
        batch_include = include if isinstance(include, bool) else False
        prompt_count = len(ids)
        ids = _samples_of(ids, n, args)
        decodes = self._row_texts(keep, include, prompt_count, n, args)  # joining rows' added as they join
        joined_rows = None
        if joining is not None:
            def joined_rows():  # the engine's rows, with every setting: each joining prompt n times
                rows = []
                prompts = joining()
                if isinstance(prompts, JoiningPrompt) or isinstance(prompts, (list, tuple)) and any(
                        x is None or isinstance(x, numbers.Number) for x in prompts):  # one prompt's fields
                    raise ValueError("joining() returns a list of prompts ([] for none), got one prompt "
                                     f"{_shown(prompts)}: put it in a list, [JoiningPrompt(input_ids, ...)]")
                for k, given in enumerate(prompts):
                    own = JoiningPrompt.of(given)
                    given_ids = own.input_ids.tolist() if hasattr(own.input_ids, "tolist") else own.input_ids
                    text = isinstance(given_ids, (str, bytes))  # (generate's checks, a row at a time)
                    if text or not isinstance(given_ids, Iterable):
                        raise ValueError(f"joining()'s input_ids: prompt {k} has {_shown(given_ids)}, not token ids: "
                                         + ("encode it first, decoder.encode(texts)[0]" if text else
                                            "give a list of whole numbers, e.g. [5, 6, 7]"))
                    given_ids = _token_ids(list(given_ids), "joining()'s input_ids", k)
                    decode = self._row_decodes(batch_keep if own.keep_in_text is None else own.keep_in_text, 1, 1)[0]
                    stop = default_stop if own.stop is None else self._stop_check(own.stop)
                    included = batch_include if own.include_stop_str_in_output is None else \
                        _row_flags(own.include_stop_str_in_output, 1, 1)[0]
                    row = JoiningRow(given_ids,
                                     default_limit if own.max_new_tokens is None else own.max_new_tokens,
                                     default_least if own.min_new_tokens is None else own.min_new_tokens,
                                     _row_stop(stop, decode, included),
                                     default_stop_ids if own.stop_token_ids is None else own.stop_token_ids,
                                     self._joining_sampling(batch_sampling, own.warpers),
                                     default_ignore if own.ignore_eos is None else own.ignore_eos)
                    rows += [row] * n
                    decodes.extend([decode] * n)
                return rows
        yield from self._row_chunks(ids, args, decodes, self._logprobs_recorder(len(ids), logprobs, top_logprobs),
                                    stats, aborted, joined_rows)

    @property
    def can_join(self) -> bool:
        """Whether rows can join a running batch (stream_batch's joining): the drafter supports it."""
        return self.engine.drafter.can_add_rows

    def check_join(self, input_ids: list[list[int]], max_new_tokens: int | None = None,
                   min_new_tokens: int | None = None, stop: list[str] | None = None,
                   stop_token_ids: list[int] | None = None, num_return_sequences: int = 1,
                   ignore_eos: bool | None = None, keep_in_text: list[str] | None = None,
                   include_stop_str_in_output: bool | None = None, **warpers) -> None:
        """Raise ValueError, naming the problem, if these prompts cannot join a running batch
        with these limits, stops, ignore_eos, keep_in_text, include_stop_str_in_output and per-row
        sampling settings (ROW_FIELDS, e.g. temperature=0.7; None: the config's), so a caller can
        refuse them alone."""
        g = self.config["generation"]
        ids = _token_rows(input_ids)
        limit = g["max_new_tokens"] if max_new_tokens is None else max_new_tokens
        least = g["min_new_tokens"] if min_new_tokens is None else min_new_tokens
        self._stop_check(stop)
        self._row_decodes(keep_in_text, 1, 1)
        if include_stop_str_in_output is not None:
            _row_flags(include_stop_str_in_output, 1, 1)
        unknown = sorted(set(warpers) - set(ROW_FIELDS))
        if unknown:
            raise TypeError(f"check_join() got unknown settings {unknown}; the per-row sampling settings are "
                            f"{list(ROW_FIELDS)}")
        sampling = self._sampling(warpers)
        _check_samples(num_return_sequences, sampling)
        self.engine.check_rows(ids, [limit] * len(ids), least, stop_token_ids or (), sampling,
                               g["ignore_eos"] if ignore_eos is None else ignore_eos)

    def _joining_sampling(self, batch_sampling: dict, own: dict | None) -> SamplingParams:
        """A joining row's SamplingParams: the batch's settings, with its own warpers where it gives
        them. A key it leaves out takes the batch's one value (else the config's); a key it gives as
        None takes the config's, so a row can ask for the config's value (e.g. no penalty) beside a
        batch whose rows all have one (as serve's requests that leave a setting out do)."""
        unknown = sorted(set(own or ()) - set(ROW_FIELDS))
        if unknown:
            raise ValueError(f"a joining row's warpers have unknown keys {unknown}; valid: {list(ROW_FIELDS)}")
        return self._sampling({**batch_sampling, **(own or {})})

    def _row_chunks(self, ids: list[list[int]], args: dict, decodes: list, recorder, stats,
                    aborted: Container[int] = (), joining=None):
        """(row, StreamChunk) per row and round; each row's text decoded (by its own of `decodes`,
        which joining() extends with the rows it adds) a window at a time and held back while a stop
        string may yet complete. A row's last chunk (its held-back tail and finish_reason) comes in
        the round the row ends, before the next is drafted, not when the whole batch does."""
        stats = stats if stats is not None else GenerationStats()  # its finish_reasons tell a row has ended
        texts = [IncrementalText(decode) for decode in decodes]  # decodes a window per round, not the whole row
        shown = [""] * len(ids)
        row_stops = _row_values(args["stop"], len(ids))

        def join():
            rows = joining()
            texts.extend(IncrementalText(decode) for decode in decodes[len(texts):])
            shown.extend("" for _ in rows)
            row_stops.extend(row.stop for row in rows)
            return rows

        def last(row: int) -> tuple[int, StreamChunk]:
            final = decodes[row](texts[row].tokens)  # the one whole decode, as generate's
            stops = row_stops[row]
            final = stops.cut(final) if stops else final
            tail = final[len(shown[row]):] if final.startswith(shown[row]) else ""  # held back, now final
            return row, StreamChunk(tail, [], *_scores(recorder, row, 0, 0), finish_reason=stats.finish_reasons[row])

        for row, new in self.engine.stream(ids, stats=stats, logprobs=recorder, aborted=aborted,
                                           joining=join if joining is not None else None, **args):
            if not new:  # it ended in this round with no new token
                yield last(row)
                continue
            text = texts[row]
            scores = _scores(recorder, row, len(text.tokens), len(new))
            piece, stops = "", row_stops[row]
            if text.add(new):  # else nothing new, or a character still incomplete
                visible = text.text
                if stops:  # never show a stop string (unless kept), nor the start of one that may yet complete
                    at = stops.text_end(visible, len(shown[row]))  # what is shown holds no stop's start
                    visible = visible[:at] if at is not None else visible[: max(0, len(visible) - stops.hold_back)]
                if len(visible) > len(shown[row]):
                    piece, shown[row] = visible[len(shown[row]):], visible
            yield row, StreamChunk(piece, list(new), *scores)
            if stats.finish_reasons[row]:  # it ended in this round: its last chunk now, before the next round
                yield last(row)

    def prompt_logprobs(self, input_ids: list[list[int]], top_logprobs: int = 0) -> tuple[list, list | None]:
        """The target's log-probability of each prompt token given the ones before it, None for
        the first (vLLM's prompt_logprobs); with top_logprobs=N also the N likeliest tokens at each
        position, as generate's top_logprobs. The model's raw distribution; no drafter involved."""
        ids = _token_rows(input_ids)
        self.engine.check_prompts(ids, generates=False)  # scored in one pass: a prompt may fill the context
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be a whole number >= 0, got {top_logprobs!r}")
        return prompt_logprobs(self.target, ids, top_logprobs)

    def decode(self, tokens: list[int]) -> str:
        """The text of these tokens, special tokens dropped but those keep_in_text() keeps."""
        try:
            text = self._decode_with(tokens, self.kept_in_text)
        except (TypeError, OverflowError):  # the tokenizer's own words ("Can't extract `str` to `Vec`")
            raise ValueError(f"decode takes one row of token ids (whole numbers >= 0), got {_shown(tokens)}") from None
        if not isinstance(text, str):  # (the tokenizer decodes a list of rows as a batch)
            raise ValueError(f"decode takes one row of token ids, got several rows ({_shown(tokens)}): decode "
                             "each, [decoder.decode(row) for row in rows]")
        highest = int(max(tokens)) if len(tokens) else -1
        if highest >= self.engine.vocab_size:
            self._outside_vocabulary(highest, "decode")
        return text

    def _outside_vocabulary(self, token: int, call: str):
        """(the tokenizer decodes an id past its vocabulary as "", silently)"""
        raise ValueError(f"{call}: token id {token} is outside the target's vocabulary of {self.engine.vocab_size} "
                         "tokens: were these ids made by another model's tokenizer?")

    def _decode_with(self, tokens: list[int], kept: dict[int, str]) -> str:
        if not self.tokenizer:
            return ""
        if kept and not kept.keys().isdisjoint(tokens):  # (a set operation: no Python loop per token)
            return self._decode_keeping(tokens, kept)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _decode_keeping(self, tokens: list[int], kept: dict[int, str]) -> str:
        """The text with the kept special tokens written out and the other special tokens dropped."""
        pieces, run = [], []
        for token in tokens:
            if token in kept:
                pieces += [self.tokenizer.decode(run, skip_special_tokens=True), kept[token]]
                run = []
            else:
                run.append(token)
        return "".join(pieces) + self.tokenizer.decode(run, skip_special_tokens=True)

    def keep_in_text(self, markers) -> dict[int, str]:
        """Decoded text keeps these special tokens (a tool-call format's markers, e.g. Mistral's
        [TOOL_CALLS]; draftsman/tool_calls.py KEPT_IN_TEXT), where it drops the others, in every
        call from now on that does not set its own (generate's keep_in_text=); markers that are no
        token of the target's tokenizer, or no special one, change nothing. Replaces what an
        earlier call kept; returns {token id: text} kept."""
        self.kept_in_text = self._special_tokens(markers)
        return self.kept_in_text

    def special_tokens(self) -> dict[int, str]:
        """{token id: text} of every special token decoded text drops: what keep_in_text can keep
        (vLLM's skip_special_tokens false keeps them all)."""
        if self.tokenizer is None:
            return {}
        added = (token.content for token in getattr(self.tokenizer, "added_tokens_decoder", {}).values())
        return self._special_tokens(list(dict.fromkeys([*self.tokenizer.all_special_tokens, *added])))

    def _special_tokens(self, markers) -> dict[int, str]:
        """{token id: text} of the markers that are special tokens of the target's tokenizer."""
        if isinstance(markers, str) or not all(isinstance(m, str) for m in markers):
            raise ValueError(f"keep_in_text takes a list of special tokens' texts, e.g. ['[TOOL_CALLS]'], "
                             f"got {markers!r}")
        kept = {}
        for marker in markers:
            token = self.tokenizer.convert_tokens_to_ids(marker) if self.tokenizer is not None else None
            # (an unknown marker comes back as the unknown token's id, which is some other token)
            if token is not None and self.tokenizer.convert_ids_to_tokens(token) == marker and \
                    self.tokenizer.decode([token], skip_special_tokens=True) == "":
                kept[token] = marker
        return kept

    def _row_decodes(self, keep_in_text, prompts: int, n: int) -> list:
        """Each row's decode (n rows a prompt): keeping the special tokens its keep_in_text names
        (one list for all prompts or one per prompt; None: the decoder's, `self.decode`)."""
        given = list(keep_in_text) if per_row(keep_in_text) else [keep_in_text] * prompts
        if len(given) != prompts:
            raise ValueError(f"keep_in_text has {len(given)} lists for {prompts} prompts: give one list, or one "
                             "per prompt")
        decodes, resolved = [], {}  # each list of markers resolved once, however many prompts give it
        for markers in given:
            if repr(markers) not in resolved:
                kept = None if markers is None else self._special_tokens(markers)
                resolved[repr(markers)] = (self.decode if kept is None or kept == self.kept_in_text
                                           else partial(self._decode_with, kept=kept))
            decodes += [resolved[repr(markers)]] * n
        return decodes

    def _row_texts(self, keep_in_text, include_stop_str_in_output, prompts: int, n: int, args: dict) -> list:
        """Each row's decode (keep_in_text, _row_decodes), with its stop strings (args["stop"])
        searched in the text it gives and kept in it or not (include_stop_str_in_output)."""
        decodes = self._row_decodes(keep_in_text, prompts, n)
        includes = _row_flags(include_stop_str_in_output, prompts, n)
        if any(decode != self.decode for decode in decodes) or any(includes):
            args["stop"] = [_row_stop(stop, decode, include) for stop, decode, include
                            in zip(_row_values(args["stop"], len(decodes)), decodes, includes)]
        return decodes

    def _with_markers(self, keep_in_text, markers: tuple[str, ...]):
        """keep_in_text (generate's: None, one list or one per prompt) with these markers kept too."""
        own = list(self.kept_in_text.values())
        if per_row(keep_in_text):
            return [[*(own if given is None else given), *markers] for given in keep_in_text]
        return [*(own if keep_in_text is None else keep_in_text), *markers]

    def decode_token(self, token: int) -> str:
        """One token's own text, special tokens included (how an API names a scored token)."""
        if isinstance(token, bool) or not hasattr(token, "__index__") or operator.index(token) < 0:
            raise ValueError(f"decode_token takes one token id (a whole number >= 0), got {_shown(token)}")
        token = operator.index(token)  # (a numpy or 0-d torch integer too)
        if token >= self.engine.vocab_size:
            self._outside_vocabulary(token, "decode_token")
        return self.tokenizer.decode([token]) if self.tokenizer else str(token)

    def _run_args(self, max_new_tokens, seed, stop, sampling: dict, min_new_tokens=None, stop_token_ids=None,
                  ignore_eos=None) -> dict:
        """The engine's arguments: each one given (not None), else the config's. A setting given per
        prompt comes back as a list (and only then: one stop_token_ids for all as a tuple; sampling
        as one SamplingParams per prompt when a warper is given per prompt)."""
        g = self.config["generation"]
        limit = g["max_new_tokens"] if max_new_tokens is None else max_new_tokens
        least = g["min_new_tokens"] if min_new_tokens is None else min_new_tokens
        stop = g["stop"] if stop is None else stop
        stop_token_ids = g["stop_token_ids"] if stop_token_ids is None else stop_token_ids
        as_list = lambda value: list(value) if isinstance(value, tuple) else value  # noqa: E731
        return {"max_new_tokens": as_list(limit), "sampling": self._sampling(sampling),
                "seed": g["seed"] if seed is None else seed,
                "stop": [self._stop_check(s) for s in stop] if per_row(stop) else self._stop_check(stop),
                "min_new_tokens": as_list(least),
                "stop_token_ids": ([ids or () for ids in stop_token_ids] if per_row(stop_token_ids) else
                                   tuple(stop_token_ids) if isinstance(stop_token_ids, list) else stop_token_ids or ()),
                "ignore_eos": ([g["ignore_eos"] if flag is None else flag for flag in ignore_eos]
                               if isinstance(ignore_eos, (list, tuple)) else
                               g["ignore_eos"] if ignore_eos is None else ignore_eos)}

    def _sampling(self, given: dict) -> SamplingParams | list[SamplingParams]:
        """SamplingParams from generate's sampling keywords (None: the config's). A warper given as
        a list (one value per prompt, None: the config's) makes one SamplingParams per prompt."""
        s = self.config["sampling"]
        values = {key: s[key] if given.get(key) is None else given[key] for key in s}
        per_prompt = {key: list(values[key]) for key in ROW_FIELDS if _per_prompt(key, values[key])}
        listed = [key for key in given if key not in ROW_FIELDS and isinstance(given[key], (list, tuple))]
        if listed:
            raise ValueError(f"{listed[0]} takes one value for all prompts; only {list(ROW_FIELDS)} can be "
                             "given per prompt: run prompts with other values as generations of their own")
        if not per_prompt:
            return SamplingParams(**values)
        counts = {len(v) for v in per_prompt.values()}
        if len(counts) > 1:
            raise ValueError(f"per-prompt settings {sorted(per_prompt)} have {sorted(counts)} values: give each "
                             "one value per prompt")
        return [SamplingParams(**{**values, **{key: s[key] if v[i] is None else v[i] for key, v in per_prompt.items()}})
                for i in range(counts.pop())]

    def _logprobs_recorder(self, rows: int, logprobs, top_logprobs) -> TokenLogprobs | None:
        if not (isinstance(logprobs, bool) or logprobs in LOGPROBS_MODES):
            raise ValueError(f"logprobs must be False, True (= 'raw': the model's distribution) or 'processed' "
                             f"(the distribution each token is drawn from), got {logprobs!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be a whole number >= 0, got {top_logprobs!r}")
        if top_logprobs and not logprobs:
            raise ValueError(f"top_logprobs={top_logprobs} needs logprobs=True: pass both")
        if not logprobs:
            return None
        return TokenLogprobs(rows, top_logprobs, "raw" if logprobs is True else logprobs)

    def _stop_check(self, stop) -> StopStrings | None:
        strings = check_stop_strings(stop)
        if not strings:
            return None
        if self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer and target folder '{self.config['target']['path']}' "
                             "has none: end rows with EOS or max_new_tokens instead")
        return StopStrings(self.decode, strings)


def _row_stop(stop: StopStrings | None, decode, include: bool) -> StopStrings | None:
    """These stop strings searched in the text `decode` gives, kept in it or not (include)."""
    if stop is None or (stop.decode == decode and stop.include == include):
        return stop
    return StopStrings(decode, stop.strings, include)


def _row_flags(value, prompts: int, n: int, name: str = "include_stop_str_in_output") -> list[bool]:
    """A flag given for all prompts or one per prompt, as one per row (n rows a prompt)."""
    flags = list(value) if isinstance(value, (list, tuple)) else [value] * prompts
    if len(flags) != prompts or not all(isinstance(flag, bool) for flag in flags):
        raise ValueError(f"{name} takes true or false, or a list of one per prompt ({prompts}), got {value!r}")
    return [flag for flag in flags for _ in range(n)]


def _row_values(value, rows: int) -> list:
    """A setting that is one value for all rows, or already a list of one per row, as that list."""
    return value if isinstance(value, list) else [value] * rows


def load(config: dict | str) -> Decoder:
    """Build a Decoder from a config dict or a YAML/JSON file path."""
    return Decoder(load_config(config))
