"""Throwaway certificate authorities and service certificates for the TLS tests (cryptography)."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# What every test server certificate carries besides its identity, so clients can dial loopback.
LOOPBACK_SANS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Issued:
    cert_path: Path
    key_path: Path
    ca_path: Path

    def env(self) -> dict[str, str]:
        """The SPINDLE_TLS_* variables of a service that uses this certificate."""
        return {"SPINDLE_TLS_CERT": str(self.cert_path), "SPINDLE_TLS_KEY": str(self.key_path),
                "SPINDLE_TLS_CA": str(self.ca_path)}

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate, key, CA) as bytes, the arguments of grpc.ssl_channel_credentials."""
        return self.cert_path.read_bytes(), self.key_path.read_bytes(), self.ca_path.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


class CertificateAuthority:
    """A self-signed CA in `folder` (ca.crt) that issues certificates to named services."""

    def __init__(self, folder: Path, name: str = "spindle-test-ca"):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_path = folder / "ca.crt"
        self.ca_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, identity: str, sans: tuple[str, ...] = LOOPBACK_SANS, folder: Path | None = None) -> Issued:
        """A certificate with subject CN `identity` and SANs `identity` plus `sans` (DNS names or IP
        addresses), valid for both server and client authentication, in `folder` (tls.crt, tls.key,
        ca.crt: the keys of a cert-manager Secret)."""
        folder = folder or self.folder / identity
        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        alt_names: list[x509.GeneralName] = []
        for san in (identity, *sans):
            try:
                alt_names.append(x509.IPAddress(ipaddress.ip_address(san)))
            except ValueError:
                alt_names.append(x509.DNSName(san))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder().subject_name(_name(identity)).issuer_name(self._cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        issued = Issued(folder / "tls.crt", folder / "tls.key", folder / "ca.crt")
        issued.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, issued.key_path)
        issued.ca_path.write_bytes(self.ca_path.read_bytes())
        return issued
