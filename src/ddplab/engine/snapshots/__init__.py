"""Snapshots: written (write.py: the only writer) under a checksummed manifest (manifest.py), read back and checked
(read.py); which config changes an unfinished run may be continued under (fingerprint.py). What a snapshot holds
is registered in loop/parts.py (snapshot_parts); a run is continued from one by loop/resume.py. Stands on
run_folder/ alone."""
