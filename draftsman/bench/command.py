"""The `draftsman compare` command line: flags, --quick, --build-prompts, and what gets printed."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path


def _numbers(kind):
    def parse(text: str):
        parts = text.replace(" ", "").split(",")
        if "" in parts and parts != [""]:  # '1,,4' or '1,2,': a number lost, not a shorter list to run
            raise argparse.ArgumentTypeError(f"'{text}': a number is missing between commas (or before or after them)")
        try:
            return [kind(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}': expected comma-separated numbers, e.g. 1,2,4") from None
    return parse


def drafters_flag(text: str) -> list[dict]:
    """--drafters: "ngram,recycling" (names with their defaults), a YAML list of drafter configs, or
    one drafter config ('{name: ngram, k: 3}', read as a list of one)."""
    if not text.strip():  # (it ran the default set, as if the flag were not there)
        raise ValueError("--drafters is empty: name the drafters to compare (e.g. --drafters ngram,recycling), or "
                         "leave the flag out for the default set")
    if not text.strip().startswith(("[", "{")):
        names = text.replace(" ", "").split(",")
        if "" in names:  # 'ngram,,recycling' or 'ngram,': a name lost, not a shorter list to run
            raise ValueError(f"--drafters '{text}': a drafter name is missing between commas (or before or after "
                             "them); e.g. --drafters ngram,recycling")
        if any(c in text for c in ":{}[]"):  # YAML without its brackets: "unknown drafter 'name:ngram'" misled
            raise ValueError(f"--drafters '{text}': give a comma-separated list of names (ngram,recycling) or a "
                             "YAML list of drafter configs, e.g. '[{name: ngram, k: 3}]'")
        return [{"name": name} for name in names]
    import yaml

    from ..config import parse_yaml

    try:
        drafters = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--drafters is not a valid YAML list: {e}") from None
    if isinstance(drafters, dict):  # one drafter: names never start with "{", so nothing else was meant
        drafters = [drafters]
    if not all(isinstance(d, dict) and "name" in d for d in drafters):
        raise ValueError(f"--drafters: each drafter in a YAML list is a mapping with a name, e.g. "
                         f"'[{{name: draft_model, path: DIR}}, {{name: ngram}}]', got {text!r}")
    return drafters


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="bench YAML (see configs/bench.yaml); default: the bundled zoo target with "
                                    "none, ngram, recycling and every drafter bundled in zoo/")
    p.add_argument("--target", metavar="DIR", help="the target model folder (sets target.path, over the config's); "
                                                   "its drafters are none and ngram unless --drafters or the config "
                                                   "names them")
    p.add_argument("--drafters", metavar="LIST",
                   help="the drafters to compare: names, each with its defaults (ngram,recycling), or a YAML list "
                        "of drafter configs ('[{name: draft_model, path: DIR, k: 4}, {name: ngram}]', or one "
                        "such mapping); none, the baseline, is always added")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 prompts per category, 16 new tokens, 1 repeat, batch sizes 1,2 (still "
                        "minutes on a CPU: every drafter runs; --drafters ngram --no-peers for the shortest)")
    p.add_argument("--out", help="output folder (default results/compare)")
    p.add_argument("--prompts", help="JSONL prompt file, one {\"text\": ..., \"category\": ...} per line, or "
                                     "\"messages\" (a conversation for the target's chat template) in place of "
                                     "\"text\"; Spec-Bench's question.jsonl ({\"question_id\", \"category\", "
                                     "\"turns\"}) reads as it is (default: the bundled held-out set)")
    p.add_argument("--categories", type=lambda s: [c for c in s.split(",") if c], help="e.g. copy,docstring")
    p.add_argument("--prompts-per-category", type=int, metavar="N")
    p.add_argument("--temperatures", type=_numbers(float), help="e.g. 0,1 (default 0,1)")
    p.add_argument("--batch-sizes", type=_numbers(int), help="e.g. 1,2,4,8,16 (default)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--min-new-tokens", type=int,
                   help="EOS cannot end a row before this many new tokens; = --max-new-tokens for fixed-length runs")
    p.add_argument("--repeats", type=int, help="timed passes over the prompts; medians are reported")
    p.add_argument("--no-peers", action="store_true", help="skip the Hugging Face generate peers")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--build-prompts", metavar="OUT.jsonl",
                   help="build the held-out prompt set with the target's tokenizer, write it here, and exit")
    p.add_argument("--per-category", type=int, default=24, help="with --build-prompts: prompts per category")


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, rebuilt from the flags that were set (for the report)."""
    import shlex

    parts = ["draftsman", "compare"]
    for key, value in vars(args).items():
        if key in ("command", "per_category") or value in (None, False):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        else:
            parts += [flag, ",".join(map(_num, value)) if isinstance(value, list) else str(value)]
    return shlex.join(parts)


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging  # here, not above: --help answers without them

    from .config import QUICK, load_bench_config

    overrides = dict(QUICK) if args.quick else {}
    flags = {"out": args.out, "prompts": args.prompts, "categories": args.categories,
             "prompts_per_category": args.prompts_per_category, "temperatures": args.temperatures,
             "batch_sizes": args.batch_sizes, "max_new_tokens": args.max_new_tokens,
             "min_new_tokens": args.min_new_tokens, "repeats": args.repeats,
             "peers": False if args.no_peers else None,
             "target": {"path": args.target} if args.target else None,
             "drafters": drafters_flag(args.drafters) if args.drafters is not None else None}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    cfg = load_bench_config(args.config, overrides, quick=args.quick)
    hf_logging.disable_progress_bar()  # "Loading weights" bars would tangle with ours
    if args.build_prompts:
        return build(cfg, Path(args.build_prompts), args.per_category)

    from .compare import run_compare
    from .report import markdown, write_all

    out = Path(cfg["out"])
    if out.exists() and not out.is_dir():  # found now, not after an hour of runs
        raise ValueError(f"out '{out}' is a file: the results go in a folder; give a folder (--out DIR)")
    created = _missing_folders(out)
    out.mkdir(parents=True, exist_ok=True)  # now: a folder that cannot be made is named before the runs
    try:
        results = run_compare(cfg, command_line(args), progress=not args.no_progress)
    except BaseException:  # refused (prompts, target, categories) or stopped: leave no empty folder of ours
        for folder in created:
            with contextlib.suppress(OSError):  # (rmdir refuses a folder something was written into)
                folder.rmdir()
        raise
    files = write_all(results, Path(cfg["out"]))
    print(markdown(results))
    print("\nwrote " + ", ".join(str(f) for f in files))
    bad = sorted({c["drafter"] for c in results["cells"] if c["mismatches"]})
    if bad:
        print(f"\nERROR: at temperature 0 these drafters changed the output: {bad} (first divergences listed above)",
              file=sys.stderr)
        return 1
    return 0


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def build(cfg: dict, out: Path, per_category: int) -> int:
    from .. import zoo
    from ..models import load_tokenizer
    from ..training.corpus import python_version, stdlib_root
    from .prompts_set import CATEGORIES, build_meta, build_prompts, write_prompts

    if per_category < 1:  # (it wrote an empty prompt set and exited 0)
        raise ValueError(f"--per-category must be an integer >= 1, got {per_category}")
    tokenizer = load_tokenizer(cfg["target"]["path"])
    if tokenizer is None:
        raise ValueError(f"target folder '{cfg['target']['path']}' has no tokenizer to count prompt tokens with")
    max_tokens = 256
    prompts = build_prompts(zoo.heldout_files(), tokenizer, per_category, max_tokens, root=stdlib_root())
    write_prompts(out, prompts, build_meta(out, Path(cfg["target"]["path"]).name, per_category, max_tokens,
                                           python_version()))
    print(f"wrote {len(prompts)} prompts ({', '.join(f'{per_category} {c}' for c in CATEGORIES)}) to {out}")
    return 0
