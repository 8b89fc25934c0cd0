"""``kvpilot router``: flags -> :class:`kvpilot.router.app.RouterConfig`, then serve."""

from __future__ import annotations

import argparse
import asyncio
import logging

logger = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", action="append", default=[], metavar="URL",
                        help="an engine's base URL, e.g. http://10.0.0.5:8000; repeat for several (default: none)")
    parser.add_argument("--discover", default=None, metavar="HOST:PORT",
                        help="a DNS name whose addresses are the engines (a headless Service), re-resolved "
                             "every scrape; default none")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument("--tokenizer", default=None,
                        help="model directory or Hub id whose tokenizer (and chat template) the engines use; "
                             "default none: only token-id prompts get prefix affinity")
    parser.add_argument("--tokenizer-revision", default=None,
                        help="Hub revision of --tokenizer (branch, tag or commit); default none: main")
    parser.add_argument("--chat-template", default=None,
                        help="the engines' --chat-template, if they were started with one; default none")
    parser.add_argument("--tokens-per-block", type=int, default=32, help="the engines' KV block size in tokens")
    parser.add_argument("--max-affinity-blocks", type=int, default=256,
                        help="leading blocks of a prompt hashed for prefix affinity")
    parser.add_argument("--imbalance", type=float, default=0.5,
                        help="a replica keeps its prefixes while its load is at most the least-loaded "
                             "replica's x (1 + imbalance) + slack")
    parser.add_argument("--slack", type=float, default=8.0, help="absolute requests allowed above that bound")
    parser.add_argument("--scrape-interval", type=float, default=2.0,
                        help="seconds between scrapes of each engine's /metrics")
    parser.add_argument("--unhealthy-after", type=int, default=2,
                        help="failed scrapes or connections in a row that take a replica out of rotation")
    parser.add_argument("--request-timeout", type=float, default=3600.0,
                        help="seconds one proxied request may take in total")
    parser.add_argument("--hold-timeout", type=float, default=0.0,
                        help="seconds to hold a request while no replica is healthy (scaled to zero, all "
                             "loading); 0 answers 503 at once")
    parser.add_argument("--max-held", type=int, default=1000, help="requests held at most at a time")
    parser.add_argument("--api-key", default=None,
                        help="require Authorization: Bearer KEY (passed on to the engines); default none")


def run(args: argparse.Namespace) -> int:
    from kvpilot.router.app import Router, RouterConfig, serve
    from kvpilot.router.prefix import PromptTokenizer

    try:
        config = RouterConfig(upstreams=list(args.upstream), discover=args.discover,
                              tokens_per_block=args.tokens_per_block, max_affinity_blocks=args.max_affinity_blocks,
                              imbalance=args.imbalance, slack=args.slack, scrape_interval_s=args.scrape_interval,
                              unhealthy_after=args.unhealthy_after, request_timeout_s=args.request_timeout,
                              api_key=args.api_key, hold_timeout_s=args.hold_timeout, max_held=args.max_held)
    except ValueError as exc:
        raise SystemExit(f"kvpilot router: {exc}") from None
    tokenizer = (PromptTokenizer.from_pretrained(args.tokenizer, args.chat_template, args.tokenizer_revision)
                 if args.tokenizer else None)
    try:
        asyncio.run(serve(Router(config, tokenizer), args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0
