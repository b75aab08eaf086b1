"""Evaluation: prompt suites, side-by-side speculative vs autoregressive runs, reports and plots."""
