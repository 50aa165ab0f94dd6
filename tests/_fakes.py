"""Test doubles shared by the unit tests of the patch replacements."""

from __future__ import annotations


class RecordingEngine:
    """The engine calls a replacement makes: ``note`` (recorded in ``notes``) and ``original`` (``originals``)."""

    def __init__(self, originals: dict | None = None):
        self.notes: list[tuple] = []
        self.owners: list = []  # the object each note was made for (None: not given), beside ``notes``
        self.originals = originals or {}

    def note(self, name, key, decision, owner=None):
        self.notes.append((name, key, decision))
        self.owners.append(owner)

    def original(self, name):
        return self.originals.get(name)
