import pytest

from ddplab.distributed import detect_launch, expand_nodelist, pick_backend


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
    info = detect_launch({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
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
    from ddplab.distributed import check_one_gpu_per_process
    from ddplab.errors import UserError

    check_one_gpu_per_process(4, 4)
    with pytest.raises(UserError, match="2 processes on this node but 1 GPU.*distributed.backend=gloo"):
        check_one_gpu_per_process(2, 1)
