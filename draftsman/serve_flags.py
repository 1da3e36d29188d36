"""`draftsman serve`'s flags, apart from the server (draftsman/serve.py), which imports torch and
transformers: `draftsman serve --help` and a mistyped flag answer without them."""
from __future__ import annotations

import argparse
import errno
import os
import socket

# Chunked prefill of joining prompts (verifier/prefill.py). On the 2-core CPU a pass of the
# bundled target costs about 45 ms up to 128 tokens, 80 ms for 256: small chunks pay that fixed
# cost many times. With 800-token prompts joining streams (docs/serving.md) 256 cut the p99 gap
# between a stream's pieces from 320 to 140 ms at the same tokens/s; 128 cut it as far but cost
# 8% tokens/s and 60% time to first token.
DEFAULT_PREFILL_CHUNK = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import add_reply_parser_args, add_run_config_args

    add_run_config_args(p)  # the config's sampling and generation values are every request's defaults
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: the target folder's name)")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("DRAFTSMAN_API_KEY"),
                   help="the /v1 routes need the header 'Authorization: Bearer KEY' (default: the DRAFTSMAN_API_KEY "
                        "environment variable; none: open)")
    p.add_argument("--max-batch-rows", type=int, default=16, metavar="N",
                   help="requests with the same settings run as one batch of at most N rows at once, joining a "
                        "running batch between rounds (default 16; 1: one request at a time)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="TOKENS",
                   help="a request that joins a running batch has its prompt prefilled at most TOKENS tokens per "
                        "round, so the running streams wait one chunk a round, not the whole prompt (chunked "
                        f"prefill; default {DEFAULT_PREFILL_CHUNK}; 0: the whole prompt at once)")
    p.add_argument("--save-memory-every", type=float, default=300.0, metavar="SECONDS",
                   help="a drafter with a memory_file (suffix, recycling) writes its memory between rounds at "
                        "most every SECONDS seconds, and when the server stops (default 300; 0: only when it stops)")
    add_reply_parser_args(p, 'chat replies (tool calls: of requests that send "tools"; vLLM\'s flags): ')
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, taken so its command lines run as they are: with --tool-call-parser, "
                        "tool_choice \"auto\" is served with or without it")


def check_address(host: str, port: int) -> None:
    """Before the model loads (minutes, for a large one): a port out of range or in use, and a host
    this machine cannot listen on, are named with the fix. The server binds as this does (IPv4,
    SO_REUSEADDR as http.server sets it: a port a stopped server left in TIME_WAIT is free)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {port}")
    try:
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        raise listen_error(host, port, e) from None


def listen_error(host: str, port: int, e: OSError) -> ValueError:
    """What a failed bind means, and the fix (the OSError alone says "[Errno 98] Address already in use")."""
    if e.errno == errno.EADDRINUSE:
        return ValueError(f"port {port} on {host} is in use (another server?): stop it, or pick another --port "
                          "(0: any free one)")
    hosts = "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
    if isinstance(e, socket.gaierror):
        return ValueError(f"--host {host!r} is no IPv4 address or name this machine resolves ({e.strerror}): "
                          f"use {hosts}")
    return ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}): --host must be an address of this "
                      f"machine, e.g. {hosts}")
