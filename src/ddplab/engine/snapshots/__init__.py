"""Snapshots: written (write.py) under a checksummed manifest (manifest.py), read back and checked (read.py),
continued (resume.py); which config changes a resume allows (fingerprint.py). A stateful part is added in
loop/parts.py: snapshot_parts()."""
