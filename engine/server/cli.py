"""``kvpilot serve MODEL``: one engine, one uvicorn server, OpenAI's HTTP API, graceful drain.

SIGTERM (or Ctrl-C) starts a drain: ``/health`` and new requests get 503, requests already running
finish within ``--drain-timeout`` seconds (the rest are aborted), then the process exits 0.
A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import socket
from typing import Any, Optional

import uvicorn

from kvpilot.config import KV_CACHE_DTYPES
from kvpilot import envs
from kvpilot.server.app import create_app
from kvpilot.server.chat_template import load_chat_template
from kvpilot.server.reasoning import REASONING_PARSERS
from kvpilot.server.tool_parsers import TOOL_PARSERS
from kvpilot.server.state import ServerState

logger = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add ``kvpilot serve``'s arguments (DESIGN.md's CLI contract, plus server options)."""
    parser.add_argument("model", help="Hugging Face checkpoint directory, or Hub repo id (org/name) fetched into "
                                      "the Hugging Face cache (HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE apply)")
    parser.add_argument("--revision", default=None,
                        help="Hub branch, tag or commit of MODEL (default: main; Hub ids only)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for compatibility; kvpilot never runs a checkpoint's own model code "
                             "(default: off)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on, 1-65535 (default 8000)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs each layer is split over (one worker process per GPU)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="pipeline stages the layers are split into (one worker process per stage and TP rank)")
    parser.add_argument("--max-batch-size", type=int, default=256, help="most sequences in one engine step")
    parser.add_argument("--max-num-tokens", type=int, default=8192, help="most tokens in one engine step")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="context limit in tokens, prompt + output (default: the model's "
                             "max_position_embeddings)")
    parser.add_argument("--allow-long-max-seq-len", action="store_true",
                        help="accept --max-seq-len beyond the model's max_position_embeddings")
    parser.add_argument("--free-gpu-memory-fraction", type=float, default=0.9,
                        help="fraction of the GPU memory left after loading that the KV cache takes (0-1)")
    parser.add_argument("--tokens-per-block", type=int, default=32, help="KV-cache block size in tokens")
    parser.add_argument("--enable-block-reuse", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse cached KV blocks of shared prompt prefixes (default: on)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="same as --no-enable-block-reuse (vLLM's flag name)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV-cache element type: auto (the model's), fp8 (E4M3, half the memory), or a "
                             "16/32-bit float type")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="quantize a 16/32-bit checkpoint's linear weights at load: fp8 (E4M3, per-channel "
                             "scales, per-token activations; QuantConfig(quant_algo='FP8')). Default: none; "
                             "FP8 checkpoints (ModelOpt, compressed-tensors, block-wise) need no flag")
    parser.add_argument("--dtype", default="auto",
                        help="weights' dtype: auto (the checkpoint's 16-bit type on GPU, float32 on CPU), "
                             "bfloat16, float16, float32")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available, else CPU), cuda, cuda:N or cpu")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as a JSON object: {"decoding_type": "NGram", "max_draft_len": 4, '
                             '"max_matching_ngram_size": 4} or {"decoding_type": "DraftTarget", "max_draft_len": 4, '
                             '"speculative_model": DIR_OR_HUB_ID} (default: none, no speculation; '
                             'docs/speculative_decoding.md)')
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients put in requests' 'model' field and /v1/models lists "
                             "(default: MODEL exactly as given on the command line)")
    parser.add_argument("--api-key", default=envs.api_key(),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVPILOT_API_KEY)")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template overriding the tokenizer's: a file, an inline template, "
                             "or a bundled one by name ('plain': the messages' contents in order, for base "
                             "models such as stories260K) (default: the tokenizer's own chat_template)")
    parser.add_argument("--metrics-compat", choices=["none", "vllm"], default="none",
                        help="'vllm' also exports every metric under vLLM's vllm: names")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM (default 30)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters: each is a model name clients put in 'model' (docs/lora.md)")
    parser.add_argument("--lora-modules", nargs="+", default=[], type=lora_module, metavar="NAME=PATH",
                        help="adapters to load at start-up, as name=path or vLLM's JSON "
                             "'{\"name\": ..., \"path\": ...}' (needs --enable-lora)")
    parser.add_argument("--max-loras", type=int, default=4,
                        help="LoRA adapters resident on the GPU at once (default 4)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted (default 16)")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="LoRA adapters kept in host memory (default: max(--max-loras, adapters listed))")
    parser.add_argument("--moe-backend", default="TRITON", type=str.upper, choices=["TRITON", "TORCH"],
                        help="mixture-of-experts kernels: TRITON (fused, default) or TORCH (the PyTorch "
                             "reference); MoeConfig(backend=...) (docs/models.md)")
    parser.add_argument("--moe-expert-parallel-size", type=int, default=None,
                        help="MoE models: expert groups the tensor-parallel ranks form (must divide "
                             "--tensor-parallel-size and the expert count; default 1)")
    parser.add_argument("--moe-tensor-parallel-size", type=int, default=None,
                        help="MoE models: ways each expert is split (default: --tensor-parallel-size / "
                             "--moe-expert-parallel-size)")
    parser.add_argument("--guided-decoding-backend", choices=["xgrammar", "none"], default="xgrammar",
                        help="grammar engine for response_format / guided_* / forced tool calls; 'none' refuses "
                             "them (default xgrammar; docs/structured_output.md)")
    parser.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                        help="parse the model's tool calls into tool_calls under tool_choice 'auto' "
                             "(docs/tool_calling.md); default none: 'auto' replies are text")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM compatibility: --tool-call-parser alone enables parsing (default off)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="split <think>...</think> reasoning into reasoning_content (docs/tool_calling.md); "
                             "default none")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        help="uvicorn's own log level: debug, info, warning, error")


