"""What a local Ray started by rayfuse listens on: every listening socket of its processes, on loopback only.

The run happens in a subprocess (its own ``RAY_TMPDIR``, no ``RAY_ADDRESS``) because the session's Ray (the
``ray_session`` fixture) is started by the test process itself, not by rayfuse: the subprocess is a plain
``rayfuse`` driver that starts its own local Ray through ``RayBackend`` with the default ``federation.ray_init``
(dashboard included), runs a tiny federation and, while the method runs, lists the listening TCP sockets of its
process tree from ``/proc/net/tcp{,6}``. docs/security.md states the result.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 300  # an upper bound for the subprocess, not a performance assertion


def parse_address(hex_address: str) -> str:
    """``/proc/net/tcp{,6}``'s hexadecimal local address (each 32-bit word in host byte order) as text."""
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    raw = b"".join(words)
    return str(ipaddress.ip_address(raw))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def process_tree(root: int) -> dict[int, str]:
    """``root`` and its descendants, each with its command name (``/proc/<pid>/comm``)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            names[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return {pid: names.get(pid, "?") for pid in sorted(tree)}


def listening_sockets(pids: dict[int, str]) -> list[dict[str, object]]:
    """The listening TCP sockets owned by ``pids``: address, port, pid and process name."""
    listening: dict[int, tuple[str, int]] = {}  # socket inode -> (address, port)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                address, port = fields[1].split(":")
                listening[int(fields[9])] = (parse_address(address), int(port, 16))
    found = []
    for pid, name in pids.items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in listening:
                address, port = listening[int(link[8:-1])]
                found.append({"address": address, "port": port, "pid": pid, "process": name})
    return sorted(found, key=lambda s: (str(s["process"]), int(s["port"])))  # type: ignore[call-overload]


def probe_a_local_run(out: Path) -> None:
    """Run a tiny federation on a local Ray that rayfuse starts; print the listening sockets seen while it ran."""
    from actors.backend import RayBackend
    from rayfuse.config import validate_config
    from rayfuse.report import Printer
    from rayfuse.runner import run_experiment

    class Snapshot(Printer):
        def __init__(self) -> None:
            super().__init__(enabled=False)
            self.sockets: list[dict[str, object]] = []

        def __call__(self, event):
            if event.get("kind") == "method_start" and not self.sockets:
                self.sockets = listening_sockets(process_tree(os.getpid()))

    cfg = validate_config(
        {
            "run": {"name": "exposure", "seed": 0, "storage": str(out)},
            "data": {"dataset": "digits"},
            "partition": {"method": "iid", "num_clients": 2},
            "model": {"name": "mlp", "hidden": [8]},
            "train": {"epochs": 1},
            "federation": {"backend": "ray", "ray_init": {"num_cpus": 2}},
            "methods": {"fedavg": {"rounds": 1, "local_epochs": 1}},
        }
    )
    snapshot = Snapshot()
    results = run_experiment(cfg, RayBackend(), out / "run", printer=snapshot, show_tables=False)
    print(json.dumps({"status": results["status"], "sockets": snapshot.sockets}))


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_a_local_run_listens_on_loopback_only(tmp_path):
    short = Path(tempfile.mkdtemp(prefix="rf", dir="/tmp"))  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_TMPDIR": str(short), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)  # a new local Ray, never one already running on this machine
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration.test_exposure", str(tmp_path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "succeeded"
    sockets = report["sockets"]
    processes = {s["process"] for s in sockets}
    assert {"gcs_server", "raylet"} <= processes, sockets  # the snapshot saw Ray's processes
    exposed = [s for s in sockets if not is_loopback(s["address"])]
    assert not exposed, f"listening beyond loopback: {exposed}"


if __name__ == "__main__":
    probe_a_local_run(Path(sys.argv[1]))
