"""A per-cluster CA and one certificate per node, for runs with ``tls: true`` (`wiiide.wire.tls`).

Made fresh for every run with `cryptography` (harness side only: the nodes read PEM with the standard
library's `ssl`) into the run's folder, one sub-folder per node holding exactly what that node needs::

    <run>/tls/<node>/ca.crt     the cluster's CA certificate (PEM)
    <run>/tls/<node>/node.crt   the node's certificate, signed by the CA, subjectAltName = its names
    <run>/tls/<node>/node.key   the node's private key (PEM, unencrypted, mode 0600)

The CA's private key is never written: it signs the node certificates in memory and is dropped, so
no certificate can be added to the cluster afterwards. A container mounts only its own sub-folder
(`harness.run.compose_project.cluster_up`), so no node can read another node's key. Nothing is written outside the run.

Keys: ECDSA P-256 (fast to make, about 1 ms each; TLS 1.3's mandatory-to-implement signature,
RFC 8446 section 9.1). Validity: one day before now (clock skew between hosts) to 30 days after.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from harness.errors import HarnessError
from wiiide.config import ENV_PREFIX

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "node.crt", "node.key"
VALID_BEFORE_S = 24 * 3600  # not-before lies this far in the past: hosts' clocks may differ
VALID_FOR_DAYS = 30


@dataclass(frozen=True)
class NodeTLS:
    """One node's three PEM files (absolute paths on the host)."""

    folder: Path

    @property
    def ca_file(self) -> Path:
        """The cluster's CA certificate."""
        return self.folder / CA_FILE

    @property
    def cert_file(self) -> Path:
        """The node's certificate."""
        return self.folder / CERT_FILE

    @property
    def key_file(self) -> Path:
        """The node's private key (0600)."""
        return self.folder / KEY_FILE

    def env(self) -> dict[str, str]:
        """These files as a node's ``WIIIIIDE_TLS_*_FILE`` environment variables."""
        return {ENV_PREFIX + k.upper(): v for k, v in config_fields(str(self.folder)).items()}


def config_fields(folder: str) -> dict[str, str]:
    """``tls_ca_file``/``tls_cert_file``/``tls_key_file`` for a `RunConfig`: a node's three files in
    `folder` (its own folder on the host, or where a container mounts it)."""
    base = folder.rstrip("/")
    return {"tls_ca_file": f"{base}/{CA_FILE}", "tls_cert_file": f"{base}/{CERT_FILE}",
            "tls_key_file": f"{base}/{KEY_FILE}"}


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)  # the umask may have narrowed it; a key is never wider than 0600


def write_cluster_tls(folder: Path, nodes: Mapping[str, Sequence[str]], cluster: str = "wiiide") -> dict[str, NodeTLS]:
    """Make a CA and a certificate per node; write them under `folder`, one sub-folder per node.

    Args:
        folder: where (created; e.g. ``<run>/tls``). Folders are 0700, keys 0600, certificates 0644.
        nodes: node name -> the names its certificate carries as subjectAltName (DNS names or IP
            addresses: what peers dial to reach it). The node name is the certificate's CN.
        cluster: the CA's common name (``<cluster> cluster CA``).

    Returns:
        node name -> its `NodeTLS` (absolute paths).

    Raises:
        HarnessError: a node name is not a plain name (it becomes a folder) or has no SAN, or the
            files cannot be written.
    """
    now = dt.datetime.now(dt.timezone.utc)
    not_before, not_after = now - dt.timedelta(seconds=VALID_BEFORE_S), now + dt.timedelta(days=VALID_FOR_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{cluster} cluster CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    out: dict[str, NodeTLS] = {}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        for name, sans in nodes.items():
            if not name or "/" in name or name in (".", "..") or not sans:
                raise HarnessError(f"tls: node {name!r}: a node needs a plain name (no '/') and at least one "
                                   f"subjectAltName; got {list(sans)}")
            key = ec.generate_private_key(ec.SECP256R1())
            cert = (x509.CertificateBuilder()
                    .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                    .issuer_name(ca_name).public_key(key.public_key())
                    .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
                    .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                    .add_extension(x509.SubjectAlternativeName([_san(s) for s in dict.fromkeys(sans)]), critical=False)
                    .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                          ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                    .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                   critical=False)
                    .sign(ca_key, hashes.SHA256()))
            node = NodeTLS((folder / name).resolve())
            node.folder.mkdir(exist_ok=True)
            os.chmod(node.folder, 0o700)
            _write(node.ca_file, ca_pem, 0o644)
            _write(node.cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
            _write(node.key_file, _pem_key(key), 0o600)
            out[name] = node
    except OSError as exc:
        raise HarnessError(f"tls: cannot write the cluster's certificates under {folder}: {exc}") from None
    return out
