"""When a run goes wrong: which rank stalled (heartbeat.py), the job's report (failure.py), NCCL's last collectives
(flight_recorder.py), where the wall time went (phases.py), and how a worker tells the launcher how it ended
(outcome.py). Stands on parallel/ and run_folder/."""
