"""The model runner: ragged batch inputs, persistent block tables, CUDA graphs."""
