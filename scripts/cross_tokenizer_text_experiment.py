"""`cross_tokenizer` on long prompts, two changes each against the way before it, interleaved in
one process with the same target, draft model and prompts; outputs must match (greedy):
1. each row's text in the draft model's ids kept a round at a time (drafters/text_ids.py) against
   decoding and encoding the whole text every round: the conversion alone per round, then
   tokens/s per prompt length with the drafting share of engine time;
2. past the draft model's context, a window whose start moves a stride at a time against one
   that moved every round (and so fed the draft model its whole window every round).

    python scripts/cross_tokenizer_text_experiment.py            # zoo/python-target + zoo/python-draft-4k
"""
import argparse
import inspect
import json.decoder
import statistics
import sys
import time
import types

import draftsman
from draftsman.drafters.text_ids import TextIds


class WholeText(TextIds):
    """The earlier way: every round decodes the row's whole output and encodes all of its text."""

    def ids(self, b, context):
        self.whole += 1
        return self.tokenizer(self.decode(context), verbose=False)["input_ids"]


def window_every_round(self, b, context):
    """The earlier window: the latest ids that fit, its start moved by every new id."""
    ids = self.text_ids.ids(b, context) or [self._any_start()]
    return ids[-max(1, self.context - self.k):]


def conversion_ms(text_ids: TextIds, source: list[int], length: int, rounds: int = 50, step: int = 3) -> float:
    """Milliseconds per round to bring one row's draft ids up to date, the row growing by `step`
    tokens a round from `length` tokens (the conversion alone: no model runs)."""
    text_ids.reset(1)
    text_ids.ids(0, source[:length])
    start = time.perf_counter()
    for r in range(1, rounds + 1):
        text_ids.ids(0, source[: length + r * step])
    return (time.perf_counter() - start) / rounds * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo/python-target")
    parser.add_argument("--draft", default="zoo/python-draft-4k")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 300, 600],
                        help="prompt lengths in target tokens (the draft model's context is 1024 of its own)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per length")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", action="store_true", help="each length's prompts as one batch")
    parser.add_argument("--window-length", type=int, default=940,
                        help="prompt length (target tokens) whose text overflows the draft model's context")
    parser.add_argument("--conversion-lengths", type=int, nargs="+", default=[500, 2000, 8000],
                        help="row lengths (target tokens) at which to time the conversion alone")
    args = parser.parse_args()

    dec = draftsman.load({"target": {"path": args.target},
                          "drafter": {"name": "cross_tokenizer", "path": args.draft, "k": 4}})
    drafter = dec.engine.drafter
    ways = {"whole text": WholeText(drafter.target_tokenizer, drafter.tokenizer), "a round at a time": drafter.text_ids}
    # Python source from this interpreter's standard library
    text = "\n".join(inspect.getsource(m) for m in (argparse, json.decoder, statistics))
    source = drafter.target_tokenizer(text, verbose=False)["input_ids"]
    print("Per round and row, the conversion alone (target tokens -> text -> draft ids), 3 new tokens a round:")
    print("| row tokens | whole text ms | a round at a time ms | ratio |")
    print("|---|---|---|---|")
    for length in args.conversion_lengths:
        whole, rounds = (conversion_ms(text_ids, source, length) for text_ids in ways.values())
        print(f"| {length} | {whole:.2f} | {rounds:.3f} | {whole / rounds:.0f}x faster |")
    print()
    print(f"{args.target} + cross_tokenizer {args.draft}, {args.new} new tokens, greedy, "
          f"batch {args.prompts if args.batch else 1}, "
          f"{args.repeats} repeats interleaved")
    print("| prompt tokens | whole text tok/s | a round at a time tok/s | ratio | draft share (whole / round) |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        prompts = [source[i * 997: i * 997 + length] for i in range(args.prompts)]
        speed = {way: [] for way in ways}
        share = {way: [] for way in ways}
        outputs = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, text_ids in ways.items():
                drafter.text_ids = text_ids
                for batch in ([prompts] if args.batch else [[p] for p in prompts]):
                    start = time.perf_counter()
                    out = dec.generate(input_ids=batch, max_new_tokens=args.new)
                    seconds = time.perf_counter() - start
                    speed[way].append(sum(map(len, out.token_ids)) / seconds)
                    share[way].append(out.stats.draft_seconds / out.stats.total_seconds)
                    outputs[way] += out.token_ids
        if outputs["whole text"] != outputs["a round at a time"]:
            sys.exit(f"outputs differ at prompt length {length}")
        whole, rounds = (statistics.median(speed[w]) for w in ways)
        shares = " / ".join(f"{statistics.median(share[w]):.0%}" for w in ways)
        print(f"| {length} | {whole:.1f} | {rounds:.1f} | {rounds / whole:.2f}x | {shares} |")
    drafter.text_ids = ways["a round at a time"]
    report = dec.generate(input_ids=[prompts[0]], max_new_tokens=args.new).stats.drafter_report
    print(f"last prompt, a round at a time: {report['text_encoded_end']} rounds encoded the text's end, "
          f"{report['text_encoded_whole']} all of it")

    prompts = [source[i * 997: i * 997 + args.window_length] for i in range(args.prompts)]
    overflow = [len(drafter.tokenizer(drafter.target_tokenizer.decode(p), verbose=False)["input_ids"])
                for p in prompts]
    print(f"\n{args.window_length}-token prompts, {overflow} draft ids (room: {drafter.context - drafter.k}), batch 1:")
    windows = {"start moved every round": types.MethodType(window_every_round, drafter),
               "a stride at a time": drafter._draft_ids}
    speed, outputs = {w: [] for w in windows}, {w: [] for w in windows}
    for _ in range(args.repeats):
        for way, draft_ids in windows.items():
            drafter._draft_ids = draft_ids
            for prompt in prompts:
                start = time.perf_counter()
                out = dec.generate(input_ids=[prompt], max_new_tokens=args.new)
                speed[way].append(len(out.token_ids[0]) / (time.perf_counter() - start))
                outputs[way] += out.token_ids
    if len({str(o) for o in outputs.values()}) != 1:
        sys.exit("outputs differ between the two windows")
    before, after = (statistics.median(speed[w]) for w in windows)
    print(f"start moved every round {before:.1f} tok/s, a stride at a time {after:.1f} tok/s: {after / before:.2f}x")


if __name__ == "__main__":
    main()
