"""A real two-node Ray cluster on this machine: ``ray start --head`` plus ``ray start --address`` (a worker node).

Both nodes use free non-default ports and their own ``--temp-dir``, so they neither collide with nor redirect any
other Ray on the machine (``ray.init()`` elsewhere still finds its own cluster). :meth:`TwoNodeCluster.stop` ends
exactly the processes of this cluster (found by its temp dir in their command lines), never ``ray stop``.

Run by hand (``python -m tests.integration.two_node``) it starts a cluster, prints its addresses and waits for
Ctrl-C.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux: ``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def poll(check, what: str, *, timeout: float, every: float = 2.0):
    """``check()``'s first truthy value, asked every ``every`` s; an AssertionError after ``timeout`` s (an upper
    bound for waiting on the cluster, not a performance assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(every)


class _Ports:
    """Distinct free ports for one cluster, all below the kernel's ephemeral range.

    A port taken from the ephemeral range (binding port 0 and closing) can be handed to another process as the local
    end of an outgoing connection before the node binds it, and starting a head opens many such connections. Ports
    below that range are only ever taken by an explicit bind, which :func:`_bindable` checks just before.
    """

    WORKER_BLOCK = 400  # worker ports per node
    LOW = 20000  # above the worker ports a default ``ray.init()`` uses (10002-19999)

    def __init__(self) -> None:
        self.high = max(_ephemeral_low(), self.LOW + 4000)
        self.taken: set[int] = set()
        self.rng = random.Random()

    def one(self) -> int:
        for _ in range(1000):
            port = self.rng.randrange(self.LOW, self.high)
            if port not in self.taken and _bindable(port):
                self.taken.add(port)
                return port
        raise RuntimeError(f"no free port in [{self.LOW}, {self.high})")

    def block(self) -> tuple[int, int]:
        """``(low, high)``: a run of :attr:`WORKER_BLOCK` ports overlapping none handed out before (a node's workers)."""
        for _ in range(1000):
            base = self.rng.randrange(self.LOW, self.high - self.WORKER_BLOCK)
            span = set(range(base, base + self.WORKER_BLOCK + 1))
            if not span & self.taken:
                self.taken |= span
                return base, base + self.WORKER_BLOCK
        raise RuntimeError(f"no free block of {self.WORKER_BLOCK} ports in [{self.LOW}, {self.high})")


def node_addresses() -> list[str]:
    """The IPv4 addresses a node of this machine may be reached at: loopback, and the address of the default route
    (the one Ray's processes advertise to each other even with ``--node-ip-address=127.0.0.1``)."""
    found = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent: connect only picks the route's source address
            found.append(s.getsockname()[0])
        except OSError:
            pass
    return sorted(set(found))


