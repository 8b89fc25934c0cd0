"""Speculative configs (TensorRT-LLM's classes and JSON), their errors, and n-gram prompt lookup."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.spec_decode.config import DraftTargetDecodingConfig, NGramDecodingConfig, parse_speculative_config
from kvpilot.spec_decode.ngram import ngram_draft


def test_importable_as_the_seed_imports_them():
    import kvpilot
    from kvpilot.llmapi import DraftTargetDecodingConfig as D, NGramDecodingConfig as N

    assert D is DraftTargetDecodingConfig and N is NGramDecodingConfig
    assert kvpilot.NGramDecodingConfig is NGramDecodingConfig


def test_json_and_dict_forms():
    c = parse_speculative_config('{"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}')
    assert c == NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2)
    d = parse_speculative_config({"decoding_type": "Draft_Target", "max_draft_len": 5, "speculative_model_dir": "/m"})
    assert d.speculative_model == "/m" and d.max_draft_len == 5
    assert parse_speculative_config(None) is None and parse_speculative_config(c) is c


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"max_draft_len": 3}', "decoding_type"),
    ('{"decoding_type": "Medusa"}', "unknown speculative decoding_type 'Medusa'"),
    ('{"decoding_type": "NGram", "draft_len": 3}', "unknown field(s) ['draft_len']"),
    ('{"decoding_type": "NGram", "max_draft_len": 0}', "max_draft_len must be an integer in [1, 32]"),
    ('{"decoding_type": "NGram", "max_draft_len": true}', "max_draft_len must be an integer"),
    ('{"decoding_type": "DraftTarget"}', "needs speculative_model"),
    ('{"decoding_type": "NGram", "max_concurrency": 0}', "max_concurrency must be an integer"),
])
def test_bad_configs_say_what_is_wrong(value, message):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert message in str(e.value)


def test_conflicting_model_names():
    with pytest.raises(ValueError, match="differ"):
        DraftTargetDecodingConfig(speculative_model="/a", speculative_model_dir="/b")


def test_llm_refuses_speculation_with_several_gpus():
    from kvpilot import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        LLM("/nonexistent", tensor_parallel_size=2, speculative_config=NGramDecodingConfig())


def test_serve_preflight_rejects_a_bad_speculative_config():
    from kvpilot.server.cli import configure_parser, preflight

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["/nonexistent", "--device", "cpu", "--speculative-config", '{"decoding_type": "X"}'])
    with pytest.raises(ValueError, match="unknown speculative decoding_type"):
        preflight(args)


def test_ngram_draft_takes_the_longest_then_most_recent_match():
    # suffix [7, 8] occurs at 1 and 5; the most recent (5) is followed by 4, 7
    assert ngram_draft([3, 7, 8, 9, 1, 7, 8, 4, 7, 8], 3, 2) == [4, 7, 8]
    # a 3-gram [1, 2, 3] match beats the more recent 1-gram [3]
    assert ngram_draft([1, 2, 3, 5, 6, 3, 9, 1, 2, 3], 2, 3) == [5, 6]
    # the draft stops at the end of the sequence
    assert ngram_draft([5, 6, 5], 4, 2) == [6, 5]
    assert ngram_draft([1, 2, 3, 4], 4, 3) == []
    assert ngram_draft([4, 4, 4, 4], 2, 2) == [4]
