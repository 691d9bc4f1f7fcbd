"""One step and the loop around it: the Trainer (trainer.py), the session that builds its parts and hands them over
(session.py, setup.py, parts.py), when it stops (stops.py, preemption.py), what callbacks see (view.py)."""
