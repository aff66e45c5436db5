"""The whole training recipe in one run, in a time budget, resumable: self-distillation, the
teacher pass, each training stage, the pick of a checkpoint, its export and an evaluation
(`python -m train.pipeline` is its command line).

budget.py: each part's minutes; plan.py: what the parts run, checked before anything runs;
state.py: the run's recorded state (pipeline.json); parts.py: the parts; run.py: the loop over
the parts."""
