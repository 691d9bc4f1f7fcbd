"""One step and the loop around it: the Trainer (trainer.py), the session that builds its parts and hands them over
(session.py, setup.py, parts.py: snapshot_parts() is where a stateful part is added), a run continued from a
snapshot (resume.py, data_identity.py, rng.py), when it stops (stops.py, preemption.py), what callbacks see
(view.py), what metrics.json holds (summary.py). The top room: it stands on the four others."""
