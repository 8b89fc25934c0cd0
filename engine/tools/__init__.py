"""Command-line tools: checkpoint conversion and benchmarks."""
