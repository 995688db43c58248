"""Fleet-only TLS gateway: the one port a deployment opens to its sites.

Why: Flower 1.42's ``flower-superlink`` serves its Control API (``flwr`` CLI: register SuperNodes, start,
list and stop runs), its Runtime API (the ServerApp executor) and its Fleet API (SuperNodes) on ONE HTTPS
port (``--host``/``--port``; ``--control-api-address`` and ``--fleet-api-address`` are deprecated and only
configure legacy gRPC servers behind internal switches), and without Flower Enterprise (OIDC,
``FLWR_OIDC_ENABLED``) the Control API has no user authentication: anyone who can reach that port and holds
the public ``ca.crt`` can register a SuperNode key and list runs. So the SuperLink listens on the operator's
host only (127.0.0.1) and sites reach this gateway instead, which terminates TLS with the SuperLink's
certificate and forwards only ``POST /v1/fleet/<endpoint>`` (the SuperNode's calls, each still checked by
the SuperLink's node authentication) and ``GET /health``; every other path, method or malformed name gets
404 here and never reaches the SuperLink.

Run: ``python -m dpdro.launch.fleet_gateway --listen 0.0.0.0:9092 --superlink 127.0.0.1:8000
--ssl-certfile server.pem --ssl-keyfile server.key --root-certificates ca.crt`` (``dpdro deploy`` starts it;
``compose.yaml`` runs it as the ``fleet-gateway`` service). Built on uvicorn, Starlette and httpx (Flower's
own HTTP stack).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import ssl
import sys

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

# Exact shape of a Fleet endpoint: no dots, slashes or escapes, so no path trick (``/v1/fleet/../control/...``,
# ``%2e%2e``) can name another API once the upstream client normalises the URL.
FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z-]{0,63}")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length"}


def allowed(method: str, raw_path: str, query: bytes = b"") -> bool:
    """True for the only requests a site may make: ``POST /v1/fleet/<endpoint>`` and ``GET /health``
    (``raw_path`` as sent, before any decoding), without a query string."""
    if query:
        return False
    if method == "POST":
        return FLEET_PATH.fullmatch(raw_path) is not None
    return method == "GET" and raw_path == "/health"


def create_app(superlink: str, root_certificates: str | None, timeout: float = 600.0,
               transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The gateway's ASGI app, forwarding allowed requests to ``https://<superlink>`` (verified with
    ``root_certificates``; None: plain HTTP, for tests only).

    Args:
        superlink: the SuperLink's host:port as the gateway reaches it (e.g. 127.0.0.1:8000).
        root_certificates: CA file that signed the SuperLink's certificate.
        timeout: seconds allowed per forwarded call (a SuperNode's pull can wait long).
        transport: httpx transport to the SuperLink (tests pass a mock; None: the network).
    """
    if root_certificates is None:
        base, verify = f"http://{superlink}", False
    else:
        base, verify = f"https://{superlink}", ssl.create_default_context(cafile=root_certificates)
    client = httpx.AsyncClient(base_url=base, verify=verify, timeout=httpx.Timeout(timeout, connect=10.0),
                               transport=transport)

    async def forward(request: Request) -> Response:
        raw_path = request.scope.get("raw_path", b"").decode("latin-1")
        if not allowed(request.method, raw_path, request.scope.get("query_string", b"")):
            return JSONResponse({"detail": "not available on the site-facing Fleet port; the Control API is "
                                           "reachable from the operator's host only"}, status_code=404)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        upstream = client.build_request(request.method, raw_path, headers=headers, content=await request.body())
        try:  # Fleet calls are unary: read the whole reply (decoded, hence no content-encoding passed on)
            resp = await client.send(upstream)
        except httpx.HTTPError as e:
            return JSONResponse({"detail": f"SuperLink unreachable from the gateway: {type(e).__name__}"},
                                status_code=502)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP | {"content-encoding"}}
        return Response(resp.content, status_code=resp.status_code, headers=out_headers)

    @contextlib.asynccontextmanager
    async def lifespan(app):  # noqa: ARG001 - Starlette's lifespan signature
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def _host_port(text: str, name: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"fleet_gateway: {name} must be HOST:PORT with PORT in 1..65535, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> None:
    """Command line (see the module docstring); serves until SIGTERM/SIGINT."""
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m dpdro.launch.fleet_gateway", description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT the sites connect to (e.g. 0.0.0.0:9092)")
    p.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink (operator-only address)")
    p.add_argument("--ssl-certfile", required=True, help="TLS certificate presented to the sites (server.pem)")
    p.add_argument("--ssl-keyfile", required=True, help="its private key (server.key)")
    p.add_argument("--root-certificates", required=True, help="CA that signed the SuperLink's certificate")
    a = p.parse_args(argv)
    host, port = _host_port(a.listen, "--listen")
    _host_port(a.superlink, "--superlink")
    app = create_app(a.superlink, a.root_certificates)
    print(f"Fleet gateway on https://{a.listen} -> https://{a.superlink} (POST /v1/fleet/* and GET /health only)",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, ssl_certfile=a.ssl_certfile, ssl_keyfile=a.ssl_keyfile,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
