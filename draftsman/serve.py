"""`draftsman serve --config run.yaml`: the OpenAI API (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`) over one Decoder, so clients written for vLLM or the OpenAI SDK get speculative
decoding by changing their base URL.

- One batch generates at a time. A request's prompts and its n samples are one batch, and
  requests that arrive while another generates join the next batch when their settings are the
  same, streamed or not (draftsman/serve_batch.py; `--max-batch-rows`, 1 turns it off); each
  is answered as soon as its own rows end. Health checks and model lists answer while a batch generates.
- `"stream": true` sends server-sent events as rounds accept tokens, one choice (index) per prompt and sample;
  `"stream_options": {"include_usage": true}` adds OpenAI's final usage chunk. A request whose
  client disconnects leaves the queue, or stops generating after the round it is in (finish
  reason "abort").
- Log-probabilities (`logprobs`, chat's `top_logprobs`) in OpenAI's shapes, streamed too;
  completions' `echo` adds the prompt and its scores (lm-evaluation-harness's loglikelihood).
- Fields: OpenAI's sampling fields (temperature, top_p, max_tokens, stop, seed, n, presence and
  frequency penalties, logit_bias) and vLLM's extras (top_k, min_p, repetition_penalty, min_tokens,
  stop_token_ids, ignore_eos, chat_template_kwargs, add_generation_prompt and continue_final_message;
  best_of when it equals n, as benchmark clients send it) and Hugging Face's (typical_p, epsilon_cutoff,
  eta_cutoff, top_h, no_repeat_ngram_size, bad_words_ids). An unknown field is refused with the list of valid ones:
  a setting that silently did nothing would be a lie about the output. A 400's "param" names the
  field at fault where it is known (error_param), as OpenAI's does.
- Structured output: OpenAI's `response_format` (json_schema, json_object), vLLM's
  `structured_outputs` (json, regex, choice, grammar) and its older `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`: the output is held to the grammar, exactly as plain decoding
  under it (verifier/structured.py).
- `--tool-call-parser hermes|qwen3_coder|llama3_json|pythonic|mistral`: a chat reply's tool calls come back as OpenAI's
  tool_calls, whole or streamed (draftsman/tool_calls.py); tool_choice "auto" or "none", and
  "required" or a named function, which hold the reply to calls by a grammar (draftsman/forced_calls.py);
  parallel_tool_calls false keeps a reply's first call only, as vLLM does ("required": one call).
- `--reasoning-parser qwen3|deepseek_r1|mistral`: a chat reply's <think> (Magistral's [THINK]) thought comes back
  apart as reasoning_content, whole or streamed (draftsman/reasoning.py).
- vLLM's `POST /tokenize` (a prompt or a chat, encoded as the endpoints encode them) and
  `POST /detokenize`.
- `--api-key KEY` (or DRAFTSMAN_API_KEY): the /v1 routes need "Authorization: Bearer KEY".
- `GET /metrics`: Prometheus counters named as vLLM's (prompt and generation tokens, finished
  rows, drafts, draft and accepted tokens, acceptance by position, batches; draftsman/serve_metrics.py).
- Each response carries a `draftsman` object: the drafter, tau and whether the run was lossy;
  also `batch_rows`, the rows running in its batch when it started, its own included (its tau
  is that batch's, over the rows that ran in it; a stream's comes in its last chunk).

Built on the standard library's http.server: no web framework to install, and one process
serves one model, as the rest of draftsman does.
"""
from __future__ import annotations

import argparse
import hmac
import itertools
import json
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .api import Decoder, GenerationOutput, GenerationStats
from .chat import check_conversation, check_unicode
from .detokenize import IncrementalText
from .forced_calls import ForcedCalls, check_tool_choice, forced_calls
from .replies import (PARSER_FLAGS, ReplyStream, check_parsers, grammar_after_thought, kept_in_text, opened_thoughts,
                      reply_message, with_default_grammar)
from .serve_batch import Batcher, ServerStopping, check_max_rows
from .serve_flags import DEFAULT_PREFILL_CHUNK, add_arguments  # noqa: F401 (draftsman.serve's own names)
from .serve_flags import check_address, listen_error
from .serve_metrics import ServeMetrics
from .tool_calls import PARSERS
from .verifier.structured import StructuredOutput

# OpenAI / vLLM request field -> Decoder.generate argument.
SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias", "n": "num_return_sequences",
    "lossy_typical_acceptance": "lossy_typical_acceptance",
    # Hugging Face's truncation warpers (typical_p is also TGI's)
    "typical_p": "typical_p", "epsilon_cutoff": "epsilon_cutoff", "eta_cutoff": "eta_cutoff", "top_h": "top_h",
    "no_repeat_ngram_size": "no_repeat_ngram_size", "bad_words_ids": "bad_words_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",  # vLLM's: the text keeps the stop string
}
# Decoder.generate argument -> request field, for the errors that name the argument (error_param)
GENERATE_FIELDS = {arg: field for field, arg in SAMPLING_FIELDS.items() if arg != field}
# read elsewhere, or change nothing here (best_of: vLLM's; benchmark clients send best_of 1, which is n's sampling)
IGNORED_FIELDS = {"model", "stream", "stream_options", "user", "best_of"}
# The output held to a grammar (verifier/structured.py): OpenAI's response_format, vLLM's
# structured_outputs and its older guided_* fields; at most one per request.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
# How the text is decoded: vLLM's skip_special_tokens (default true; false keeps the special tokens).
DECODING_FIELDS = {"skip_special_tokens"}
COMPLETION_FIELDS = ({"prompt", "logprobs", "echo"} | set(SAMPLING_FIELDS) | IGNORED_FIELDS | set(STRUCTURED_FIELDS)
                     | DECODING_FIELDS)
