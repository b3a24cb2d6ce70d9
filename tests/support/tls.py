"""Real TLS files for the database URL checks: a self-signed CA, a client certificate it
signed, the client's key (plain and encrypted), a key of another pair and an empty CRL, all
PEM, made once per test directory."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

KEY_PASSWORD = "k3ypass"


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    encrypted_key: Path
    other_key: Path
    crl: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key_file(path: Path, key: ec.EllipticCurvePrivateKey, password: str | None) -> Path:
    encryption: serialization.KeySerializationEncryption = serialization.NoEncryption()
    if password is not None:
        encryption = serialization.BestAvailableEncryption(password.encode())
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    return path


def make_pki(directory: Path) -> Pki:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("kb test CA"))
        .issuer_name(_name("kb test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = (
        x509.CertificateBuilder()
        .subject_name(_name("kb"))
        .issuer_name(ca.subject)
        .public_key(client_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(ca_key, hashes.SHA256())
    )
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.subject)
        .last_update(now - datetime.timedelta(days=1))
        .next_update(now + datetime.timedelta(days=30))
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "client.pem").write_bytes(client.public_bytes(pem))
    (directory / "crl.pem").write_bytes(crl.public_bytes(pem))
    return Pki(
        ca=directory / "ca.pem",
        cert=directory / "client.pem",
        key=_key_file(directory / "client.key", client_key, None),
        encrypted_key=_key_file(directory / "client-enc.key", client_key, KEY_PASSWORD),
        other_key=_key_file(directory / "other.key", ec.generate_private_key(ec.SECP256R1()), None),
        crl=directory / "crl.pem",
    )
