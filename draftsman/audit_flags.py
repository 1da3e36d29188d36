"""`draftsman audit`'s flags, apart from the audit (draftsman/audit.py), which imports torch and
transformers: `draftsman audit --help` and a mistyped flag answer without them."""
from __future__ import annotations

import argparse

from .cli import add_logit_bias_arg, add_lossy_typical_arg, add_ngram_ban_arg, add_target_arg, add_truncation_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or JSON run config: the target and drafter to audit")
    add_target_arg(p)
    p.add_argument("--prompts", metavar="FILE",
                   help='JSONL with a "text" field per line (or "messages": a conversation for the target\'s chat '
                        'template, "input_ids", or Spec-Bench\'s "turns": the first turn), or plain text with one '
                        "prompt per line; default: a few built-in short code prompts")
    p.add_argument("--drafter", metavar="NAME", help="audit this drafter instead of the config's (its options "
                   "are dropped; add new ones with --set)")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE",
                   help="override one config value, parsed as YAML (drafter.k=6)")
    p.add_argument("--only", choices=["greedy", "sampling"], help="run one check only (default: both)")
    p.add_argument("--max-new-tokens", type=int, help="greedy: tokens per prompt; default generation.max_new_tokens")
    p.add_argument("--tie-tolerance", type=float,
                   help="greedy: largest top-1 minus emitted logit reported as a near-tie rather than a failure; "
                        "default by target dtype: float32 1e-3, float16 2e-2, bfloat16 1e-1, float64 1e-6")
    p.add_argument("--temperature", type=float,
                   help="sampling: default sampling.temperature, or 1.0 when the config is greedy")
    p.add_argument("--top-k", type=int, help="sampling: default sampling.top_k")
    p.add_argument("--top-p", type=float, help="sampling: default sampling.top_p")
    p.add_argument("--min-p", type=float, help="sampling: default sampling.min_p")
    add_truncation_args(p, prefix="sampling: ")
    p.add_argument("--repetition-penalty", type=float, help="sampling: default sampling.repetition_penalty")
    add_ngram_ban_arg(p, prefix="sampling: ")
    p.add_argument("--presence-penalty", type=float, help="sampling: default sampling.presence_penalty")
    p.add_argument("--frequency-penalty", type=float, help="sampling: default sampling.frequency_penalty")
    add_logit_bias_arg(p, prefix="sampling: ")
    add_lossy_typical_arg(p, prefix="sampling: ")
    p.add_argument("--samples", type=int, default=2000, help="sampling: samples per side per prompt (default 2000)")
    p.add_argument("--sample-prompts", type=int, default=2, help="sampling: how many of the prompts (default 2)")
    p.add_argument("--positions", type=int, default=3, help="sampling: first tokens compared (default 3)")
    p.add_argument("--alpha", type=float, default=1e-4,
                   help="sampling: chance of a false alarm per audit, split over the tests (default 1e-4)")
    p.add_argument("--batch-size", type=int, default=500, help="sampling: rows per engine call (default 500)")
    p.add_argument("--seed", type=int, help="sampling: default generation.seed")
    p.add_argument("--json", action="store_true", help="print the full result as one JSON object")
