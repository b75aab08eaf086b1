"""Target hidden states: capture, the self-describing payload, storage backends and readers."""