# vLLM's fields that choose the turn the chat template leaves open (assistant prefill)
TURN_FIELDS = {"add_generation_prompt", "continue_final_message"}
TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "messages", "tools", "chat_template_kwargs"} | TURN_FIELDS
CHAT_FIELDS = ({"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                "chat_template_kwargs", "logprobs", "top_logprobs", "include_reasoning"} | TURN_FIELDS
               | set(SAMPLING_FIELDS) | IGNORED_FIELDS | set(STRUCTURED_FIELDS) | DECODING_FIELDS)
REQUEST_FIELDS = COMPLETION_FIELDS | TOKENIZE_FIELDS | CHAT_FIELDS | {"tokens"}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5)
# OpenAI's finish reasons for the engine's.
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class RequestError(ValueError):
    """A request the server refuses (400), with a message that says what to change; param: the
    request field at fault, for the error body's "param" (OpenAI's), when the message does not
    begin by naming it (error_param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_param(error: Exception, body: dict | None = None) -> str | None:
    """The request field an error is about, as OpenAI fills "param"; None when not known: the
    error's own param, else the name its message begins with, quoted ('"top_p" must be ...') or
    bare as the Python API writes it ('temperature must be ...'), mapped back to the field the
    client sent (body: the request, when it was read)."""
    param = getattr(error, "param", None)
    if param is not None:
        return param
    named = re.match(r'("?)(\w+)', str(error))
    if not named:
        return None
    quoted, name = named.groups()
    sent = body if isinstance(body, dict) else {}
    if name == "structured_output":  # the grammar came from the one structured field the request sent
        given = [field for field in STRUCTURED_FIELDS if sent.get(field) is not None]
        return given[0] if len(given) == 1 else None
    if name == "max_new_tokens" and sent.get("max_completion_tokens") is not None:
        return "max_completion_tokens"  # (chat's newer name, read as max_tokens)
    name = GENERATE_FIELDS.get(name, name)  # e.g. num_return_sequences -> n
    if name not in REQUEST_FIELDS:
        return None
    # A bare word is taken for a field only when the request sent that field (else it is just a word).
    return name if quoted or name in sent else None


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, decoder: Decoder, model_name: str, host: str, port: int, quiet: bool = False,
                 max_batch_rows: int = 16, api_key: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        self.decoder, self.model_name, self.quiet, self.api_key = decoder, model_name, quiet, api_key
        # The parsers' markers are kept request by request (_answer): in chat replies, as vLLM keeps them.
        check_parsers(decoder.tokenizer, tool_call_parser, reasoning_parser, PARSER_FLAGS)
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.special_tokens = decoder.special_tokens()  # what "skip_special_tokens": false keeps
        self.generating = threading.Lock()
        self.metrics = ServeMetrics(model_name, decoder.config["drafter"]["name"])
        self.batcher = Batcher(decoder, self.generating, max_batch_rows, record=self.metrics.record,
                               record_request=self.metrics.record_request)
        self.metrics.watch(self.batcher)
        self.answering = 0  # POST requests not yet answered: the exit lets them write their last bytes
        self.answered = threading.Condition()
        super().__init__((host, port), Handler)

    def wait_for_answers(self, wait: float = 5.0) -> None:
        """After the batcher stopped: the handler threads are daemons, so an exit would cut the
        answers (finish reason "abort", a stream's [DONE]) they are writing."""
        with self.answered:
            self.answered.wait_for(lambda: self.answering == 0, timeout=wait)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


GET_ROUTES = ("/v1/models", "/metrics", "/health")
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


class Handler(BaseHTTPRequestHandler):
    server: Server

    @property
    def route(self) -> str:
        """The path without its query string (\"?api-version=...\", which clients add) or a last slash."""
        return urlsplit(self.path).path.rstrip("/")

    def do_GET(self):
        if not self._authorized():
            return
        if self.route == "/health":
            return self._json(200, {"status": "ok"})
        if self.route == "/v1/models":
            return self._json(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "draftsman"}]})
        if self.route == "/metrics":
            return self._send(200, self.server.metrics.content_type, self.server.metrics.exposition())
        if self.route in POST_ROUTES:
            return self._wrong_method()
        self._no_route()

    do_HEAD = do_GET  # (_send writes no body for HEAD)

    def _wrong_method(self) -> None:
        """405 with the method the route takes (http.server answered PUT, DELETE and the like with
        an HTML page; a GET of /v1/completions was 'no route')."""
        path = self.route
        allowed = "GET" if path in GET_ROUTES else "POST" if path in POST_ROUTES else None
        if allowed is None:
            return self._no_route()
        self._error(405, f"{path} takes {allowed}, not {self.command}", {"Allow": allowed})

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _wrong_method

    def _no_route(self) -> None:
        """404 listing every route with its method (a GET listed the GET routes only)."""
        self._error(404, f"no route {self.command} {self.path}: GET {', '.join(GET_ROUTES)}; "
                         f"POST {', '.join(POST_ROUTES)}")

    def do_POST(self):
        if not self._authorized():
            return
        routes = dict(zip(POST_ROUTES, (self._completions, self._chat, self._tokenize, self._detokenize)))
        route = routes.get(self.route)
        if route is None:
            if self.route in GET_ROUTES:
                return self._wrong_method()
            return self._no_route()
        with self.server.answered:
            self.server.answering += 1
        try:
            self._post(route)
        finally:
            with self.server.answered:
                self.server.answering -= 1
                self.server.answered.notify_all()

    def _post(self, route) -> None:
        body = None  # (unread when the body itself is refused)
        try:
            body = self._body()
            route(body)
        except (ValueError, TypeError) as e:  # RequestError, and the Decoder's own checks of the input
            self._error(400, str(e), param=error_param(e, body))
        except ConnectionError:  # the client left (a broken pipe, or ClientGone): nothing to answer
            pass
        except ServerStopping as e:
            self._error(503, str(e))
        except RuntimeError as e:  # e.g. out of memory: say so rather than drop the connection
            self._error(500, f"generation failed: {e}")
        except Exception as e:  # a defect of ours: the client still gets an answer, the log the traceback
            traceback.print_exc()
            self._error(500, f"the server failed on this request ({type(e).__name__}: {e}); please report it")

    # ----------------------------------------------------------------------- the two endpoints

    def _completions(self, body: dict) -> None:
        check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        self._check_model(body)
        prompts = completion_prompts(body.get("prompt"))
        decoder = self.server.decoder
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):  # (encoded one by one below, each would be "prompt 0")
                check_unicode(prompt, f"prompt {i}")
        ids = [decoder.encode([p])[0] if isinstance(p, str) else p for p in prompts]
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError(f'"echo" is true or false, got {echo!r}')
        if echo and streams(body):
            raise RequestError('"echo" is not served with "stream": true; drop one of them')
        echoed = [p if isinstance(p, str) else decoder.decode(p) for p in prompts] if echo else None
        self._answer(body, ids, chat=False, echoed=echoed)

    def _chat(self, body: dict) -> None:
        check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
        self._check_model(body)
        if body.get("max_completion_tokens") is not None:  # OpenAI's newer name for max_tokens
            if body.get("max_tokens") is not None:
                raise RequestError('give "max_completion_tokens" or "max_tokens", not both')
            # (kept beside max_tokens: the errors name the field the client sent, max_field)
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        reading = tool_call_reading(body, self.server.tool_call_parser)
        ids = self._chat_ids(body)  # checks the tools
        try:
            forced = forced_calls(body.get("tool_choice"), body.get("tools"),
                                  parallel=body.get("parallel_tool_calls") is not False)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if forced is not None:  # the reply held to the calls by a grammar
            reading = forced
            given = [field for field in STRUCTURED_FIELDS if body.get(field) is not None]
            if given:
                raise RequestError(f'"tool_choice" {json.dumps(body["tool_choice"])} holds the reply to tool calls, '
                                   f"and {given} would constrain it too: send one of them")
            body = {**body, "structured_outputs": forced.structured_output}
        self._answer(body, ids, chat=True, parsed_tools=body["tools"] if reading else None, tool_parser=reading,
                     one_call=body.get("parallel_tool_calls") is False)

    def _kept_in_text(self, body: dict, args: dict, chat: bool, tool_parser) -> list[str]:
        """The special tokens a request's text keeps. A chat reply under a parser: those its format
        is read by (Mistral's [TOOL_CALLS]; none for tool_choice "none" or a forced call), as vLLM
        keeps them. vLLM's "skip_special_tokens": false: all of them, but the ones that end a row
        (EOS unless "ignore_eos", the request's stop_token_ids), which vLLM leaves out of the text too."""
        skip = body.get("skip_special_tokens", True)
        if not isinstance(skip, bool):
            raise RequestError(f'"skip_special_tokens" is true or false, got {json.dumps(skip)}')
        kept = list(kept_in_text(tool_parser, self.server.reasoning_parser)) if chat else []
        if skip:
            return kept
        stop_ids = args.get("stop_token_ids")  # (a bad value is refused later, with its own message)
        ends = {t for t in stop_ids if isinstance(t, int)} if isinstance(stop_ids, list) else set()
        if args.get("ignore_eos") is not True:  # (under ignore_eos EOS ends nothing: the text shows it)
            ends |= set(self.server.decoder.engine.eos_token_ids)
        return [*kept, *(text for token, text in self.server.special_tokens.items() if token not in ends)]

    def _chat_ids(self, body: dict) -> list[list[int]]:
        """A request's "messages" (with its "tools", "chat_template_kwargs" and vLLM's turn fields,
        chat_turn) as prompt ids (earlier tool calls' arguments reach the template as objects:
        Decoder.encode_chat)."""
        messages = check_conversation(body.get("messages"), '"messages"')
        continues, opens_turn = chat_turn(body)
        return self.server.decoder.encode_chat(messages, continue_final_message=continues, tools=body.get("tools"),
                                               chat_template_kwargs=body.get("chat_template_kwargs"),
                                               add_generation_prompt=opens_turn)

    def _answer(self, body: dict, ids: list[list[int]], chat: bool, echoed: list[str] | None = None,
                parsed_tools: list[dict] | None = None, tool_parser=None, one_call: bool = False) -> None:
        """echoed: with completions' "echo", each prompt's text, written before its completion
        (and its tokens' scores before the completion's); "max_tokens": 0 then only scores it.
        parsed_tools: the request's tools when a chat reply's tool calls are parsed out of its text,
        tool_parser how: the server's format (draftsman/tool_calls.py) or a forced call's
        (draftsman/forced_calls.py); one_call: only a reply's first call is sent (parallel_tool_calls false);
        a chat reply's reasoning is split from it under --reasoning-parser (draftsman/reasoning.py),
        and left out when the request sends vLLM's "include_reasoning": false."""
        args = generate_args(body)
        check_token_counts(body, self.server.decoder.config["generation"]["max_new_tokens"])
        args["keep_in_text"] = self._kept_in_text(body, args, chat, tool_parser)
        if chat and self.server.reasoning_parser:  # each grammar (the config's too) holds the answer, after the thought
            grammar = with_default_grammar(args.get("structured_output"),
                                           self.server.decoder.config["sampling"]["structured_output"])
            if grammar is not None:
                try:
                    args["structured_output"] = grammar_after_thought(
                        self.server.decoder.tokenizer, ids, grammar, self.server.reasoning_parser,
                        forced_call=isinstance(tool_parser, ForcedCalls))
                except ValueError as e:
                    raise RequestError(str(e)) from None
        include_usage = stream_usage(body)
        shows_reasoning = include_reasoning(body)
        top = logprobs_asked(body, chat)
        if top is not None:
            args.update(logprobs=True, top_logprobs=top)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.server.model_name}
        if streams(body):
            return self._stream(ids, args, head, kind, chat, include_usage, parsed_tools, shows_reasoning,
                                tool_parser, one_call)
        n = args.get("num_return_sequences", 1)
        scoring_only = echoed is not None and args.get("max_new_tokens") == 0
        if scoring_only:  # score the prompts, generate nothing: a prompt may fill the context
            self.server.decoder.engine.check_prompts(ids, generates=False)
            rows = len(ids) * n
            out, batch_rows = GenerationOutput([""] * rows, [[] for _ in range(rows)],
                                               GenerationStats(finish_reasons=["length"] * rows),
                                               [[] for _ in range(rows)], [[] for _ in range(rows)]), 0
        else:
            out, batch_rows = self.server.batcher.generate(ids, args, gone=self._client_gone)
        if echoed is not None and top is not None:
            # one model: scored between a generation's rounds, or alone
            prompt_values, prompt_tops = self.server.batcher.with_models(
                lambda: self.server.decoder.prompt_logprobs(ids, top))
        choices = []
        reasoning_parser = self.server.reasoning_parser if chat else None
        opened = opened_thoughts(self.server.decoder.tokenizer, ids, len(out.texts), reasoning_parser,
                                 args.get("structured_output"))
        for i, (text, reason) in enumerate(zip(out.texts, out.stats.finish_reasons)):
            scores = self._logprobs(out, i, chat) if top is not None else None
            if echoed is not None:
                p = i // n  # rows are prompt by prompt, n samples each
                if scores is not None:
                    scores = self._echo_scores(ids[p], prompt_values[p], prompt_tops[p] if top else None,
                                               len(echoed[p]), out, i)
                text = echoed[p] + text
            reason = FINISH.get(reason, reason)
            if chat:
                message, reason = reply_message(text, reason, tool_parser, self.server.reasoning_parser, parsed_tools,
                                                opened[i], one_call)
                if not shows_reasoning and "reasoning_content" in message:
                    message["reasoning_content"] = None
                choices.append({"index": i, "message": message, "logprobs": scores, "finish_reason": reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": scores, "finish_reason": reason})
        prompt_tokens = sum(map(len, ids))
        completion_tokens = sum(map(len, out.token_ids))
        self._json(200, {**head, "object": kind, "choices": choices,
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                   "total_tokens": prompt_tokens + completion_tokens},
                         "draftsman": {**self._report(out.stats), "batch_rows": batch_rows}})

    def _stream(self, ids, args: dict, head: dict, kind: str, chat: bool, include_usage: bool = False,
                parsed_tools: list[dict] | None = None, shows_reasoning: bool = True, tool_parser=None,
                one_call: bool = False) -> None:
        """Server-sent events as rounds commit tokens: one choice per prompt and sample (index =
        prompt x n + sample, as the answer's choices), each ending with its finish_reason as soon
        as its row ends; the last one carries the `draftsman` statistics. parsed_tools, tool_parser
        and one_call (as _answer's): each chat reply's calls are sent as OpenAI's tool_calls deltas,
        each whole as its block closes; under --reasoning-parser a chat reply's thought as
        reasoning_content deltas."""
        job, chunks = self.server.batcher.stream(ids, args, gone=self._client_gone)  # with the others waiting
        first = next(chunks, None)  # the input's errors surface here, before any header is sent
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        chunk_kind = f"{kind}.chunk" if chat else kind
        offsets = [0] * job.rows  # completions' text_offset counts from the start of each whole completion
        completion_tokens = 0

        replies = None
        if chat and (tool_parser or self.server.reasoning_parser):
            opened = opened_thoughts(self.server.decoder.tokenizer, ids, job.rows, self.server.reasoning_parser,
                                     args.get("structured_output"))
            replies = [ReplyStream(tool_parser, self.server.reasoning_parser, parsed_tools, opened[row], one_call)
                       for row in range(job.rows)]

        def send(index: int, delta: str | None, reason: str | None = None, role: bool = False, chunk=None,
                 last_event: bool = False) -> None:
            scores = None
            if chunk is not None and chunk.logprobs is not None:
                scores = self._scores(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, chat, offsets[index])
                if not chat:  # completions' text_offset runs on over the tokens just scored
                    offsets[index] += sum(map(len, scores["tokens"]))
            if replies is not None and not role:  # reasoning, content, tool_calls
                deltas = replies[index].feed(delta or "", final=reason is not None)
                if not shows_reasoning:
                    deltas = [d for d in deltas if "reasoning_content" not in d]
                if reason is not None:
                    reason = replies[index].finish_reason(reason)
                elif not deltas and scores is None:  # text held as a possible tag: nothing to send yet
                    return
                for d in deltas[:-1]:
                    emit(index, d, None, scores)
                    scores = None  # a chunk's scores go with its first delta
                return emit(index, deltas[-1] if deltas else {}, reason, scores, last_event)
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
                emit(index, d, reason, scores, last_event)
            else:
                emit(index, {"text": delta or ""}, reason, scores, last_event)

        def emit(index: int, delta: dict, reason: str | None, scores, last_event: bool = False) -> None:
            if chat:
                choice = {"index": index, "delta": delta, "logprobs": scores, "finish_reason": reason}
            else:
                choice = {"index": index, **delta, "logprobs": scores, "finish_reason": reason}
            event = {**head, "object": chunk_kind, "choices": [choice]}
            # Only the very last event: the batch's statistics are known once every row has ended, and
            # the generating thread may set them while earlier rows' ends are still being sent.
            if last_event and job.stats is not None:
                event["draftsman"] = {**self._report(job.stats), "batch_rows": job.batch_rows}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()

        last = None  # (row, reason) of the row that ends last: sent once the statistics are known
        ended = 0
        try:
            if chat:
                for index in range(job.rows):
                    send(index, None, role=True)
            for row, chunk in itertools.chain([first] if first is not None else [], chunks):
                completion_tokens += len(chunk.token_ids)
                if chunk.text or chunk.logprobs:  # held-back text sends nothing unless its scores were asked for
                    send(row, chunk.text, chunk=chunk)
                if chunk.finish_reason is not None:
                    ended += 1
                    reason = FINISH.get(chunk.finish_reason, chunk.finish_reason)
                    if ended < job.rows:
                        send(row, None, reason)
                    else:
                        last = (row, reason)
        except (BrokenPipeError, ConnectionResetError):  # the client left: stop generating its rows
            job.cancel()
            raise
        except (ValueError, TypeError, RuntimeError) as e:  # after the headers: an error event, as vLLM sends
            error = {"error": {"message": f"generation failed: {e}", "type": "server_error", "param": None,
                               "code": 500}}
            self.wfile.write(f"data: {json.dumps(error)}\n\n".encode() + b"data: [DONE]\n\n")
            self.wfile.flush()
            return
        send(last[0], None, last[1], last_event=True)
        if include_usage:  # OpenAI's last chunk: no choices, the usage of the whole request
            prompt_tokens = sum(map(len, ids))
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
            event = {**head, "object": chunk_kind, "choices": [], "usage": usage}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _echo_scores(self, prompt: list[int], values: list, tops, prompt_chars: int, out, row: int) -> dict:
        """Completions' scores of the prompt's tokens (the first has none), then the completion's."""
        before = self._scores(prompt, values, tops, chat=False)
        after = self._scores(out.token_ids[row], out.logprobs[row],
                             out.top_logprobs[row] if out.top_logprobs is not None else None, chat=False,
                             offset=prompt_chars)
        if tops is None:  # OpenAI's first prompt token has no alternatives either
            before["top_logprobs"][0] = None
        before["text_offset"] = self._prompt_offsets(prompt, prompt_chars)
        return {key: before[key] + after[key] for key in before}

    def _prompt_offsets(self, prompt: list[int], prompt_chars: int) -> list[int]:
        """Where each prompt token starts in the echoed text: the length of the text the tokens
        before it decode to. The tokens' own pieces would not do: a BOS the text leaves out ("<s>")
        or a character split over byte tokens shifted every later offset, and the completion's
        offsets then ran backwards. Never past the echoed prompt (a text prompt is echoed as sent)."""
        text, offsets = IncrementalText(self.server.decoder.decode), []
        for token in prompt:
            offsets.append(min(len(text.text), prompt_chars))
            text.add([token])
        return offsets

    def _logprobs(self, out, row: int, chat: bool) -> dict:
        """Row `row`'s token scores in the endpoint's OpenAI shape."""
        tops = out.top_logprobs[row] if out.top_logprobs is not None else None
        return self._scores(out.token_ids[row], out.logprobs[row], tops, chat)

    def _scores(self, tokens: list[int], values: list[float], tops, chat: bool, offset: int = 0) -> dict:
        """Token scores in OpenAI's chat or completions shape: the target's raw log-probability of
        each token (as vLLM reports them), tokens as their decoded text; offset: the completion
        text's length before these tokens."""
        piece = self.server.decoder.decode_token
        tops = tops if tops is not None else [[] for _ in tokens]
        if chat:
            def entry(t: int, v: float) -> dict:
                text = piece(t)
                return {"token": text, "logprob": v, "bytes": list(text.encode())}
            return {"content": [{**entry(t, v), "top_logprobs": [entry(a, b) for a, b in top]}
                                for t, v, top in zip(tokens, values, tops)]}
        pieces, offsets, at = [piece(t) for t in tokens], [], offset
        for text in pieces:
            offsets.append(at)
            at += len(text)
        return {"tokens": pieces, "token_logprobs": values,
                "top_logprobs": [_by_text(top, piece) if top is not None else None for top in tops],
                "text_offset": offsets}

    # ----------------------------------------------------------------------- vLLM's token routes

    def _tokenize(self, body: dict) -> None:
        """{"prompt": text, "add_special_tokens": true} or a chat's {"messages", "tools",
        "chat_template_kwargs"}, as the completions and chat endpoints would encode them."""
        check_fields(body, TOKENIZE_FIELDS, "/tokenize")
        self._check_model(body)
        decoder = self.server.decoder
        if ("prompt" in body) == ("messages" in body):
            raise RequestError('/tokenize takes "prompt" (text) or "messages" (a chat), one of them')
        if "messages" in body:
            ids = self._chat_ids(body)[0]
        else:
            special = body.get("add_special_tokens", True)
            if not isinstance(body["prompt"], str) or not isinstance(special, bool):
                raise RequestError('"prompt" must be a string and "add_special_tokens" true or false')
            ids = decoder.tokenizer(body["prompt"], add_special_tokens=special)["input_ids"]
        self._json(200, {"count": len(ids), "max_model_len": decoder.engine.max_context, "tokens": ids})

    def _detokenize(self, body: dict) -> None:
        check_fields(body, {"model", "tokens"}, "/detokenize")
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError(f'"tokens" must be a list of token ids, got {json.dumps(tokens)[:100]}')
        vocab = self.server.decoder.engine.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the target's vocabulary [0, {vocab})")
        self._json(200, {"prompt": self.server.decoder.decode(tokens)})

    # ----------------------------------------------------------------------- plumbing

    def _client_gone(self) -> bool:
        """The client closed its connection: its socket reads as ended. (A client waits silently for
        its answer, so anything readable is either that end, or a next request, which is kept.)"""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _authorized(self) -> bool:
        """With --api-key, the /v1 routes need "Authorization: Bearer KEY" (as vLLM's); health,
        metrics and the token routes stay open, as there."""
        key = self.server.api_key
        if not key or not self.path.startswith("/v1"):
            return True
        # As bytes: compare_digest refuses str with non-ASCII characters (a header's "café" dropped the
        # connection). http.server read the header as Latin-1, so this gives back the bytes sent.
        given = self.headers.get("Authorization", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, f"Bearer {key}".encode()):
            return True
        self._error(401, 'this server needs the header "Authorization: Bearer <key>", the key it was started '
                         "with (draftsman serve --api-key; the OpenAI SDK sends its api_key so)")
        return False

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is not None and name != self.server.model_name:
            raise RequestError(f"model '{name}' is not served here; this server serves '{self.server.model_name}' "
                               "(GET /v1/models)")

    def _report(self, stats) -> dict:
        return {"drafter": self.server.decoder.config["drafter"]["name"], "tau": round(stats.tau, 4),
                "lossy": stats.lossy}

    def _body(self) -> dict:
        try:
            body = json.loads(self._body_bytes() or b"null")
        except json.JSONDecodeError as e:
            raise RequestError(f"the request body is not valid JSON ({e.msg}): send one JSON object") from None
        except RecursionError:
            raise RequestError("the request body nests JSON too deeply to read: send a flatter object") from None
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    def _body_bytes(self) -> bytes:
        """The body as Content-Length frames it, or as chunks (Transfer-Encoding: chunked, which
        streaming HTTP clients send)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return read_chunked(self.rfile)
        length = self.headers.get("Content-Length") or "0"
        if not length.strip().isdigit():  # (-1 read until the client closed: the request hung)
            self.close_connection = True  # the body's end is unknown: the connection cannot carry another
            raise RequestError(f"Content-Length must be a whole number of bytes, got {length!r}")
        return self.rfile.read(int(length))

    def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        self._send(status, "application/json", json.dumps(payload).encode(), headers)

    def _send(self, status: int, content_type: str, data: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, message: str, headers: dict | None = None, param: str | None = None) -> None:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error"}.get(status, "server_error")
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": status}}, headers)

    def log_message(self, format, *args):  # http.server's signature
        if not self.server.quiet:
            super().log_message(format, *args)


def read_chunked(stream, limit: int = 1 << 30) -> bytes:
    """A chunked body (RFC 9112 7.1): hex-sized chunks, a zero-sized one last, trailers after it."""
    body = bytearray()
    while True:
        size = stream.readline(1024).split(b";")[0].strip()
        try:
            size = int(size, 16)
        except ValueError:
            raise RequestError(f"a chunked body's chunk size must be hexadecimal, got {size[:20]!r}") from None
        if size < 0 or len(body) + size > limit:
            raise RequestError(f"a chunked body's chunks must be 0 to {limit} bytes in all")
        if size == 0:
            while stream.readline(1024).strip():  # trailers, up to the blank line
                pass
            return bytes(body)
        body += stream.read(size)
        stream.readline(1024)  # the CRLF after the chunk


def _by_text(top: list[tuple[int, float]], piece) -> dict[str, float]:
    """Completions' {token text: logprob}, likeliest first. Two tokens can decode to one text (byte
    tokens of a split character both read "\ufffd"): the likelier one keeps the key."""
    scores: dict[str, float] = {}
    for token, value in top:
        scores.setdefault(piece(token), value)
    return scores


def check_fields(body: dict, valid: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - valid)
    if unknown:
        raise RequestError(f"{endpoint} does not take {unknown}; valid fields: {sorted(valid)}", param=unknown[0])


def completion_prompts(prompt) -> list:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, or a list of those."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in p)) for p in prompt):
        return prompt
    raise RequestError(f'"prompt" must be a string, a list of strings, a list of token ids or a list of such '
                       f"lists; got {json.dumps(prompt)[:100]}")


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """None when no scores are asked, else how many top alternatives per token. Completions:
    "logprobs": N (OpenAI's legacy form, N alternatives); chat: "logprobs": true, "top_logprobs": N."""
    if chat:
        asked, top = body.get("logprobs"), body.get("top_logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise RequestError(f'"logprobs" is true or false for chat (the count is "top_logprobs"), got {asked!r}')
        if top is not None and not asked:
            raise RequestError('"top_logprobs" needs "logprobs": true')
        if not asked:
            return None
    else:
        top = body.get("logprobs")
        if top is None:
            return None
    top = 0 if top is None else top
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"the number of top logprobs must be a whole number in [0, {MAX_TOP_LOGPROBS}], "
                           f"got {top!r}", param="top_logprobs" if chat else "logprobs")
    return top


def include_reasoning(body: dict) -> bool:
    """vLLM's "include_reasoning" (default true): false leaves a chat reply's thought out."""
    shown = body.get("include_reasoning", True)
    if not isinstance(shown, bool):
        raise RequestError(f'"include_reasoning" must be true or false, got {json.dumps(shown)}')
    return shown


def streams(body: dict) -> bool:
    """OpenAI's "stream": true, false or null (false). A string such as "false" is refused: read as
    truthy, it sent server-sent events to a client that waits for one JSON object."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f'"stream" must be true or false, got {json.dumps(stream)}')
    return bool(stream)


def max_field(body: dict) -> str:
    """The field a request gave its token limit in: chat's "max_completion_tokens" or "max_tokens"."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def check_token_counts(body: dict, default_max: int) -> None:
    """max_tokens and min_tokens, refused in the request's words (the engine's own checks name
    the Python API's max_new_tokens and min_new_tokens, which the client never sent)."""
    most, least, named = body.get("max_tokens"), body.get("min_tokens"), max_field(body)
    lowest = 0 if body.get("echo") is True else 1  # "max_tokens": 0 with echo scores the prompt
    if most is not None and (not whole_number(most) or most < lowest):
        raise RequestError(f'"{named}" must be a whole number >= {lowest}, got {json.dumps(most)}', param=named)
    if least is None:
        return
    if not whole_number(least):
        raise RequestError(f'"min_tokens" must be a whole number (the tokens before EOS or a stop may end the '
                           f'reply), got {json.dumps(least)}', param="min_tokens")
    limit = default_max if most is None else most
    if not 0 <= least <= limit:
        raise RequestError(f'"min_tokens" must be in [0, "{named}" = {limit}], got {least}: raise "{named}" or '
                           'lower "min_tokens"', param="min_tokens")


def whole_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_turn(body: dict) -> tuple[bool, bool]:
    """vLLM's (continue_final_message, add_generation_prompt) of a chat request: by default the
    assistant's turn is opened; continuing the last (assistant's) message opens none."""
    continues, opens = body.get("continue_final_message"), body.get("add_generation_prompt")
    for field, value in (("continue_final_message", continues), ("add_generation_prompt", opens)):
        if value is not None and not isinstance(value, bool):
            raise RequestError(f'"{field}" is true or false, got {json.dumps(value)}')
    if continues and opens:  # vLLM's check: the template cannot both continue a message and open a turn
        raise RequestError('"continue_final_message" and "add_generation_prompt" cannot both be true: send '
                           '"add_generation_prompt": false to continue the last (assistant) message')
    return bool(continues), opens is not False


def stream_usage(body: dict) -> bool:
    """OpenAI's stream_options: {"include_usage": bool} is the one option it has."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f'"stream_options" takes {{"include_usage": true or false}}, got {options!r}')
    if not streams(body):
        raise RequestError('"stream_options" goes with "stream": true')
    return options.get("include_usage", False)


def tool_call_reading(body: dict, parser: str | None) -> str | None:
    """The server's --tool-call-parser format when a chat request sends "tools" and "tool_choice"
    is "auto" (the default), else None: "none" leaves the reply as text, and a forced call
    ("required", a named function) is read by forced_calls (draftsman/forced_calls.py)."""
    choice, tools, parallel = body.get("tool_choice"), body.get("tools"), body.get("parallel_tool_calls")
    if choice is not None and not tools:
        raise RequestError('"tool_choice" goes with "tools": send the tools, or leave tool_choice out')
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f'"parallel_tool_calls" must be true or false, got {json.dumps(parallel)}')
    try:
        kind, _ = check_tool_choice(choice)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if kind != "auto" or not tools:
        return None
    if parser is None:
        if choice == "auto":
            raise RequestError('"tool_choice": "auto" needs the server started with --tool-call-parser (e.g. hermes), '
                               "the format the model writes its calls in; without it, leave tool_choice out and "
                               "read the calls in the reply's text")
        return None
    return parser


def generate_args(body: dict) -> dict:
    """The Decoder.generate arguments of a request's sampling fields (absent ones: the config's)."""
    args = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    check_one_value_fields(body)
    best_of, n = body.get("best_of"), body.get("n")
    if n is None:
        n = 1
    elif isinstance(n, bool) or not isinstance(n, int) or n < 1:  # 0 and -1 read "no prompts given"; "2" a TypeError
        raise RequestError(f'"n" must be a whole number >= 1 (the samples per prompt), got {n!r}')
    if best_of is not None and best_of != n:  # vLLM's best_of: n of best_of samples, by their logprob
        raise RequestError(f'"best_of" {best_of!r} is not served (only the n samples asked are made): '
                           f'leave it out or send "best_of": {n!r}, as "n"')
    if isinstance(args.get("stop"), str):
        args["stop"] = [args["stop"]]
    structured = structured_output(body)
    if structured is not None:
        args["structured_output"] = structured
    if "logit_bias" in args:  # JSON object keys are strings
        biases = args["logit_bias"]
        if not isinstance(biases, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in biases.values()):
            raise RequestError(f'"logit_bias" must map token ids to biases (numbers), e.g. {{"50256": -100}}; '
                               f"got {json.dumps(biases)[:200]}")
        try:
            args["logit_bias"] = {int(k): float(v) for k, v in biases.items()}
        except ValueError:
            raise RequestError(f'"logit_bias" keys must be token ids, e.g. {{"50256": -100}}; '
                               f"got {json.dumps(biases)[:200]}") from None
    return args


# The Python API takes a list of one value per prompt for these; a request sets one value for all
# its prompts (a list leaked into the API's per-prompt form: "max_new_tokens has 2 values for 4 prompts").
ONE_VALUE_FIELDS = set(SAMPLING_FIELDS) - {"stop", "stop_token_ids", "logit_bias", "bad_words_ids"}


def check_one_value_fields(body: dict) -> None:
    for field in sorted(ONE_VALUE_FIELDS & set(body)):
        if isinstance(body[field], (list, dict)):
            raise RequestError(f'"{field}" takes one value for the whole request, got {json.dumps(body[field])[:100]}')
    stop, ids = body.get("stop"), body.get("stop_token_ids")
    # (a list holding null was the API's per-prompt form: no stop, silently)
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(f'"stop" must be a string or a list of strings, got {json.dumps(stop)[:100]}')
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise RequestError(f'"stop_token_ids" must be a list of token ids, got {json.dumps(ids)[:100]}')


def structured_output(body: dict) -> dict | None:
    """Decoder.generate's structured_output from a request's STRUCTURED_FIELDS (None: free text).
    OpenAI's response_format: {"type": "json_schema", "json_schema": {"schema": ...}}, {"type":
    "json_object"} or {"type": "text"}; vLLM's structured_outputs: {"json" | "regex" | "choice" |
    "grammar" | "json_object": ...}; vLLM's guided_json, guided_regex, guided_choice, guided_grammar."""
    given = [field for field in STRUCTURED_FIELDS if body.get(field) is not None]
    if len(given) > 1:
        raise RequestError(f"{given} each constrain the output: send one of them")
    if not given:
        return None
    field, value = given[0], body[given[0]]
    if field == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            spec = {"json_object": True}
        elif kind == "json_schema" and isinstance(value.get("json_schema"), dict) \
                and value["json_schema"].get("schema") is not None:
            spec = {"json": value["json_schema"]["schema"]}
        else:
            raise RequestError('"response_format" must be {"type": "text"}, {"type": "json_object"} or {"type": '
                               '"json_schema", "json_schema": {"name": ..., "schema": {...}}}, got '
                               f"{json.dumps(value)[:200]}")
    elif field == "structured_outputs":
        spec = value
    else:
        spec = {field[len("guided_"):]: value}
    try:
        StructuredOutput.parse(spec)
    except ValueError as e:
        raise RequestError(f'"{field}": {e}') from None
    return spec


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    from .cli import build_config

    check_max_rows(args.max_batch_rows)  # before the model loads
    check_address(args.host, args.port)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser FORMAT (the format the model writes "
                         f"its calls in: {', '.join(PARSERS)})")
    if args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 0 tokens (0: whole prompts), got {args.prefill_chunk}")
    if args.save_memory_every < 0:
        raise ValueError(f"--save-memory-every must be >= 0 seconds (0: only when the server stops), got "
                         f"{args.save_memory_every}")
    cfg = build_config(args.config, args.drafter, args.overrides, args.target)
    hf_logging.disable_progress_bar()
    decoder = Decoder(cfg)
    decoder.engine.join_prefill_chunk = args.prefill_chunk or None
    if decoder.tokenizer is None:
        raise ValueError(f"target folder '{cfg['target']['path']}' has no tokenizer: the OpenAI API sends text")
    name = args.served_model_name or Path(cfg["target"]["path"]).name
    try:
        server = Server(decoder, name, args.host, args.port, quiet=args.quiet, max_batch_rows=args.max_batch_rows,
                        api_key=args.api_key, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser)
    except OSError as e:  # taken while the model loaded
        raise listen_error(args.host, args.port, e) from None
    server.batcher.save_memory_every = args.save_memory_every or None
    print(f"serving '{name}' with drafter {cfg['drafter']['name']} at {server.url} (Ctrl-C stops)", file=sys.stderr)
    # SIGTERM (docker stop, systemd, kill) unwinds as Ctrl-C does, so the drafter's memory is saved.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        # docker stop / systemd send SIGTERM again, then SIGKILL: the save is not interrupted
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.batcher.stop()  # the running rows end within a round (finish reason "abort")
        server.batcher.finish_at_exit()
        server.wait_for_answers()
    return 0


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)