def port_number(value: str) -> int:
    """``--port``'s type: an integer in 1-65535 (argparse turns the ValueError into a usage error)."""
    port = int(value)
    if not 1 <= port <= 65535:
        raise ValueError(value)
    return port


port_number.__name__ = "port (1-65535)"  # argparse names the type in its error message


def lora_module(value: str) -> tuple[str, str]:
    """``--lora-modules``' type: ``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``
    (``base_model_name`` accepted and ignored)."""
    import json

    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
            name, path = obj["name"], obj["path"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(value) from None
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise ValueError(value)
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ValueError(value)
    return name, path


lora_module.__name__ = "LoRA module (name=path or JSON)"


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, made before the model loads.

    uvicorn binds only after the application's start-up, which here begins loading the model, so a
    port in use would surface after seconds to minutes of loading; binding first fails at once. The
    socket is handed to uvicorn (``Server.run(sockets=...)``).

    Raises:
        OSError: the address cannot be resolved or bound; the message names it and the cause.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: unknown host ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no obstacle
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = "; another process listens there (pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def _lora_config(args: argparse.Namespace) -> Any:
    """The `LoraConfig` of ``--enable-lora`` and its flags (None without it). The
    ``--lora-modules`` adapters are read by `load_lora_modules` once the engine is built."""
    if not getattr(args, "enable_lora", False):
        return None
    from kvpilot.lora.config import LoraConfig

    cpu = args.max_cpu_loras if args.max_cpu_loras is not None else max(args.max_loras, len(args.lora_modules))
    return LoraConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=cpu)


def load_lora_modules(llm: Any, state: ServerState) -> None:
    """Read every adapter of ``state.lora_modules`` (``--lora-modules``) into ``llm``'s host cache,
    under the name and id requests will use, so a bad adapter fails the start-up with its name.

    Raises:
        FileNotFoundError, ValueError: an adapter that cannot be read or does not fit the model
            (the message starts with ``LoRA adapter 'NAME':``).
    """
    for req in state.lora_modules.values():
        llm.lora_cache.get(req)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from kvpilot import KvCacheConfig

    kv = KvCacheConfig(free_gpu_memory_fraction=args.free_gpu_memory_fraction,
                       enable_block_reuse=args.enable_block_reuse and not args.no_prefix_caching,
                       tokens_per_block=args.tokens_per_block, dtype=args.kv_cache_dtype)
    from kvpilot.config import QuantConfig

    lora = _lora_config(args)
    extra = {"lora_config": lora} if lora is not None else {}
    if getattr(args, "quantization", None) == "fp8":
        extra["quant_config"] = QuantConfig(quant_algo="FP8")
    from kvpilot.config import MoeConfig

    extra["moe_config"] = MoeConfig(backend=getattr(args, "moe_backend", "TRITON"))
    for name in ("moe_expert_parallel_size", "moe_tensor_parallel_size"):
        if getattr(args, name, None) is not None:
            extra[name] = getattr(args, name)
    return dict(**extra, tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                max_seq_len=args.max_seq_len, kv_cache_config=kv, device=args.device, dtype=args.dtype,
                revision=args.revision)


def build_engine(args: argparse.Namespace) -> Any:
    """Create the `kvpilot.LLM` described by the parsed arguments (blocking, seconds to minutes)."""
    from kvpilot import LLM

    backend = getattr(args, "guided_decoding_backend", "xgrammar")
    return LLM(args.model, tokenizer=args.tokenizer, allow_long_max_seq_len=args.allow_long_max_seq_len,
               trust_remote_code=args.trust_remote_code, speculative_config=args.speculative_config,
               guided_decoding_backend=None if backend == "none" else backend,
               **_engine_kwargs(args))


