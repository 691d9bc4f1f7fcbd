"""ddplab's built-in workloads: plain workload files, read exactly as a user's file.py:function."""
