"""The power-of-two length buckets that prompt and sample lengths are reported in: one rule for the prepare summary
and the eval's per-bucket tables."""

from __future__ import annotations


def power_of_two_at_least(n: int) -> int:
    """``n`` rounded up to a power of two: length buckets, and probe shapes (and cache keys) that many datasets share."""
    return 1 << max(int(n) - 1, 1).bit_length()


def length_bucket(tokens: int) -> int:
    """The power-of-two bucket a prompt length falls in, as its upper edge (2049..4096 -> 4096): the long-context
    suite's nominal lengths each fill one bucket, so tau and speed-up per bucket are per nominal length."""
    return max(256, power_of_two_at_least(tokens))
