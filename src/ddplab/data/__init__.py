"""Datasets, streams, shards, samplers and caches that the built-in workloads (ddplab/workloads/) are made of."""
