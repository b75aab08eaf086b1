"""Drafter training (``specdraft train``): ``config`` (TrainConfig), ``trainer`` (``train()``: plan, parts,
loop, finish), ``plan`` (what a run will do, side-effect free), ``step`` (the public ``train_step``),
``fit`` (the loop and its hooks), ``strategies`` (the resumable state; per parallel strategy, its wrapping and
checkpointer), ``checkpoint_files`` (the run directory and its checkpoints on disk), ``split`` (the validation split),
``batches`` (shuffle, packing, collation), ``decoded_tau`` and ``model_card`` (the acceptance figures), ``calibrate``
(``specdraft calibrate``), ``metrics``.

Nothing is imported here so that ``specdraft train --help`` does not load torch.
"""
