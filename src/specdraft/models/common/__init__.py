"""Pieces shared by the drafter families: layers, masks, vocabularies, losses, checkpoint format."""
