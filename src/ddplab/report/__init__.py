"""`ddplab report`: tables and plots from run folders, and nothing else."""
