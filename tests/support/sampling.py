"""The Triton sampler's raw draw, as the engine's sampler lays out its rows."""

from __future__ import annotations

from kvpilot.sampling.sampler import _Draw


def _kernel_draw(logits, rows, n_pivot="engine", check=False, **config):
    """Raw output of kvpilot.kernels.sampling.draw (-1 = handed to the exact path), the rows laid out
    as the engine's sampler sends them (``n_pivot="engine"``: its count of pivot rows), or with
    any other ``n_pivot`` (None: draw finds them), under ``CONFIG`` overrides ``config``; ``check``:
    draw's index checks (`kvpilot.kernels.sampling.draw`)."""
    from kvpilot.kernels import sampling as ks

    saved = dict(ks.CONFIG)
    ks.CONFIG.update(config)
    try:
        d = _Draw(rows, logits.shape[1])
        fprm, iprm, order = d.tensors(logits.device)
        n = len(d.plain) + len(d.greedy)
        return ks.draw(logits, fprm, iprm, order[:n], order[n:],
                       n_pivot=d.n_pivot if n_pivot == "engine" else n_pivot, check=check).tolist()
    finally:
        ks.CONFIG.clear()
        ks.CONFIG.update(saved)
