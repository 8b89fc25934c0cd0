"""Helpers shared by the test modules (importable as ``support.*``: pytest puts ``tests/`` on the path)."""
