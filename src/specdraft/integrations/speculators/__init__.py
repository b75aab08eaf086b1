"""Interoperability with the ``speculators`` package beyond the checkpoint format (which ``models`` reads and writes)."""
