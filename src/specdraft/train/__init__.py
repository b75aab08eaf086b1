"""Drafter training (``specdraft train``): ``config`` (TrainConfig), ``trainer`` (``train()``: plan, parts,
loop, finish), ``plan`` (what a run will do, side-effect free), ``step`` (the public ``train_step``),
``fit`` (the loop and its hooks), ``checkpointer`` (the resumable state, one checkpointer per parallel
strategy), ``checkpoint`` (the run-directory format), ``data`` (split, shuffle, packing), ``metrics``.

Nothing is imported here so that ``specdraft train --help`` does not load torch.
"""
