"""Speculative decoding: n-gram (prompt lookup) and draft-model drafts, verified exactly by the target.

docs/speculative_decoding.md describes the feature; `kvpilot.spec_decode.decoder` the engine hooks.
"""

from kvpilot.spec_decode.config import (DraftTargetDecodingConfig, NGramDecodingConfig, SpeculativeConfig,
                                        parse_speculative_config)

__all__ = ["DraftTargetDecodingConfig", "NGramDecodingConfig", "SpeculativeConfig", "build_speculative_decoder",
           "parse_speculative_config"]


def build_speculative_decoder(config, runner, max_num_tokens: int, max_batch_size: int, max_seq_len: int,
                              dtype: str = "auto"):
    """The `SpeculativeDecoder` of ``config`` for a target `ModelRunner` (``runner``).

    For a `DraftTargetDecodingConfig` this loads the draft checkpoint into a second `ModelRunner` on
    the target's device, with its own KV pool (as many tokens as the target's pool at most, block
    reuse off).

    Raises:
        ValueError: the draft's vocabulary size differs from the target's; what `ModelConfig`
            raises for the draft's config.
        FileNotFoundError: the draft checkpoint cannot be found or fetched.
    """
    from kvpilot.spec_decode.decoder import SpeculativeDecoder

    if isinstance(config, NGramDecodingConfig):
        return SpeculativeDecoder(config)
    from kvpilot.config import KvCacheConfig
    from kvpilot.model.config import ModelConfig
    from kvpilot.model.hub import resolve_model
    from kvpilot.runner.model_runner import ModelRunner
    from kvpilot.spec_decode.draft_model import DraftModelProposer

    draft_dir = resolve_model(config.speculative_model, None)
    cfg = ModelConfig.from_dir(draft_dir)
    if cfg.vocab_size != runner.cfg.vocab_size:
        raise ValueError(f"the draft model {config.speculative_model!r} has vocab_size {cfg.vocab_size}, the "
                         f"target {runner.cfg.vocab_size}: a draft model must share the target's tokenizer")
    target_kv = runner.kv_config
    kv = KvCacheConfig(free_gpu_memory_fraction=target_kv.free_gpu_memory_fraction, enable_block_reuse=False,
                       dtype=target_kv.dtype, tokens_per_block=target_kv.tokens_per_block,
                       max_tokens=runner.num_blocks * runner.block_size)
    draft = ModelRunner(draft_dir, cfg, kv, max_num_tokens, max_batch_size, max_seq_len,
                        device=str(runner.device), dtype=dtype, tuning=getattr(runner, "tuning", None))
    return SpeculativeDecoder(config, DraftModelProposer(draft, max_num_tokens))
