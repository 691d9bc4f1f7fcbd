"""The run folder: its files and who writes them (folder.py), safe writes (files.py), one owner (lock.py), and what
it records (env.py, assets.py). The ground room of the engine: it imports none of the others."""
