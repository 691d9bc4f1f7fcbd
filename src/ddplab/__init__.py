"""ddplab."""
