"""``kvpilot operator [--namespace NS]``: run the LLMDeployment operator with kopf.

Credentials come from the pod's service account when in a cluster, else from ``KUBECONFIG``
(kopf's and kvpilot's clients both use the ``kubernetes`` package's loaders).

Peering (https://kopf.readthedocs.io/en/stable/peering/): replicas of the operator share a
``KopfPeering`` object (``ClusterKopfPeering`` when cluster-wide) named ``--peering``. Each
replica takes a random priority; only the highest-priority live one handles events and the
others stand by, so two replicas never both act. The chart creates the peering object. A replica
that dies without leaving (a crash, a lost node) is taken over from once its record is older
than its lifetime, `--peering-lifetime-seconds` (default 15; kopf's own default is 60).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

logger = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=None, metavar="NS",
                        help="watch only this namespace (repeatable); default: the whole cluster")
    parser.add_argument("--peering", default="kvpilot", help="name of the KopfPeering object (default kvpilot)")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering: for a single operator, or a cluster without kopf's peering CRDs")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority (default: random, so that exactly one replica acts)")
    parser.add_argument("--retry-base-seconds", type=float, default=1.0,
                        help="first delay before retrying a failed reconcile (doubles per attempt, with jitter)")
    parser.add_argument("--retry-max-seconds", type=float, default=60.0, help="cap of the retry delay")
    parser.add_argument("--peering-lifetime-seconds", type=int, default=15,
                        help="how long a replica's peering record counts as alive: the failover time")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="kopf's liveness endpoint for the pod's probe ('' to disable)")


def check_credentials() -> str | None:
    """None when Kubernetes credentials can be loaded (in-cluster, else ``$KUBECONFIG`` or
    ``~/.kube/config``), else a one-line reason. kopf itself would retry its start-up every minute
    with a traceback instead of exiting."""
    from kubernetes.config import ConfigException

    from .apply import load_configuration

    try:
        load_configuration()
    except (ConfigException, OSError) as exc:
        return (f"no Kubernetes credentials: not running in a cluster and no usable kubeconfig "
                f"(set KUBECONFIG or create ~/.kube/config): {exc}")
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_credentials()
    if problem is not None:
        print(f"kvpilot operator: {problem}", file=sys.stderr)
        return 1

    import kopf

    from . import handlers
    from .config import OperatorConfig

    try:
        config = OperatorConfig(retry_base_s=args.retry_base_seconds, retry_max_s=args.retry_max_seconds,
                                peering_lifetime_s=args.peering_lifetime_seconds)
    except ValueError as exc:
        raise SystemExit(f"kvpilot operator: {exc}") from exc

    priority = args.priority if args.priority is not None else handlers.random_priority()
    logger.info("starting the kvpilot operator (%s, peering %s, priority %d)",
                f"namespaces {args.namespace}" if args.namespace else "cluster-wide",
                "off" if args.standalone else args.peering, priority)
    asyncio.run(kopf.operator(
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(config=config),
    ))
    return 0
