"""``parallelism.expert`` of an LLMDeployment: the engine's ``--moe-expert-parallel-size``, within the
tensor-parallel ranks (the pods' GPUs are unchanged); a value that does not divide ``tensor`` is
refused with the CRD's message."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.operator.crd import InvalidLLMDeployment
from kvpilot.operator.render import render
from kvpilot.server.cli import _engine_kwargs, configure_parser


def _cr(**parallelism) -> dict:
    return {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "qwen", "namespace": "ml", "uid": "1"},
            "spec": {"model": {"name": "Qwen/Qwen3-30B-A3B"}, "parallelism": parallelism}}


def _container(objects) -> dict:
    return objects[0]["spec"]["template"]["spec"]["containers"][0]


def test_expert_parallelism_is_an_engine_flag_on_the_same_gpus():
    with_ep, without = render(_cr(tensor=4, expert=2)), render(_cr(tensor=4))
    args = _container(with_ep)["args"]
    assert args[args.index("--moe-expert-parallel-size") + 1] == "2"
    assert "--moe-expert-parallel-size" not in _container(without)["args"]
    assert _container(with_ep)["resources"] == _container(without)["resources"]
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    kw = _engine_kwargs(parser.parse_args(args[1:]))
    assert (kw["tensor_parallel_size"], kw["moe_expert_parallel_size"]) == (4, 2)


def test_expert_groups_must_divide_the_tensor_ranks():
    with pytest.raises(InvalidLLMDeployment, match="parallelism.expert must divide parallelism.tensor"):
        render(_cr(tensor=4, expert=3))
