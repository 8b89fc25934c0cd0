"""`LLM`: the Python API (TensorRT-LLM's LLM API), in front of a background engine loop."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import itertools
import logging
import queue
import random
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Sequence as Seq, Union

from kvpilot.config import KvCacheConfig, MoeConfig, QuantConfig, check_moe_parallelism

from kvpilot.model.config import GenerationDefaults, ModelConfig
from kvpilot.model.hub import resolve_model
from kvpilot.core.engine_core import EngineCore
from kvpilot.core.engine_loop import EngineLoop
from kvpilot.outputs import EngineDeadError, RequestOutput  # noqa: F401  (EngineDeadError: public here too)
from kvpilot.sampling_params import SamplingParams
from kvpilot.sampling.guided import BACKENDS as GUIDED_BACKENDS, GuidedDecodingBackend, GuidedDecodingError
from kvpilot.core.sequence import Request, Sequence
from kvpilot.core.stats import IterationStats
from kvpilot.text import check_text
from kvpilot.tuning import Tuning

logger = logging.getLogger(__name__)

PromptInput = Union[str, list[int]]
_request_ids = itertools.count()


class LLM:
    """Load a Hugging Face checkpoint and serve requests from a background loop.

    Args:
        model: a Hugging Face checkpoint directory, or a Hub repo id (``org/name``) fetched into the
            Hugging Face cache (`kvpilot.model.hub.resolve_model`: safetensors, configs and tokenizer
            files only; ``HF_TOKEN``, ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` apply). The architecture
            must be one of `kvpilot.model.registry.MODEL_REGISTRY` (docs/models.md).
        tokenizer: a directory or Hub id holding the tokenizer, if not ``model``.
        revision: the Hub branch, tag or commit of ``model`` (default ``main``; Hub ids only).
        backend: only "pytorch".
        tensor_parallel_size, pipeline_parallel_size: worker layout (T x P processes when > 1).
        max_batch_size: sequences per step (default 256).
        max_num_tokens: tokens per step, the chunked-prefill budget (default 8192).
        max_seq_len: longest prompt + output in tokens (default: the model's
            ``max_position_embeddings``). A larger value is an error unless
            ``allow_long_max_seq_len`` is set.
        kv_cache_config: `KvCacheConfig`.
        trust_remote_code: accepted for API compatibility; custom model code is never run (a config
            that needs it is an error naming its architecture).
        skip_tokenizer_init: run without a tokenizer (prompts must be token ids; no text out).
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        dtype: "auto" (bfloat16/float16 from the checkpoint on GPU, float32 on CPU) or a dtype name.
        allow_long_max_seq_len: accept ``max_seq_len`` beyond the model's ``max_position_embeddings``
            (positions the model was not trained on; its output there is usually poor).
        speculative_config: `NGramDecodingConfig` or `DraftTargetDecodingConfig` (TensorRT-LLM's
            classes, `kvpilot.llmapi`), a dict or JSON text of one (`parse_speculative_config`), or
            None (no speculation). One GPU only (tensor and pipeline parallel size 1);
            docs/speculative_decoding.md.
        lora_config: `kvpilot.llmapi.LoraConfig` to serve PEFT LoRA adapters (docs/lora.md); requests
            pick one with ``lora_request``. Adapters are sharded like their base layers under tensor
            parallelism; each pipeline stage holds its layers' share.
        moe_config: `MoeConfig` (mixture-of-experts kernels; ignored by dense models).
        moe_expert_parallel_size, moe_tensor_parallel_size: how an MoE model's
            ``tensor_parallel_size`` ranks share the experts (TensorRT-LLM's names; their product is
            ``tensor_parallel_size``, `kvpilot.config.check_moe_parallelism`): experts partitioned
            over ``moe_expert_parallel_size`` groups, each expert split ``moe_tensor_parallel_size``
            ways (docs/models.md). Default: every expert split over all ranks.
        guided_decoding_backend: the grammar engine of ``SamplingParams.guided_decoding``
            (docs/structured_output.md): "xgrammar" (default), or None to refuse guided requests.
        quant_config: `QuantConfig`: FP8 weights quantized at load (``quant_algo="FP8"``) and the
            FP8 KV cache (``kv_cache_quant_algo="FP8"``). Pre-quantized FP8 checkpoints (ModelOpt,
            compressed-tensors, block-wise ``fp8``) load without it (docs/quantization.md).
        tuning: the engine's performance switches (`kvpilot.tuning.Tuning`), for benchmarks and
            tests; default: the measured winners, overridden by ``KVPILOT_TUNING`` when that is set.

    Sampling defaults: a request without ``sampling_params`` gets the checkpoint's
    ``generation_config.json`` values (temperature, top_p, top_k, repetition_penalty, min_p;
    `default_sampling_params`); its end-of-sequence ids always stop generation.

    Raises:
        FileNotFoundError: the model directory or its files are missing, or the Hub id / revision
            cannot be fetched (`kvpilot.model.hub.ModelNotFoundError`).
        PermissionError: a gated Hub repo without a token that may read it.
        ValueError: an argument outside its allowed range (``max_seq_len`` past the model's
            positions included); an unsupported architecture; an adapter of
            ``lora_config.lora_dir`` that does not fit the model (`kvpilot.lora.adapter.LoRAAdapterError`).
        kvpilot.runner.model_runner.DeviceUnavailableError: ``device`` names CUDA on a CPU-only
            torch build, with no GPU visible, or past the last GPU.
        TypeError: an unknown argument.
    """

    def __init__(self, model: str, tokenizer: Optional[str] = None, backend: str = "pytorch",
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, max_batch_size: int = 256,
                 max_num_tokens: int = 8192, max_seq_len: Optional[int] = None,
                 kv_cache_config: Optional[KvCacheConfig] = None, trust_remote_code: bool = False,
                 skip_tokenizer_init: bool = False, device: str = "auto", dtype: str = "auto",
                 allow_long_max_seq_len: bool = False, revision: Optional[str] = None,
                 lora_config: Optional[Any] = None, moe_config: Optional[MoeConfig] = None,
                 moe_expert_parallel_size: Optional[int] = None, moe_tensor_parallel_size: Optional[int] = None,
                 guided_decoding_backend: Optional[str] = "xgrammar",
                 quant_config: Optional[QuantConfig] = None,
                 speculative_config=None, tuning: Optional[Tuning] = None) -> None:
        if backend != "pytorch":
            raise ValueError(f"backend must be 'pytorch' (the only one kvpilot has), got {backend!r}")
        for name, value in (("tensor_parallel_size", tensor_parallel_size),
                            ("pipeline_parallel_size", pipeline_parallel_size),
                            ("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a kvpilot.tuning.Tuning, got {type(tuning).__name__}")
        self.tuning = tuning = tuning if tuning is not None else Tuning.from_env()
        if tuning.overrides():
            logger.info("tuning overrides: %s", tuning.overrides())
        from kvpilot.spec_decode import parse_speculative_config

        self.speculative_config = parse_speculative_config(speculative_config)
        if self.speculative_config is not None and tensor_parallel_size * pipeline_parallel_size > 1:
            raise ValueError("speculative_config needs tensor_parallel_size=1 and pipeline_parallel_size=1 "
                             "(speculative decoding runs on one GPU)")
        if lora_config is not None:
            from kvpilot.lora.config import LoraConfig

            if not isinstance(lora_config, LoraConfig):
                raise TypeError(f"lora_config must be a kvpilot.llmapi.LoraConfig, got {type(lora_config).__name__}")
        self.lora_config = lora_config
        if moe_config is not None and not isinstance(moe_config, MoeConfig):
            raise TypeError(f"moe_config must be a kvpilot.llmapi.MoeConfig, got {type(moe_config).__name__}")
        moe_ep = check_moe_parallelism(tensor_parallel_size, moe_expert_parallel_size, moe_tensor_parallel_size)
        self.moe_config = moe_config or MoeConfig()
        if guided_decoding_backend is not None and guided_decoding_backend not in GUIDED_BACKENDS:
            raise ValueError(f"guided_decoding_backend must be one of {', '.join(GUIDED_BACKENDS)} or None, "
                             f"got {guided_decoding_backend!r}")
        self.guided_decoding_backend = guided_decoding_backend
        self._guided: Optional[GuidedDecodingBackend] = None  # built at the first guided request
        self._guided_lock = threading.Lock()
        model_dir = resolve_model(str(model), revision)
        self.model_dir = model_dir
        self.revision = revision
        self.kv_cache_config = kv_cache_config or KvCacheConfig()
        if quant_config is not None and not isinstance(quant_config, QuantConfig):
            raise TypeError(f"quant_config must be a kvpilot.llmapi.QuantConfig, got {type(quant_config).__name__}")
        self.quant_config = quant_config or QuantConfig()
        kv_dtype = self.quant_config.kv_cache_dtype(self.kv_cache_config)
        if kv_dtype != self.kv_cache_config.dtype:
            self.kv_cache_config = dataclasses.replace(self.kv_cache_config, dtype=kv_dtype)
        self.model_config = ModelConfig.from_dir(model_dir, trust_remote_code=trust_remote_code)
        self.model_config.moe_backend = self.moe_config.backend
        self.model_config.moe_expert_parallel_size = moe_ep
        from kvpilot.model.moe import check_moe_layout

        check_moe_layout(self.model_config, tensor_parallel_size)  # before any worker starts
        if self.quant_config.quant_algo:
            self.model_config.quantization = self.quant_config.to_dict()
        self.generation_defaults = GenerationDefaults.from_dir(model_dir)
        logger.info("%s (%s): sampling defaults from generation_config.json: %s", model,
                    self.model_config.architecture, self.generation_defaults.describe())
        cfg = self.model_config
        self.max_seq_len = int(max_seq_len or cfg.max_position_embeddings)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        check_max_seq_len(self.max_seq_len, cfg.max_position_embeddings, allow_long_max_seq_len)
        from kvpilot.runner.model_runner import check_device

        check_device(device)  # before the tokenizer and weights load
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.tokenizer = None if skip_tokenizer_init else _load_tokenizer(
            resolve_model(tokenizer) if tokenizer else model_dir)
        eos = list(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = list(dict.fromkeys(eos))
        self._executor = _make_executor(self, device, dtype)
        spec = None
        if self.speculative_config is not None:
            from kvpilot.spec_decode import build_speculative_decoder

            spec = build_speculative_decoder(self.speculative_config, self._executor, max_num_tokens,
                                             max_batch_size, self.max_seq_len, dtype)
        self.lora_cache = None  # kvpilot.lora.adapter.AdapterCache with lora_config
        if lora_config is not None:
            self.lora_cache = _lora_cache(self._executor, lora_config, cfg)
            for d in lora_config.lora_dir:  # checked against the model at start-up, not at first use
                self.lora_cache.preload(d)
        self._core = EngineCore(self._executor, self.tokenizer, self.eos_token_ids, max_num_tokens,
                                max_batch_size, self.max_seq_len, self.kv_cache_config.enable_block_reuse,
                                max_loras=lora_config.max_loras if lora_config is not None else 0,
                                speculative=spec, tuning=tuning)
        self.pool_tokens = self._executor.num_blocks * self._executor.block_size
        _freeze_gc()
        self._loop = EngineLoop(self._core)
        self._loop.start()
        _live_engines.add(self)

    def default_sampling_params(self) -> SamplingParams:
        """`SamplingParams` with the checkpoint's ``generation_config.json`` defaults (class docstring)."""
        return SamplingParams(**self.generation_defaults.values)

    # ---- submission --------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM was created with skip_tokenizer_init=True: give prompts as token ids")
            check_text("prompt", prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not ids and self.model_config.bos_token_id is not None:
                ids = [self.model_config.bos_token_id]
            return prompt, ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size}), got {bad[:5]}")
            if not ids:
                if self.model_config.bos_token_id is None:
                    raise ValueError("empty token-id prompt and the model has no bos_token_id")
                ids = [self.model_config.bos_token_id]
            return None, ids
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _adapter(self, lora_request):
        """The loaded adapter of ``lora_request`` (None for None), from the host-memory cache.

        Raises:
            ValueError: ``lora_request`` without ``lora_config``; a bad adapter (`kvpilot.lora.adapter.load_adapter`).
            TypeError: not a `LoRARequest`.
        """
        if lora_request is None:
            return None
        if self.lora_cache is None:
            raise ValueError("lora_request needs an LLM created with lora_config=LoraConfig(...)")
        return self.lora_cache.get(lora_request)

    def _make_request(self, prompt: PromptInput, params: Optional[SamplingParams], streaming: bool,
                      lora_request=None) -> Request:
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        # A private, re-validated copy: fields changed after construction are checked again, and the
        # caller's object (often shared by many requests) is never written to.
        params = dataclasses.replace(params) if params is not None else self.default_sampling_params()
        if params.use_beam_search and params.num_candidates > min(self.max_batch_size, self.max_num_tokens):
            raise ValueError(f"beam search with {params.num_candidates} beams needs that many batch slots and "
                             f"tokens per step; max_batch_size is {self.max_batch_size}, max_num_tokens is "
                             f"{self.max_num_tokens}")
        adapter = self._adapter(lora_request)
        text, ids = self._tokenize(prompt)
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len}, which must "
                             f"hold the prompt and at least one generated token")
        # Generation stops at max_seq_len (finish_reason "length"), as vLLM's offline LLM does; the
        # HTTP server rejects prompt + max_tokens > max_seq_len up front, as OpenAI's API does.
        if min(len(ids) + params.max_tokens, self.max_seq_len) > self.pool_tokens:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) can never fit the KV "
                             f"cache pool of {self.pool_tokens} tokens")
        vocab = self.model_config.vocab_size
        for name, ids_ in (("allowed_token_ids", params.allowed_token_ids or []),
                           ("logit_bias", list(params.logit_bias or {})), ("stop_token_ids", params.stop_token_ids),
                           ("bad_token_ids", params.bad_token_ids)):
            bad_ids = [t for t in ids_ if not 0 <= t < vocab]
            if bad_ids:
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab}): {bad_ids[:5]}")
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            banned_early = set(params.bad_token_ids) | set(params.stop_token_ids) | (
                {params.end_id} if params.end_id is not None else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= banned_early:
                raise ValueError("allowed_token_ids holds only end-of-sequence, stop or bad token ids, which "
                                 f"min_tokens ({params.min_tokens}) bans: no token could be generated")
        if params.bad_words and self.tokenizer is not None:
            params._bad_words_ids = _bad_words_ids(self.tokenizer, params.bad_words)
        compiled = self._compile_guided(params) if params.guided_decoding is not None else None
        rid = next(_request_ids)
        out = RequestOutput(rid, text, ids, params.n, streaming, abort_fn=self._loop.abort)
        req = Request(rid, ids, params, out, lora=adapter)
        base_seed = params.seed % (1 << 63) if params.seed is not None else random.getrandbits(63)
        # Beam search starts from one sequence and forks it (engine/core/beam_search.py).
        for i in range(1 if params.use_beam_search else params.num_candidates):
            seed = base_seed if i == 0 else hash((base_seed, i)) & ((1 << 63) - 1)
            req.seqs.append(Sequence(request=req, index=i, token_ids=list(ids), seed=seed))
            if compiled is not None:
                req.seqs[-1].guide = self._guided.guide(
                    compiled, [params.end_id] if params.end_id is not None else None,
                    params.guided_decoding.start_after)
        return req

    def guided_backend(self) -> GuidedDecodingBackend:
        """The engine's `GuidedDecodingBackend` (built on first use: tokenizer tables for xgrammar).

        Raises:
            GuidedDecodingError: ``guided_decoding_backend`` is None, the engine has no tokenizer, or
                xgrammar cannot read the tokenizer (or is not installed).
        """
        if self._guided is None:
            if self.guided_decoding_backend is None:
                raise GuidedDecodingError("guided_decoding needs a guided_decoding_backend; this LLM was "
                                          "created with guided_decoding_backend=None")
            if self.tokenizer is None:
                raise GuidedDecodingError("guided_decoding needs a tokenizer (skip_tokenizer_init=True)")
            with self._guided_lock:
                if self._guided is None:
                    try:
                        self._guided = GuidedDecodingBackend(self.tokenizer, self.model_config.vocab_size,
                                                             self.eos_token_ids)
                    except (ImportError, RuntimeError, ValueError, TypeError) as exc:
                        raise GuidedDecodingError(f"guided decoding cannot use this tokenizer: {exc}") from exc
        return self._guided

    def _compile_guided(self, params: SamplingParams):
        """The compiled grammar of ``params.guided_decoding`` (cached by its text; raises
        GuidedDecodingError, a ValueError, when it does not compile)."""
        return self.guided_backend().compile(params.guided_decoding)

    def generate_async(self, inputs: PromptInput, sampling_params: Optional[SamplingParams] = None,
                       streaming: bool = False, lora_request=None) -> RequestOutput:
        """Queue one request and return its `RequestOutput` at once.

        ``lora_request``: a `kvpilot.executor.LoRARequest` to run with that adapter (loaded into
        host memory on this thread on first use), or None for the base model.

        ``await`` it for the finished result (or, with ``streaming=True``, ``async for`` over it and
        get a chunk per engine step). A non-streaming handle receives one update, when the request
        ends, so iterating it yields only the final result.

        Raises:
            ValueError / TypeError: bad prompt or parameters (nothing is queued).
            EngineDeadError: the engine has shut down.
        """
        req = self._make_request(inputs, sampling_params, streaming, lora_request)
        self._loop.submit(req)
        return req.output

    def generate(self, inputs: Union[PromptInput, Seq[PromptInput]],
                 sampling_params: Optional[Union[SamplingParams, Seq[SamplingParams]]] = None,
                 use_tqdm: bool = True, lora_request=None) -> Union[RequestOutput, list[RequestOutput]]:
        """Generate for one prompt or a batch; results in input order.

        Args:
            inputs: a string, a list of token ids, or a list of either. ``[]`` is one empty token-id
                prompt: the BOS token alone, or a ValueError on a model without one.
            sampling_params: one for all prompts, or one per prompt.
            use_tqdm: show a progress bar over finished requests.
            lora_request: a `kvpilot.executor.LoRARequest` for all prompts, or a list with one per
                prompt (None entries: the base model); needs ``lora_config``.
        Returns:
            A `RequestOutput` for a single prompt, else a list of them.
        """
        if not isinstance(inputs, (str, list, tuple)):
            raise TypeError(f"inputs must be a string, a list of token ids, or a list of those, "
                            f"got {type(inputs).__name__}")
        # An empty list is one empty token-id prompt (BOS alone; an error without a BOS token), as
        # for `generate_async`, not an empty batch.
        single = isinstance(inputs, str) or all(isinstance(t, int) and not isinstance(t, bool) for t in inputs)
        prompts = [list(inputs) if not isinstance(inputs, str) else inputs] if single else list(inputs)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompts):
                raise ValueError(f"got {len(lora_request)} lora_request entries for {len(prompts)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        reqs = [self._make_request(p, sp, False, lr) for p, sp, lr in zip(prompts, params, loras)]
        for r in reqs:
            self._loop.submit(r)
        bar = None
        if use_tqdm and len(reqs) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="Processed prompts", dynamic_ncols=True)
        results = []
        try:
            for r in reqs:
                results.append(r.output.result())
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results[0] if single else results

    # ---- stats and lifecycle ----------------------------------------------------------------
    def add_stat_logger(self, fn: Callable[[IterationStats], None]) -> None:
        """Call ``fn(stats)`` on the engine thread after every step and when the engine turns idle."""
        self._loop.stat_loggers.append(fn)

    def get_stats(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Iteration stats (TensorRT-LLM field names) gathered since the last call; waits up to
        ``timeout`` seconds for the first one when none is pending."""
        return self._loop.take_stats(timeout)

    async def get_stats_async(self, timeout: float = 2.0) -> AsyncIterator[dict[str, Any]]:
        """Yield iteration stats as they arrive; ends after ``timeout`` seconds without a new one."""
        while True:
            stats = await asyncio.get_running_loop().run_in_executor(None, self._loop.take_stats, timeout)
            if not stats:
                return
            for s in stats:
                yield s

    def abort(self, request_id: int) -> None:
        self._loop.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engine loop, fail unfinished requests, release the model.

        A script that never calls it is shut down at interpreter exit (`_shutdown_at_exit`).
        """
        _live_engines.discard(self)
        self._loop.stop()
        close = getattr(self._executor, "shutdown", None)
        if close is not None:
            close()
        # Hand the heap frozen at start-up back to the collector, so this engine (its weights
        # included) can be freed once unreachable, even if it sits in a reference cycle.
        gc.unfreeze()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self._loop.stop()
        except Exception:
            pass


# Engines started and not yet shut down; `_shutdown_at_exit` stops them when the interpreter exits.
_live_engines: "weakref.WeakSet[LLM]" = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    """Shut down every engine still running, then unfreeze the heap frozen at start-up.

    Objects that `_freeze_gc` moved to the permanent generation are skipped by the collections
    Python runs while it finalizes, so Triton's compiled-kernel objects (nanobind bindings) held in
    reference cycles would outlive the interpreter, and nanobind prints ``leaked ...`` lines at
    exit. Runs after non-daemon threads are joined and before modules are torn down.
    """
    for llm in list(_live_engines):
        try:
            llm.shutdown()
        except Exception:  # exiting anyway: one engine's failure must not keep the others running
            logger.debug("shutdown at exit failed", exc_info=True)
    gc.unfreeze()


def _freeze_gc() -> None:
    """Collect once, then move every object alive after start-up (modules, weights' Python
    wrappers, tokenizer tables) out of the cyclic garbage collector's reach (`gc.freeze`), as vLLM
    does after its engine starts. A full collection of a started engine's process otherwise walks
    ~300k objects: 136 ms on this project's CPU machine (stories260K, transformers imported), a
    stall of many decode steps whenever Python decides to run one (BENCHMARKS.md).
    """
    gc.collect()
    gc.freeze()


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise FileNotFoundError(f"could not load a tokenizer from {path}: {e}; pass tokenizer=DIR or "
                                f"skip_tokenizer_init=True") from e


def _bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences for each bad word, with and without a leading space (as vLLM does)."""
    out = []
    for w in words:
        for variant in (w, " " + w.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def check_max_seq_len(max_seq_len: int, max_position_embeddings: int, allow_long: bool) -> None:
    """Refuse a context limit beyond the positions the model was trained on, unless allowed.

    Raises:
        ValueError: ``max_seq_len > max_position_embeddings`` and not ``allow_long``; the message
            names the model's limit and the argument that allows more.
    """
    if max_seq_len > max_position_embeddings and not allow_long:
        raise ValueError(f"max_seq_len {max_seq_len} is beyond this model's {max_position_embeddings} positions "
                         f"(config.json max_position_embeddings); pass max_seq_len <= {max_position_embeddings}, "
                         f"or allow_long_max_seq_len=True (kvpilot serve --allow-long-max-seq-len) to use "
                         f"positions the model was not trained on")


def _lora_cache(executor, lora_config, cfg: ModelConfig):
    from kvpilot.lora.adapter import AdapterCache, load_adapter
    from kvpilot.lora.layers import global_targets

    targets = global_targets(cfg)
    import torch

    # With worker processes the front end's copies only validate adapters (each rank loads its own).
    dtype = getattr(executor, "dtype", torch.float32)
    num_layers, rank = cfg.num_hidden_layers, lora_config.max_lora_rank
    return AdapterCache(lora_config, lambda req: load_adapter(req, targets, num_layers, rank, dtype))


def _make_executor(llm: LLM, device: str, dtype: str):
    from kvpilot.runner.model_runner import ModelRunner

    if llm.tensor_parallel_size * llm.pipeline_parallel_size > 1:
        from kvpilot.parallel.executor import MultiprocExecutor

        return MultiprocExecutor(llm, device, dtype)
    return ModelRunner(llm.model_dir, llm.model_config, llm.kv_cache_config, llm.max_num_tokens,
                       llm.max_batch_size, llm.max_seq_len, device=device, dtype=dtype,
                       lora_config=llm.lora_config, tuning=llm.tuning)
