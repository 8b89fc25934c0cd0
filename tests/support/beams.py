"""Beam-search helpers: the tiny random Llama fixture, Hugging Face's beams for it, and `_SimEngine`,
a scheduler + KV cache manager driven without a model (tokens scripted per step)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpilot import LLM, KvCacheConfig, RequestTooLargeError, SamplingParams
from kvpilot.core.beam_search import BeamSearch
from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.core.scheduler import Scheduler
from kvpilot.core.sequence import Request, Sequence, SequenceStatus

EOS, PAD = 2, 0
RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED


PROMPTS = [[1, 5, 9, 11], [1, 40, 41], [1, 7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    # initializer_range 0.2 makes the distributions peaked enough that float32 rounding of a
    # different (paged) attention never reorders two candidates.
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d)
    return d, model


def _hf_beams(model, prompt, width, n, length_penalty, max_tokens):
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n,
                         length_penalty=length_penalty, max_new_tokens=max_tokens, do_sample=False,
                         early_stopping=False, return_dict_in_generate=True, output_scores=True,
                         pad_token_id=PAD, eos_token_id=EOS)
    return [out.sequences[i, len(prompt):].tolist() for i in range(n)], out.sequences_scores.tolist()


def _check(out, ref_seqs, ref_scores, length_penalty):
    assert len(out.outputs) == len(ref_seqs)
    for o, hf, score in zip(out.outputs, ref_seqs, ref_scores):
        # HF pads finished hypotheses with pad_token_id, or EOS when the pad id is 0.
        assert hf[:len(o.token_ids)] == o.token_ids
        assert all(t in (PAD, EOS) for t in hf[len(o.token_ids):])
        assert o.cumulative_logprob / len(o.token_ids) ** length_penalty == pytest.approx(score, abs=1e-3)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == EOS else "length")


# ---- scheduler level: a simulated engine -------------------------------------------------------
def _prefix_keys(tokens: list[int]) -> list[int]:
    """``keys[p]`` stands for ``tokens[:p + 1]``: what the K/V of position ``p`` depends on."""
    keys, h = [], 0
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


class _SimEngine:
    """Drives a `Scheduler` as `EngineCore.step` does, without a model: scheduled tokens become
    computed; a sequence whose tokens are all computed gets a new token, except that a beam request
    gets tokens only when all of its sequences got theirs in the same step (otherwise they compute
    their last token again, as `BeamSearch.step` makes them), and forks to its width after its
    first token, its new beams taking the parent's full blocks (as `BeamSearch._reassign`)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_tokens: int, max_batch_size: int,
                 reuse: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_block_reuse=reuse)
        self.sched = Scheduler(self.kv, max_num_tokens, max_batch_size)
        self.reqs: list[Request] = []
        self.errors: dict[int, RequestTooLargeError] = {}
        self.limits: dict[int, int] = {}
        # What each KV slot holds: a key of the token prefix whose last token's K/V was written there
        # (`_check_kv`). Shared blocks make this worth checking: a sequence must only ever attend to
        # positions holding its own prefix's K/V, written in an earlier step.
        self.slots: dict[int, int] = {}

    def add(self, rid: int, prompt_len: int, max_tokens: int, **kw) -> Request:
        params = SamplingParams(max_tokens=max_tokens, **kw)
        req = Request(rid, [1 + (rid * 7 + i) % 50 for i in range(prompt_len)], params, output=None)
        for i in range(1 if params.use_beam_search else params.num_candidates):
            req.seqs.append(Sequence(request=req, index=i, token_ids=list(req.prompt_token_ids), seed=i))
        self.limits[rid] = prompt_len + max_tokens
        self.reqs.append(req)
        for s in req.seqs:
            self.sched.add(s)
        return req

    def _finish(self, req: Request) -> None:
        for s in req.seqs:
            if s.status is not FINISHED:
                self.sched.finish(s)

    def _token(self, seq: Sequence) -> int:
        return 3 + (seq.seq_id * 5 + len(seq.token_ids)) % 40

    def step(self) -> None:
        sched, kv = self.sched, self.kv
        out = sched.schedule()
        self.check(out)
        if not out.scheduled:
            if sched.waiting and not sched.running:  # EngineCore.step: nothing can ever run
                head = sched.waiting[0]
                self.errors[head.request.request_id] = sched.unfit_error(head)
                self._finish(head.request)
            return
        self._check_kv(out)
        done: dict[int, list[Sequence]] = {}
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            kv.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                done.setdefault(seq.request.request_id, []).append(seq)
        for seqs in done.values():
            req = seqs[0].request
            if not req.lockstep:
                for seq in seqs:
                    seq.token_ids.append(self._token(seq))
                    if seq.num_tokens >= self.limits[req.request_id]:
                        sched.finish(seq)
                continue
            if len(seqs) < len(req.seqs):  # a beam got no logits this step: all compute theirs again
                for seq in seqs:
                    seq.num_computed_tokens -= 1
                continue
            self._advance_lockstep(req)

    def _advance_lockstep(self, req: Request) -> None:
        """Every beam of ``req`` got its logits this step: append their tokens (and fork)."""
        kv = self.kv
        for seq in list(req.seqs):
            seq.token_ids.append(self._token(seq))
        if req.seqs[0].num_tokens >= self.limits[req.request_id]:
            self._finish(req)
            return
        forks = []
        while len(req.seqs) < req.max_num_seqs:  # the first step forks the beam to its width
            parent = req.seqs[0]
            full = parent.block_table[:parent.num_computed_tokens // kv.block_size]
            for bid in full:
                kv.blocks[bid].ref_count += 1  # held by the parent: never in the free queue
            fork = Sequence(request=req, index=len(req.seqs), token_ids=list(parent.token_ids), seed=0,
                            block_table=list(full), num_computed_tokens=len(full) * kv.block_size,
                            num_cached_blocks=min(parent.num_cached_blocks, len(full)))
            fork.status = RUNNING
            forks.append(fork)
            req.seqs.append(fork)
        self.sched.add_forks(forks)  # as `BeamSearch._reassign`

    def _check_kv(self, out) -> None:
        """Each scheduled sequence attends to its positions before this step's tokens: their slots
        must hold its own prefix's K/V, written in an earlier step; no slot is written twice in one
        step. Then this step's writes are recorded."""
        B = self.kv.block_size
        written: dict[int, tuple[int, int]] = {}
        for seq, n in out.scheduled:
            keys = _prefix_keys(seq.token_ids)
            table, start = seq.block_table, seq.num_computed_tokens
            for p in range(start):
                slot = table[p // B] * B + p % B
                assert self.slots.get(slot) == keys[p], (seq.request.request_id, seq.seq_id, p, "stale KV")
            for p in range(start, start + n):
                slot = table[p // B] * B + p % B
                assert slot not in written, (seq.seq_id, p, "slot written twice in one step", written[slot])
                written[slot] = (seq.seq_id, keys[p])
        for slot, (_, key) in written.items():
            self.slots[slot] = key

    def check(self, out) -> None:
        sched, kv = self.sched, self.kv
        assert out.num_tokens <= sched.max_num_tokens
        running = sched.running
        for seq, n in out.scheduled:
            assert seq.status is RUNNING and n > 0
            assert len(seq.block_table) * kv.block_size >= seq.num_computed_tokens + n
        reserved = sum(r.max_num_seqs for r in self.reqs if r.lockstep and any(s.status is RUNNING for s in r.seqs))
        plain = sum(1 for s in running if not s.request.lockstep)
        assert plain + reserved <= sched.max_batch_size
        for req in self.reqs:
            if req.lockstep:
                states = {s.status for s in req.seqs if s.status is not FINISHED}
                assert len(states) <= 1, (req.request_id, [(s.seq_id, s.status) for s in req.seqs])
        refs = [0] * kv.num_blocks
        for s in list(running) + list(sched.waiting):
            for bid in s.block_table:
                refs[bid] += 1
        assert refs == [b.ref_count for b in kv.blocks]
        assert sorted(kv.free_blocks) == [i for i, r in enumerate(refs) if r == 0]
        assert not any(s.block_table for s in sched.waiting)

    def run(self, max_steps: int) -> int:
        steps = 0
        while self.sched.has_work:
            steps += 1
            assert steps <= max_steps, "livelock: " + repr([(s.request.request_id, s.status.value, s.num_tokens)
                                                           for s in self.sched.running + list(self.sched.waiting)])
            self.step()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        return steps


# ---- engine level: a tiny random Llama against transformers ----------------------------------
def _llm(d, monkeypatch, async_scheduling: bool, pool_tokens: int, reuse: bool = True, block: int = 4,
         max_batch_size: int = 16, max_num_tokens: int = 64) -> LLM:
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": %s}' % ("true" if async_scheduling else "false"))
    llm = LLM(str(d), skip_tokenizer_init=True, device="cpu", max_batch_size=max_batch_size,
              max_num_tokens=max_num_tokens,
              kv_cache_config=KvCacheConfig(tokens_per_block=block, max_tokens=pool_tokens, enable_block_reuse=reuse))
    llm._loop.stop()  # the test steps the engine itself, so that a livelock fails instead of hanging
    assert llm._core.async_scheduling is async_scheduling
    return llm


def _drive(llm: LLM, items: list[tuple[list[int], SamplingParams]], max_idle: int = 40):
    """Submit, then step until done; fail after ``max_idle`` steps in a row without a new token.
    Returns the requests' `RequestOutput`s (``result(timeout=0)`` gives each one's result or error)."""
    core = llm._core
    reqs = [llm._make_request(p, sp, False) for p, sp in items]
    for r in reqs:
        core.add_request(r)
    idle = last = 0
    while core.has_work:
        core.step()
        core.flush_outputs()
        total = sum(len(s.token_ids) for r in reqs for s in r.seqs)
        idle, last = (idle + 1 if total == last else 0), total
        assert idle < max_idle, ("livelock", len(core.scheduler.waiting), len(core.scheduler.running))
    core.flush_outputs()
    assert core.kv.num_used_blocks == 0  # every block of every beam came back
    return [r.output for r in reqs]


def _alone(d, items: list[tuple[list[int], SamplingParams]]) -> list:
    """Each request's result alone in a large pool (no preemption; synchronous engine)."""
    mp = pytest.MonkeyPatch()
    try:
        llm = _llm(d, mp, False, pool_tokens=2048)
        try:
            return [_drive(llm, [item])[0].result(timeout=0) for item in items]
        finally:
            llm.shutdown()
    finally:
        mp.undo()


def _same_tokens(a, b) -> None:
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert ([o.cumulative_logprob for o in a.outputs]
            == pytest.approx([o.cumulative_logprob for o in b.outputs], abs=1e-4))


def _workload(rng: random.Random, num_blocks: int, B: int) -> list[tuple[int, int, dict]]:
    items = []
    for _ in range(rng.randint(3, 6)):
        kind = rng.choice(["plain", "beam", "beam"])
        prompt = rng.randint(1, num_blocks * B // 2)
        max_tokens = rng.randint(2, num_blocks * B // 2)
        kw = dict(use_beam_search=True, n=1, best_of=rng.randint(2, 4)) if kind == "beam" else {}
        items.append((prompt, max_tokens, kw))
    return items


def _alone_then_mixed(cfg: dict, workload: list[tuple[int, int, dict]], max_steps: int,
                      on_sim=None) -> tuple[dict, _BeamTreeSim]:
    """Each (prompt length, max_tokens, params) of ``workload`` alone in a `_BeamTreeSim` of ``cfg``,
    then those that finish alone all together (``on_sim(sim)`` may instrument that sim first).
    Returns the results alone (by request id) and the mixed sim after `run` (which raises on a
    livelock or a broken invariant); `_mix_failed` compares them."""
    alone, items = {}, []
    for rid, (prompt, max_tokens, kw) in enumerate(workload):
        sim = _BeamTreeSim(**cfg)
        sim.add(rid, prompt, max_tokens, **kw)
        sim.run(max_steps=max_steps)
        if not sim.errors:
            alone[rid] = sim.results.get(rid)
            items.append((rid, prompt, max_tokens, kw))
    sim = _BeamTreeSim(**cfg)
    if on_sim is not None:
        on_sim(sim)
    for rid, prompt, max_tokens, kw in items:
        sim.add(rid, prompt, max_tokens, **kw)
    sim.run(max_steps=2 * max_steps)
    return alone, sim


def _mix_failed(alone: dict, sim: _BeamTreeSim) -> bool:
    """Whether a request that finished alone failed in the mix, or got other beams."""
    return bool(sim.errors) or {rid: sim.results.get(rid) for rid in alone} != alone


class _BeamTreeSim(_SimEngine):
    """`_SimEngine` whose beam requests choose their beams as a beam search does: each step ``W``
    distinct (parent beam, token) pairs, drawn from a generator seeded by the request id and its
    length (the same beams whatever else runs), applied by `BeamSearch._reassign` (forks take their
    parent's full blocks, beams not chosen are dropped). Tokens from a small vocabulary and parents
    biased towards beam 0 make beams share long prefixes."""

    def __init__(self, *args, vocab: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.vocab = vocab
        self.search = BeamSearch(SimpleNamespace(kv=self.kv, scheduler=self.sched))
        self.results: dict[int, list[list[int]]] = {}

    def _token(self, seq: Sequence) -> int:  # plain requests: independent of sequence ids
        return 3 + (seq.request.request_id * 7 + seq.index * 5 + len(seq.token_ids)) % 40

    def _advance_lockstep(self, req: Request) -> None:
        L = req.seqs[0].num_tokens
        rng = random.Random(req.request_id * 100_003 + L)
        pairs: list[tuple[int, int]] = []
        while len(pairs) < req.max_num_seqs:
            pair = (min(rng.randrange(len(req.seqs)), rng.randrange(len(req.seqs))), 3 + rng.randrange(self.vocab))
            if pair not in pairs:
                pairs.append(pair)
        self.search._reassign(req, pairs)
        if L + 1 >= self.limits[req.request_id]:
            self.results[req.request_id] = [list(s.token_ids) for s in req.seqs]
            self._finish(req)
