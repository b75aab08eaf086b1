"""Lossless speculative decoding: verification maths, draft proposers, the runtime loop, and the
DSpark verify-length scheduler.

Modules: ``config`` (typed configs), ``sampling`` (the shared sampling transform),
``verification`` (greedy / rejection-sampling verification as pure functions), ``proposers``
(``Proposer`` interface + ``PROPOSERS`` registry: ngram, suffix (prompt lookup, else the target's own
answers: ``proposers/corpus.py``), none, eagle3, dflash, dflash2, dspark, and ``METHOD+ngram`` /
``METHOD+suffix``, a trained drafter and a lookup chosen per request and round),
``scheduler`` (verify policies), ``sps`` (target steps/s profile), ``runtime`` (the loop).
Kept import-light: nothing here imports torch until a submodule is used.
"""
