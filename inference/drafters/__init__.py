"""Drafters: each proposes a token tree for one verify step (see inference.draft.Drafter)."""
