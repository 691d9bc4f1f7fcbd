"""What belongs to the process as a whole: its changes recorded and undone (process_state.py), what the launcher
tells its workers (handoff.py), which optional packages are installed (extras.py)."""
