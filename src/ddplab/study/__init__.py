"""`ddplab study`: a grid of runs across process counts and config values, one run folder each."""
