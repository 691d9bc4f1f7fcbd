"""Built-in models: plain nn.Modules that take a small config and know nothing of
torch.distributed, YAML or files (ddplab/workloads/ builds them from a run's config)."""
