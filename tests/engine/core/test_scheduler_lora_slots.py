"""The scheduler keeps the running sequences within ``max_loras`` distinct LoRA adapters: a request
whose adapter has no free device slot is passed over (keeping its place at the head of the queue)
while requests of the base model and of running adapters behind it are admitted; it runs once a
running adapter's last sequence finishes."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from kvpilot import SamplingParams
from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.core.scheduler import Scheduler
from kvpilot.core.sequence import Request, Sequence

_ids = itertools.count()


def _add(sched, adapter, prompt_len=5):
    lora = None if adapter is None else SimpleNamespace(int_id=adapter, cache_key=b"lora%d" % adapter)
    req = Request(next(_ids), [1] * prompt_len, SamplingParams(max_tokens=4), output=None, lora=lora)
    seq = Sequence(request=req, index=0, token_ids=[1] * prompt_len, seed=0)
    seq.length_limit = prompt_len + 4
    req.seqs.append(seq)
    sched.add(seq)
    return seq


def test_a_request_without_a_free_slot_waits_at_the_head_while_others_run():
    sched = Scheduler(KVCacheManager(64, 4), max_num_tokens=256, max_batch_size=8, max_loras=1)
    a1, b, base, a2 = _add(sched, 1), _add(sched, 2), _add(sched, None), _add(sched, 1)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [a1, base, a2]
    assert list(sched.waiting) == [b]
    for s in (a1, a2):
        sched.finish(s)
    out = sched.schedule()
    assert b in [s for s, _ in out.scheduled]  # adapter 1 no longer runs: its slot is free


def test_without_lora_slots_admission_is_unchanged():
    sched = Scheduler(KVCacheManager(64, 4), max_num_tokens=256, max_batch_size=8)
    seqs = [_add(sched, i) for i in (1, 2, 3)]
    assert [s for s, _ in sched.schedule().scheduled] == seqs
