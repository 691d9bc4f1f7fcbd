"""The grid of a `ddplab study` (grid.py): setups and sweeps expanded into points, which commands/study.py runs and
forecast/ predicts."""
