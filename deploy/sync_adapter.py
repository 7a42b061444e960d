"""Load (or reload) or unload one LoRA adapter on EVERY replica of the API, not just the one a load
balancer picks. Standard library only, so it runs in the API image itself:

    docker compose --profile tools run --rm adapter-sync load translation git   # every replica of `api`
    python deploy/sync_adapter.py --targets 10.0.0.5:8000,10.0.0.6:8000 unload translation git

Replicas share the adapter directory (a volume), so `load` sends a body-less
PUT /v1/models/{model}/adapters/{name}: each replica (re)reads <adapters>/<model>/<name>/ from the
shared volume. Upload a new version first (PUT with an archive, through the load balancer: one
replica writes it to the volume), then run `load` here so that every replica swaps to it.
Replicas are found by resolving --host (Docker's DNS answers a service name with one address per
container). Exit status 0 when every replica succeeded, 1 otherwise (each replica's answer is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request


def resolve(host: str, port: int) -> list[str]:
    """Every IPv4 address of ``host`` as ``address:port``, sorted, without duplicates."""
    infos = socket.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({f"{info[4][0]}:{port}" for info in infos})


def call(target: str, method: str, model: str, adapter: str, key: str | None, timeout_s: float) -> tuple[bool, str]:
    """One request to one replica: (succeeded, what it answered)."""
    path = f"/v1/models/{urllib.parse.quote(model, safe='')}/adapters/{urllib.parse.quote(adapter, safe='')}"
    request = urllib.request.Request(f"http://{target}{path}", method=method, data=b"" if method == "PUT" else None)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read().decode(errors="replace")
            return True, f"{response.status} {body[:200]}".strip()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            body = json.loads(body)["error"]["message"]
        return False, f"{exc.code} {body}"[:300]
    except OSError as exc:
        return False, f"unreachable: {exc}"


def has_model(target: str, model: str, key: str | None) -> bool:
    request = urllib.request.Request(f"http://{target}/v1/models/{urllib.parse.quote(model, safe='')}/adapters")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10):
            return True
    except OSError:  # HTTPError included
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("load", "unload"))
    parser.add_argument("model")
    parser.add_argument("adapter")
    parser.add_argument("--host", default=os.environ.get("TSERVE_SYNC_HOST", "api"),
                        help="DNS name whose every address is a replica (default: api)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TSERVE_SYNC_PORT", "8000")))
    parser.add_argument("--targets", help="comma-separated host:port list instead of resolving --host")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    args = parser.parse_args(argv)

    key = os.environ.get("TSERVE_ADMIN_KEY")  # an admin key when the servers have keys set
    try:
        targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets else resolve(
            args.host, args.port)
    except OSError as exc:
        print(f"cannot resolve {args.host}: {exc}", file=sys.stderr)
        return 1
    if not targets:
        print("no replicas found", file=sys.stderr)
        return 1
    method = "PUT" if args.action == "load" else "DELETE"
    failed = 0
    for target in targets:
        ok, answer = call(target, method, args.model, args.adapter, key, args.timeout)
        if not ok and method == "DELETE" and answer.startswith("404 ") and has_model(target, args.model, key):
            ok, answer = True, "not known there (nothing to unload)"
        failed += not ok
        print(f"{target}: {'ok' if ok else 'FAILED'} {answer}")
    print(f"{args.action} {args.model}/{args.adapter}: {len(targets) - failed} of {len(targets)} replicas")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
