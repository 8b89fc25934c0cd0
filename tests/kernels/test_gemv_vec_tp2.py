"""CPU checks of benchmarks/lab/gpu_gemv_vec.py's ``--tp 2`` sweep: the shard shapes it times are the
engine's, its candidates are configurations the kernel runs as labelled, and the ``CONFIGS`` rows it
proposes give every shape the configuration asked for (checked through ``gemv_config`` itself).

The timing needs an H200 (``python3 benchmarks/lab/gpu_gemv_vec.py --tp 2``); the sm_90 compile of the
candidates (``--compile-check``) is the ``slow`` test at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support.paths import BENCHMARK_LAB, load_benchmark

BENCH = BENCHMARK_LAB


@pytest.fixture(scope="module")
def V():
    # importing the scripts must leave this process's environment as it was.
    saved = dict(os.environ)
    try:
        return load_benchmark("gpu_gemv_vec")
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shard_shapes_are_the_engine_modules_weights(V, tp):
    from kvpilot.model import llama

    cfg = V.D.model_config(1)
    pc = llama.ParallelContext(tp_rank=0, tp_size=tp)
    with torch.device("meta"):
        attn, mlp = llama.LlamaAttention(cfg, 0, pc, reduce_fp32=False), llama.LlamaMLP(cfg, pc, reduce_fp32=False)
    got = {op: (n, k) for op, (n, k, _) in V.shard_shapes(tp).items()}
    assert got == {"qkv": tuple(attn.qkv_proj.weight.shape), "o": tuple(attn.o_proj.weight.shape),
                   "gate_up": tuple(mlp.gate_up_proj.weight.shape), "down": tuple(mlp.down_proj.weight.shape)}
    if tp == 1:  # and gpu_gemv's unsplit shapes ([K, N, prologue] there)
        unsplit = {op: V.GB.SHAPES[V.SHAPE[op]] for op in V.SHAPE}
        assert V.shard_shapes(1) == {op: (n, k, p) for op, (k, n, p) in unsplit.items()}


def test_tp2_candidates_run_as_labelled_and_are_distinct(V):
    G = V.G
    for op, cands in V.TP2_CANDIDATES.items():
        n, k, pro = V.TP2_SHAPES[op]
        current = V.fma_config(n, k, pro)
        keys = [V.spec_key(c, k, pro) + (c["programs_per_sm"],) for c in cands]
        assert len(set(keys)) == len(cands), f"{op}: duplicate candidates"
        timed = [current] + [c for c in cands if c != current]  # as the script times them (the table
        assert len({str(sorted(c.items())) for c in timed}) == len(timed)  # may have adopted a candidate)
        assert len(cands) <= 9, f"{op}: keep the --tp 2 run near a minute"
        for c in cands:
            assert G._check_config(dict(c)) == c
            assert V.legal_for(c, k, pro), f"{op}: {V.label(c)} would silently take the K-tile norm pass"
            assert c["block_m"] == 1
            assert eval(V.cfg_source(c), {"_cfg": G.launch_config}) == c  # noqa: S307 - our own source text
    # legal_for refuses what _launch would quietly drop
    one_load = G.launch_config("fma", 1, 4, 2048, norm_one_load=True, vec=8)
    assert V.legal_for(one_load, G.NORM_ONE_LOAD_MAX, "rmsnorm")
    assert not V.legal_for(one_load, G.NORM_ONE_LOAD_MAX + 1, "rmsnorm")
    assert not V.legal_for(one_load, 4096, "silu")


def _wanted(V, best: dict, shared: dict) -> dict:
    """prologue -> wanted list as summarize_tp2 builds it."""
    G = V.G
    out = {}
    for op, (n, k, p) in V.shard_shapes(1).items():
        same_n = V.TP2_SHAPES[op][0] == n and op in best
        out.setdefault(p, []).append((f"tp1 {op}", n, k, best[op] if same_n and shared.get(op) else
                                      V.fma_config(n, k, p), True))
    for op, (n, k, p) in V.TP2_SHAPES.items():
        out.setdefault(p, []).append((f"tp2 {op}", n, k, best.get(op, V.fma_config(n, k, p)), False))
    return out


def test_no_change_proposes_todays_rows(V):
    G = V.G
    for pro, wanted in _wanted(V, {}, {}).items():
        rows, _, notes = V.propose_rows(pro, wanted)
        assert notes == []
        assert rows == [r for r in G.CONFIGS[pro] if r[0] == 1]


@pytest.mark.parametrize("pick", [0, 3, 7])
@pytest.mark.parametrize("shared", [False, True])
def test_proposed_rows_give_each_shape_its_configuration(V, pick, shared):
    G = V.G
    best = {op: cands[pick] for op, cands in V.TP2_CANDIDATES.items()}
    sh = {op: shared for op in best}
    for pro, wanted in _wanted(V, best, sh).items():
        rows, catches, notes = V.propose_rows(pro, wanted)
        table = V.table_with(pro, rows)
        assert rows[-1][1] == 0 and all(r[0] == 1 for r in rows)
        assert [r for r in table if r[0] > 1] == [r for r in G.CONFIGS[pro] if r[0] > 1]
        assert sorted(sum(catches.values(), [])) == sorted(w[0] for w in wanted)
        for lab, n, k, cfg, keep in wanted:
            got = V.config_under(pro, table, n, k)
            clash = [w for w in wanted if w[1] == n and w[3] != cfg]
            if keep or not clash:
                assert got == cfg, (pro, lab)
            else:  # same N as a TP-1 shape that keeps its configuration
                assert got == clash[0][3] and any(lab in note for note in notes)
        assert G.CONFIGS[pro] is not table  # config_under put the real table back
    # o_proj and down share N = 4096 with TP 1: a conflict exactly when not shared
    conflicts = [n for pro, wanted in _wanted(V, best, sh).items() for n in V.propose_rows(pro, wanted)[2]]
    assert len(conflicts) == (0 if shared else 2)


def test_gate_up_alone_on_tp1_gate_ups_row_is_the_8192_row(V):
    """The brief's example: TP-2 gate_up (N = 14336) on TP-1 gate_up's configuration is one row with
    min N 8192, which QKV's N (6144 at TP 1, 3072 at TP 2) does not reach."""
    G = V.G
    tp1_row = V.fma_config(28672, 4096, "rmsnorm")
    rows, catches, notes = V.propose_rows("rmsnorm", _wanted(V, {"gate_up": tp1_row}, {})["rmsnorm"])
    assert rows[0] == (1, 8192, tp1_row) and rows[-1][1] == 0  # then the QKV rows, as the table has them
    assert sorted(catches[0]) == ["tp1 gate_up", "tp2 gate_up"] and notes == []


