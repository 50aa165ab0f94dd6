"""Test doubles shared by the unit tests of the patch replacements."""

from __future__ import annotations


class RecordingEngine:
    """The engine calls a replacement makes: ``note`` (recorded in ``notes``) and ``original`` (``originals``)."""

    def __init__(self, originals: dict | None = None):
        self.notes: list[tuple] = []
        self.originals = originals or {}

    def note(self, name, key, decision):
        self.notes.append((name, key, decision))

    def original(self, name):
        return self.originals.get(name)
