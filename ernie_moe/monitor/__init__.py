"""Metrics: JSONL and VisualDL writers, expert-balance summaries."""
