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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodeCluster:
    """Parameters
    ----------
    cpus_per_node : int
        Logical CPUs each node advertises (more than the machine has is fine: they are only counters).
    resources : (dict, dict)
        The custom resources of the head and of the worker node (each node stands for one site or silo).
    node_env : (dict, dict)
        Extra environment of the head's and of the worker's processes (``SITE_DATA``: where that node keeps its data).
    """

    def __init__(self, cpus_per_node: int = 4, resources: tuple[dict[str, float], dict[str, float]] = ({"silo_a": 1}, {"silo_b": 1}),
                 node_env: tuple[dict[str, str], dict[str, str]] = ({}, {})) -> None:
        self.cpus_per_node = cpus_per_node
        self.resources = resources
        self.node_env = node_env
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rfc", dir="/tmp"))  # short: Ray's socket paths have a length limit
        self.gcs_port = _free_port()
        self.dashboard_port = _free_port()
        self.metrics_ports = [_free_port(), _free_port()]
        bin_dir = str(Path(sys.executable).parent)
        # The nodes run in the environment where rayfuse is installed: this interpreter's bin first on PATH (a job's
        # `python` is this one) and this checkout on PYTHONPATH (Tune trials import actors.tune on every node).
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
                    "RAY_AUTH_MODE": "token", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.ray = str(Path(sys.executable).parent / "ray")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _node_ports(self, metrics_port: int) -> list[str]:
        base = random.randrange(20000, 30000, 500)  # below the ephemeral range the other ports come from
        return [f"--metrics-export-port={metrics_port}", f"--dashboard-agent-listen-port={_free_port()}",
                f"--dashboard-agent-grpc-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
                f"--node-manager-port={_free_port()}", f"--object-manager-port={_free_port()}",
                f"--min-worker-port={base}", f"--max-worker-port={base + 400}"]

    def start(self) -> TwoNodeCluster:
        common = ["--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus_per_node}", "--disable-usage-stats"]
        # Each node is a "silo" (custom resources, as in cluster.yaml): a config pins clients to nodes with them.
        head = [self.ray, "start", "--head", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={_free_port()}",
                f"--temp-dir={self.temp_dir}", "--include-dashboard=true", f"--resources={json.dumps(self.resources[0])}", *common,
                *self._node_ports(self.metrics_ports[0])]
        worker = [self.ray, "start", f"--address={self.address}", f"--resources={json.dumps(self.resources[1])}", *common,
                  *self._node_ports(self.metrics_ports[1])]
        try:
            for command, extra in ((head, self.node_env[0]), (worker, self.node_env[1])):
                # a node's processes (raylet, workers, actors) inherit the environment `ray start` runs in
                out = subprocess.run(command, env={**self.env, **extra}, capture_output=True, text=True, timeout=180)
                if out.returncode != 0:
                    raise RuntimeError(f"{' '.join(command[:3])} failed: {out.stderr[-2000:]}")
        except BaseException:
            self.stop()
            raise
        return self

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

    def stop(self, grace_s: float = 15.0) -> None:
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
