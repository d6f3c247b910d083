"""A cluster that admits only its members (docs/security.md's recipe): two nodes over loopback with token
authentication and TLS (certificates made for the cluster, a token of its own). A member connects and runs; a process
with the certificates but another token is refused by the GCS, one without the cluster's certificate completes no TLS
handshake, and the job API refuses a submission with another token.

Marked slow (a cluster of its own and Ray's connection retries: about 40 s of a 2-core machine, which the suite's
20-minute budget does not hold today); ``RAYFUSE_SLOW=1`` runs it. Its fast twin, in every suite, checks the
certificates the recipe makes (:func:`test_the_recipes_certificates_name_every_address_a_node_is_reached_at`).
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys

import pytest

from tests.integration.two_node import TwoNodeCluster, make_tls_files, node_addresses

WAIT_S = 300  # an upper bound for waiting on the cluster, not a performance assertion


def test_the_recipes_certificates_name_every_address_a_node_is_reached_at(tmp_path):
    from cryptography import x509

    env = make_tls_files(tmp_path, node_addresses())
    assert env["RAY_USE_TLS"] == "1" and {k for k in env if k.startswith("RAY_TLS_")} == {
        "RAY_TLS_SERVER_CERT",
        "RAY_TLS_SERVER_KEY",
        "RAY_TLS_CA_CERT",
    }
    node = x509.load_pem_x509_certificate(open(env["RAY_TLS_SERVER_CERT"], "rb").read())
    ca = x509.load_pem_x509_certificate(open(env["RAY_TLS_CA_CERT"], "rb").read())
    node.verify_directly_issued_by(ca)
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == set(node_addresses()) >= {"127.0.0.1"}
    assert (tmp_path / "node.key").stat().st_mode & 0o077 == 0  # the key readable by its owner only


@pytest.mark.ray
@pytest.mark.slow
def test_a_process_without_the_clusters_token_or_certificates_is_refused():
    cluster = TwoNodeCluster(cpus_per_node=1, resources=({}, {}), secured=True).start()
    try:
        _check_refusals(cluster)
    finally:
        cluster.stop()


def _check_refusals(cluster: TwoNodeCluster) -> None:
    """A member (the token and the certificates) connects; a process with the certificates but another token is refused
    by the GCS, one without TLS cannot even complete a handshake, and the job API refuses a submission with another
    token (the dashboard's HTTP API checks the token; TLS covers Ray's gRPC ports)."""
    code = f"import ray; ray.init(address={cluster.address!r}); print('CPU', ray.cluster_resources().get('CPU')); ray.shutdown()"

    def connect(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=WAIT_S)

    member = connect(cluster.env)
    assert member.returncode == 0 and "CPU 2.0" in member.stdout, (member.stdout + member.stderr)[-2000:]
    other_token = connect({**cluster.env, "RAY_AUTH_TOKEN": "0" * 64})  # the GCS refuses it (after Ray's retries)
    assert other_token.returncode != 0 and "CPU" not in other_token.stdout and "ConnectionError" in other_token.stderr

    # without TLS: the GCS port completes no handshake for a client that presents no certificate of the cluster's CA
    host, port = cluster.address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=cluster.env["RAY_TLS_CA_CERT"])  # trusts the cluster, presents nothing
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if not tls.recv(1):  # the server ends a client without a certificate (mutual TLS): an alert, or a close
                    raise ConnectionError("closed by the server")

    # the job API: a submission with another token is refused before anything runs
    out = subprocess.run(
        ["ray", "job", "submit", "--address", cluster.dashboard_url, "--", "python", "-c", "print('ran')"],
        env={**cluster.env, "RAY_AUTH_TOKEN": "0" * 64},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "ran" not in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
