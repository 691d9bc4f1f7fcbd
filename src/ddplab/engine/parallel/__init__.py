"""Many processes: the process group (world.py, distributed.py), DDP's and FSDP's communication (ddp_comm.py,
fsdp_comm.py) and the clock that times it against compute (clock.py), sharding (sharding.py), replica groups
(replicas.py, fault_tolerance.py), and every private torch name ddplab uses (torch_internals.py). Stands on
snapshots/ (a sharded snapshot) and run_folder/."""
