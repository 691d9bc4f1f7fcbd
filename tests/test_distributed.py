import sys

import pytest

from ddplab.engine.parallel.distributed import pick_backend
from ddplab.engine.parallel.world import detect_launch, detect_nodes, expand_nodelist
from ddplab.errors import UserError


def test_no_launcher_is_one_process():
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size) == ("none", 0, 1)


def test_torchrun_variables():
    info = detect_launch(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "29400",
        }
    )
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.master_port) == (
        "torchrun",
        3,
        4,
        1,
        29400,
    )


def test_torchrun_inside_srun_wins():
    master = {"MASTER_ADDR": "n1", "MASTER_PORT": "29400"}
    info = detect_launch({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", **master})
    assert info.launcher == "torchrun" and info.world_size == 2


def test_slurm_variables():
    info = detect_launch(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_NODELIST": "gpu[07-08,10]",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_ID": "12345",
        }
    )
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 5, 8, 1)
    assert info.master_addr == "gpu07" and info.local_world_size == 4 and info.master_port == 32345


def test_single_task_slurm_job_is_one_process():
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "none"


def test_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("node5") == ["node5"]


def test_backend_choice():
    assert pick_backend("auto", cuda=False) == "gloo" and pick_backend("auto", cuda=True) == "nccl"
    assert pick_backend("gloo", cuda=True) == "gloo"


def test_nccl_with_more_processes_than_gpus_is_refused_in_one_line():
    from ddplab.engine.parallel.distributed import check_one_gpu_per_process

    check_one_gpu_per_process(4, 4)
    with pytest.raises(UserError, match="2 processes on this node but 1 GPU.*distributed.backend=gloo"):
        check_one_gpu_per_process(2, 1)


TRAINER = {  # what Kubeflow Trainer's torch plugin sets on node 1 of 2
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
}
SKYPILOT = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8",
}


def test_kubeflow_trainer_variables_place_the_node():
    node = detect_nodes(TRAINER)
    assert (node.via, node.nnodes, node.node_rank, node.nproc_per_node) == ("Kubeflow Trainer", 2, 1, "4")
    assert (node.master_addr, node.master_port) == ("job-node-0-0.job", 29400)
    assert "node 1 of 2 (Kubeflow Trainer: PET_NNODES" in node.describe()


def test_skypilot_variables_place_the_node():
    node = detect_nodes(SKYPILOT)
    assert (node.via, node.nnodes, node.node_rank, node.nproc_per_node) == ("SkyPilot", 2, 1, "8")
    assert (node.master_addr, node.master_port) == ("10.0.0.5", 29500)  # the first node; torchrun's port
    assert detect_nodes({**SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE": "0"}).nproc_per_node == "1"  # CPU nodes


def test_no_node_launcher():
    assert detect_nodes({"RANK": "0", "WORLD_SIZE": "1"}) is None


@pytest.mark.parametrize(
    "env, message",
    [
        ({k: v for k, v in TRAINER.items() if k != "PET_MASTER_PORT"}, "PET_NNODES is set but PET_MASTER_PORT is not"),
        ({**TRAINER, "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 contradicts PET_NNODES=2"),
        ({**TRAINER, "PET_NPROC_PER_NODE": "many"}, "PET_NPROC_PER_NODE='many' is not a number"),
        ({**SKYPILOT, "SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NODE_IPS holds 2 address.*SKYPILOT_NUM_NODES=3"),
        ({"SKYPILOT_NODE_RANK": "0"}, "SKYPILOT_NODE_RANK is set but SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES are not"),
    ],
)
def test_a_missing_or_contradictory_node_variable_is_named(env, message):
    with pytest.raises(UserError, match=message):
        detect_nodes(env)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=2 contradicts WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, "WORLD_SIZE=2 is set but MASTER_PORT is not"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number"),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 contradicts SLURM_NTASKS=4"),
    ],
)
def test_a_missing_or_contradictory_rank_variable_is_named(env, message):
    with pytest.raises(UserError, match=message):
        detect_launch(env)


def test_the_start_line_names_the_launcher_rank_world_and_master():
    env = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "job-node-0-0.job", "MASTER_PORT": "29400", **TRAINER}
    assert (
        detect_launch(env).describe() == "torchrun under Kubeflow Trainer: rank 3 of 8, master job-node-0-0.job:29400"
    )
    assert detect_launch({}).describe() == "no launcher: one process"


def test_a_process_group_made_by_the_launcher_is_used_and_left_to_it(one_rank_group, monkeypatch):
    """As Ray Train's TorchTrainer does: the group exists before ddplab starts; ddplab neither makes another
    (torch would refuse) nor destroys the launcher's."""
    import torch.distributed as dist

    from ddplab.engine.parallel import distributed

    monkeypatch.delitem(sys.modules, "ray.train", raising=False)  # Ray is not what made it here
    with distributed.session() as ctx:
        assert ctx.launch.launcher == "external" and ctx.backend == "gloo" and ctx.is_distributed
        assert ctx.launch.describe() == "external: rank 0 of 1"
    assert dist.is_initialized()  # still the launcher's
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(UserError, match="already made is rank 0 of 1, but RANK=1 and WORLD_SIZE=2"):
        with distributed.session():
            pass
