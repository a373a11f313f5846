"""Checkpoints: written so that a crash at any moment leaves the last one whole (writer.py,
snapshot.py, write_progress.py, manifest.py), laid out and read back (layout.py, load.py), the
state each owner keeps in them (state.py), checked by all ranks before a resume (agree.py),
resumed on any layout (resume.py, reshard.py, universal.py)."""
