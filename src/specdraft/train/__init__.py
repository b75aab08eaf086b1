"""Drafter training (``specdraft train``): ``config`` (TrainConfig), ``data`` (split, shuffle, packing),
``trainer`` (the loop, ``train()``), ``checkpoint`` (resumable run directories), ``metrics``.

Nothing is imported here so that ``specdraft train --help`` does not load torch.
"""
