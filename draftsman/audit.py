"""`draftsman audit`: check on your own target, drafter and prompts that speculation changes nothing.

    greedy    generate at temperature 0 with the configured drafter, then run the target once over
              each prompt + output: every emitted token must be the target's argmax there. A token
              that differs only by a near-tie (top logits within the tolerance: numerical noise
              between the cached tree pass and a plain pass) is reported apart and does not fail.
    sampling  for the first few prompts, many samples of the first few tokens with the drafter and
              with plain decoding (drafter `none`, same engine, same temperature / top-k / top-p);
              per position j, two-sample chi-square tests on the token at j and on the joint of
              tokens 1..j.
              The audit fails if any p-value is below alpha / number of tests (Bonferroni).

Exit status: 0 pass, 1 fail, 2 a usage error. docs/audit.md says what each check proves.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from .api import Decoder
from .bench.prompts_set import read_prompts as read_prompt_set
from .chat import ToolConversation
from .chisquare import two_sample_chi2
from .audit_flags import add_arguments  # noqa: F401 (draftsman.audit's own name, as before)
from .cli import UserError, build_config, sampling_flags
from .config import DEFAULTS
from .verifier.ngram_ban import BadWords, repeated_ngram_tokens
from .verifier.sampling import SamplingParams, penalize_counts, penalize_repeats

BUILTIN_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
]

# Largest top-1 minus emitted logit counted as a near-tie, by target dtype: a few ulps of typical
# logits (|logit| ~ 10-30) plus the reordering noise of a batched tree pass versus a plain one.
TIE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}


# --------------------------------------------------------------------------- prompts

def read_prompts(path: str | Path) -> list[str | list[int] | list[dict]]:
    """A JSONL file (one object per line with "text", "messages" (a conversation, for a chat
    target's template, with its "tools" if any), "turns" (a Spec-Bench question, whose first turn
    is the prompt) or "input_ids" for targets without a tokenizer; read by compare's reader) or
    a plain text file with one prompt per line (blank lines skipped). A file whose first non-blank
    line starts with '{' is read as JSONL."""
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"prompts file '{p}' is a folder: give a file in it (JSONL, or one prompt per line)")
    if p.exists() and not p.is_file():  # /dev/null, a pipe: read twice below (JSONL), or empty
        raise ValueError(f"prompts file '{p}' is not a regular file: save the prompts to a file (JSONL, or one "
                         "prompt per line) and give its path")
    if not p.is_file():
        raise FileNotFoundError(f"prompts file '{p}' does not exist")
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"prompts file '{p}' has no prompts: write one per line, or JSONL with a \"text\" field")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts: list[str | list[int] | list[dict]] = []
    for prompt in read_prompt_set(p)[0]:
        if prompt.turns is not None and len(prompt.turns) > 1:
            continue  # a Spec-Bench question's later turn: its first turn, which needs no reply, is enough
        if prompt.input_ids is not None:
            prompts.append(prompt.input_ids)
        elif prompt.messages is not None:
            prompts.append(ToolConversation(prompt.messages, prompt.tools) if prompt.tools else prompt.messages)
        else:
            prompts.append(prompt.text)
    return prompts


def encode_prompts(decoder: Decoder, prompts: list[str | list[int] | list[dict]]) -> list[list[int]]:
    if any(isinstance(p, str) for p in prompts) and decoder.tokenizer is None:
        raise ValueError("the target folder has no tokenizer, so text prompts cannot be encoded: give "
                         "--prompts FILE in JSONL with {\"input_ids\": [...]} per line")

    def encode(p) -> list[int]:
        if isinstance(p, str):
            return decoder.encode([p])[0]
        if isinstance(p, ToolConversation):
            return decoder.encode_chat(p.messages, tools=p.tools)[0]
        if p and isinstance(p[0], dict):  # a conversation
            return decoder.encode_chat(p)[0]
        return list(p)
    return [encode(p) for p in prompts]


# --------------------------------------------------------------------------- greedy

def greedy_check(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int,
                 tolerance: float | None = None) -> dict:
    """Generate at temperature 0 with the drafter, then one plain target pass per prompt over
    prompt + output; every emitted token must be the argmax at its position (after the config's
    penalties, if any, for the context before it)."""
    tol = TIE_TOLERANCE.get(decoder.target.dtype, 1e-3) if tolerance is None else tolerance
    params = SamplingParams(**{**decoder.config["sampling"], "temperature": 0.0})  # the config's penalties
    # The config's generation settings, as the engine applies them: the tokens that end a row (EOS
    # unless ignore_eos, and stop_token_ids), held back before min_new_tokens. A min_new_tokens above
    # --max-new-tokens is capped: the engine refuses it, and it bans those tokens at every position anyway.
    generation = decoder.config["generation"]
    least = min(generation.get("min_new_tokens") or 0, max_new_tokens)
    out = decoder.generate(input_ids=prompts, max_new_tokens=max_new_tokens, min_new_tokens=least,
                           temperature=0.0, stop=[])
    eos = decoder.engine.eos_token_ids
    stop_ids = set(generation.get("stop_token_ids") or ())
    ends = stop_ids | (set() if generation.get("ignore_eos") else set(eos))
    rows = []
    for i, (prompt, new) in enumerate(zip(prompts, out.token_ids)):
        row = {"prompt": i, "tokens": len(new), "mismatches": [], "near_ties": [], "problems": []}
        with torch.no_grad():
            ids = torch.tensor([prompt + new[:-1]], device=decoder.device)
            logits = decoder.target(input_ids=ids).logits[0, len(prompt) - 1:].float()
        if params.logit_bias:  # first, as the engine adds it
            bias_ids, biases = params.bias_tensors(logits.device)
            logits[:, bias_ids] += biases.float()
        if params.penalizes_repeats or params.penalizes_counts:
            # Position j predicts new[j]: its context holds the prompt and new[:j], generated[j] counts new[:j].
            steps = torch.nn.functional.one_hot(torch.tensor(new[:-1], dtype=torch.long), logits.shape[-1])
            generated = torch.cat([torch.zeros(1, logits.shape[-1], dtype=torch.long), steps]).cumsum(0)
            generated = generated.to(logits.device)
        if params.penalizes_repeats:
            seen = generated > 0
            seen[:, torch.tensor(prompt)] = True
            logits = penalize_repeats(logits, seen, params.repetition_penalty)
        if params.penalizes_counts:  # vLLM's: they count generated tokens only
            logits = penalize_counts(logits, generated, params.presence_penalty, params.frequency_penalty)
        if params.bans_repeated_ngrams or params.bans_words:  # position j's sequence: the prompt and new[:j]
            ban = BadWords(params.bad_words_ids or (), decoder.engine.eos_token_ids)
            for j in range(len(new)):
                sequence = prompt + new[:j]
                banned = ban.banned_after(sequence)
                if params.bans_repeated_ngrams:
                    banned |= repeated_ngram_tokens(sequence, params.no_repeat_ngram_size)
                logits[j, sorted(banned)] = float("-inf")
        if least and ends:
            logits[:least, sorted(ends)] = float("-inf")
        best = logits.argmax(-1).tolist()
        for j, (tok, top) in enumerate(zip(new, best)):
            if tok == top:
                continue
            gap = float(logits[j, top] - logits[j, tok])
            rank = int((logits[j] > logits[j, tok]).sum())  # 1 = second best
            entry = {"position": j, "emitted": tok, "argmax": top, "logit_gap": gap, "rank": rank}
            row["near_ties" if gap <= tol else "mismatches"].append(entry)
        # The row must stop exactly at EOS or a stop id (kept), at max_new_tokens or at the context limit.
        early_end = [j for j, t in enumerate(new[:-1]) if t in ends]
        if early_end:
            ended_by = "EOS" if new[early_end[0]] in eos and not generation.get("ignore_eos") else "a stop token id"
            row["problems"].append(f"tokens emitted after {ended_by} at position {early_end[0]}")
        reason = out.stats.finish_reasons[i]
        if reason == "eos" and (not new or new[-1] not in eos):
            row["problems"].append("finished as 'eos' but the output does not end with EOS")
        if reason == "stop" and (not new or new[-1] not in stop_ids):
            row["problems"].append("finished as 'stop' but the output does not end with a stop token id")
        if reason == "length" and len(new) != max_new_tokens:
            row["problems"].append(f"finished as 'length' after {len(new)} of {max_new_tokens} tokens")
        rows.append(row)
    failed = any(r["mismatches"] or r["problems"] for r in rows)
    result = {"passed": not failed, "tolerance": tol, "max_new_tokens": max_new_tokens,
              "tokens": sum(r["tokens"] for r in rows), "tau": out.stats.tau, "prompts": rows}
    if out.stats.drafter_report:  # e.g. a cascade: which child proposed what
        result["drafter_report"] = out.stats.drafter_report
    return result


# --------------------------------------------------------------------------- sampling

def _samples(decoder: Decoder, prompt: list[int], n: int, positions: int, params: SamplingParams,
             seeds, batch_size: int) -> tuple[list[list[int]], float, list[dict]]:
    """n independent samples of the first `positions` tokens (one seed per batch), tau, and the
    drafter's report() of each engine call (empty where it has none)."""
    # The config's min_new_tokens, capped at `positions` (the engine refuses one above max_new_tokens):
    # it only holds EOS and the stop ids back before it, so the first `positions` tokens are distributed
    # exactly as in a run with the config's own max_new_tokens, and both sides get the same cap.
    least = min(decoder.config["generation"].get("min_new_tokens") or 0, positions)
    rows, new, row_rounds, reports = [], 0, 0, []
    for start in range(0, n, batch_size):
        out = decoder.generate(input_ids=[prompt] * min(batch_size, n - start), max_new_tokens=positions,
                               min_new_tokens=least, stop=[], seed=next(seeds), **dataclasses.asdict(params))
        rows += out.token_ids
        new, row_rounds = new + out.stats.new_tokens, row_rounds + out.stats.row_rounds
        if out.stats.drafter_report:
            reports.append(out.stats.drafter_report)
    return rows, new / max(row_rounds, 1), reports


ENDED = -1  # the category of "this row ended (at EOS) before position j"


def _at(row: list[int], j: int) -> int:
    return row[j - 1] if len(row) >= j else ENDED


def sampling_check(decoder: Decoder, prompts: list[list[int]], params: SamplingParams, samples: int = 2000,
                   positions: int = 3, alpha: float = 1e-4, seed: int = 0, batch_size: int = 500) -> dict:
    """Per prompt, `samples` rows with the drafter and as many with plain decoding; per position j
    a two-sample chi-square test on the joint of the first j tokens (a row that ended at EOS
    earlier keeps its shorter tuple, its own category) and on the token at j alone. Fails if any
    p < alpha / number of tests (Bonferroni)."""
    if params.greedy:
        raise ValueError("the sampling check needs temperature > 0")
    plain = decoder.with_drafter({"name": "none"})
    seeds = iter(range(seed, seed + 10**9))  # every engine call its own seed: independent samples
    tests, taus, reports = [], [], []
    for i, prompt in enumerate(prompts):
        spec, tau, calls = _samples(decoder, prompt, samples, positions, params, seeds, batch_size)
        base, _, _ = _samples(plain, prompt, samples, positions, params, seeds, batch_size)
        taus.append(tau)
        reports.append(calls)
        for j in range(1, positions + 1):
            # The token at j alone (most power), and for j > 1 the joint of tokens 1..j, which also
            # sees wrong dependence between positions. ENDED marks rows that stopped at EOS before j.
            result = two_sample_chi2([_at(r, j) for r in spec], [_at(r, j) for r in base])
            tests.append({"prompt": i, "position": j, "joint": False, **result})
            if j > 1:
                result = two_sample_chi2([tuple(r[:j]) for r in spec], [tuple(r[:j]) for r in base], hash_rare=True)
                tests.append({"prompt": i, "position": j, "joint": True, **result})
    threshold = alpha / max(len(tests), 1)
    for t in tests:
        t["passed"] = t["p_value"] >= threshold
    result = {"passed": all(t["passed"] for t in tests), **dataclasses.asdict(params),
              "samples": samples, "positions": positions, "alpha": alpha,
              "threshold": threshold, "seed": seed, "tau": taus,
              "min_p_value": min((t["p_value"] for t in tests), default=1.0), "tests": tests}
    if any(reports):
        # Per sampled prompt, each engine call's report as it came: reports hold ratios and sizes
        # as well as counts (e.g. cross_tokenizer's shared_tokens), so they are not summed.
        result["drafter_reports"] = reports
    return result


# --------------------------------------------------------------------------- both, and the report

def run_audit(decoder: Decoder, prompts: list[list[int]], *, max_new_tokens: int, sampling: SamplingParams,
              checks: tuple[str, ...] = ("greedy", "sampling"), tolerance: float | None = None,
              sample_prompts: int = 2, samples: int = 2000, positions: int = 3, alpha: float = 1e-4,
              seed: int = 0, batch_size: int = 500) -> dict:
    result = {"target": str(decoder.config["target"]["path"]), "drafter": decoder.config["drafter"],
              "dtype": str(decoder.target.dtype).replace("torch.", ""), "warnings": []}
    weak = decoder.config["drafter"].get("name") != "none"  # `none` never drafts: nothing to warn about
    if "greedy" in checks:
        result["greedy"] = greedy_check(decoder, prompts, max_new_tokens, tolerance)
        if weak and result["greedy"]["tau"] <= 1.0:
            result["warnings"].append("greedy: no draft was accepted, so the accept path went unchecked; "
                                      "use prompts where the drafter helps")
    if "sampling" in checks:
        result["sampling"] = sampling_check(decoder, prompts[:sample_prompts], sampling, samples, positions,
                                            alpha, seed, batch_size)
        if sampling.lossy:
            result["warnings"].append("sampling: lossy_typical_acceptance is on, so this check is expected to fail: "
                                      "drafts accepted by typical acceptance are not the target's samples")
        if weak and min(result["sampling"]["tau"]) <= 1.0:
            result["warnings"].append("sampling: on some prompt no draft was accepted, so the accept path "
                                      "went unchecked there")
    result["passed"] = all(result[c]["passed"] for c in checks)
    return result


def format_report(r: dict) -> str:
    lines = [f"audit: target {r['target']} ({r['dtype']}), drafter {json.dumps(r['drafter'])}"]
    if "greedy" in r:
        g = r["greedy"]
        lines.append(f"\ngreedy: {len(g['prompts'])} prompts, up to {g['max_new_tokens']} new tokens each, "
                     f"tau {g['tau']:.2f}; near-tie tolerance {g['tolerance']:g} (logits)")
        for row in g["prompts"]:
            status = "FAIL" if row["mismatches"] or row["problems"] else "ok"
            lines.append(f"  prompt {row['prompt']}: {row['tokens']} tokens, {len(row['mismatches'])} not the "
                         f"argmax, {len(row['near_ties'])} near-ties  {status}")
            for kind, entries in (("NOT ARGMAX", row["mismatches"]), ("near-tie", row["near_ties"])):
                for e in entries[:5]:
                    lines.append(f"    {kind} at new token {e['position']}: emitted {e['emitted']} (rank "
                                 f"{e['rank'] + 1}), argmax {e['argmax']}, logit gap {e['logit_gap']:.3g}")
                if len(entries) > 5:
                    lines.append(f"    ... {len(entries) - 5} more {kind}")
            lines += [f"    PROBLEM: {p}" for p in row["problems"]]
        if "drafter_report" in g:
            lines.append(f"  drafter report: {json.dumps(g['drafter_report'])}")
        lines.append(f"  greedy: {'PASS' if g['passed'] else 'FAIL'} ({g['tokens']} tokens checked)")
    if "sampling" in r:
        s = r["sampling"]
        lines.append(f"\nsampling: temperature {s['temperature']:g}, "
                     + ", ".join(f"{key} {s[key]}" for key in DEFAULTS["sampling"] if key != "temperature") + "; "
                     f"{s['samples']} samples per side of the first {s['positions']} tokens; tau "
                     + ", ".join(f"{t:.2f}" for t in s["tau"]))
        for i in sorted({t["prompt"] for t in s["tests"]}):
            cells = [f"{'tokens 1-%d' % t['position'] if t['joint'] else 'token %d' % t['position']} "
                     f"p={t['p_value']:.2g}{'' if t['passed'] else ' FAIL'}"
                     for t in s["tests"] if t["prompt"] == i]
            lines.append(f"  prompt {i}: " + ", ".join(cells))
            if s.get("drafter_reports") and s["drafter_reports"][i]:
                lines.append(f"    drafter report, per engine call: {json.dumps(s['drafter_reports'][i])}")
        lines.append(f"  sampling: {'PASS' if s['passed'] else 'FAIL'} (smallest p-value {s['min_p_value']:.2g}; "
                     f"fails below {s['threshold']:.2g} = alpha {s['alpha']:g} / {len(s['tests'])} tests)")
    lines += [f"\nwarning: {w}" for w in r["warnings"]]
    lines.append(f"\nRESULT: {'PASS' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line

def run(args: argparse.Namespace) -> int:
    for name, low in (("samples", 10), ("sample_prompts", 1), ("positions", 1), ("batch_size", 1)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.tie_tolerance is not None and not args.tie_tolerance >= 0:  # (a negative one failed exact ties too)
        raise UserError(f"--tie-tolerance must be >= 0 (a logit gap), got {args.tie_tolerance}")
    prompts = read_prompts(args.prompts) if args.prompts else BUILTIN_PROMPTS
    cfg = build_config(args.config, args.drafter, args.overrides, args.target)
    s, g = cfg["sampling"], cfg["generation"]
    temperature = args.temperature if args.temperature is not None else s["temperature"] or 1.0
    if temperature <= 0:
        raise UserError(f"--temperature must be > 0 for the sampling check (the greedy check runs at 0 anyway), "
                        f"got {temperature}")
    given = {**sampling_flags(args), "temperature": temperature}
    sampling = SamplingParams(**{key: s[key] if value is None else value for key, value in given.items()})
    if sampling.structured_output is not None:  # its references sample the target alone
        raise UserError("the audit checks drafting against the target's own distribution and does not take "
                        "sampling.structured_output: drop it from the config (tests/test_structured_output.py "
                        "checks structured output)")

    hf_logging.disable_progress_bar()
    decoder = Decoder(cfg)
    ids = encode_prompts(decoder, prompts)
    decoder.engine.check_prompts(ids)
    result = run_audit(decoder, ids, max_new_tokens=args.max_new_tokens or g["max_new_tokens"], sampling=sampling,
                       checks=(args.only,) if args.only else ("greedy", "sampling"),
                       tolerance=args.tie_tolerance, sample_prompts=args.sample_prompts, samples=args.samples,
                       positions=args.positions, alpha=args.alpha,
                       seed=args.seed if args.seed is not None else g["seed"], batch_size=args.batch_size)
    print(json.dumps({**result, "config": cfg}) if args.json else format_report(result))
    return 0 if result["passed"] else 1
