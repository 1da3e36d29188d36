"""Sampled rounds (T=1) timed in two checkouts side by side: this one and an earlier commit, each
run in its own process and alternated, so the comparison sees the same machine drift. Used for
verify_sampled's passes over the vocabulary (docs/benchmarks.md, session 43).

    python scripts/sampled_verification_experiment.py --before c51f401 --repeats 4

Cases: a 152k-vocabulary Qwen2 (scripts/top_p_large_vocab_experiment.py's) drafting for itself
with `draft_model` at batch 1 and 4, and the bundled zoo target with `eagle3` (batch 1) and
`draft_model` (batch 4). Each prints tok/s and a digest of its outputs, which must agree.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("verifier", "drafters", "heads", "training")  # installed as draftsman.<name>
ZOO_PROMPTS = ["def parse(text):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n"]


def package_tree(checkout: Path, into: Path) -> Path:
    """draftsman laid out as installed (draftsman/verifier, ...) with links into a checkout."""
    package = into / "draftsman"
    package.mkdir(parents=True)
    for item in (checkout / "draftsman").iterdir():
        (package / item.name).symlink_to(item)
    for name in PACKAGES:
        (package / name).symlink_to(checkout / name)
    return into


def cases(checkout: Path, qwen: str) -> list:
    eagle3 = {"name": "eagle", "path": str(checkout / "zoo/python-eagle3"), "quantize": "int8", "depth": 6,
              "total_tokens": 20, "sampled_depth": 5, "min_confidence": 0.05}
    zoo = str(checkout / "zoo/python-target")
    return [("the 152k Qwen2 drafting for itself, batch 1", {"path": qwen}, {"name": "draft_model", "path": qwen,
                                                                            "k": 4}, 1),
            ("the same, batch 4", {"path": qwen}, {"name": "draft_model", "path": qwen, "k": 4}, 4),
            ("zoo target, eagle3, batch 1", {"path": zoo}, eagle3, 1),
            ("zoo target, draft_model, batch 4", {"path": zoo},
             {"name": "draft_model", "path": str(checkout / "zoo/python-draft")}, 4)]


def one_pass(checkout: Path, qwen: str) -> dict:
    """{case: (tok/s, outputs' digest)} with the draftsman found first on sys.path."""
    import torch

    import draftsman
    from draftsman.verifier import rejection
    from top_p_large_vocab_experiment import VOCAB

    # the checkout's own code, not the installed package's
    assert Path(rejection.__file__).resolve().is_relative_to(checkout.resolve()), rejection.__file__

    torch.manual_seed(0)
    random_prompts = [[int(t) for t in torch.randint(0, VOCAB, (24,))] for _ in range(3)]
    out = {}
    for name, target, drafter, batch in cases(checkout, qwen):
        decoder = draftsman.load({"target": target, "drafter": drafter})
        prompts = random_prompts if target["path"] == qwen else decoder.encode(ZOO_PROMPTS)
        decoder.generate(input_ids=[prompts[0]] * batch, max_new_tokens=16, temperature=1.0, seed=0)  # warm-up
        start, tokens, outputs = time.perf_counter(), 0, []
        for seed, prompt in enumerate(prompts):
            got = decoder.generate(input_ids=[prompt] * batch, max_new_tokens=64, temperature=1.0, seed=seed)
            tokens += sum(map(len, got.token_ids))
            outputs.append(got.token_ids)
        out[name] = (tokens / (time.perf_counter() - start), hashlib.md5(str(outputs).encode()).hexdigest())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--pass", dest="one", nargs=2, metavar=("CHECKOUT", "QWEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    if args.one:  # a child process: one pass in the checkout whose package tree leads sys.path
        print(json.dumps(one_pass(Path(args.one[0]), args.one[1])))
        return
    from top_p_large_vocab_experiment import target_folder

    work = Path(tempfile.mkdtemp())
    before = work / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True)
    try:
        trees = {"before": (before, package_tree(before, work / "tree-before")),
                 "after": (ROOT, package_tree(ROOT, work / "tree-after"))}
        qwen = target_folder()
        runs = {way: [] for way in trees}
        for rep in range(args.repeats):
            for way in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                checkout, tree = trees[way]
                env = {**os.environ, "PYTHONPATH": f"{tree}:{ROOT / 'scripts'}"}
                command = [sys.executable, __file__, "--before", args.before, "--pass", str(checkout), qwen]
                done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
                runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"| case | {args.before} tok/s | this checkout tok/s | ratio | same outputs |")
        print("|---|---|---|---|---|")
        for case in runs["after"][0]:
            before_speed, after_speed = (statistics.median(r[case][0] for r in runs[w]) for w in ("before", "after"))
            same = {r[case][1] for r in runs["before"]} == {r[case][1] for r in runs["after"]}
            print(f"| {case} | {before_speed:.1f} | {after_speed:.1f} | {after_speed / before_speed:.2f}x | {same} |")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)


if __name__ == "__main__":
    main()
