"""The command-line options of a cluster's security and input bounds (issue 38): the gateway's
API key, role-to-role transport security, and the gateway's per-client limits. Every command
that starts roles takes them (``serve``, ``launch``, ``demo``, ``bench``)."""

from __future__ import annotations

import argparse
import os

#: the environment variable the key is read from when ``--api-key`` is not given
API_KEY_ENV = "SPECMESH_API_KEY"


def api_key_from(option: str | None) -> str | None:
    """The key a command serves with: ``option`` (``--api-key``) if given, else
    ``$SPECMESH_API_KEY``; None (no key: every route open) when neither is set or both are
    empty.

    Raises:
        SystemExit: a key with whitespace or non-printable characters (it could not be sent
            in an ``Authorization`` header unchanged). The message never shows the key.
    """
    key = option if option is not None else os.environ.get(API_KEY_ENV)
    if not key:
        return None
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise SystemExit("--api-key / SPECMESH_API_KEY: the key must be printable ASCII "
                         "without spaces")
    return key


def add_security_options(p: argparse.ArgumentParser) -> None:
    """``--api-key``, ``--protect-metrics``, ``--insecure-transport`` / ``--secure-transport``
    and ``--max-requests-per-client``."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="every gateway route but /health and /metrics requires the header "
                        f"'Authorization: Bearer KEY' (401 otherwise); default: ${API_KEY_ENV}, "
                        "else none (open). The key is never logged")
    p.add_argument("--protect-metrics", action="store_true",
                   help="with --api-key: /health and /metrics need the key too")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--insecure-transport", dest="transport", action="store_const",
                   const="insecure",
                   help="plain TCP between roles even off the loopback (a trusted single host "
                        "or network); default: CurveZMQ (encrypted, only the roster's keys "
                        "admitted) for roles bound to an address other hosts reach, plain on "
                        "127.0.0.1")
    t.add_argument("--secure-transport", dest="transport", action="store_const", const="curve",
                   help="CurveZMQ between roles even on the loopback")
    p.set_defaults(transport="auto")
    p.add_argument("--max-requests-per-client", type=int, default=None, metavar="N",
                   help="generation requests one client (its address) may have in flight at "
                        "the gateway; past it: 429 (0: no limit; default: "
                        "ClusterConfig.max_requests_per_client, 256)")


def security_settings(args: argparse.Namespace) -> dict:
    """The ClusterConfig settings of these options (``{}`` entries left at their defaults for
    a command without them).

    Raises:
        SystemExit: a malformed key, or a negative per-client limit.
    """
    out: dict = {"api_key": api_key_from(getattr(args, "api_key", None)),
                 "protect_metrics": bool(getattr(args, "protect_metrics", False)),
                 "transport": getattr(args, "transport", None) or "auto"}
    limit = getattr(args, "max_requests_per_client", None)
    if limit is not None:
        if limit < 0:
            raise SystemExit("--max-requests-per-client must be >= 0 (0: no limit)")
        out["max_requests_per_client"] = limit
    return out
