"""Validation of the simulator against real runs on this machine (``topomesh validate``)."""
