"""The choices specdraft measures on the machine at hand instead of fixing in code: their cache, probes and settings.

A stage resolves its choices once, before its work, into a :class:`~specdraft.tuning.settings.MachineSettings`
and logs it in one block, each choice marked measured now, read from the cache, or given.

- ``measured``: the per-machine cache of timings (keyed by machine, software and the work timed) and the choice rule.
- ``paths`` (torch-free, for configs and ``--help``) and ``forward_path``: the exact forward paths and their probe;
  ``streamed`` and ``native/``: the C++ kernel part ``streamed`` runs.
- ``threads``: the CPU thread count; ``dtype``: the compute dtype (training step, drafter round).
- ``settings``: the one entry point, ``resolve_choices`` (path, then dtype, then threads for a caller's work), and the
  typed settings object a stage resolves and logs.
- ``engines``: the regeneration engine (``prepare --engine auto``); ``budget_probes``: the plans made from timing
  probes (a training run's steps, a comparison's reserve); ``data_split``: the quickstart's minutes of regeneration,
  from the rates its pilot measured.

The probes here time work a caller hands them (a training step, a decoding round, a generate), so this package sits
below every layer that has work to time and imports none of them. Measured figures live in
``docs/results/machine_tuning.md``.
"""
