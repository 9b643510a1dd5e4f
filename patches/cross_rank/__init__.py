"""``cross_rank``: every rank publishes its settings, so a job whose ranks disagree stops."""
