"""ddplab's built-in workloads: plain workload files, named in ddplab.registry."""
