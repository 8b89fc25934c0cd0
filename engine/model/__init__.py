"""Models: shared layers, one module per model family, and the registry from `config.json`."""
