"""Certificates and keys for a Flower deployment, made with ``cryptography`` (no openssl).

What it writes into one folder (docs/explanation/FLOWER.md 3.5, 3.6):

    ca.crt, ca.key               a self-signed EC P-384 certificate authority (BasicConstraints ca=True)
    server.pem, server.key       the SuperLink's TLS certificate, signed by the CA, with subject alternative
                                 names for every host name / IP address the SuperLink is reached at
                                 (default: localhost, 127.0.0.1, superlink; add yours with ``hosts``)
    <node>, <node>.pub           one SuperNode authentication key pair per node: EC P-384, private key in
                                 OpenSSH format, public key as an ``ecdsa-sha2-nistp384 ...`` line (the form
                                 ``flwr supernode register`` and ``flower-supernode
                                 --auth-supernode-private-key`` read)

Private keys are created with mode 0600 (opened with O_EXCL, so an existing file is never replaced by a
race), certificates and public keys with 0644. An existing key is never overwritten silently: without
``force=True`` the call raises ``CertificateExistsError`` naming the file; an existing complete set can be
reused with ``reuse=True`` (the loopback deployment does that).

Only the SuperLink has a TLS certificate; SuperNodes verify it with ca.crt (server-side TLS, not mTLS) and
prove who they are with their authentication key, registered at the SuperLink with
``flwr supernode register <node>.pub <connection>``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..common.errors import DpdroError

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "superlink")
CA_DAYS = 3650
SERVER_DAYS = 825


class CertificateExistsError(FileExistsError, DpdroError):
    """A key or certificate already exists and would be overwritten; the message names it and the fix."""


@dataclass(frozen=True)
class CertSet:
    """Paths of a complete set (all absolute)."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: dict[str, tuple[Path, Path]]  # node name -> (private key, public key)


def _paths(out_dir: Path, nodes: Sequence[str]) -> CertSet:
    out_dir = out_dir.resolve()
    return CertSet(out_dir / "ca.crt", out_dir / "ca.key", out_dir / "server.pem", out_dir / "server.key",
                   {n: (out_dir / n, out_dir / f"{n}.pub") for n in nodes})


def _all_files(cs: CertSet) -> list[Path]:
    files = [cs.ca_cert, cs.ca_key, cs.server_cert, cs.server_key]
    for priv, pub in cs.node_keys.values():
        files += [priv, pub]
    return files


def _write(path: Path, data: bytes, mode: int, force: bool) -> None:
    """Write ``data`` to ``path`` with permission ``mode``; refuse to replace a file unless ``force``."""
    if path.exists() and not force:
        raise CertificateExistsError(f"{path} already exists; refusing to overwrite it. Use another folder, "
                                     f"delete the file yourself, or pass --force to replace every file.")
    if force:
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)  # the umask may have removed bits of a public file


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):  # keep order, drop duplicates
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_ca(common_name: str = "dpdro deployment CA", days: int = CA_DAYS
            ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA key and certificate valid for ``days`` days."""
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA384()))
    return key, cert


def make_server_cert(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, hosts: Sequence[str],
                     days: int = SERVER_DAYS) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A TLS server key and certificate signed by the CA, with SANs ``hosts`` (DNS names or IP addresses;
    the first one is also the common name). Raises ValueError if ``hosts`` is empty."""
    if not hosts:
        raise ValueError("the SuperLink certificate needs at least one host name or IP address (--host)")
    key = _new_key()
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA384()))
    return key, cert


def node_key_pair() -> tuple[bytes, bytes]:
    """(private key in OpenSSH format, public key line 'ecdsa-sha2-nistp384 ...') of a new P-384 key."""
    key = _new_key()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return priv, pub + b"\n"


def create_certificates(out_dir: str | os.PathLike, nodes: Sequence[str] = ("supernode-1", "supernode-2"),
                        hosts: Sequence[str] = DEFAULT_HOSTS, *, force: bool = False, reuse: bool = False
                        ) -> CertSet:
    """Create the CA, the SuperLink certificate and one authentication key pair per node in ``out_dir``.

    Args:
        out_dir: folder (created with mode 0700 if missing).
        nodes: node names; each gives files ``<name>`` (private) and ``<name>.pub``.
        hosts: SANs of the SuperLink certificate (DNS names or IPs).
        force: replace existing files (all of them: a new CA invalidates the old server certificate).
        reuse: if every file already exists, return them untouched instead of failing.
    Returns the CertSet. Raises CertificateExistsError if a file exists (and neither force nor reuse applies),
    ValueError for a bad node name or empty hosts.
    """
    for n in nodes:
        if not n or "/" in n or n.startswith(".") or n in ("ca", "server"):
            raise ValueError(f"bad node name {n!r}: use a plain file name such as supernode-1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    cs = _paths(out, nodes)
    existing = [p for p in _all_files(cs) if p.exists()]
    if reuse and len(existing) == len(_all_files(cs)):
        return cs
    if existing and not force:
        raise CertificateExistsError(
            f"{', '.join(str(p) for p in existing)} already exist(s) in {out}; refusing to overwrite keys. "
            f"Use another folder, or --force to replace every file (nodes must then be registered again).")
    ca_key, ca_cert = make_ca()
    srv_key, srv_cert = make_server_cert(ca_key, ca_cert, list(hosts))
    _write(cs.ca_key, _pem_key(ca_key), 0o600, force)
    _write(cs.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    _write(cs.server_key, _pem_key(srv_key), 0o600, force)
    _write(cs.server_cert, srv_cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    for priv_path, pub_path in cs.node_keys.values():
        priv, pub = node_key_pair()
        _write(priv_path, priv, 0o600, force)
        _write(pub_path, pub, 0o644, force)
    return cs


def add_node_key(out_dir: str | os.PathLike, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Create one more node key pair ``<name>``/``<name>.pub`` in ``out_dir`` (for adding a site later).
    Raises CertificateExistsError if it exists and not ``force``."""
    if not name or "/" in name or name.startswith(".") or name in ("ca", "server"):
        raise ValueError(f"bad node name {name!r}: use a plain file name such as supernode-3")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    priv, pub = node_key_pair()
    _write(out / name, priv, 0o600, force)
    _write(out / f"{name}.pub", pub, 0o644, force)
    return out / name, out / f"{name}.pub"