def make_tls_files(folder: Path, addresses: list[str]) -> dict[str, str]:
    """A certificate authority and one node certificate it signs (for every node: Ray's TLS is mutual, each process
    presents it), valid for ``addresses``, as the recipe in docs/security.md makes them with openssl; returns Ray's
    TLS environment (``RAY_USE_TLS`` and the three files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, node_key = key(), key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rayfuse-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses] + [x509.DNSName("localhost")]
    node = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, addresses[0])]))
        .issuer_name(ca_name)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    files = {"ca.crt": ca.public_bytes(serialization.Encoding.PEM), "node.crt": node.public_bytes(serialization.Encoding.PEM)}
    files["node.key"] = node_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "node.key").chmod(0o600)
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(folder / "node.crt"),
        "RAY_TLS_SERVER_KEY": str(folder / "node.key"),
        "RAY_TLS_CA_CERT": str(folder / "ca.crt"),
    }


class TwoNodeCluster:
    """Parameters
    ----------
    cpus_per_node : int
        Logical CPUs each node advertises (more than the machine has is fine: they are only counters).
    resources : (dict, dict)
        The custom resources of the head and of the worker node (each node stands for one site or silo).
    node_env : (dict, dict)
        Extra environment of the head's and of the worker's processes (``SITE_DATA``: where that node keeps its data).
    secured : bool
        Token authentication and TLS on both nodes (docs/security.md's recipe): a token of this cluster's own
        (``RAY_AUTH_TOKEN``, not the machine's ``~/.ray/auth_token``) and certificates made for it
        (:func:`make_tls_files`); :attr:`env`, what its commands run with, holds both, as a member's shell would.
    """

    def __init__(
        self,
        cpus_per_node: int = 4,
        resources: tuple[dict[str, float], dict[str, float]] = ({"silo_a": 1}, {"silo_b": 1}),
        node_env: tuple[dict[str, str], dict[str, str]] = ({}, {}),
        secured: bool = False,
    ) -> None:
        self.cpus_per_node = cpus_per_node
        self.resources = resources
        self.node_env = node_env
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rfc", dir="/tmp"))  # short: Ray's socket paths have a length limit
        self.ports = _Ports()
        self.gcs_port = self.ports.one()
        self.dashboard_port = self.ports.one()
        self.metrics_ports = [self.ports.one(), self.ports.one()]
        bin_dir = str(Path(sys.executable).parent)
        # The nodes run in the environment where rayfuse is installed: this interpreter's bin first on PATH (a job's
        # `python` is this one) and this checkout on PYTHONPATH (Tune trials import actors.tune on every node).
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
            "RAY_AUTH_MODE": "token",
            "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.secured = secured
        if secured:
            import secrets

            self.env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
            self.env.update(make_tls_files(self.temp_dir / "tls", node_addresses()))
        self.ray = str(Path(sys.executable).parent / "ray")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _node_ports(self, metrics_port: int) -> list[str]:
        low, high = self.ports.block()
        return [
            f"--metrics-export-port={metrics_port}",
            f"--dashboard-agent-listen-port={self.ports.one()}",
            f"--dashboard-agent-grpc-port={self.ports.one()}",
            f"--runtime-env-agent-port={self.ports.one()}",
            f"--node-manager-port={self.ports.one()}",
            f"--object-manager-port={self.ports.one()}",
            f"--min-worker-port={low}",
            f"--max-worker-port={high}",
        ]

    def start(self) -> TwoNodeCluster:
        common = ["--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus_per_node}", "--disable-usage-stats"]
        # Each node is a "silo" (custom resources, as in cluster.yaml): a config pins clients to nodes with them.
        head = [
            self.ray,
            "start",
            "--head",
            f"--port={self.gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={self.ports.one()}",
            f"--temp-dir={self.temp_dir}",
            "--include-dashboard=true",
            f"--resources={json.dumps(self.resources[0])}",
            *common,
            *self._node_ports(self.metrics_ports[0]),
        ]
        worker = [
            self.ray,
            "start",
            f"--address={self.address}",
            f"--resources={json.dumps(self.resources[1])}",
            *common,
            *self._node_ports(self.metrics_ports[1]),
        ]
        try:
            for command, extra in ((head, self.node_env[0]), (worker, self.node_env[1])):
                # a node's processes (raylet, workers, actors) inherit the environment `ray start` runs in
                out = subprocess.run(command, env={**self.env, **extra}, capture_output=True, text=True, timeout=180)
                if out.returncode != 0:
                    raise RuntimeError(f"{' '.join(command[:3])} failed: {out.stderr[-2000:]}")
            self._wait_for_nodes(2)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_nodes(self, count: int, timeout_s: float = 60.0) -> None:
        """Return once ``count`` nodes are alive; raise, with what the cluster reports, if they are not in time.

        ``ray start`` returns before every process of its node is up: a node whose agent then dies never joins, and a
        test would otherwise find out only as a job waiting, unplaced, for that node's resource.
        """

        def alive() -> bool:
            out = self.run(
                "ray", "list", "nodes", "--address", self.dashboard_url, "--format", "json", "--filter", "state=ALIVE", timeout=60
            )
            try:
                return out.returncode == 0 and len(json.loads(out.stdout)) >= count
            except json.JSONDecodeError:
                return False

        try:
            poll(alive, f"{count} nodes alive", timeout=timeout_s, every=1.0)
        except AssertionError as e:
            raise RuntimeError(f"{e}\n{self.diagnostics()}") from None

    def diagnostics(self, tail: int = 2000) -> str:
        """What to read when the cluster misbehaves: ``ray status`` (nodes, resources, pending demands) and the last
        lines of each node's raylet and agent logs."""
        status = self.run("ray", "status", "--address", self.address, timeout=60)
        parts = [f"$ ray status\n{(status.stdout + status.stderr)[-tail:]}"]
        for pattern in ("raylet*.out", "raylet*.err", "runtime_env_agent*", "dashboard_agent*"):
            for log in sorted((self.temp_dir / "session_latest" / "logs").glob(pattern)):
                lines = [line for line in log.read_text(errors="replace").splitlines() if "[state-dump]" not in line]
                text = "\n".join(lines).strip()  # without the raylet's periodic state dumps
                if text:
                    parts.append(f"--- {log.name}\n{text[-tail:]}")
        return "\n".join(parts)

    def pids(self) -> list[int]:
        """The processes of this cluster: every process whose command line names its temp dir."""
        marker = str(self.temp_dir).encode()
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if marker in (proc / "cmdline").read_bytes():
                        found.append(int(proc.name))
                except OSError:
                    continue
        return [pid for pid in found if pid != os.getpid()]

    def stop(self, grace_s: float = 5.0) -> None:
        # SIGTERM, then SIGKILL for what is still up after grace_s: the processes that end on SIGTERM do so within a
        # second, while the GCS server, both raylets and one Python process were still up 20 s after it (measured on
        # Ray 2.60), so a longer grace only adds its length to every cluster's teardown.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.5)
            if not self.pids():
                break
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def run(self, *args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        """A command in the cluster's environment (``ray job submit ...``, ``python -m rayfuse ...``)."""
        return subprocess.run(list(args), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the cluster too
    cluster = TwoNodeCluster().start()
    print(f"GCS {cluster.address}  dashboard {cluster.dashboard_url}  metrics {cluster.metrics_ports}  temp {cluster.temp_dir}", flush=True)
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        cluster.stop()
