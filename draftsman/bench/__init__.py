"""`draftsman compare`: every drafter on one target side by side, with Hugging Face peers.

    prompts_set.py   build / read the JSONL prompt set (held-out corpus, three categories)
    config.py        bench.yaml: defaults and validation
    runner.py        contenders and the interleaved timing loop, batch sweep, divergence check
    peers.py         Hugging Face generate: plain, assisted, prompt lookup
    memory.py        peak memory of one call (CUDA allocator, or sampled RSS on CPU)
    compare.py       the whole run, results as one dict
    report.py        Markdown, results.json, CSV, PNG plots
    command.py       the command line
"""
from .._submodules import submodule_loader

__getattr__ = submodule_loader(__name__)  # draftsman.bench.module after a plain `import draftsman`
