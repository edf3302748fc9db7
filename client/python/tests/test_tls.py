"""TLS through the Python client: a daemon with --tls_cert/--tls_key/--tls_client_ca serves
a Client that trusts its CA and presents a certificate signed by it, and no other."""
import subprocess

import grpc
import pytest

import kvferry

from conftest import Daemon


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-subj", "/CN=py test CA",
             "-days", "2")
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", str(d / "server.ext")]), ("client", [])):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
                 "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                 "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
                 "-out", str(d / f"{name}.pem"), *ext)
    return d


def test_mutual_tls_serves_only_the_client_with_a_certificate(pki):
    d = Daemon(f"--tls_cert={pki / 'server.pem'}", f"--tls_key={pki / 'server.key'}",
               f"--tls_client_ca={pki / 'ca.pem'}")
    try:
        ca = (pki / "ca.pem").read_bytes()
        with kvferry.Client(d.address, root_certificates=ca,
                            private_key=(pki / "client.key").read_bytes(),
                            certificate_chain=(pki / "client.pem").read_bytes()) as good:
            assert good.list_pools() == []
        for kwargs in ({"root_certificates": ca}, {}):  # no client certificate; plaintext
            with kvferry.Client(d.address, timeout=5, **kwargs) as bad:
                with pytest.raises(kvferry.Error) as info:
                    bad.list_pools()
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        d.stop()
