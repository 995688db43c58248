"""``dpdro certs``: TLS certificates and SuperNode authentication keys for a deployment (no openssl)."""

from __future__ import annotations

import argparse
import sys

NAME = "certs"
HELP = "create TLS certificates and SuperNode authentication keys (no openssl)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    csub = p.add_subparsers(dest="certs_command", required=True)
    c = csub.add_parser("create", help="CA, SuperLink certificate and one key pair per SuperNode")
    c.add_argument("--out", required=True, help="folder for the files (created 0700)")
    c.add_argument("--nodes", type=int, default=2, help="number of SuperNode key pairs supernode-1..N")
    c.add_argument("--node", action="append", help="SuperNode key name (repeatable; overrides --nodes)")
    c.add_argument("--host", action="append", default=None,
                   help="SAN of the SuperLink certificate, DNS name or IP (repeatable; default localhost, "
                        "127.0.0.1, superlink)")
    c.add_argument("--force", action="store_true", help="replace existing files (re-register the nodes)")
    c = csub.add_parser("add-node", help="one more SuperNode key pair NAME / NAME.pub")
    c.add_argument("--out", required=True)
    c.add_argument("name")
    c.add_argument("--force", action="store_true")


def run(args: argparse.Namespace) -> int:
    from dpdro.launch.certs import add_node_key, create_certificates

    try:
        if args.certs_command == "add-node":
            priv, pub = add_node_key(args.out, args.name, force=args.force)
            print(f"wrote {priv} (private, 0600) and {pub}; register it at the SuperLink with\n"
                  f"    flwr supernode register {pub} <connection>")
            return 0
        nodes = args.node or [f"supernode-{i + 1}" for i in range(args.nodes)]
        hosts = args.host or ["localhost", "127.0.0.1", "superlink"]
        cs = create_certificates(args.out, nodes, hosts, force=args.force)
    except ValueError as e:  # a bad host or node name (CertificateExistsError is a DpdroError: main's line)
        print(f"dpdro: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote CA {cs.ca_cert}, SuperLink certificate {cs.server_cert} (SANs: {', '.join(hosts)}), "
          f"private keys with mode 0600, and node keys: {', '.join(str(pub) for _, pub in cs.node_keys.values())}")
    return 0
