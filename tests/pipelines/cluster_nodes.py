"""A Ray cluster of several nodes on one host, for the multi-node tests.

Each node is a `ray start --block` process of its own, in its own session: own ports (every port Ray
would otherwise take by default is a free one, so the node coexists with other Ray instances on the
host), its own logical CPUs and a custom resource `drelay_node_<name>` that names it, so placement can
be read back from Ray's node table. Each node has a temp dir of its own, under one short folder per
cluster (Ray's socket paths have a length limit): nodes that share one share its session folder, and
one node's runtime-env agent then deletes the `working_dir` another node's job runs in. Token auth is on with a token
of the cluster's own (`RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN`), passed to every process that talks to
it, so nothing is read from or written to `~/.ray`. Nodes end by the pids they own: the `ray start`
process, its process group and every descendant (raylet, agents, workers) — never `ray stop`, which
stops every Ray instance of the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

RAY = Path(sys.executable).with_name("ray")
AGENT_PORT_FLAGS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
                    "runtime-env-agent-port", "node-manager-port", "object-manager-port")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resource_name(node: str) -> str:
    return f"drelay_node_{node}"


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    log: Path
    temp: Path

    def failed(self) -> bool:
        """`ray start` exited, or the raylet aborted (it waits a fixed 15 s for its dashboard agent, a
        Python process, to report its ports: too short on a loaded host)."""
        return self.proc.poll() is not None or any(
            "Check failed" in f.read_text(errors="replace") for f in self.temp.glob("session_*/logs/raylet.out")
        )

    def pids(self) -> set[int]:
        """The `ray start` process, every descendant, and whatever else runs in its process group (the
        group outlives `ray start`: its raylet and agents stay in it). A reaped `ray start`'s pid is never
        used: it may belong to another process by now."""
        found = set()
        if self.proc.poll() is None:
            found.add(self.proc.pid)
            try:
                found |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.proc.pid:
                    found.add(p.pid)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return found

    def kill(self, timeout_s: float = 30.0) -> None:
        """SIGKILL every process of the node at once (a lost machine), then reap `ray start`."""
        for _ in range(2):  # a second pass catches a worker its raylet forked meanwhile
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM `ray start` (it stops its node's processes), then kill what is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class LocalCluster:
    """A head and worker nodes on 127.0.0.1; `close()` ends every node it started (worker nodes first)."""

    def __init__(self, logs: Path, *, cpus_per_node: int, env: dict[str, str] | None = None) -> None:
        self.logs, self.cpus = logs, cpus_per_node
        self.port, self.dashboard_port = free_port(), free_port()
        self.temp = Path(f"/tmp/drn-{os.getpid()}-{self.port}")
        self.token = secrets.token_hex(16)
        self.nodes: dict[str, Node] = {}
        # The head's GCS declares a node dead after 3 failed 1-s health checks (15 s by default). RAY_ADDRESS
        # names this cluster to processes that look for "the" local Ray instance (Train's placement-group
        # cleaner does, and fails on a host running several). No drain wait on SIGTERM (Serve proxies only).
        # No memory monitor: it judges the host's memory, and on a shared host it kills this cluster's
        # actors for memory other processes hold. A starting raylet may take longer than `ray start`'s 30 s
        # to register with the GCS on a loaded host: it waits up to 120 s.
        self.env = {**os.environ, "PATH": f"{RAY.parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_ADDRESS": self.gcs_address,
                    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_failure_threshold": "3", "RAY_memory_monitor_refresh_ms": "0",
                    "RAY_raylet_start_wait_time_s": "120", **(env or {})}  # fmt: skip
        self.env.pop("RAY_AUTH_TOKEN_PATH", None)

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start_and_wait(self, name: str, role: list[str], timeout_s: float, tries: int = 4) -> None:
        """Start node `name` and wait until it is ALIVE. A start that fails on a loaded host (see
        `Node.failed`) has its processes killed and is tried again, with a fresh temp dir and log
        (ray-NAME-2.log, …), up to `tries` times."""
        for attempt in range(tries):
            self._start(name, role, f"{name}-{attempt + 1}" if attempt else name)
            try:
                self.wait_for_nodes(set(self.alive_names()) | {name}, timeout_s)
                return
            except RuntimeError:
                self.nodes[name].kill()
                if attempt == tries - 1:
                    raise

    def _start(self, name: str, role: list[str], tag: str) -> Node:
        ports = [f"--{flag}={free_port()}" for flag in AGENT_PORT_FLAGS]
        cmd = [str(RAY), "start", "--block", *role, "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}",
               f"--resources={json.dumps({resource_name(name): 1})}", f"--temp-dir={self.temp / tag}",
               "--object-store-memory=100000000", "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats",
               *ports]  # fmt: skip
        log = self.logs / f"ray-{tag}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        node = self.nodes[name] = Node(name, proc, log, self.temp / tag)
        return node

    def start_head(self, name: str = "head", timeout_s: float = 180.0) -> None:
        role = ["--head", f"--port={self.port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                "--include-dashboard=true", f"--ray-client-server-port={free_port()}"]  # fmt: skip
        self._start_and_wait(name, role, timeout_s)

    def add_node(self, name: str, timeout_s: float = 180.0) -> None:
        self._start_and_wait(name, [f"--address={self.gcs_address}"], timeout_s)

    def get(self, path: str, timeout_s: float = 30.0):
        """GET a dashboard endpoint with the cluster's token; the parsed JSON."""
        req = urllib.request.Request(f"{self.dashboard}{path}", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - a local head
            return json.loads(resp.read())

    def node_table(self) -> list[dict]:
        """Ray's node table (state API): one row per node that ever joined, dead ones too."""
        return self.get("/api/v0/nodes?detail=1")["data"]["result"]["result"]

    def node_ids(self, *, alive_only: bool = True) -> dict[str, str]:
        """{node name: Ray node id}, names read from each node's `drelay_node_<name>` resource."""
        out = {}
        for row in self.node_table():
            if alive_only and row["state"] != "ALIVE":
                continue
            for key in row["resources_total"]:
                if key.startswith("drelay_node_"):
                    out[key.removeprefix("drelay_node_")] = row["node_id"]
        return out

    def alive_names(self) -> list[str]:
        try:
            return list(self.node_ids())
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            return []

    def wait_for_nodes(self, names: set[str], timeout_s: float) -> None:
        """Until exactly `names` are ALIVE in the node table (a killed node leaves it within seconds)."""
        deadline = time.monotonic() + timeout_s
        while set(self.alive_names()) != names:
            dead = [n for n in names if n in self.nodes and self.nodes[n].failed()]
            if dead or time.monotonic() > deadline:
                tails = {n: self.nodes[n].log.read_text()[-1500:] for n in names if n in self.nodes}
                raise RuntimeError(f"nodes {sorted(names)} not alive (have {self.alive_names()}): {tails}")
            time.sleep(1)

    def kill_node(self, name: str) -> None:
        """Lose a node: SIGKILL its processes, then wait until the head has declared it dead."""
        self.nodes[name].kill()
        self.wait_for_nodes(set(self.alive_names()) - {name}, timeout_s=120)

    def train_runs(self) -> list[dict]:
        """Ray Train's own record of every run (`RAY_TRAIN_ENABLE_STATE_TRACKING=1`): attempts, workers, node ids."""
        return self.get("/api/train/v2/runs/v1")["train_runs"]

    def close(self) -> None:
        """Stop every node (worker nodes first, the head last); keep the Ray logs that explain a failure
        (each node's raylet and agents, the GCS) beside the `ray start` logs, then remove the temp dir."""
        for name in sorted(self.nodes, key=lambda n: n in ("head",)):
            self.nodes[name].stop()
        for log in self.temp.glob("*/session_*/logs/*"):
            if log.name.startswith(("raylet.", "gcs_server.", "runtime_env_agent.", "dashboard_agent.")):
                shutil.copy(log, self.logs / f"{log.parts[len(self.temp.parts)]}-{log.name}")
        shutil.rmtree(self.temp, ignore_errors=True)
