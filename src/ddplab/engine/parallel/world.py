"""What the launcher told this process, read without importing torch (ddplab's own launcher reads it too).

`detect_launch`: a launcher that starts every process and says where each sits (torchrun, SLURM's srun).
`detect_nodes`: one that starts a single `ddplab train` per node (Kubeflow Trainer's PET_*, SkyPilot's SKYPILOT_*),
which then starts the node's processes itself, torchrun's way. A variable that is missing or contradicts another is
one line naming it (UserError: exit 2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddplab.errors import UserError

# The systems that start a launcher, and how a worker (which sees the variables its node inherited) knows them.
VIA = {"PET_NNODES": "Kubeflow Trainer", "SKYPILOT_NODE_RANK": "SkyPilot"}
# What `ddplab env` shows of the environment: every launcher's variables, and what changes how a job talks
# (of SkyPilot's, its placement only: its other variables may hold an endpoint or a token, not for a bug report).
SHOWN = tuple(
    """
    RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_ SLURM_ PET_
    SKYPILOT_NODE_RANK SKYPILOT_NODE_IPS SKYPILOT_NUM_NODES SKYPILOT_NUM_GPUS_PER_NODE SKYPILOT_TASK_ID
    REPLICA_GROUP_ID NUM_REPLICA_GROUPS CUDA_VISIBLE_DEVICES NCCL_ GLOO_ OMP_NUM_THREADS
""".split()
)
DEFAULT_PORT = 29500  # torchrun's, where a launcher names no port (SkyPilot)


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher told it."""

    launcher: str  # "torchrun" | "slurm" | "none" | "ray" (a process group Ray Train made) | "external" (another's)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    via: str | None = None  # what started the launcher, where it says: "Kubeflow Trainer", "SkyPilot"

    def describe(self) -> str:
        """For the start line: 'torchrun under Kubeflow Trainer: rank 0 of 4, master node-0:29500'."""
        if self.launcher == "none":
            return "no launcher: one process"
        under = f" under {self.via}" if self.via else ""
        master = f", master {self.master_addr}:{self.master_port}" if self.master_addr else ""
        return f"{self.launcher}{under}: rank {self.rank} of {self.world_size}{master}"


@dataclass(frozen=True)
class NodeLaunch:
    """This node's place in a job whose launcher starts one `ddplab train` per node."""

    via: str  # "Kubeflow Trainer" | "SkyPilot"
    nnodes: int
    node_rank: int
    nproc_per_node: str  # a number, or torchrun's auto / gpu / cpu
    master_addr: str
    master_port: int
    read: tuple[str, ...]  # the variables it came from, for the start line

    def describe(self) -> str:
        return (
            f"node {self.node_rank} of {self.nnodes} ({self.via}: {', '.join(self.read)}), {self.nproc_per_node} "
            f"process(es) per node, master {self.master_addr}:{self.master_port}"
        )


def _int(env: Mapping[str, str], name: str, low: int = 0) -> int:
    value = env[name].strip()
    if not value.isdigit() or int(value) < low:
        raise UserError(f"{name}={env[name]!r} is not a whole number of at least {low}")
    return int(value)


def _needs(env: Mapping[str, str], names: tuple[str, ...], because: str) -> None:
    if missing := [n for n in names if not env.get(n, "").strip()]:
        verb = "is" if len(missing) == 1 else "are"
        raise UserError(
            f"{because} is set but {', '.join(missing)} {verb} not: the launcher's environment is incomplete"
        )


