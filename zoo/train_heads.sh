#!/bin/sh
# Train every bundled head for zoo/python-target, one after another, then the parallel draft model
# (2-core CPU: about 4h10).
# Logs: zoo/.work/<kind>.log. Each run resumes from its atomic checkpoint if interrupted.
set -e
cd "$(dirname "$0")/.."
python -m draftsman train eagle --config training/configs/eagle.yaml > zoo/.work/eagle.log 2>&1
python -m draftsman train mtp --config training/configs/mtp.yaml > zoo/.work/mtp.log 2>&1
python -m draftsman train eagle3 --config training/configs/eagle3.yaml > zoo/.work/eagle3.log 2>&1
# EAGLE-3's second stage: from the head above, cosine-decayed rate, 85 min (fp32; see its config).
python -m draftsman train eagle3 --config training/configs/eagle3-continue.yaml > zoo/.work/eagle3-continue.log 2>&1
python -m draftsman train medusa --config training/configs/medusa.yaml > zoo/.work/medusa.log 2>&1
python -m draftsman train mlp_speculator --config training/configs/mlp_speculator.yaml > zoo/.work/mlp_speculator.log 2>&1
# Corpus labels instead of self-distillation, same steps: the comparison in docs/training-heads.md.
python -m draftsman train mtp --config training/configs/mtp.yaml --set labels=corpus \
    --set out=zoo/.work/python-mtp-corpus > zoo/.work/mtp-corpus.log 2>&1
# The parallel draft model (PARD) adapted from python-draft: not a head (no target read), 45 min.
python -m draftsman train pard --config training/configs/pard.yaml > zoo/.work/pard.log 2>&1
