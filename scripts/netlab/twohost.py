"""Two hosts on one machine: two network namespaces joined by a veth pair, optionally limited by
a token bucket filter (tbf), with one torchrun agent in each. Needs root and `ip netns`.

    python scripts/netlab/twohost.py --rate 50mbit -- train configs/char_gpt_cpu.yaml training.epochs=1

Everything after `--` goes to `ddplab` (a leading `train` may be left out). The namespaces, and
with them the veth pair and its qdiscs, are removed on exit, also on failure or a signal.
Addresses (10.201.0.1 and .2) exist only inside the namespaces made here.

What makes c10d rendezvous work across the pair (both namespaces share the machine's hostname,
so torchrun's defaults resolve to an address that does not exist inside them): each agent gets
--local-addr=<its veth address>, the rendezvous endpoint is host 0's veth address with
is_host=1 there and is_host=0 on host 1, and GLOO_SOCKET_IFNAME names the veth inside each.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "10.201.0"
RDZV_PORT = 29400


def available() -> str | None:
    """None when namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip and tc)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` unavailable: {probe.stderr.strip()[:120]}"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip()}")


class TwoHosts:
    """The test bed; a context manager. `rate` is a tc rate ('50mbit', '1gbit') or None."""

    def __init__(self, rate: str | None = None, burst: str = "16kb", queue: str = "500ms") -> None:
        tag = f"{os.getpid()}{int(time.time() * 1000) % 1000:03d}"  # unique per process and instance
        self.namespaces = [f"ddpl{tag}a", f"ddpl{tag}b"]
        self.devices = [f"ddv{tag}a"[:15], f"ddv{tag}b"[:15]]
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.rate, self.burst, self.queue = rate, burst, queue
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def up(self) -> TwoHosts:
        atexit.register(self.down)
        try:
            for ns in self.namespaces:
                _ip("ip", "netns", "add", ns)
                self._made.append(ns)
            a, b = self.devices
            _ip("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            for ns, dev, addr in zip(self.namespaces, self.devices, self.addresses):
                _ip("ip", "link", "set", dev, "netns", ns)
                _ip("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("ip", "-n", ns, "link", "set", dev, "up")
                _ip("ip", "-n", ns, "link", "set", "lo", "up")
                if self.rate:
                    # Each end shapes what it sends: the link is `rate` in each direction.
                    _ip("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                        "burst", self.burst, "latency", self.queue)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop the agents, then delete the namespaces (the veth pair and qdiscs go with them)."""
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs = []
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)
        # A veth made before its namespaces were deleted would be left in the root namespace.
        subprocess.run(["ip", "link", "del", self.devices[0]], capture_output=True)

    def __enter__(self) -> TwoHosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def agent_command(self, host: int, nproc: int, ddplab_args: list[str], run_id: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], sys.executable, "-m", "torch.distributed.run",
                "--nnodes=2", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.addresses[0]}:{RDZV_PORT}", f"--rdzv-conf=is_host={1 if host == 0 else 0}",
                f"--rdzv-id={run_id}", f"--local-addr={self.addresses[host]}", "-m", "ddplab", *ddplab_args]

    def run(self, ddplab_args: list[str], nproc: int = 1, timeout: float | None = None, log=None) -> int:
        """One torchrun agent per namespace; returns the first non-zero exit code, or 0."""
        run_id = f"netlab-{self.namespaces[0]}"
        for host in (0, 1):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=self.devices[host])
            env.setdefault("OMP_NUM_THREADS", "1")
            self._procs.append(subprocess.Popen(self.agent_command(host, nproc, ddplab_args, run_id), env=env,
                                                stdout=log, stderr=subprocess.STDOUT if log else None,
                                                start_new_session=True))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self._procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                return 124
            time.sleep(0.2)


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally/`with` that removes the namespaces


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, ddplab_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="twohost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", help="tbf rate of the link in each direction, e.g. 50mbit, 1gbit (default: none)")
    p.add_argument("--burst", default="16kb", help="tbf burst (bucket size)")
    p.add_argument("--nproc-per-host", type=int, default=1)
    p.add_argument("--timeout", type=float, default=None, help="seconds before the agents are stopped")
    ns = p.parse_args(ours)
    if not ddplab_args:
        print("twohost.py: error: give the ddplab arguments after --, e.g. -- train training.epochs=1", file=sys.stderr)
        return 2
    if ns.nproc_per_host < 1:
        print(f"twohost.py: error: --nproc-per-host must be >= 1, got {ns.nproc_per_host}", file=sys.stderr)
        return 2
    if ddplab_args[0] not in ("train", "verify"):
        ddplab_args = ["train", *ddplab_args]
    why = available()
    if why:
        print(f"twohost.py: error: {why}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    with TwoHosts(ns.rate, ns.burst) as hosts:
        print(f"namespaces {hosts.namespaces}, link {hosts.rate or 'unlimited'}", file=sys.stderr)
        code = hosts.run(ddplab_args, ns.nproc_per_host, ns.timeout)
    return code


if __name__ == "__main__":
    sys.exit(main())