def _below(env: Mapping[str, str], name: str, bound: str) -> None:
    if _int(env, name) >= _int(env, bound, 1):
        raise UserError(f"{name}={env[name]} contradicts {bound}={env[bound]}: it must be below it")


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """torchrun's variables win (torchrun inside srun is common); then SLURM's; else one process."""
    env = os.environ if env is None else env
    if "RANK" in env or "LOCAL_RANK" in env:
        _needs(env, ("RANK", "WORLD_SIZE"), "RANK" if "RANK" in env else "LOCAL_RANK")
        world = _int(env, "WORLD_SIZE", 1)
        _below(env, "RANK", "WORLD_SIZE")
        if world > 1:
            _needs(env, ("MASTER_ADDR", "MASTER_PORT"), f"WORLD_SIZE={world}")
        local_world = _int(env, "LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in env else world
        if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
            _below(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        return LaunchInfo(
            "torchrun",
            rank=_int(env, "RANK"),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT", 1) if env.get("MASTER_PORT") else None,
            via=next((who for var, who in VIA.items() if var in env), None),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        world = _int(env, "SLURM_NTASKS", 1)
        _below(env, "SLURM_PROCID", "SLURM_NTASKS")
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
        tasks = re.match(r"\d+", per_node)  # "4(x2)": 4 tasks on each of 2 nodes
        if tasks is None:
            raise UserError(f"SLURM_TASKS_PER_NODE={per_node!r} does not start with a number of tasks")
        job = int(env.get("SLURM_JOB_ID", "0"))
        return LaunchInfo(
            "slurm",
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(tasks.group()),
            master_addr=env.get("MASTER_ADDR") or nodes[0],
            # A job-dependent port lets two jobs share a first node.
            master_port=int(env.get("MASTER_PORT") or 20000 + job % 20000),
        )
    return LaunchInfo(launcher="none")


PET = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
SKYPILOT = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES")


def detect_nodes(env: Mapping[str, str] | None = None) -> NodeLaunch | None:
    """Kubeflow Trainer's torch plugin (every PET_ variable torchrun reads), else SkyPilot's; None for neither.
    Read by `ddplab train` where no launcher has placed this process (no RANK)."""
    env = os.environ if env is None else env
    if found := [n for n in PET if n in env]:
        _needs(env, PET, found[0])
        nproc = env["PET_NPROC_PER_NODE"].strip()
        if not (nproc in ("auto", "gpu", "cpu") or (nproc.isdigit() and int(nproc) > 0)):
            raise UserError(f"PET_NPROC_PER_NODE={nproc!r} is not a number of processes, auto, gpu or cpu")
        _below(env, "PET_NODE_RANK", "PET_NNODES")
        return NodeLaunch(
            "Kubeflow Trainer",
            nnodes=_int(env, "PET_NNODES", 1),
            node_rank=_int(env, "PET_NODE_RANK"),
            nproc_per_node=nproc,
            master_addr=env["PET_MASTER_ADDR"].strip(),
            master_port=_int(env, "PET_MASTER_PORT", 1),
            read=PET,
        )
    if found := [n for n in SKYPILOT if n in env]:
        _needs(env, SKYPILOT, found[0])
        ips = env["SKYPILOT_NODE_IPS"].split()
        nnodes = _int(env, "SKYPILOT_NUM_NODES", 1)
        if len(ips) != nnodes:
            raise UserError(
                f"SKYPILOT_NODE_IPS holds {len(ips)} address(es), SKYPILOT_NUM_NODES={nnodes}: they must agree"
            )
        _below(env, "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES")
        # No GPU (or the variable unset): one process per node; SkyPilot names no port: torchrun's, or MASTER_PORT.
        gpus = _int(env, "SKYPILOT_NUM_GPUS_PER_NODE") if env.get("SKYPILOT_NUM_GPUS_PER_NODE") else 0
        return NodeLaunch(
            "SkyPilot",
            nnodes=nnodes,
            node_rank=_int(env, "SKYPILOT_NODE_RANK"),
            nproc_per_node=str(gpus or 1),
            master_addr=ips[0],
            master_port=_int(env, "MASTER_PORT", 1) if env.get("MASTER_PORT") else DEFAULT_PORT,
            read=(*SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE"),
        )
    return None


def shown(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher variables set here, sorted by name (`ddplab env`)."""
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env) if k in SHOWN or k.startswith(tuple(p for p in SHOWN if p.endswith("_")))}


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ('gpu[01-03,07],login1') to host names, in order."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts
