"""Checkpoint layout, initialisation, save and load. Knows tensor names and shapes, no math."""
