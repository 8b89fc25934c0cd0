"""Tensor x pipeline parallelism: the front end's executor, the worker processes, the all-reduce."""