def preflight(args: argparse.Namespace) -> None:
    """The checks `kvpilot.LLM` makes of the arguments before loading, made before the server
    starts: a bad device or context limit is one line at once, not a traceback after start-up.

    Raises:
        FileNotFoundError: MODEL is written as a local path (``/``, ``./``, ``../`` or ``~`` first)
            and is not a directory. Other names may be Hub ids and are left to `kvpilot.LLM`.
        ValueError: a bad ``--device`` (`DeviceUnavailableError` included), ``--max-seq-len``,
            ``--speculative-config`` or MoE layout (`kvpilot.config.check_moe_parallelism`).
    """
    from pathlib import Path

    from kvpilot.llm import check_max_seq_len
    from kvpilot.model.config import ModelConfig
    from kvpilot.runner.model_runner import check_device

    check_device(args.device)
    from kvpilot.config import check_moe_parallelism

    check_moe_parallelism(args.tensor_parallel_size, getattr(args, "moe_expert_parallel_size", None),
                          getattr(args, "moe_tensor_parallel_size", None))
    speculative = getattr(args, "speculative_config", None)
    if speculative is not None:
        from kvpilot.spec_decode.config import parse_speculative_config

        parse_speculative_config(speculative)
        if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
            raise ValueError("--speculative-config needs --tensor-parallel-size 1 and --pipeline-parallel-size 1")
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if getattr(args, "enable_lora", False):
        _lora_config(args)  # a bad count is a one-line error before the engine loads
        names = [n for n, _ in args.lora_modules]
        dup = sorted({n for n in names if names.count(n) > 1} | ({args.served_model_name or args.model} & set(names)))
        if dup:
            raise ValueError(f"--lora-modules: name(s) {', '.join(dup)} used twice (or the base model's name)")
    if args.model.startswith(("/", "./", "../", "~")) and not Path(args.model).expanduser().is_dir():
        raise FileNotFoundError(f"model {args.model!r}: no such directory (expected a Hugging Face checkpoint "
                                f"directory with config.json, *.safetensors and tokenizer files)")
    if args.max_seq_len is not None and (Path(args.model) / "config.json").is_file():
        cfg = ModelConfig.from_dir(Path(args.model))
        check_max_seq_len(args.max_seq_len, cfg.max_position_embeddings, args.allow_long_max_seq_len)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on the first SIGTERM/SIGINT instead of an immediate stop.

    uvicorn re-raises the signals it caught after shutting down (so the process would die of
    SIGTERM); this handler records none, so a drained server returns normally and exits 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_task: Optional[asyncio.Future] = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self._loop is None:
            logger.warning("second signal %s: exiting now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = self.state.draining
            return
        logger.info("%s: draining (up to %.0f s for %d running requests)", signal.Signals(sig).name,
                    self.drain_timeout, self.state.num_active)
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        if not await self.state.wait_idle(self.drain_timeout):
            n = self.state.abort_all()
            logger.warning("drain timeout: aborted %d requests still running", n)
            await self.state.wait_idle(5.0)
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.state.load_error is not None:
            self.should_exit = True
        return await super().on_tick(counter)


def run(args: argparse.Namespace) -> int:
    """Serve until drained; returns 0, or 1 if the model failed to load.

    On a LeaderWorkerSet worker pod (``LWS_WORKER_INDEX`` > 0) there is no HTTP server: the pod
    runs its share of the engine's ranks until the leader stops (`kvpilot.parallel.executor.run_lws_worker`).
    """
    from kvpilot.parallel.executor import LwsGroup, run_lws_worker

    group = LwsGroup.from_env()
    if group is not None and group.index > 0:
        kwargs = _engine_kwargs(args)
        # The leader's front end checks adapters; every rank reads them from the plan's requests.
        lora = kwargs.pop("lora_config", None)
        return run_lws_worker(args.model, group=group, lora_config=lora, **kwargs)
    try:
        template = load_chat_template(args.chat_template)
        preflight(args)
    except (OSError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    try:
        sock = bind_listen_socket(args.host, args.port)
    except OSError as exc:
        logger.error("%s", exc.strerror or exc)
        return 1
    state = ServerState(served_model_name=args.served_model_name or args.model, model_path=args.model,
                        chat_template=template, api_key=args.api_key or None, lora_enabled=args.enable_lora,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    for name, path in args.lora_modules:
        state.add_lora(name, path)
    prefixes = ("kvpilot:", "vllm:") if args.metrics_compat == "vllm" else ("kvpilot:",)
    def load() -> Any:
        llm = build_engine(args)
        try:
            load_lora_modules(llm, state)
        except BaseException:
            llm.shutdown()
            raise
        return llm

    app = create_app(state, load=load, metrics_prefixes=prefixes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(config, state, args.drain_timeout)
    logger.info("serving %s on http://%s:%d", state.served_model_name, args.host, args.port)
    server.run(sockets=[sock])
    if state.load_error is not None:
        return 1
    logger.info("server stopped")
    return 0