def test_resident_programs_per_sm(V):
    # Hand-derived from the sm_90 limits: 64K registers per SM allocated per warp in units of 256
    # (58 registers -> 64 per thread -> 8 K per 4-warp program), 64 warps, 228 KB shared memory.
    assert V.resident_per_sm(58, 4, 64) == 8  # QKV's table row asks for 8 programs per SM: all fit
    assert V.resident_per_sm(126, 4, 4096) == 4  # gate/up's 2-D row (128 x 128 threads) at 4
    assert V.resident_per_sm(32, 4, 32) == 16  # warp-limited: 64 / 4
    assert V.resident_per_sm(32, 4, 100_000) == 2  # shared-memory-limited


def test_script_help_and_refusals():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    def run(*args):
        return subprocess.run([sys.executable, str(BENCH / "gpu_gemv_vec.py"), *args], capture_output=True,
                              text=True, cwd="/tmp", env=env, timeout=120)

    h = run("--help")
    assert h.returncode == 0 and "--tp {1,2}" in h.stdout and "--compile-check" in h.stdout
    bad = run("--compile-check")  # needs --tp 2
    assert bad.returncode == 2 and "--compile-check needs --tp 2" in bad.stderr


@pytest.mark.slow
def test_tp2_configurations_compile_for_sm90_without_spills(V, tmp_path):
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        if not os.path.exists(get_ptxas(90).path):
            pytest.skip("no ptxas for sm_90")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no ptxas for sm_90: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_gemv_vec.py"), "--tp", "2", "--compile-check"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("| ") and "configuration" not in x]
    # each op's current configuration, then its candidates other than that one
    assert len(lines) == sum(1 + sum(c != V.fma_config(*V.TP2_SHAPES[op]) for c in cands)
                             for op, cands in V.TP2_CANDIDATES.items())
    assert "all configurations compiled without spills" in proc.stdout
    for line in lines:
        regs = int(line.split("|")[3])
        assert 0 < regs <= 255, line
